package forwarder_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/forwarder"
)

// lockOrdered configures a relay for writers ordered by the key's lock.
func lockOrdered(c *forwarder.RelayConfig) { c.LockOrderedWriters = true }

// TestLockOrderedWritersKeepKeyOrder: with LockOrderedWriters, the
// schedules of TestKeyOrderIsInsertOrder keep the order of the writers'
// commits, and a transaction left open meanwhile (Long) holds nothing back.
func TestLockOrderedWritersKeepKeyOrder(t *testing.T) {
	t.Parallel()
	o := newPrivateOutbox(t)
	ctx := context.Background()

	// The schedules of TestKeyOrderIsInsertOrder: paid first, although
	// T2's transaction id is older.
	t.Run("a writer that waited for the lock", func(t *testing.T) {
		o.reset(t)
		commitShipped := o.waitedForLock(t)

		// Paid is committed and goes at once; shipped is written, not yet
		// committed, and waits for T2.
		s := &sink{}
		r := newRelay(t, o.b, s, lockOrdered)
		relayAll(t, r, 1)
		n, err := r.RelayBatch(ctx)
		require.NoError(t, err)
		require.Zero(t, n, "shipped is not committed yet")
		require.Equal(t, []string{"paid"}, statuses(s))
		require.NoError(t, commitShipped())
		relayAll(t, r, 1)
		require.Equal(t, []string{"paid", "shipped"}, statuses(s))
	})

	// Long stays open throughout and holds nothing back.
	t.Run("an open transaction holds nothing back", func(t *testing.T) {
		o.reset(t)
		long, _ := o.longOpen(t)

		s := &sink{}
		r := newRelay(t, o.b, s, lockOrdered)
		relayAll(t, r, 3)
		require.Equal(t, []string{"created", "paid", "shipped"}, statuses(s), "in commit order, Long still open")
		lag, err := r.Lag(ctx)
		require.NoError(t, err)
		require.Zero(t, lag.Pending)
		require.Zero(t, lag.Waiting)
		require.Nil(t, lag.HeldBy)
		require.NoError(t, long.Rollback(ctx))
	})
}

// TestLockOrderedWritersDoNotStall: a transaction left open in another
// database of the server, which stalls a relay that waits for older
// transactions (TestLagNamesTheTransactionThatHoldsTheOutbox), holds back
// nothing with LockOrderedWriters: the rows go out, Lag reports no waiting
// rows and the relay logs no stall.
func TestLockOrderedWritersDoNotStall(t *testing.T) {
	t.Parallel()
	o := newPrivateOutbox(t)
	ctx := context.Background()
	o.reset(t)
	_, err := o.pool.Exec(ctx, `CREATE DATABASE reporting`)
	require.NoError(t, err)
	otherTx, _ := o.openIn(t, "reporting")

	o.b.write(t, "orders", event("order-1", 1), event("order-2", 2))
	strict, err := forwarder.OutboxLag(ctx, o.pool, o.b.schema)
	require.NoError(t, err)
	require.Equal(t, 2, strict.Waiting, "a relay that waits would hold both rows back")

	logger := &lineLogger{}
	s := &sink{}
	r := newRelay(t, o.b, s, func(c *forwarder.RelayConfig) {
		lockOrdered(c)
		c.StallWarning = 200 * time.Millisecond
		c.Logger = logger
	})
	run(t, r)
	require.Eventually(t, func() bool { return len(s.snapshot()) == 2 }, 30*time.Second, 10*time.Millisecond,
		"the rows go out while the other database's transaction is open")
	lag, err := r.Lag(ctx)
	require.NoError(t, err)
	require.Zero(t, lag.Pending)
	require.Zero(t, lag.Waiting)
	require.Nil(t, lag.HeldBy)
	require.Empty(t, logger.stalls(), "no stall logged")
	require.NoError(t, otherTx.Rollback(ctx))
}
