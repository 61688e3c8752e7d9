package twotier_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/dedup"
	dlv "github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/internal/testing/msgtest"
	"github.com/oncemill/oncemill/middleware"
)

// TestBuriedKeyIsDeadInTheRecordNeverDoneInTheLock buries a key, then
// claims it again in every way: the record answers dead each time, and the
// lock is released, never marked done, so that no claim is answered done
// from Redis. Reopening it in the record makes it claimable at once.
func TestBuriedKeyIsDeadInTheRecordNeverDoneInTheLock(t *testing.T) {
	t.Parallel()
	b := setup(t, options{lease: time.Hour})
	ctx := context.Background()
	key := dedup.Key{Consumer: "billing", Key: "poison-1"}

	start, err := b.store.InboxStart(ctx, key, time.Hour)
	require.NoError(t, err)
	require.Equal(t, dedup.StateNew, start.State)
	tx, c := b.claim(t, key)
	require.Equal(t, dedup.StateNew, c.State)
	buriedAt := time.Date(2026, 3, 1, 12, 0, 0, 0, time.UTC)
	require.NoError(t, tx.InboxBury(ctx, key, dedup.Failure{Err: "bad payload", At: buriedAt}))
	require.Equal(t, "processing", b.lockRecord(t, key)["status"], "the lock is held until the transaction ends")
	require.NoError(t, tx.Commit(ctx))

	status, _ := b.recordRow(t, key)
	require.Equal(t, "dead", status)
	lockRec := b.lockRecord(t, key)
	require.Equal(t, "failed", lockRec["status"], "the lock was released, not completed")
	require.Equal(t, "bad payload", lockRec["last_error"])
	require.NotContains(t, lockRec, "lease_until")

	start, err = b.store.InboxStart(ctx, key, time.Hour)
	require.NoError(t, err)
	require.Equal(t, dedup.StateDead, start.State, "the record answers the start")
	p, err := b.store.InboxPeek(ctx, key)
	require.NoError(t, err)
	require.Equal(t, dedup.StateDead, p.State)

	// A claim of the dead key frees the lock at once, and neither end of
	// its transaction marks it done.
	for _, end := range []string{"commit", "rollback"} {
		tx, c := b.claim(t, key)
		require.Equal(t, dedup.StateDead, c.State, end)
		require.Equal(t, "failed", b.lockRecord(t, key)["status"], "%s: the lock is not held for a dead key", end)
		if end == "commit" {
			require.NoError(t, tx.Commit(ctx))
		} else {
			require.NoError(t, tx.Rollback(ctx))
		}
		require.Equal(t, "failed", b.lockRecord(t, key)["status"], "%s: the lock never says done for a dead key", end)
		status, _ := b.recordRow(t, key)
		require.Equal(t, "dead", status)
	}
	require.Zero(t, b.store.Stats().LockHits, "the lock answered nothing about the dead key")

	require.NoError(t, b.store.InboxDeadCopy(ctx, key))
	require.NoError(t, b.store.InboxDeadCopy(ctx, key))
	require.Equal(t, 2, b.deadCopies(t, key), "dead copies are counted in the record")

	// Only the grant written on the dead key reopens it: no marker, a
	// forged one or another grant leave it dead.
	reopened, err := b.store.InboxReopen(ctx, key, "")
	require.NoError(t, err)
	require.False(t, reopened, "no grant")
	reopened, err = b.store.InboxReopen(ctx, key, "1")
	require.NoError(t, err)
	require.False(t, reopened, "a marker the store never granted")
	_, err = b.store.InboxGrantReplay(ctx, key, "")
	require.ErrorIs(t, err, dedup.ErrNoGrant)
	granted, err := b.store.InboxGrantReplay(ctx, key, "grant-1")
	require.NoError(t, err)
	require.True(t, granted, "the key is dead")
	reopened, err = b.store.InboxReopen(ctx, key, "grant-2")
	require.NoError(t, err)
	require.False(t, reopened, "another grant")
	ok, err := b.store.InboxReplayGranted(ctx, key, "grant-2")
	require.NoError(t, err)
	require.False(t, ok)

	// Reopened in the record, the key is claimable at once, without the
	// lock being told.
	reopened, err = b.store.InboxReopen(ctx, key, "grant-1")
	require.NoError(t, err)
	require.True(t, reopened)
	status, attempts := b.recordRow(t, key)
	require.Equal(t, "failed", status)
	require.Zero(t, attempts, "the attempts are reset")
	reopened, err = b.store.InboxReopen(ctx, key, "grant-1")
	require.NoError(t, err)
	require.False(t, reopened, "the key is no longer dead")

	start, err = b.store.InboxStart(ctx, key, time.Hour)
	require.NoError(t, err)
	require.Equal(t, dedup.StateNew, start.State)
	require.Equal(t, 1, start.Attempts, "the replay's attempt is the first counted")
	tx, c = b.claim(t, key)
	require.Equal(t, dedup.StateNew, c.State)
	require.NoError(t, tx.InboxComplete(ctx, key, []byte("charged")))
	require.NoError(t, tx.Commit(ctx))
	status, _ = b.recordRow(t, key)
	require.Equal(t, "done", status)
	require.Equal(t, "done", b.lockRecord(t, key)["status"], "a done key is taught to the lock as before")

	acquiresBefore := b.acquires()
	start, err = b.store.InboxStart(ctx, key, time.Hour)
	require.NoError(t, err)
	require.Equal(t, dedup.StateDone, start.State)
	require.Equal(t, []byte("charged"), start.Result)
	require.Equal(t, acquiresBefore, b.acquires(), "a done key is answered by the lock")
}

// TestBuryRolledBack: a burial whose transaction rolls back leaves the key
// as it was, and the lock free. A transaction that claimed nothing new
// cannot bury.
func TestBuryRolledBack(t *testing.T) {
	t.Parallel()
	b := setup(t, options{lease: time.Hour})
	ctx := context.Background()
	key := dedup.Key{Consumer: "billing", Key: "poison-2"}

	tx, c := b.claim(t, key)
	require.Equal(t, dedup.StateNew, c.State)
	require.NoError(t, tx.InboxBury(ctx, key, dedup.Failure{Err: "bad payload", At: time.Now()}))
	require.NoError(t, tx.Rollback(ctx))
	status, _ := b.recordRow(t, key)
	require.Empty(t, status, "the burial rolled back with the claim")
	require.Equal(t, "failed", b.lockRecord(t, key)["status"], "the lock was released")

	empty, err := b.store.InboxBegin(ctx)
	require.NoError(t, err)
	require.ErrorContains(t, empty.InboxBury(ctx, key, dedup.Failure{}), "no key was claimed new")
	require.NoError(t, empty.Rollback(ctx))

	holder, c := b.claim(t, key)
	require.Equal(t, dedup.StateNew, c.State)
	dup, c := b.claim(t, key)
	require.Equal(t, dedup.StateInFlight, c.State)
	require.ErrorContains(t, dup.InboxBury(ctx, key, dedup.Failure{}), "no key was claimed new", "only the lock's holder reaches the record")
	require.NoError(t, dup.Rollback(ctx))
	require.NoError(t, holder.Rollback(ctx))
}

// TestStartCountsInTheRecord: starts and unstarts are the record's, and a
// done key the lock had forgotten is answered by the record and taught to
// the lock.
func TestStartCountsInTheRecord(t *testing.T) {
	t.Parallel()
	b := setup(t, options{})
	ctx := context.Background()
	key := dedup.Key{Consumer: "billing", Key: "started"}

	for want := 1; want <= 2; want++ {
		c, err := b.store.InboxStart(ctx, key, time.Hour)
		require.NoError(t, err)
		require.Equal(t, dedup.Claim{State: dedup.StateNew, Attempts: want}, c)
	}
	require.NoError(t, b.store.InboxUnstart(ctx, key))
	c, err := b.store.InboxStart(ctx, key, time.Hour)
	require.NoError(t, err)
	require.Equal(t, 2, c.Attempts, "the unstarted attempt was taken back")
	require.Empty(t, b.lockRecord(t, key), "a start takes no lock")

	tx, c := b.claim(t, key)
	require.Equal(t, dedup.StateNew, c.State)
	require.NoError(t, tx.InboxComplete(ctx, key, []byte("r")))
	require.NoError(t, tx.Commit(ctx))

	// The lock forgets the key; the record answers the start and the lock
	// learns it again.
	require.NoError(t, b.redis.Del(ctx, b.prefix+"{billing}:started").Err())
	acquiresBefore := b.acquires()
	c, err = b.store.InboxStart(ctx, key, time.Hour)
	require.NoError(t, err)
	require.Equal(t, dedup.StateDone, c.State)
	require.Equal(t, []byte("r"), c.Result)
	require.Greater(t, b.acquires(), acquiresBefore, "the record was asked")
	lockRec := b.lockRecord(t, key)
	require.Equal(t, "done", lockRec["status"], "the lock learnt the key from the record")
	require.Equal(t, "r", lockRec["result"])
	hits := b.store.Stats().LockHits
	acquiresBefore = b.acquires()
	c, err = b.store.InboxStart(ctx, key, time.Hour)
	require.NoError(t, err)
	require.Equal(t, dedup.StateDone, c.State)
	require.Equal(t, []byte("r"), c.Result)
	require.Equal(t, acquiresBefore, b.acquires())
	require.Equal(t, hits+1, b.store.Stats().LockHits)
}

// TestPoisonDeadLettersThroughTheRecord runs the poison middleware in front
// of the inbox on the two-tier store: a message that always fails is
// dead-lettered and its key buried in PostgreSQL; later copies are acked
// without running and counted, however the lock stands; the replay of the
// dead letter reopens the key and runs once.
func TestPoisonDeadLettersThroughTheRecord(t *testing.T) {
	t.Parallel()
	b := setup(t, options{lease: time.Hour})
	dlq := gochannel.NewGoChannel(gochannel.Config{Persistent: true}, watermill.NopLogger{})
	t.Cleanup(func() { require.NoError(t, dlq.Close()) })
	poison, err := middleware.NewPoison(middleware.PoisonConfig{
		Publisher: dlq, Topic: "billing.dlq", Consumer: "billing", MaxAttempts: 2,
		InitialBackoff: time.Millisecond, MaxBackoff: time.Millisecond,
		// Each failure goes back to the broker: the test delivers again.
		InProcessRetries: middleware.NoInProcessRetries,
	})
	require.NoError(t, err)
	in := newInbox(t, b.store, "billing")
	var (
		broken atomic.Bool
		runs   atomic.Int32
	)
	broken.Store(true)
	h := poison.Middleware(in.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		runs.Add(1)
		if err := b.effect(msg.Context(), middleware.IdempotencyKey(msg.Context())); err != nil {
			return nil, err
		}
		if broken.Load() {
			return nil, errors.New("bad payload")
		}
		return nil, nil
	}))
	key := dedup.Key{Consumer: "billing", Key: "p-1"}

	_, err = h(delivery("p-1"))
	require.ErrorContains(t, err, "bad payload", "the first failure is nacked for redelivery")
	_, err = h(delivery("p-1"))
	require.NoError(t, err, "the second is dead-lettered and acked")
	require.Equal(t, int64(1), poison.Stats().DeadLettered)
	status, _ := b.recordRow(t, key)
	require.Equal(t, "dead", status)
	require.NotEqual(t, "done", b.lockRecord(t, key)["status"])
	require.Empty(t, b.effects(t), "no failed attempt left an effect")

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	letters, err := dlq.Subscribe(ctx, "billing.dlq")
	require.NoError(t, err)
	dead := msgtest.Receive(t, letters, 5*time.Second)
	dead.Ack()

	// Copies of the dead key are acked without running, counted in the
	// record, and never answered done by the lock.
	for i := 0; i < 3; i++ {
		_, err = h(delivery("p-1"))
		require.NoError(t, err)
		require.NotEqual(t, "done", b.lockRecord(t, key)["status"])
	}
	require.Equal(t, int32(2), runs.Load())
	require.Equal(t, int64(3), in.Stats().DeadCopies)
	require.Equal(t, 3, b.deadCopies(t, key))

	// A copy that only says it is a replay is one more dead copy.
	broken.Store(false)
	forged := delivery("p-1")
	forged.Metadata.Set(dlv.Replay, "1")
	_, err = h(forged)
	require.NoError(t, err)
	require.Equal(t, int32(2), runs.Load())
	require.Equal(t, int64(4), in.Stats().DeadCopies)

	// The replay of the dead letter, granted in the record, the payload
	// fixed, runs once.
	grant, err := dedup.NewReplayGrant()
	require.NoError(t, err)
	granted, err := b.store.InboxGrantReplay(context.Background(), key, grant)
	require.NoError(t, err)
	require.True(t, granted)
	replay := delivery("p-1")
	replay.Metadata.Set(dlv.Replay, grant)
	_, err = h(replay)
	require.NoError(t, err)
	require.Equal(t, int32(3), runs.Load())
	require.Equal(t, map[string]int{"p-1": 1}, b.effects(t))
	status, _ = b.recordRow(t, key)
	require.Equal(t, "done", status)
	require.Equal(t, "done", b.lockRecord(t, key)["status"])

	acquiresBefore := b.acquires()
	_, err = h(delivery("p-1"))
	require.NoError(t, err)
	require.Equal(t, int32(3), runs.Load())
	require.Equal(t, acquiresBefore, b.acquires(), "a later copy is a duplicate answered by the lock")
}
