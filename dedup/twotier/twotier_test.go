package twotier_test

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/dedup"
	"github.com/oncemill/oncemill/dedup/memory"
	"github.com/oncemill/oncemill/dedup/twotier"
	"github.com/oncemill/oncemill/internal/testing/msgtest"
	"github.com/oncemill/oncemill/internal/testing/redistest"
	"github.com/oncemill/oncemill/middleware"
)

func TestConfigValidate(t *testing.T) {
	t.Parallel()
	b := setup(t, options{})
	_, err := twotier.New(twotier.Config{Record: b.record})
	require.ErrorContains(t, err, "twotier: Config.Lock is required")
	_, err = twotier.New(twotier.Config{Lock: b.lock})
	require.ErrorContains(t, err, "twotier: Config.Record is required")
	_, err = twotier.New(twotier.Config{Lock: b.record, Record: b.record})
	require.ErrorContains(t, err, "Config.Lock and Config.Record are the same store")
	_, err = twotier.New(twotier.Config{Lock: b.lock, Record: b.record, Lease: -time.Second})
	require.ErrorContains(t, err, "Config.Lease")
	// The postgres store may be the lock of another postgres store, if
	// one wishes: they are not the same store.
	other, err := twotier.New(twotier.Config{Lock: memory.New(), Record: b.record})
	require.NoError(t, err)
	require.NotNil(t, other)
}

// TestDuplicatesAreAnsweredFromTheLock applies a key once, then shows that
// its duplicates are answered by Redis alone: no connection is taken from
// the PostgreSQL pool, the handler does not run, and the produced messages
// are replayed with their UUIDs.
func TestDuplicatesAreAnsweredFromTheLock(t *testing.T) {
	t.Parallel()
	b := setup(t, options{})
	in := newInbox(t, b.store, "billing")
	var calls atomic.Int32
	h := in.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		calls.Add(1)
		if err := b.effect(msg.Context(), middleware.IdempotencyKey(msg.Context())); err != nil {
			return nil, err
		}
		return []*message.Message{message.NewMessage(watermill.NewUUID(), []byte("receipt"))}, nil
	})

	first, err := h(delivery("o-1"))
	require.NoError(t, err)
	require.Len(t, first, 1)
	require.Equal(t, map[string]int{"o-1": 1}, b.effects(t))
	status, attempts := b.recordRow(t, dedup.Key{Consumer: "billing", Key: "o-1"})
	require.Equal(t, "done", status, "PostgreSQL holds the record")
	require.Equal(t, 1, attempts)
	require.Equal(t, "done", b.lockRecord(t, dedup.Key{Consumer: "billing", Key: "o-1"})["status"], "the lock learnt it after the commit")

	acquiresBefore := b.acquires()
	for i := 0; i < 5; i++ {
		again, err := h(delivery("o-1"))
		require.NoError(t, err)
		require.Len(t, again, 1)
		require.Equal(t, first[0].UUID, again[0].UUID, "the stored result comes from the lock")
		require.Equal(t, first[0].Payload, again[0].Payload)
	}
	require.Equal(t, acquiresBefore, b.acquires(), "no duplicate touched the database")
	require.Equal(t, int32(1), calls.Load())
	require.Equal(t, map[string]int{"o-1": 1}, b.effects(t))
	require.Equal(t, middleware.InboxStats{Applied: 1, Duplicates: 5}, in.Stats())
	require.Equal(t, twotier.Stats{LockHits: 5}, b.store.Stats())
}

// TestConcurrentDuplicatesApplyOnce delivers one key 50 times at once. The
// lock lets one delivery through to the database; the others are nacked as
// in flight and redelivered until they find the key done.
func TestConcurrentDuplicatesApplyOnce(t *testing.T) {
	t.Parallel()
	b := setup(t, options{maxConns: 8})
	in := newInbox(t, b.store, "billing")
	var calls atomic.Int32
	h := in.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		calls.Add(1)
		return nil, b.effect(msg.Context(), "hot")
	})
	const n = 50
	var (
		wg    sync.WaitGroup
		start = make(chan struct{})
		mu    sync.Mutex
		errs  []error
	)
	for i := 0; i < n; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			for { // the broker's redelivery
				_, err := h(delivery("hot"))
				if errors.Is(err, middleware.ErrInFlight) {
					continue
				}
				if err != nil {
					mu.Lock()
					errs = append(errs, err)
					mu.Unlock()
				}
				return
			}
		}()
	}
	close(start)
	wg.Wait()
	require.Empty(t, errs)
	require.Equal(t, map[string]int{"hot": 1}, b.effects(t))
	require.Equal(t, int32(1), calls.Load())
	stats := in.Stats()
	require.Equal(t, int64(1), stats.Applied)
	require.Equal(t, int64(n-1), stats.Duplicates)
	_, attempts := b.recordRow(t, dedup.Key{Consumer: "billing", Key: "hot"})
	require.Equal(t, 1, attempts, "only the lock holder reached the record")
}

// TestRouterWithDuplicates runs the inbox under a real router: 100 keys,
// each published 3 times to 3 handlers of one consumer.
func TestRouterWithDuplicates(t *testing.T) {
	t.Parallel()
	b := setup(t, options{maxConns: 8})
	const n, copies = 100, 3
	h := newHarness(t, b, copies)
	ks := msgtest.Keys("order", n)
	h.Publish(ks, copies)
	h.WaitAcked(n * copies)
	h.RequireNoOtherErrors()

	effects := b.effects(t)
	require.Len(t, effects, n)
	for _, k := range ks {
		require.Equal(t, 1, effects[k], "key %s", k)
	}
	require.Equal(t, int64(n), h.runs.Load())
	stats := h.inbox.Stats()
	require.Equal(t, int64(n), stats.Applied)
	require.Equal(t, int64(n*copies-n), stats.Duplicates)
}

// TestRecordAnswersWhatTheLockForgot empties Redis, as a failover or a
// restart without persistence would: the next duplicate gets past the lock,
// the record answers it done, and the lock learns it again.
func TestRecordAnswersWhatTheLockForgot(t *testing.T) {
	t.Parallel()
	b := setup(t, options{})
	in := newInbox(t, b.store, "billing")
	var calls atomic.Int32
	h := in.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		calls.Add(1)
		if err := b.effect(msg.Context(), "o-2"); err != nil {
			return nil, err
		}
		return []*message.Message{message.NewMessage("receipt-o-2", nil)}, nil
	})
	_, err := h(delivery("o-2"))
	require.NoError(t, err)
	require.NoError(t, redistest.DeleteKeys(context.Background(), b.redis, b.prefix))

	acquiresBefore := b.acquires()
	out, err := h(delivery("o-2"))
	require.NoError(t, err)
	require.Len(t, out, 1)
	require.Equal(t, "receipt-o-2", out[0].UUID, "the record's stored result")
	require.Greater(t, b.acquires(), acquiresBefore, "the record was asked")
	require.Equal(t, int32(1), calls.Load())
	require.Equal(t, map[string]int{"o-2": 1}, b.effects(t))
	lockRec := b.lockRecord(t, dedup.Key{Consumer: "billing", Key: "o-2"})
	require.Equal(t, "done", lockRec["status"], "the lock learnt the key from the record")

	acquiresBefore = b.acquires()
	out, err = h(delivery("o-2"))
	require.NoError(t, err)
	require.Equal(t, "receipt-o-2", out[0].UUID)
	require.Equal(t, acquiresBefore, b.acquires(), "answered from the lock again")
	require.Equal(t, middleware.InboxStats{Applied: 1, Duplicates: 2}, in.Stats())
}

// TestCrashLikeRollbackReleasesTheLock makes the handler panic, as a crash
// in the middle of the effect would, then fail: each time the record's
// transaction rolls back and the lock is released, so that the redelivery
// is applied at once although the lease is an hour. The inbox recovers the
// panic and counts it as a failure.
func TestCrashLikeRollbackReleasesTheLock(t *testing.T) {
	t.Parallel()
	b := setup(t, options{lease: time.Hour})
	in := newInbox(t, b.store, "billing")
	var runs atomic.Int32
	h := in.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		n := runs.Add(1)
		if err := b.effect(msg.Context(), "o-3"); err != nil {
			return nil, err
		}
		switch n {
		case 1:
			panic("nil map in handler")
		case 2:
			return nil, errors.New("card network timeout")
		}
		return nil, nil
	})
	key := dedup.Key{Consumer: "billing", Key: "o-3"}

	_, err := h(delivery("o-3"))
	require.ErrorIs(t, err, middleware.ErrPanicked)
	require.Empty(t, b.effects(t), "the effect rolled back with the claim")
	require.Equal(t, "failed", b.lockRecord(t, key)["status"], "the lock was released, not left to expire")
	status, attempts := b.recordRow(t, key)
	require.Equal(t, "failed", status, "the panic is recorded in PostgreSQL")
	require.Equal(t, 1, attempts)

	_, err = h(delivery("o-3"))
	require.ErrorContains(t, err, "card network timeout")
	require.Empty(t, b.effects(t))
	status, attempts = b.recordRow(t, key)
	require.Equal(t, "failed", status, "the failure is recorded in PostgreSQL")
	require.Equal(t, 2, attempts)

	_, err = h(delivery("o-3"))
	require.NoError(t, err)
	require.Equal(t, map[string]int{"o-3": 1}, b.effects(t))
	require.Equal(t, int32(3), runs.Load())
	require.Equal(t, middleware.InboxStats{Applied: 1, Failed: 2, Panicked: 1}, in.Stats(), "no delivery waited for a lease")
	lockRec := b.lockRecord(t, key)
	require.Equal(t, "done", lockRec["status"])
	require.Equal(t, "3", lockRec["attempts"])
	status, attempts = b.recordRow(t, key)
	require.Equal(t, "done", status)
	require.Equal(t, 3, attempts)
}

// TestRedisStoppedMidRun stops the lock's Redis under a running router:
// every claim falls back to PostgreSQL, which keeps every key exactly once;
// after the restart the lock, which forgot everything, learns the keys
// again from the record.
func TestRedisStoppedMidRun(t *testing.T) {
	t.Parallel()
	srv := redistest.StartServer(t)
	logs := watermill.NewCaptureLogger()
	b := setup(t, options{maxConns: 8, server: srv, logger: logs, lease: 10 * time.Second})
	const n, copies = 30, 3
	h := newHarness(t, b, copies)

	before := msgtest.Keys("before", n)
	h.Publish(before, copies)
	h.WaitAcked(n * copies)
	require.Zero(t, b.store.Stats().Fallbacks)

	srv.Stop()
	during := msgtest.Keys("during", n)
	h.Publish(during, copies)
	h.Publish(before, 1) // duplicates of keys done before the stop
	h.WaitAcked(2*n*copies + n)
	// Each delivery while Redis was down went to the record alone: its
	// start, and its claim if the record did not answer the start.
	fallbacks := b.store.Stats().Fallbacks
	require.GreaterOrEqual(t, fallbacks, int64(n*copies+n), "every delivery while Redis was down went to the record alone")
	require.LessOrEqual(t, fallbacks, int64(2*(n*copies+n)))
	require.NotEmpty(t, logs.Captured()[watermill.ErrorLogLevel], "the lock's failures are logged")
	effects := b.effects(t)
	for _, k := range append(append([]string{}, before...), during...) {
		require.Equal(t, 1, effects[k], "key %s", k)
	}

	// Bring Redis back (empty) while no delivery runs; see
	// restartBetweenDeliveries in dedup/redis for why.
	h.Pause()
	srv.Start()
	msgtest.WaitFor(t, "the client to reconnect", func() bool { return b.redis.Ping(context.Background()).Err() == nil })
	h.Resume()
	// The breaker, open since the stop, closes on its next probe; the
	// starts made meanwhile went to the record alone.
	waitBreakerClosed(t, b.store, dedup.Key{Consumer: "orders", Key: before[0]}, 10*twotier.DefaultBreakerProbe)
	fallbacks = b.store.Stats().Fallbacks

	all := append(append([]string{}, before...), during...)
	h.Publish(all, 1)
	h.WaitAcked(2*n*copies + n + 2*n)
	h.RequireNoOtherErrors()
	require.Equal(t, int64(2*n), h.runs.Load(), "the handler ran once per key, Redis or not")
	effects = b.effects(t)
	require.Len(t, effects, 2*n)
	for _, k := range all {
		require.Equal(t, 1, effects[k], "key %s", k)
	}

	// The restarted lock learnt every key from the record.
	acquiresBefore := b.acquires()
	h.Publish(all, 1)
	h.WaitAcked(2*n*copies + n + 4*n)
	require.Equal(t, acquiresBefore, b.acquires(), "duplicates are answered by the lock again")
	require.Equal(t, fallbacks, b.store.Stats().Fallbacks)
}

// TestLazyTransaction shows that nothing is opened before the lock says
// new, and the no-op ends of a transaction.
func TestLazyTransaction(t *testing.T) {
	t.Parallel()
	b := setup(t, options{})
	ctx := context.Background()
	key := dedup.Key{Consumer: "billing", Key: "lazy"}

	acquiresBefore := b.acquires()
	tx, err := b.store.InboxBegin(ctx)
	require.NoError(t, err)
	require.Equal(t, ctx, tx.WithTx(ctx), "no record transaction to carry yet")
	require.NoError(t, tx.Rollback(ctx), "rollback without a claim is a no-op")
	require.NoError(t, tx.Commit(ctx), "commit after rollback is a no-op")
	require.Equal(t, acquiresBefore, b.acquires(), "no database transaction was opened")

	// The lock holds the key: a second claim is in flight, without the
	// database.
	holder, err := b.store.InboxBegin(ctx)
	require.NoError(t, err)
	c, err := holder.InboxClaim(ctx, key, time.Hour)
	require.NoError(t, err)
	require.Equal(t, dedup.StateNew, c.State)
	require.Equal(t, 1, c.Attempts)
	_, err = holder.InboxClaim(ctx, key, time.Hour)
	require.ErrorContains(t, err, "already claimed")

	acquiresBefore = b.acquires()
	dup, err := b.store.InboxBegin(ctx)
	require.NoError(t, err)
	c, err = dup.InboxClaim(ctx, key, time.Hour)
	require.NoError(t, err)
	require.Equal(t, dedup.StateInFlight, c.State)
	require.False(t, c.Until.IsZero())
	require.NoError(t, dup.Rollback(ctx))
	require.Equal(t, acquiresBefore, b.acquires())
	require.ErrorContains(t, dup.InboxComplete(ctx, key, nil), "no key was claimed new")

	require.NoError(t, holder.InboxComplete(ctx, key, []byte("r")))
	require.NoError(t, holder.Commit(ctx))
	require.NoError(t, holder.Rollback(ctx), "rollback after commit is a no-op")
	require.Equal(t, "done", b.lockRecord(t, key)["status"])
	require.Equal(t, "r", b.lockRecord(t, key)["result"])
	status, _ := b.recordRow(t, key)
	require.Equal(t, "done", status)
}

// failingLock is a lock whose every call fails, as an unreachable Redis.
type failingLock struct{ calls atomic.Int32 }

func (l *failingLock) InboxPeek(context.Context, dedup.Key) (dedup.Claim, error) {
	l.calls.Add(1)
	return dedup.Claim{}, errors.New("dial tcp: connection refused")
}

func (l *failingLock) LeaseClaim(context.Context, dedup.Key, time.Duration, time.Duration) (dedup.Claim, error) {
	l.calls.Add(1)
	return dedup.Claim{}, errors.New("dial tcp: connection refused")
}

func (l *failingLock) LeaseComplete(context.Context, dedup.Key, int64, []byte) error {
	l.calls.Add(1)
	return errors.New("dial tcp: connection refused")
}

func (l *failingLock) LeaseRelease(context.Context, dedup.Key, int64, dedup.Failure) error {
	l.calls.Add(1)
	return errors.New("dial tcp: connection refused")
}

func (l *failingLock) LeaseExtend(context.Context, dedup.Key, int64, time.Duration) (time.Time, error) {
	l.calls.Add(1)
	return time.Time{}, errors.New("dial tcp: connection refused")
}

func (l *failingLock) LeaseBury(context.Context, dedup.Key, int64, dedup.Failure) error {
	l.calls.Add(1)
	return errors.New("dial tcp: connection refused")
}

func (l *failingLock) InboxGrantReplay(context.Context, dedup.Key, string) (bool, error) {
	l.calls.Add(1)
	return false, errors.New("dial tcp: connection refused")
}

func (l *failingLock) InboxReopen(context.Context, dedup.Key, string) (bool, error) {
	l.calls.Add(1)
	return false, errors.New("dial tcp: connection refused")
}

func (l *failingLock) InboxReplayGranted(context.Context, dedup.Key, string) (bool, error) {
	l.calls.Add(1)
	return false, errors.New("dial tcp: connection refused")
}

func (l *failingLock) InboxDeadCopy(context.Context, dedup.Key) error {
	l.calls.Add(1)
	return errors.New("dial tcp: connection refused")
}

// TestLockErrorsFallBackToTheRecord: with a lock that always fails, the
// store is the record alone, still exactly once, and every fallback is
// logged. A cancelled context is returned, not fallen back from.
func TestLockErrorsFallBackToTheRecord(t *testing.T) {
	t.Parallel()
	b := setup(t, options{maxConns: 8})
	lock := &failingLock{}
	logs := watermill.NewCaptureLogger()
	store, err := twotier.New(twotier.Config{Lock: lock, Record: b.record, Logger: logs})
	require.NoError(t, err)
	in := newInbox(t, store, "billing")
	h := in.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		return nil, b.effect(msg.Context(), middleware.IdempotencyKey(msg.Context()))
	})
	var wg sync.WaitGroup
	for i := 0; i < 10; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, err := h(delivery("o-4"))
			if err != nil {
				t.Error(err)
			}
		}()
	}
	wg.Wait()
	require.Equal(t, map[string]int{"o-4": 1}, b.effects(t))
	require.Equal(t, middleware.InboxStats{Applied: 1, Duplicates: 9}, in.Stats())
	// Every delivery peeked, and claimed unless the record answered its
	// start done.
	stats := store.Stats()
	require.Zero(t, stats.LockHits)
	require.GreaterOrEqual(t, stats.Fallbacks, int64(11), "10 starts and at least the claim that applied the key")
	require.LessOrEqual(t, stats.Fallbacks, int64(20))
	require.Equal(t, stats.Fallbacks, int64(lock.calls.Load()), "no lease to settle after a failed claim")
	require.Len(t, logs.Captured()[watermill.ErrorLogLevel], int(stats.Fallbacks))

	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	_, err = store.InboxStart(ctx, dedup.Key{Consumer: "billing", Key: "o-5"}, time.Hour)
	require.ErrorContains(t, err, "twotier: start: lock peek")
	tx, err := store.InboxBegin(ctx)
	require.NoError(t, err)
	_, err = tx.InboxClaim(ctx, dedup.Key{Consumer: "billing", Key: "o-5"}, time.Hour)
	require.ErrorContains(t, err, "twotier: lock claim")
	require.NoError(t, tx.Rollback(ctx))
	require.Equal(t, stats.Fallbacks, store.Stats().Fallbacks)
}

// plainRecord is a record that neither expires, peeks nor lists keys.
type plainRecord struct {
	dedup.TxStore
}

func TestDelegationToTheRecord(t *testing.T) {
	t.Parallel()
	b := setup(t, options{})
	ctx := context.Background()
	key := dedup.Key{Consumer: "billing", Key: "k"}

	// InboxFail reaches the record.
	failedAt := time.Date(2026, 3, 1, 12, 0, 0, 0, time.UTC)
	require.NoError(t, b.store.InboxFail(ctx, key, dedup.Failure{Err: "boom", At: failedAt}, time.Hour))
	status, attempts := b.recordRow(t, key)
	require.Equal(t, "failed", status)
	require.Equal(t, 1, attempts)

	// Peek and DoneKeys read the record, not the lock.
	in := newInbox(t, b.store, "billing")
	h := in.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		return nil, b.effect(msg.Context(), middleware.IdempotencyKey(msg.Context()))
	})
	_, err := h(delivery("k"))
	require.NoError(t, err)
	require.NoError(t, redistest.DeleteKeys(ctx, b.redis, b.prefix))
	c, err := b.store.InboxPeek(ctx, key)
	require.NoError(t, err)
	require.Equal(t, dedup.StateDone, c.State)
	require.Equal(t, 2, c.Attempts)
	require.True(t, failedAt.Equal(c.FirstFailedAt))
	var listed []string
	require.NoError(t, b.store.InboxDoneKeys(ctx, "billing", time.Time{}, func(k string) error {
		listed = append(listed, k)
		return nil
	}))
	require.Equal(t, []string{"k"}, listed)
	n, err := b.store.InboxDeleteExpired(ctx, 10)
	require.NoError(t, err)
	require.Zero(t, n)
	_, err = b.store.InboxDeleteExpired(ctx, 0)
	require.ErrorContains(t, err, "twotier: delete expired")

	// A record without them: the error says so.
	plain, err := twotier.New(twotier.Config{Lock: b.lock, Record: plainRecord{b.record}})
	require.NoError(t, err)
	_, err = plain.InboxPeek(ctx, key)
	require.ErrorContains(t, err, "does not implement dedupdriver.Peeker")
	err = plain.InboxDoneKeys(ctx, "billing", time.Time{}, func(string) error { return nil })
	require.ErrorContains(t, err, "does not implement dedupdriver.KeyLister")
	_, err = plain.InboxDeleteExpired(ctx, 10)
	require.ErrorContains(t, err, "does not implement dedup.Expirer")
}
