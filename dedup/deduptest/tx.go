package deduptest

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/dedup"
	"github.com/oncemill/oncemill/dedup/dedupdriver"
)

// RunTxStore runs the conformance suite of [dedup.TxStore] on the stores
// h.New makes, one fresh store per subtest, the subtests in parallel. Each
// subtest is named after the behaviour it checks (see the package
// documentation); one for an optional interface the store does not
// implement is skipped, naming the interface.
func RunTxStore(t *testing.T, h TxHarness) {
	t.Helper()
	if h.New == nil {
		t.Fatal("deduptest: TxHarness.New is required")
	}
	for _, st := range []struct {
		name string
		run  func(t *testing.T, x txSubject)
	}{
		{"ClaimCommitDuplicate", txClaimCommitDuplicate},
		{"Result", func(t *testing.T, x txSubject) { x.results(t) }},
		{"Consumers", txConsumers},
		{"Rollback", txRollback},
		{"FailedReclaim", txFailedReclaim},
		{"ConcurrentDuplicates", txConcurrentDuplicates},
		{"Bury", txBury},
		{"DeadCopies", func(t *testing.T, x txSubject) { x.deadCopiesCounted(t) }},
		{"ReplayGrant", func(t *testing.T, x txSubject) { x.replayGrant(t) }},
		{"StartCounts", txStartCounts},
		{"Window", txWindow},
		{"Sweep", func(t *testing.T, x txSubject) { x.sweepExpired(t) }},
		{"CanceledContext", txCanceled},
		{"Peek", func(t *testing.T, x txSubject) { x.peek(t) }},
		{"HasRecord", func(t *testing.T, x txSubject) { x.hasRecord(t) }},
		{"DoneKeys", func(t *testing.T, x txSubject) { x.doneKeys(t) }},
		{"Classify", txClassify},
		{"Aborted", txAborted},
		{"Cut", txCut},
		{"StartClaim", txStartClaim},
		{"BeginClaim", txBeginClaim},
		{"Batch", txBatch},
		{"Drain", txDrain},
		{"Misconfigured", txMisconfigured},
		{"HandOutMark", txHandOutMark},
	} {
		t.Run(st.name, func(t *testing.T) {
			t.Parallel()
			b := h.New(t)
			switch {
			case b.Store == nil:
				t.Fatal("deduptest: TxBundle.Store is required")
			case b.Effect == nil:
				t.Fatal("deduptest: TxBundle.Effect is required")
			case b.Effects == nil:
				t.Fatal("deduptest: TxBundle.Effects is required")
			}
			st.run(t, newTxSubject(b))
		})
	}
}

// txSubject is a transactional store under test.
type txSubject struct {
	subject
	b TxBundle
	s dedup.TxStore
}

func newTxSubject(b TxBundle) txSubject {
	x := txSubject{b: b, s: b.Store}
	x.subject = subject{
		store:      b.Store,
		graveyard:  b.Store,
		deadCopies: b.DeadCopies,
		apply: func(t *testing.T, k dedup.Key, result []byte, w time.Duration) {
			t.Helper()
			tx := x.claimNew(t, k, w)
			require.NoError(t, b.Effect(t.Context(), tx, k.Key))
			require.NoError(t, tx.InboxComplete(t.Context(), k, result))
			require.NoError(t, tx.Commit(t.Context()))
		},
		fail: func(t *testing.T, k dedup.Key, at time.Time, w time.Duration) {
			t.Helper()
			tx := x.claimNew(t, k, w)
			require.NoError(t, b.Effect(t.Context(), tx, k.Key))
			require.NoError(t, tx.Rollback(t.Context()))
			require.NoError(t, b.Store.InboxFail(t.Context(), k, dedup.Failure{Err: "deduptest: handler failed", At: at}, w))
		},
		bury: func(t *testing.T, k dedup.Key, at time.Time, w time.Duration) {
			t.Helper()
			tx := x.claimNew(t, k, w)
			require.NoError(t, tx.InboxBury(t.Context(), k, dedup.Failure{Err: "deduptest: dead-lettered", At: at}))
			require.NoError(t, tx.Commit(t.Context()))
		},
		look: func(t *testing.T, k dedup.Key) dedup.Claim {
			t.Helper()
			tx, c := x.claim(t, k, window)
			require.NoError(t, tx.Rollback(t.Context()))
			return c
		},
	}
	return x
}

// claim begins a transaction and claims k in it.
func (x txSubject) claim(t *testing.T, k dedup.Key, w time.Duration) (dedup.InboxTx, dedup.Claim) {
	t.Helper()
	tx, err := x.s.InboxBegin(t.Context())
	require.NoError(t, err)
	c, err := tx.InboxClaim(t.Context(), k, w)
	if err != nil {
		require.NoError(t, errors.Join(err, tx.Rollback(t.Context())))
	}
	return tx, c
}

// claimNew claims k, requiring it new, and returns the open transaction.
func (x txSubject) claimNew(t *testing.T, k dedup.Key, w time.Duration) dedup.InboxTx {
	t.Helper()
	tx, c := x.claim(t, k, w)
	if c.State != dedup.StateNew {
		require.NoError(t, tx.Rollback(t.Context()))
		t.Fatalf("claim of %s: %s, want new", k.Key, c.State)
	}
	return tx
}

// effects counts the committed effects of k.
func (x txSubject) effects(t *testing.T, k dedup.Key) int {
	t.Helper()
	n, err := x.b.Effects(t.Context(), k.Key)
	require.NoError(t, err)
	return n
}

// txClaimCommitDuplicate: claim, effect, complete and commit make the key
// done, and a later claim answers it as a duplicate with the stored
// result, without a second effect.
func txClaimCommitDuplicate(t *testing.T, x txSubject) {
	ctx := t.Context()
	k := key("order-1")
	tx, c := x.claim(t, k, window)
	require.Equal(t, dedup.StateNew, c.State, "a key never seen is new")
	require.Equal(t, 1, c.Attempts, "this attempt is the first")
	require.True(t, c.FirstFailedAt.IsZero(), "no attempt failed")
	require.NoError(t, x.b.Effect(ctx, tx, k.Key))
	require.Zero(t, x.effects(t, k), "the effect is not visible before the commit")
	require.NoError(t, tx.InboxComplete(ctx, k, []byte("receipt")))
	require.NoError(t, tx.Commit(ctx))
	require.NoError(t, tx.Rollback(ctx), "Rollback after Commit is a no-op")
	require.Equal(t, 1, x.effects(t, k))

	for range 2 {
		tx, c = x.claim(t, k, window)
		require.Equal(t, dedup.StateDone, c.State, "a committed key is done")
		require.Equal(t, []byte("receipt"), c.Result, "with its stored result")
		require.NoError(t, tx.Rollback(ctx))
	}
	c, err := x.s.InboxStart(ctx, k, window)
	require.NoError(t, err)
	require.Equal(t, dedup.StateDone, c.State, "the start answers a done key")
	require.Equal(t, []byte("receipt"), c.Result)
	require.Equal(t, 1, x.effects(t, k), "duplicates apply nothing")
}

// txConsumers: two consumers of one key keep separate records.
func txConsumers(t *testing.T, x txSubject) {
	a, b := dedup.Key{Consumer: "billing", Key: "order-1"}, dedup.Key{Consumer: "shipping", Key: "order-1"}
	x.apply(t, a, []byte("billed"), window)
	c := x.requireState(t, b, dedup.StateNew, "another consumer's copy of the key is new")
	require.Equal(t, 1, c.Attempts)
	x.apply(t, b, []byte("shipped"), window)
	require.Equal(t, []byte("billed"), x.requireState(t, a, dedup.StateDone).Result)
	require.Equal(t, []byte("shipped"), x.requireState(t, b, dedup.StateDone).Result)
}

// txRollback: a rolled-back claim undoes the effect and leaves the key
// claimable, as if the attempt never happened.
func txRollback(t *testing.T, x txSubject) {
	ctx := t.Context()
	k := key("order-2")
	tx := x.claimNew(t, k, window)
	require.NoError(t, x.b.Effect(ctx, tx, k.Key))
	require.NoError(t, tx.InboxComplete(ctx, k, []byte("undone")))
	require.NoError(t, tx.Rollback(ctx))
	require.Zero(t, x.effects(t, k), "the effect rolled back with the claim")

	tx, c := x.claim(t, k, window)
	require.Equal(t, dedup.StateNew, c.State, "the key is claimable again")
	require.Equal(t, 1, c.Attempts, "a rolled-back claim is not an attempt of the record")
	require.NoError(t, x.b.Effect(ctx, tx, k.Key))
	require.NoError(t, tx.InboxComplete(ctx, k, []byte("kept")))
	require.NoError(t, tx.Commit(ctx))
	require.Equal(t, 1, x.effects(t, k))
	require.Equal(t, []byte("kept"), x.requireState(t, k, dedup.StateDone).Result)
}

// txFailedReclaim: a failed attempt is recorded outside the transaction;
// the next claim takes the key again, counting the attempts and keeping
// the first failure's time; a failure reported after the key is done
// changes nothing.
func txFailedReclaim(t *testing.T, x txSubject) {
	ctx := t.Context()
	k := key("order-3")
	first := failedAt(2 * time.Minute)
	x.fail(t, k, first, window)
	require.Zero(t, x.effects(t, k))

	tx, c := x.claim(t, k, window)
	require.Equal(t, dedup.StateNew, c.State, "a failed key is claimed again")
	require.Equal(t, 2, c.Attempts, "the failed attempt and this one")
	require.True(t, first.Equal(c.FirstFailedAt), "the first failure's time: %s, want %s", c.FirstFailedAt, first)
	require.NoError(t, tx.Rollback(ctx))
	require.NoError(t, x.s.InboxFail(ctx, k, dedup.Failure{Err: "second", At: first.Add(time.Minute)}, window))

	tx, c = x.claim(t, k, window)
	require.Equal(t, dedup.StateNew, c.State)
	require.Equal(t, 3, c.Attempts)
	require.True(t, first.Equal(c.FirstFailedAt), "still the first failure's time: %s", c.FirstFailedAt)
	require.NoError(t, x.b.Effect(ctx, tx, k.Key))
	require.NoError(t, tx.InboxComplete(ctx, k, []byte("r")))
	require.NoError(t, tx.Commit(ctx))

	require.NoError(t, x.s.InboxFail(ctx, k, dedup.Failure{Err: "late", At: time.Now()}, window))
	c = x.requireState(t, k, dedup.StateDone, "a late failure never reopens a done key")
	require.Equal(t, []byte("r"), c.Result)
	require.Equal(t, 1, x.effects(t, k))
}

// txConcurrentDuplicates: copies of one key claimed at once apply it once.
// Each loser answers done (it waited for the winner) or in flight (a lock
// in front of the record holds it), never new. A delivery that loses a
// conflict (dedup.ErrConflict: a deadlock, a serialization failure, a
// busy database) is run again, as the inbox runs it.
func txConcurrentDuplicates(t *testing.T, x txSubject) {
	for _, failedBefore := range []bool{false, true} {
		name := "New"
		if failedBefore {
			// A key whose earlier attempt failed is taken by another
			// path (an update of its record, not an insert).
			name = "Failed"
		}
		t.Run(name, func(t *testing.T) {
			k := key("hot-" + name)
			if failedBefore {
				x.fail(t, k, failedAt(time.Minute), window)
			}
			claims, errs := make([]dedup.Claim, copies), make([]error, copies)
			var wg sync.WaitGroup
			start := make(chan struct{})
			for i := range copies {
				wg.Go(func() {
					<-start
					claims[i], errs[i] = x.redeliver(t.Context(), k, []byte("r"), never, false)
				})
			}
			close(start)
			wg.Wait()
			states := map[dedup.State]int{}
			for i := range copies {
				require.NoError(t, errs[i], "copy %d", i)
				states[claims[i].State]++
				switch claims[i].State {
				case dedup.StateNew:
					want := 1
					if failedBefore {
						want = 2
					}
					require.Equal(t, want, claims[i].Attempts, "the winner's attempts")
				case dedup.StateDone:
					require.Equal(t, []byte("r"), claims[i].Result, "a loser that found the key done gets the winner's result")
				case dedup.StateInFlight:
				default:
					t.Fatalf("copy %d: %s; want new, done or in flight", i, claims[i].State)
				}
			}
			require.Equal(t, 1, states[dedup.StateNew], "exactly one copy wins: %v", states)
			require.Equal(t, 1, x.effects(t, k), "exactly one effect")
			require.Equal(t, []byte("r"), x.requireState(t, k, dedup.StateDone).Result)
		})
	}
	t.Run("RolledBack", x.concurrentRolledBack)
}

// errHandlerFailed is the error of a handler that the suite makes fail.
const errHandlerFailed = suiteError("the handler failed")

// concurrentRolledBack: copies of one key claimed at once, of which the
// first winner fails and rolls back: another copy then claims the key
// itself (every copy is redelivered while the key is in flight) and
// applies it, once.
func (x txSubject) concurrentRolledBack(t *testing.T) {
	ctx := t.Context()
	k := key("hot-RolledBack")
	var (
		wg     sync.WaitGroup
		start  = make(chan struct{})
		failed atomic.Bool
		claims = make([]dedup.Claim, copies)
		errs   = make([]error, copies)
	)
	fail := func() bool { return failed.CompareAndSwap(false, true) }
	for i := range copies {
		wg.Go(func() {
			<-start
			c, err := x.redeliver(ctx, k, []byte("r"), fail, true)
			if errors.Is(err, errHandlerFailed) {
				// As the inbox does after the rollback.
				err = x.s.InboxFail(ctx, k, dedup.Failure{Err: err.Error(), At: time.Now()}, window)
			}
			claims[i], errs[i] = c, err
		})
	}
	close(start)
	wg.Wait()
	news := 0
	for i := range copies {
		require.NoError(t, errs[i], "copy %d", i)
		switch claims[i].State {
		case dedup.StateNew:
			news++
		case dedup.StateDone:
			require.Equal(t, []byte("r"), claims[i].Result)
		default:
			t.Fatalf("copy %d: %s; want new or done", i, claims[i].State)
		}
	}
	require.Equal(t, 2, news, "the winner that rolled back and the one that took the key after it")
	require.Equal(t, 1, x.effects(t, k), "exactly one effect")
	require.Equal(t, []byte("r"), x.requireState(t, k, dedup.StateDone).Result)
}

// never is a handler that never fails.
func never() bool { return false }

// redeliver runs deliveries of k, as the broker redelivers a nacked
// message, until one ends: a delivery that lost a conflict (an error
// wrapping dedup.ErrConflict, which the inbox runs again) is run again,
// and so is one that found the key in flight when untilSettled is set.
// fail is as for deliver.
func (x txSubject) redeliver(ctx context.Context, k dedup.Key, result []byte, fail func() bool, untilSettled bool) (dedup.Claim, error) {
	ctx, cancel := context.WithTimeout(ctx, patience)
	defer cancel()
	for {
		c, err := x.deliver(ctx, k, result, fail)
		again := errors.Is(err, dedup.ErrConflict) || (err == nil && untilSettled && c.State == dedup.StateInFlight)
		if !again {
			return c, err
		}
		select {
		case <-ctx.Done():
			return c, fmt.Errorf("deduptest: key %s still %s after %s of redeliveries: %w", k.Key, c.State, patience, errors.Join(err, ctx.Err()))
		case <-time.After(time.Millisecond):
		}
	}
}

// deliver is one delivery as the inbox runs it: claim, effect, complete
// and commit when the key is new; roll back otherwise. The handler fails,
// after writing its effect, when fail says so: the transaction is rolled
// back and the error wraps errHandlerFailed. An effect's error goes
// through the transaction's dedupdriver.Classifier, as the inbox's does.
func (x txSubject) deliver(ctx context.Context, k dedup.Key, result []byte, fail func() bool) (dedup.Claim, error) {
	tx, err := x.s.InboxBegin(ctx)
	if err != nil {
		return dedup.Claim{}, err
	}
	c, err := tx.InboxClaim(ctx, k, window)
	if err == nil && c.State != dedup.StateNew {
		return c, tx.Rollback(ctx)
	}
	if err == nil {
		if err = x.b.Effect(ctx, tx, k.Key); err != nil {
			if cl, ok := tx.(dedupdriver.Classifier); ok {
				err = cl.InboxClassify(err)
			}
		}
	}
	if err == nil && fail() {
		err = errHandlerFailed
	}
	if err == nil {
		err = tx.InboxComplete(ctx, k, result)
	}
	if err == nil {
		err = tx.Commit(ctx)
	}
	if err != nil {
		return c, errors.Join(err, tx.Rollback(ctx))
	}
	return c, nil
}

// txBury: a key buried in its claim's transaction is dead for every
// later claim and start, and a failure reported later leaves it dead; a
// burial rolled back leaves the key as it was.
func txBury(t *testing.T, x txSubject) {
	ctx := t.Context()
	k := key("poison")
	x.fail(t, k, failedAt(time.Minute), window)
	tx := x.claimNew(t, k, window)
	require.NoError(t, tx.InboxBury(ctx, k, dedup.Failure{Err: "still bad", At: failedAt(0)}))
	require.NoError(t, tx.Commit(ctx))

	for range 2 {
		x.requireState(t, k, dedup.StateDead, "a buried key is dead")
		c, err := x.s.InboxStart(ctx, k, window)
		require.NoError(t, err)
		require.Equal(t, dedup.StateDead, c.State, "the start answers a dead key")
	}
	require.NoError(t, x.s.InboxFail(ctx, k, dedup.Failure{Err: "late", At: time.Now()}, window))
	x.requireState(t, k, dedup.StateDead, "a late failure leaves the key dead")
	require.Zero(t, x.effects(t, k))
	x.deadCopyRequired(t, k)

	rb := key("bury-rolled-back")
	tx = x.claimNew(t, rb, window)
	require.NoError(t, tx.InboxBury(ctx, rb, dedup.Failure{Err: "bad", At: failedAt(0)}))
	require.NoError(t, tx.Rollback(ctx))
	c := x.requireState(t, rb, dedup.StateNew, "a burial rolled back leaves the key claimable")
	require.Equal(t, 1, c.Attempts)
}

// txStartCounts: InboxStart counts every attempt started and not
// completed, across processes: one whose process died (a start without an
// end), one rolled back and one failed stay counted, InboxUnstart takes
// one back, and the count is forgotten when the key commits.
func txStartCounts(t *testing.T, x txSubject) {
	ctx := t.Context()
	k := key("crash-loop")
	start := func(want int, msg string) {
		t.Helper()
		c, err := x.s.InboxStart(ctx, k, window)
		require.NoError(t, err)
		require.Equal(t, dedup.StateNew, c.State, msg)
		require.Equal(t, want, c.Attempts, msg)
	}
	start(1, "the first attempt")
	start(2, "the first attempt's process died before it ended")
	require.NoError(t, x.s.InboxUnstart(ctx, k))
	start(2, "an attempt taken back (shutdown) is not counted")

	tx := x.claimNew(t, k, window)
	require.NoError(t, x.b.Effect(ctx, tx, k.Key))
	require.NoError(t, tx.Rollback(ctx))
	start(3, "a rolled-back attempt stays counted")
	x.requireState(t, k, dedup.StateNew)
	require.NoError(t, x.s.InboxFail(ctx, k, dedup.Failure{Err: "boom", At: failedAt(0)}, window))
	start(4, "a failed attempt stays counted")

	tx = x.claimNew(t, k, window)
	require.NoError(t, x.b.Effect(ctx, tx, k.Key))
	require.NoError(t, tx.InboxComplete(ctx, k, []byte("r")))
	require.NoError(t, tx.Commit(ctx))
	c, err := x.s.InboxStart(ctx, k, window)
	require.NoError(t, err)
	require.Equal(t, dedup.StateDone, c.State, "the count is forgotten when the key commits; the start answers it done")
	require.Equal(t, []byte("r"), c.Result)

	never := key("never-started")
	require.NoError(t, x.s.InboxUnstart(ctx, never), "taking back an attempt never counted is no error")
	c, err = x.s.InboxStart(ctx, never, window)
	require.NoError(t, err)
	require.Equal(t, 1, c.Attempts, "the count never goes below zero")

	other := dedup.Key{Consumer: "other-" + consumer, Key: k.Key}
	c, err = x.s.InboxStart(ctx, other, window)
	require.NoError(t, err)
	require.Equal(t, dedup.StateNew, c.State, "another consumer's count is its own")
	require.Equal(t, 1, c.Attempts)
}

// txWindow: a record is forgotten once its window has passed (swept by
// dedup.Expirer, or expired by the store itself), and so is a start count;
// a record whose window has not passed stays.
func txWindow(t *testing.T, x txSubject) {
	ctx := t.Context()
	k, live, started := key("short"), key("live"), key("started")
	for range 2 {
		_, err := x.s.InboxStart(ctx, started, shortWindow)
		require.NoError(t, err)
	}
	x.apply(t, k, []byte("r"), shortWindow)
	x.apply(t, live, []byte("live"), window)
	eventually(t, "the record's window to pass", func() bool {
		x.sweep(t)
		tx, c := x.claim(t, k, shortWindow)
		require.NoError(t, tx.Rollback(ctx))
		return c.State == dedup.StateNew
	})
	x.sweep(t)
	tx, c := x.claim(t, k, window)
	require.Equal(t, dedup.StateNew, c.State)
	require.Equal(t, 1, c.Attempts, "the record was forgotten")
	require.NoError(t, x.b.Effect(ctx, tx, k.Key))
	require.NoError(t, tx.Commit(ctx))
	c, err := x.s.InboxStart(ctx, started, window)
	require.NoError(t, err)
	require.Equal(t, 1, c.Attempts, "the start count was forgotten with its window")
	require.Equal(t, []byte("live"), x.requireState(t, live, dedup.StateDone, "a live record stays").Result)
}

// txCanceled: a call on a canceled context, or one whose deadline has
// passed (Watermill's Timeout middleware), is the caller's, not the
// store's: if it fails, its error does not wrap dedup.ErrUnavailable.
func txCanceled(t *testing.T, x txSubject) {
	k := key("canceled")
	for name, ctx := range callerDone(t) {
		notUnavailable := func(call string, err error) {
			t.Helper()
			assert.NotErrorIs(t, err, dedup.ErrUnavailable, "%s on a %s context", call, name)
		}
		_, err := x.s.InboxStart(ctx, k, window)
		notUnavailable("InboxStart", err)
		tx, err := x.s.InboxBegin(ctx)
		notUnavailable("InboxBegin", err)
		if err == nil {
			_, err = tx.InboxClaim(ctx, k, window)
			notUnavailable("InboxClaim", err)
			require.NoError(t, tx.Rollback(t.Context()))
		}
		notUnavailable("InboxFail", x.s.InboxFail(ctx, k, dedup.Failure{Err: "x", At: time.Now()}, window))
		notUnavailable("InboxUnstart", x.s.InboxUnstart(ctx, k))
		for call, err := range x.everyCall(ctx, k) {
			notUnavailable(call, err)
		}
		for call, err := range x.pipelinedCalls(ctx, k) {
			notUnavailable(call, err)
		}
	}
}

// callerDone returns contexts that the caller ended, by name.
func callerDone(t *testing.T) map[string]context.Context {
	canceled, cancel := context.WithCancel(t.Context())
	cancel()
	expired, cancel := context.WithDeadline(t.Context(), time.Now().Add(-time.Second))
	t.Cleanup(cancel)
	return map[string]context.Context{"canceled": canceled, "expired": expired}
}

// pipelinedCalls makes the calls of the pipelined and batched claims the
// store implements, on ctx, ending any transaction they open, and returns
// their errors by name.
func (x txSubject) pipelinedCalls(ctx context.Context, k dedup.Key) map[string]error {
	errs := map[string]error{}
	end := func(call string, tx dedup.InboxTx, err error) {
		if tx != nil {
			err = errors.Join(err, tx.Rollback(context.WithoutCancel(ctx)))
		}
		errs[call] = err
	}
	if sc, ok := x.s.(dedupdriver.StartClaimer); ok {
		_, tx, _, err := sc.InboxStartClaim(ctx, k, window)
		end("InboxStartClaim", tx, err)
	}
	if bc, ok := x.s.(dedupdriver.BeginClaimer); ok {
		tx, _, err := bc.InboxBeginClaim(ctx, k, window, dedupdriver.ClaimHint{})
		end("InboxBeginClaim", tx, err)
	}
	if bc, ok := x.s.(dedupdriver.BatchClaimer); ok {
		_, err := bc.InboxStartBatch(ctx, k.Consumer, []string{k.Key}, window)
		errs["InboxStartBatch"] = err
		tx, _, err := bc.InboxBeginClaimBatch(ctx, k.Consumer, []string{k.Key}, window)
		end("InboxBeginClaimBatch", tx, err)
	}
	return errs
}

// everyCall makes every call of the Graveyard and of the optional
// interfaces the store implements, on ctx, and returns their errors by
// name.
func (s subject) everyCall(ctx context.Context, k dedup.Key) map[string]error {
	errs := map[string]error{}
	g := s.graveyard
	_, errs["InboxGrantReplay"] = g.InboxGrantReplay(ctx, k, "grant")
	_, errs["InboxReopen"] = g.InboxReopen(ctx, k, "grant")
	_, errs["InboxReplayGranted"] = g.InboxReplayGranted(ctx, k, "grant")
	errs["InboxDeadCopy"] = g.InboxDeadCopy(ctx, k)
	if p, ok := s.store.(dedupdriver.Peeker); ok {
		_, errs["InboxPeek"] = p.InboxPeek(ctx, k)
	}
	if f, ok := s.store.(dedupdriver.RecordFinder); ok {
		_, errs["InboxHasRecord"] = f.InboxHasRecord(ctx, k)
	}
	if l, ok := s.store.(dedupdriver.KeyLister); ok {
		errs["InboxDoneKeys"] = l.InboxDoneKeys(ctx, k.Consumer, time.Time{}, func(string) error { return nil })
	}
	if e, ok := s.store.(dedup.Expirer); ok {
		_, errs["InboxDeleteExpired"] = e.InboxDeleteExpired(ctx, 10)
	}
	return errs
}

// handlerErrors are errors a handler returns for the message's own fault,
// whatever they wrap: a payload that fails to decode wraps io.EOF, an
// HTTP client that is refused wraps a net.Error.
func handlerErrors() []error {
	refused := &net.OpError{Op: "dial", Net: "tcp", Err: syscall.ECONNREFUSED}
	return []error{
		errors.New("card declined"),
		fmt.Errorf("decode order: %w", io.EOF),
		io.ErrUnexpectedEOF,
		fmt.Errorf("payment API: %w", refused),
	}
}

// txClassify: while its connection is healthy, the transaction's
// dedupdriver.Classifier leaves the handler's own errors the message's,
// whatever they wrap.
func txClassify(t *testing.T, x txSubject) {
	ctx := t.Context()
	k := key("classify")
	tx := x.claimNew(t, k, window)
	defer func() { require.NoError(t, tx.Rollback(ctx)) }()
	c := need[dedupdriver.Classifier](t, tx)
	require.NoError(t, x.b.Effect(ctx, tx, k.Key))
	for _, err := range handlerErrors() {
		got := c.InboxClassify(err)
		require.ErrorIs(t, got, err, "the handler's error is kept")
		require.NotErrorIs(t, got, dedup.ErrUnavailable, "%v is the message's", err)
		require.NotErrorIs(t, got, dedup.ErrConflict, "%v is the message's", err)
	}
}

// txAborted: the transaction's dedupdriver.AbortReporter tells a
// transaction in which a statement failed, which the database will no
// longer commit, from one that is healthy; the rollback of an aborted one
// undoes its effect and leaves the key claimable, by a transaction that is
// not aborted.
func txAborted(t *testing.T, x txSubject) {
	ctx := t.Context()
	k := key("aborted")
	tx := x.claimNew(t, k, window)
	ended := false
	defer func() {
		if !ended {
			require.NoError(t, tx.Rollback(ctx))
		}
	}()
	a := need[dedupdriver.AbortReporter](t, tx)
	if x.b.Refused == nil {
		t.Skip("the bundle has no Refused")
	}
	require.False(t, a.InboxAborted(), "a claimed transaction is not aborted")
	require.NoError(t, x.b.Effect(ctx, tx, k.Key))
	require.False(t, a.InboxAborted(), "an effect written does not abort the transaction")
	require.Error(t, x.b.Refused(ctx, tx), "the database refuses the statement")
	require.True(t, a.InboxAborted(), "a statement failed in the transaction")

	ended = true
	require.NoError(t, tx.Rollback(ctx), "an aborted transaction rolls back")
	require.Zero(t, x.effects(t, k), "the rollback undid the effect")
	again := x.claimNew(t, k, window)
	defer func() { require.NoError(t, again.Rollback(ctx)) }()
	require.False(t, need[dedupdriver.AbortReporter](t, again).InboxAborted(),
		"the next transaction is not aborted")
}

// txCut: once the store's connections are cut, the handler's next
// statement fails, the transaction's dedupdriver.Classifier marks every error
// the handler returns as the infrastructure's, the commit fails with an
// error wrapping dedup.ErrUnavailable, and so does every later call: the
// inbox nacks the message without counting an attempt.
func txCut(t *testing.T, x txSubject) {
	if x.b.Cut == nil {
		t.Skip("the bundle has no Cut")
	}
	ctx := t.Context()
	k := key("cut")
	tx := x.claimNew(t, k, window)
	require.NoError(t, x.b.Effect(ctx, tx, k.Key))

	x.b.Cut(t)
	err := x.b.Effect(ctx, tx, k.Key+"-after-cut")
	require.Error(t, err, "the handler's statement after the cut")
	if c, ok := tx.(dedupdriver.Classifier); ok {
		require.ErrorIs(t, c.InboxClassify(err), dedup.ErrUnavailable, "the statement's error: %v", err)
		for _, herr := range handlerErrors() {
			require.ErrorIs(t, c.InboxClassify(herr), dedup.ErrUnavailable,
				"whatever the handler returns once its transaction's connection is gone: %v", herr)
		}
	}
	err = tx.Commit(ctx)
	require.ErrorIs(t, err, dedup.ErrUnavailable, "the commit after the cut: %v", err)
	_ = tx.Rollback(ctx) // the connection is gone: there may be nothing to roll back

	other := key("after-cut")
	unavailable := func(call string, err error) {
		t.Helper()
		assert.ErrorIs(t, err, dedup.ErrUnavailable, "%s after the cut: %v", call, err)
	}
	_, err = x.s.InboxStart(ctx, other, window)
	unavailable("InboxStart", err)
	if tx, err := x.s.InboxBegin(ctx); err != nil {
		unavailable("InboxBegin", err)
	} else {
		_, err = tx.InboxClaim(ctx, other, window)
		unavailable("InboxClaim", err)
		_ = tx.Rollback(ctx) // as above
	}
	unavailable("InboxFail", x.s.InboxFail(ctx, other, dedup.Failure{Err: "x", At: time.Now()}, window))
	unavailable("InboxUnstart", x.s.InboxUnstart(ctx, other))
	for call, err := range x.everyCall(ctx, other) {
		unavailable(call, err)
	}
	for call, err := range x.pipelinedCalls(ctx, other) {
		unavailable(call, err)
	}
}

// txStartClaim checks dedupdriver.StartClaimer: the start, BEGIN and the claim
// in one exchange, with the answers InboxStart and InboxClaim give.
func txStartClaim(t *testing.T, x txSubject) {
	sc := need[dedupdriver.StartClaimer](t, x.s)
	ctx := t.Context()
	k := key("order-1")
	start, tx, c, err := sc.InboxStartClaim(ctx, k, window)
	require.NoError(t, err)
	require.Equal(t, dedup.StateNew, start.State)
	require.Equal(t, 1, start.Attempts)
	require.NotNil(t, tx, "a new key's transaction is open")
	require.Equal(t, dedup.StateNew, c.State)
	require.Equal(t, 1, c.Attempts)
	require.NoError(t, x.b.Effect(ctx, tx, k.Key))
	require.NoError(t, tx.Rollback(ctx))
	require.NoError(t, x.s.InboxFail(ctx, k, dedup.Failure{Err: "boom", At: failedAt(time.Minute)}, window))

	start, tx, c, err = sc.InboxStartClaim(ctx, k, window)
	require.NoError(t, err)
	require.Equal(t, 2, start.Attempts, "the rolled-back attempt stays counted")
	require.Equal(t, dedup.StateNew, c.State, "a failed key is claimed again")
	require.Equal(t, 2, c.Attempts)
	require.False(t, c.FirstFailedAt.IsZero())
	require.NoError(t, x.b.Effect(ctx, tx, k.Key))
	require.NoError(t, tx.InboxComplete(ctx, k, []byte("r")))
	require.NoError(t, tx.Commit(ctx))
	require.Equal(t, 1, x.effects(t, k))

	start, tx, c, err = sc.InboxStartClaim(ctx, k, window)
	require.NoError(t, err)
	require.Equal(t, dedup.StateDone, start.State, "the start answers a done key")
	require.Equal(t, []byte("r"), start.Result)
	require.Nil(t, tx, "nothing is held for a done key")
	require.Equal(t, dedup.Claim{}, c)

	dead := key("dead")
	x.bury(t, dead, failedAt(0), window)
	start, tx, _, err = sc.InboxStartClaim(ctx, dead, window)
	require.NoError(t, err)
	require.Equal(t, dedup.StateDead, start.State)
	require.Nil(t, tx, "nothing is held for a dead key")
}

// txBeginClaim checks dedupdriver.BeginClaimer: BEGIN and the claim in one
// exchange, with the answers InboxClaim gives, whatever the hint: new,
// rolled back, done, failed before and dead keys.
func txBeginClaim(t *testing.T, x txSubject) {
	bc := need[dedupdriver.BeginClaimer](t, x.s)
	for _, hint := range []dedupdriver.ClaimHint{{}, {New: true}, {New: true, Unstarted: true}, {Unstarted: true}} {
		t.Run(fmt.Sprintf("New=%t,Unstarted=%t", hint.New, hint.Unstarted), func(t *testing.T) {
			ctx := t.Context()
			k := key(fmt.Sprintf("order-%t-%t", hint.New, hint.Unstarted))
			tx, c, err := bc.InboxBeginClaim(ctx, k, window, hint)
			require.NoError(t, err)
			require.Equal(t, dedup.StateNew, c.State)
			require.Equal(t, 1, c.Attempts)
			require.NoError(t, x.b.Effect(ctx, tx, k.Key))
			require.NoError(t, tx.Rollback(ctx))
			require.Zero(t, x.effects(t, k))

			tx, c, err = bc.InboxBeginClaim(ctx, k, window, hint)
			require.NoError(t, err)
			require.Equal(t, dedup.StateNew, c.State, "a rolled-back claim leaves the key new")
			require.NoError(t, x.b.Effect(ctx, tx, k.Key))
			require.NoError(t, tx.InboxComplete(ctx, k, []byte("r")))
			require.NoError(t, tx.Commit(ctx))
			require.Equal(t, 1, x.effects(t, k))

			tx, c, err = bc.InboxBeginClaim(ctx, k, window, hint)
			require.NoError(t, err)
			require.Equal(t, dedup.StateDone, c.State)
			require.Equal(t, []byte("r"), c.Result)
			require.NoError(t, tx.Rollback(ctx))

			failed := key(k.Key + "-failed")
			first := failedAt(time.Minute)
			x.fail(t, failed, first, window)
			tx, c, err = bc.InboxBeginClaim(ctx, failed, window, hint)
			require.NoError(t, err)
			require.Equal(t, dedup.StateNew, c.State, "a failed key is claimed again")
			require.Equal(t, 2, c.Attempts, "the failed attempt and this one")
			require.True(t, first.Equal(c.FirstFailedAt), "the first failure's time: %s, want %s", c.FirstFailedAt, first)
			require.NoError(t, tx.Rollback(ctx))

			dead := key(k.Key + "-dead")
			x.bury(t, dead, failedAt(0), window)
			tx, c, err = bc.InboxBeginClaim(ctx, dead, window, hint)
			require.NoError(t, err)
			require.Equal(t, dedup.StateDead, c.State)
			require.NoError(t, tx.Rollback(ctx))
		})
	}
}

// txBatch checks dedupdriver.BatchClaimer: one start and one claim for the keys
// of many deliveries, with the single path's answers; a key that has a
// record already is left to the single path.
func txBatch(t *testing.T, x txSubject) {
	bc := need[dedupdriver.BatchClaimer](t, x.s)
	ctx := t.Context()
	done, dead, failed := key("done"), key("dead"), key("failed")
	x.apply(t, done, []byte("r"), window)
	x.bury(t, dead, failedAt(0), window)
	x.fail(t, failed, failedAt(time.Minute), window)

	keys := []string{done.Key, dead.Key, "n1", "n2"}
	claims, err := bc.InboxStartBatch(ctx, consumer, keys, window)
	require.NoError(t, err)
	require.Len(t, claims, len(keys))
	require.Equal(t, dedup.StateDone, claims[0].State)
	require.Equal(t, []byte("r"), claims[0].Result)
	require.Equal(t, dedup.StateDead, claims[1].State)
	for i := 2; i < 4; i++ {
		require.Equal(t, dedup.StateNew, claims[i].State, keys[i])
		require.Equal(t, 1, claims[i].Attempts, keys[i])
	}
	claims, err = bc.InboxStartBatch(ctx, consumer, []string{"n1"}, window)
	require.NoError(t, err)
	require.Equal(t, 2, claims[0].Attempts, "the batch start counts as InboxStart does")

	keys = []string{"n1", "n2", done.Key, failed.Key}
	tx, claims, err := bc.InboxBeginClaimBatch(ctx, consumer, keys, window)
	require.NoError(t, err)
	require.Len(t, claims, len(keys))
	require.Equal(t, dedup.StateNew, claims[0].State)
	require.Equal(t, dedup.StateNew, claims[1].State)
	require.Equal(t, dedup.Claim{}, claims[2], "a done key is not taken")
	require.Equal(t, dedup.Claim{}, claims[3], "a failed key is left to the single path")
	for _, k := range []string{"n1", "n2"} {
		require.NoError(t, x.b.Effect(ctx, tx, k))
		require.NoError(t, tx.InboxComplete(ctx, key(k), []byte("batched-"+k)))
	}
	require.NoError(t, tx.Commit(ctx))
	for _, k := range []string{"n1", "n2"} {
		require.Equal(t, 1, x.effects(t, key(k)), k)
		require.Equal(t, []byte("batched-"+k), x.requireState(t, key(k), dedup.StateDone).Result)
	}
	claims, err = bc.InboxStartBatch(ctx, consumer, []string{"n1"}, window)
	require.NoError(t, err)
	require.Equal(t, dedup.StateDone, claims[0].State, "the count went with the commit")

	tx, claims, err = bc.InboxBeginClaimBatch(ctx, consumer, []string{"n3"}, window)
	require.NoError(t, err)
	require.Equal(t, dedup.StateNew, claims[0].State)
	require.NoError(t, x.b.Effect(ctx, tx, "n3"))
	require.NoError(t, tx.Rollback(ctx))
	require.Zero(t, x.effects(t, key("n3")), "a batch rolled back applies nothing")
	x.requireState(t, key("n3"), dedup.StateNew, "and leaves its keys new")
}
