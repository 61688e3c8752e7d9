package deduptest

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/dedup"
	"github.com/oncemill/oncemill/dedup/dedupdriver"
)

// RunLeaseStore runs the conformance suite of [dedup.LeaseStore] on the
// stores h.New makes, one fresh store per subtest, the subtests in
// parallel. Each subtest is named after the behaviour it checks (see the
// package documentation); one for an optional interface the store does
// not implement is skipped, naming the interface.
func RunLeaseStore(t *testing.T, h LeaseHarness) {
	t.Helper()
	if h.New == nil {
		t.Fatal("deduptest: LeaseHarness.New is required")
	}
	for _, st := range []struct {
		name string
		run  func(t *testing.T, x leaseSubject)
	}{
		{"ClaimComplete", leaseClaimComplete},
		{"Result", func(t *testing.T, x leaseSubject) { x.results(t) }},
		{"Consumers", leaseConsumers},
		{"Extend", leaseExtend},
		{"Release", leaseRelease},
		{"Abandon", leaseAbandon},
		{"Takeover", leaseTakeover},
		{"LateEnd", leaseLateEnd},
		{"ConcurrentClaims", leaseConcurrentClaims},
		{"Bury", leaseBury},
		{"DeadCopies", func(t *testing.T, x leaseSubject) { x.deadCopiesCounted(t) }},
		{"ReplayGrant", func(t *testing.T, x leaseSubject) { x.replayGrant(t) }},
		{"Window", leaseWindow},
		{"Sweep", func(t *testing.T, x leaseSubject) { x.sweepExpired(t) }},
		{"CanceledContext", leaseCanceled},
		{"Peek", func(t *testing.T, x leaseSubject) { x.peek(t) }},
		{"HasRecord", func(t *testing.T, x leaseSubject) { x.hasRecord(t) }},
		{"DoneKeys", func(t *testing.T, x leaseSubject) { x.doneKeys(t) }},
		{"Cut", leaseCut},
	} {
		t.Run(st.name, func(t *testing.T) {
			t.Parallel()
			b := h.New(t)
			if b.Store == nil {
				t.Fatal("deduptest: LeaseBundle.Store is required")
			}
			st.run(t, newLeaseSubject(b))
		})
	}
}

// leaseSubject is a lease store under test.
type leaseSubject struct {
	subject
	b LeaseBundle
	s dedup.LeaseStore
}

// leaseFor is the lease the suite claims with for a window: shorter than
// it, as the inbox requires.
func leaseFor(w time.Duration) time.Duration {
	if w > lease {
		return lease
	}
	return w / 2
}

func newLeaseSubject(b LeaseBundle) leaseSubject {
	x := leaseSubject{b: b, s: b.Store}
	x.subject = subject{
		store:      b.Store,
		graveyard:  b.Store,
		deadCopies: b.DeadCopies,
		leaseMode:  true,
		apply: func(t *testing.T, k dedup.Key, result []byte, w time.Duration) {
			t.Helper()
			c := x.claimNew(t, k, leaseFor(w), w)
			require.NoError(t, b.Store.LeaseComplete(t.Context(), k, c.Token, result))
		},
		fail: func(t *testing.T, k dedup.Key, at time.Time, w time.Duration) {
			t.Helper()
			c := x.claimNew(t, k, leaseFor(w), w)
			require.NoError(t, b.Store.LeaseRelease(t.Context(), k, c.Token, dedup.Failure{Err: "deduptest: effect failed", At: at}))
		},
		bury: func(t *testing.T, k dedup.Key, at time.Time, w time.Duration) {
			t.Helper()
			c := x.claimNew(t, k, leaseFor(w), w)
			require.NoError(t, b.Store.LeaseBury(t.Context(), k, c.Token, dedup.Failure{Err: "deduptest: dead-lettered", At: at}))
		},
		look: func(t *testing.T, k dedup.Key) dedup.Claim {
			t.Helper()
			c := x.claim(t, k, lease, window)
			if c.State == dedup.StateNew {
				require.NoError(t, b.Store.LeaseRelease(t.Context(), k, c.Token, dedup.Failure{Abandoned: true}))
			}
			return c
		},
		hold: func(t *testing.T, k dedup.Key, d time.Duration) dedup.Claim {
			t.Helper()
			return x.claimNew(t, k, d, window)
		},
	}
	return x
}

func (x leaseSubject) claim(t *testing.T, k dedup.Key, l, w time.Duration) dedup.Claim {
	t.Helper()
	c, err := x.s.LeaseClaim(t.Context(), k, l, w)
	require.NoError(t, err)
	return c
}

func (x leaseSubject) claimNew(t *testing.T, k dedup.Key, l, w time.Duration) dedup.Claim {
	t.Helper()
	c := x.claim(t, k, l, w)
	require.Equal(t, dedup.StateNew, c.State, "claim of %s", k.Key)
	require.NotZero(t, c.Token, "a new claim carries a fencing token")
	return c
}

// requireFenced requires that token can neither complete, release,
// extend nor bury k, and that trying changes nothing a claim sees.
func (x leaseSubject) requireFenced(t *testing.T, k dedup.Key, token int64, msg string) {
	t.Helper()
	ctx := t.Context()
	before := x.claim(t, k, lease, window)
	require.ErrorIs(t, x.s.LeaseComplete(ctx, k, token, []byte("zombie")), dedup.ErrLeaseLost, "complete: %s", msg)
	require.ErrorIs(t, x.s.LeaseRelease(ctx, k, token, dedup.Failure{Err: "zombie", At: time.Now()}), dedup.ErrLeaseLost, "release: %s", msg)
	require.ErrorIs(t, x.s.LeaseRelease(ctx, k, token, dedup.Failure{Abandoned: true}), dedup.ErrLeaseLost, "abandoned release: %s", msg)
	_, err := x.s.LeaseExtend(ctx, k, token, lease)
	require.ErrorIs(t, err, dedup.ErrLeaseLost, "extend: %s", msg)
	require.ErrorIs(t, x.s.LeaseBury(ctx, k, token, dedup.Failure{Err: "zombie", At: time.Now()}), dedup.ErrLeaseLost, "bury: %s", msg)
	after := x.claim(t, k, lease, window)
	if before.State == dedup.StateNew {
		t.Fatalf("requireFenced of %s: the key was free, and the check claimed it", k.Key)
	}
	require.Equal(t, before.State, after.State, "a fenced call changes nothing: %s", msg)
	require.True(t, before.Until.Equal(after.Until), "a fenced call moves no lease: %s", msg)
	require.Equal(t, before.Result, after.Result, "a fenced call stores no result: %s", msg)
}

// leaseClaimComplete: a new claim carries a token and the lease's end; a
// duplicate meanwhile is in flight until then; the current token
// completes the key, which then answers done with its result and cannot
// be completed, released, extended or buried again.
func leaseClaimComplete(t *testing.T, x leaseSubject) {
	ctx := t.Context()
	k := key("mail-1")
	c := x.claimNew(t, k, lease, window)
	require.Equal(t, 1, c.Attempts)
	require.False(t, c.Until.IsZero(), "a new claim says when its lease ends")
	require.True(t, c.FirstFailedAt.IsZero(), "no attempt failed")

	dup := x.claim(t, k, lease, window)
	require.Equal(t, dedup.StateInFlight, dup.State, "a copy during a live lease is in flight, never new")
	require.True(t, c.Until.Equal(dup.Until), "until the lease ends: %s, want %s", dup.Until, c.Until)
	require.Equal(t, 1, dup.Attempts, "an in-flight answer counts no attempt")

	require.NoError(t, x.s.LeaseComplete(ctx, k, c.Token, []byte("sent")))
	for range 2 {
		done := x.claim(t, k, lease, window)
		require.Equal(t, dedup.StateDone, done.State)
		require.Equal(t, []byte("sent"), done.Result)
	}
	x.requireFenced(t, k, c.Token, "a done key has no lease")

	ghost := key("ghost")
	require.ErrorIs(t, x.s.LeaseComplete(ctx, ghost, c.Token, nil), dedup.ErrLeaseLost, "a key never claimed")
	require.ErrorIs(t, x.s.LeaseRelease(ctx, ghost, c.Token, dedup.Failure{}), dedup.ErrLeaseLost)
	_, err := x.s.LeaseExtend(ctx, ghost, c.Token, lease)
	require.ErrorIs(t, err, dedup.ErrLeaseLost)
	require.ErrorIs(t, x.s.LeaseBury(ctx, ghost, c.Token, dedup.Failure{}), dedup.ErrLeaseLost)
	if f, ok := x.s.(dedupdriver.RecordFinder); ok {
		found, err := f.InboxHasRecord(ctx, ghost)
		require.NoError(t, err)
		require.False(t, found, "fenced calls write nothing")
	}
}

// leaseConsumers: two consumers of one key keep separate records.
func leaseConsumers(t *testing.T, x leaseSubject) {
	a, b := dedup.Key{Consumer: "billing", Key: "order-1"}, dedup.Key{Consumer: "shipping", Key: "order-1"}
	ca := x.claimNew(t, a, lease, window)
	cb := x.claimNew(t, b, lease, window)
	require.NotEqual(t, ca.Token, cb.Token)
	require.NoError(t, x.s.LeaseComplete(t.Context(), a, ca.Token, []byte("billed")))
	require.Equal(t, dedup.StateInFlight, x.claim(t, b, lease, window).State, "completing one consumer's key leaves the other's")
	require.ErrorIs(t, x.s.LeaseComplete(t.Context(), b, ca.Token, nil), dedup.ErrLeaseLost, "a token is its key's and consumer's")
	require.NoError(t, x.s.LeaseComplete(t.Context(), b, cb.Token, []byte("shipped")))
	require.Equal(t, []byte("billed"), x.requireState(t, a, dedup.StateDone).Result)
	require.Equal(t, []byte("shipped"), x.requireState(t, b, dedup.StateDone).Result)
}

// leaseExtend: only the current token renews a lease, which then holds the
// key until its new end.
func leaseExtend(t *testing.T, x leaseSubject) {
	ctx := t.Context()
	k := key("slow-charge")
	c := x.claimNew(t, k, time.Minute, window)
	until, err := x.s.LeaseExtend(ctx, k, c.Token, lease)
	require.NoError(t, err)
	require.True(t, until.After(c.Until), "the lease ends later: %s, was %s", until, c.Until)
	dup := x.claim(t, k, lease, window)
	require.Equal(t, dedup.StateInFlight, dup.State)
	require.True(t, until.Equal(dup.Until), "the extended lease holds the key: %s, want %s", dup.Until, until)

	for _, wrong := range []int64{c.Token - 1, c.Token + 1} {
		_, err := x.s.LeaseExtend(ctx, k, wrong, 2*lease)
		require.ErrorIs(t, err, dedup.ErrLeaseLost, "token %d is not the current one", wrong)
	}
	dup = x.claim(t, k, lease, window)
	require.True(t, until.Equal(dup.Until), "a fenced extension moves nothing")

	require.NoError(t, x.s.LeaseComplete(ctx, k, c.Token, nil))
	_, err = x.s.LeaseExtend(ctx, k, c.Token, lease)
	require.ErrorIs(t, err, dedup.ErrLeaseLost, "a done key has no lease")
	_, err = x.s.LeaseExtend(ctx, key("ghost"), c.Token, lease)
	require.ErrorIs(t, err, dedup.ErrLeaseLost, "a key never claimed has no lease")
}

// leaseRelease: a released key is claimable at once, with a higher token,
// the attempts counted and the first failure's time kept; the released
// token is fenced.
func leaseRelease(t *testing.T, x leaseSubject) {
	ctx := t.Context()
	k := key("mail-2")
	first := failedAt(2 * time.Minute)
	c1 := x.claimNew(t, k, lease, window)
	require.NoError(t, x.s.LeaseRelease(ctx, k, c1.Token, dedup.Failure{Err: "smtp down", At: first}))

	c2 := x.claimNew(t, k, lease, window)
	require.Equal(t, 2, c2.Attempts, "the failed attempt and this one")
	require.Greater(t, c2.Token, c1.Token, "tokens grow")
	require.True(t, first.Equal(c2.FirstFailedAt), "the first failure's time: %s, want %s", c2.FirstFailedAt, first)
	x.requireFenced(t, k, c1.Token, "the released token")

	require.NoError(t, x.s.LeaseRelease(ctx, k, c2.Token, dedup.Failure{Err: "smtp 451", At: first.Add(time.Minute)}))
	c3 := x.claimNew(t, k, lease, window)
	require.Equal(t, 3, c3.Attempts)
	require.Greater(t, c3.Token, c2.Token)
	require.True(t, first.Equal(c3.FirstFailedAt), "still the first failure's time: %s", c3.FirstFailedAt)
	require.NoError(t, x.s.LeaseComplete(ctx, k, c3.Token, []byte("sent")))
	require.Equal(t, []byte("sent"), x.requireState(t, k, dedup.StateDone).Result)
}

// leaseAbandon: an abandoned attempt (the consumer shut down) frees the
// key at once and takes its count back.
func leaseAbandon(t *testing.T, x leaseSubject) {
	ctx := t.Context()
	k := key("deploy")
	first := failedAt(time.Minute)
	c := x.claimNew(t, k, lease, window)
	require.NoError(t, x.s.LeaseRelease(ctx, k, c.Token, dedup.Failure{Err: "timeout", At: first}))
	c = x.claimNew(t, k, lease, window)
	require.Equal(t, 2, c.Attempts)
	require.NoError(t, x.s.LeaseRelease(ctx, k, c.Token, dedup.Failure{Err: "ignored", At: time.Now(), Abandoned: true}))
	next := x.claimNew(t, k, lease, window)
	require.Equal(t, 2, next.Attempts, "the abandoned attempt is not counted")
	require.Greater(t, next.Token, c.Token)
	require.True(t, first.Equal(next.FirstFailedAt), "an abandoned attempt records no failure: %s", next.FirstFailedAt)
	x.requireFenced(t, k, c.Token, "the abandoned token")
}

// leaseTakeover: a lease that ends is taken over by the next claim, with a
// higher token and the attempt counted; the first holder's token is then
// fenced, so a zombie cannot overwrite the taker.
func leaseTakeover(t *testing.T, x leaseSubject) {
	ctx := t.Context()
	k := key("charge-9")
	zombie := x.claimNew(t, k, shortLease, window)
	var taker dedup.Claim
	eventually(t, "the lease to end", func() bool {
		taker = x.claim(t, k, lease, window)
		if taker.State != dedup.StateNew {
			require.Equal(t, dedup.StateInFlight, taker.State)
			require.True(t, zombie.Until.Equal(taker.Until), "in flight until the zombie's lease ends")
		}
		return taker.State == dedup.StateNew
	})
	require.Greater(t, taker.Token, zombie.Token)
	require.Equal(t, 2, taker.Attempts, "the taken-over attempt and this one")
	x.requireFenced(t, k, zombie.Token, "the zombie's token")
	require.NoError(t, x.s.LeaseComplete(ctx, k, taker.Token, []byte("taker")))
	require.Equal(t, []byte("taker"), x.requireState(t, k, dedup.StateDone).Result)
}

// leaseLateEnd: a lease that ended without another claim taking it over
// still belongs to its token, which completes or extends it: the inbox
// records an attempt that finished after its lease ended when its token
// is still the current one.
func leaseLateEnd(t *testing.T, x leaseSubject) {
	ctx := t.Context()
	late, slow := key("late"), key("slow")
	c1 := x.claimNew(t, late, shortLease, window)
	c2 := x.claimNew(t, slow, shortLease, window)
	x.waitLeaseEnd(t, late, c1)
	x.waitLeaseEnd(t, slow, c2)
	require.NoError(t, x.s.LeaseComplete(ctx, late, c1.Token, []byte("late")), "nobody took the key over")
	require.Equal(t, []byte("late"), x.requireState(t, late, dedup.StateDone).Result)
	until, err := x.s.LeaseExtend(ctx, slow, c2.Token, lease)
	require.NoError(t, err, "nobody took the key over")
	c := x.claim(t, slow, lease, window)
	require.Equal(t, dedup.StateInFlight, c.State, "the renewed lease holds the key")
	require.True(t, until.Equal(c.Until))
}

// retryConflict calls f until it returns an error that does not wrap
// dedup.ErrConflict, within the suite's patience.
func retryConflict(ctx context.Context, f func() error) error {
	deadline := time.Now().Add(patience)
	for {
		err := f()
		if !errors.Is(err, dedup.ErrConflict) || time.Now().After(deadline) {
			return err
		}
		select {
		case <-ctx.Done():
			return errors.Join(err, ctx.Err())
		case <-time.After(time.Millisecond):
		}
	}
}

// waitLeaseEnd waits, without claiming k, until the lease of c has ended:
// as a peek sees it, or by the clock where the store cannot peek.
func (x leaseSubject) waitLeaseEnd(t *testing.T, k dedup.Key, c dedup.Claim) {
	t.Helper()
	p, peeks := x.s.(dedupdriver.Peeker)
	eventually(t, "the lease to end", func() bool {
		if !peeks {
			return time.Now().After(c.Until)
		}
		pc, err := p.InboxPeek(t.Context(), k)
		require.NoError(t, err)
		return pc.State == dedup.StateNew
	})
}

// leaseConcurrentClaims: copies of one key claimed at once take one lease;
// the others are in flight (or done, once the winner completed), and the
// effect runs once. A call that loses a conflict (dedup.ErrConflict) is
// made again, as the inbox's redelivery and completion retries make it.
func leaseConcurrentClaims(t *testing.T, x leaseSubject) {
	for _, failedBefore := range []bool{false, true} {
		name := "New"
		if failedBefore {
			name = "Failed"
		}
		t.Run(name, func(t *testing.T) {
			ctx := t.Context()
			k := key("burst-" + name)
			if failedBefore {
				x.fail(t, k, failedAt(time.Minute), window)
			}
			var (
				wg      sync.WaitGroup
				effects atomic.Int32
				start   = make(chan struct{})
				claims  = make([]dedup.Claim, copies)
				errs    = make([]error, copies)
			)
			for i := range copies {
				wg.Go(func() {
					<-start
					errs[i] = retryConflict(ctx, func() (err error) {
						claims[i], err = x.s.LeaseClaim(ctx, k, lease, window)
						return err
					})
					if errs[i] == nil && claims[i].State == dedup.StateNew {
						effects.Add(1)
						errs[i] = retryConflict(ctx, func() error {
							return x.s.LeaseComplete(ctx, k, claims[i].Token, []byte("r"))
						})
					}
				})
			}
			close(start)
			wg.Wait()
			states := map[dedup.State]int{}
			for i := range copies {
				require.NoError(t, errs[i], "copy %d", i)
				states[claims[i].State]++
				switch claims[i].State {
				case dedup.StateNew, dedup.StateInFlight:
				case dedup.StateDone:
					require.Equal(t, []byte("r"), claims[i].Result)
				default:
					t.Fatalf("copy %d: %s; want new, in flight or done", i, claims[i].State)
				}
			}
			require.Equal(t, 1, states[dedup.StateNew], "exactly one copy takes the lease: %v", states)
			require.EqualValues(t, 1, effects.Load(), "exactly one effect")
			require.Equal(t, []byte("r"), x.requireState(t, k, dedup.StateDone).Result)
		})
	}
}

// leaseBury: only the current token buries a key, which then answers dead
// to every claim, with its first failure's time, and has no lease left.
func leaseBury(t *testing.T, x leaseSubject) {
	ctx := t.Context()
	k := key("poison")
	first := failedAt(2 * time.Minute)
	c1 := x.claimNew(t, k, lease, window)
	require.NoError(t, x.s.LeaseRelease(ctx, k, c1.Token, dedup.Failure{Err: "bad json", At: first}))
	c2 := x.claimNew(t, k, lease, window)
	x.requireFenced(t, k, c1.Token, "a released token cannot bury")
	require.NoError(t, x.s.LeaseBury(ctx, k, c2.Token, dedup.Failure{Err: "still bad json", At: first.Add(time.Minute)}))
	for range 2 {
		c := x.claim(t, k, time.Millisecond, window)
		require.Equal(t, dedup.StateDead, c.State, "a buried key is dead")
		require.True(t, first.Equal(c.FirstFailedAt), "with its first failure's time: %s, want %s", c.FirstFailedAt, first)
	}
	x.requireFenced(t, k, c2.Token, "a dead key has no lease")
	x.deadCopyRequired(t, k)
}

// leaseWindow: a record is forgotten once its window has passed (swept by
// dedup.Expirer, or expired by the store itself), and its key's next token
// is still higher than every token it had; a record whose window has not
// passed stays.
func leaseWindow(t *testing.T, x leaseSubject) {
	ctx := t.Context()
	k, live := key("short"), key("live")
	old := x.claimNew(t, k, leaseFor(shortWindow), shortWindow)
	require.NoError(t, x.s.LeaseComplete(ctx, k, old.Token, []byte("r")))
	x.apply(t, live, []byte("live"), window)
	var fresh dedup.Claim
	eventually(t, "the record's window to pass", func() bool {
		x.sweep(t)
		fresh = x.claim(t, k, leaseFor(shortWindow), shortWindow)
		return fresh.State == dedup.StateNew
	})
	require.Equal(t, 1, fresh.Attempts, "the record was forgotten")
	require.Greater(t, fresh.Token, old.Token, "a token is never issued twice for a key, even after its record expired")
	require.ErrorIs(t, x.s.LeaseComplete(ctx, k, old.Token, []byte("zombie")), dedup.ErrLeaseLost, "the forgotten record's token is fenced")
	require.NoError(t, x.s.LeaseComplete(ctx, k, fresh.Token, nil))
	require.Equal(t, []byte("live"), x.requireState(t, live, dedup.StateDone, "a live record stays").Result)
}

// leaseCanceled: a call on a canceled context, or one whose deadline has
// passed, is the caller's, not the store's: if it fails, its error does
// not wrap dedup.ErrUnavailable.
func leaseCanceled(t *testing.T, x leaseSubject) {
	k := key("canceled")
	c := x.claimNew(t, k, lease, window)
	for name, ctx := range callerDone(t) {
		notUnavailable := func(call string, err error) {
			t.Helper()
			assert.NotErrorIs(t, err, dedup.ErrUnavailable, "%s on a %s context", call, name)
		}
		_, err := x.s.LeaseClaim(ctx, key("other"), lease, window)
		notUnavailable("LeaseClaim", err)
		_, err = x.s.LeaseExtend(ctx, k, c.Token, lease)
		notUnavailable("LeaseExtend", err)
		notUnavailable("LeaseComplete", x.s.LeaseComplete(ctx, k, c.Token, nil))
		notUnavailable("LeaseRelease", x.s.LeaseRelease(ctx, k, c.Token, dedup.Failure{Err: "x", At: time.Now()}))
		notUnavailable("LeaseBury", x.s.LeaseBury(ctx, k, c.Token, dedup.Failure{Err: "x", At: time.Now()}))
		for call, err := range x.everyCall(ctx, k) {
			notUnavailable(call, err)
		}
	}
}

// leaseCut: once the store's connections are cut, every call fails with
// an error wrapping dedup.ErrUnavailable; a lease held then is neither
// lost nor completed (not dedup.ErrLeaseLost): the inbox nacks the
// message without counting an attempt, and the lease ends by itself.
func leaseCut(t *testing.T, x leaseSubject) {
	if x.b.Cut == nil {
		t.Skip("the bundle has no Cut")
	}
	ctx := t.Context()
	k := key("cut")
	c := x.claimNew(t, k, lease, window)
	x.b.Cut(t)
	unavailable := func(call string, err error) {
		t.Helper()
		assert.ErrorIs(t, err, dedup.ErrUnavailable, "%s after the cut: %v", call, err)
		assert.NotErrorIs(t, err, dedup.ErrLeaseLost, "%s after the cut: the lease is not known lost", call)
	}
	unavailable("LeaseComplete", x.s.LeaseComplete(ctx, k, c.Token, []byte("r")))
	_, err := x.s.LeaseExtend(ctx, k, c.Token, lease)
	unavailable("LeaseExtend", err)
	unavailable("LeaseRelease", x.s.LeaseRelease(ctx, k, c.Token, dedup.Failure{Err: "x", At: time.Now()}))
	unavailable("LeaseBury", x.s.LeaseBury(ctx, k, c.Token, dedup.Failure{Err: "x", At: time.Now()}))
	_, err = x.s.LeaseClaim(ctx, key("after-cut"), lease, window)
	unavailable("LeaseClaim", err)
	for call, err := range x.everyCall(ctx, key("after-cut")) {
		unavailable(call, err)
	}
}
