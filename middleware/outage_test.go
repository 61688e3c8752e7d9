package middleware_test

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/dedup"
	"github.com/oncemill/oncemill/dedup/postgres"
	"github.com/oncemill/oncemill/internal/msgtest"
	"github.com/oncemill/oncemill/internal/pgtest"
	"github.com/oncemill/oncemill/middleware"
)

// privatePool connects to a private PostgreSQL server that the test may
// stop, with a short connect timeout so that an outage shows quickly.
func privatePool(t *testing.T, srv *pgtest.Server) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(srv.URL())
	require.NoError(t, err)
	cfg.ConnConfig.ConnectTimeout = time.Second
	cfg.MaxConns = 8
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	return pool
}

// TestStoreOutageIsNotTheMessagesFault: with the inbox's PostgreSQL down, a
// healthy message is nacked again and again without counting an attempt,
// so that even MaxAttempts 2 does not dead-letter it; once the database is
// back it is applied once. It used to be dead-lettered within seconds,
// its handler never run.
func TestStoreOutageIsNotTheMessagesFault(t *testing.T) {
	t.Parallel()
	srv := pgtest.StartServer(t)
	pool := privatePool(t, srv)
	b := postgresBackendIn(t, pool, pgtest.Schema(t, pool))
	rig := startPoisonRig(t, b, middleware.PoisonConfig{MaxAttempts: 2}, func(int32, *message.Message) error { return nil })

	srv.Stop()
	rig.publish(t, "order-outage")
	require.Eventually(t, func() bool { return rig.poison.Stats().Infrastructure >= 4 }, 60*time.Second, 10*time.Millisecond,
		"the delivery is nacked for the outage, again and again")
	msgtest.Nothing(t, rig.dead, 100*time.Millisecond)
	require.Equal(t, int32(0), rig.calls.Load(), "the handler never ran")

	srv.Start()
	require.Eventually(t, func() bool { return b.effects(t) == 1 }, 60*time.Second, 10*time.Millisecond)
	require.Equal(t, "done", b.status(t, "charge", "order-outage"))
	require.Equal(t, 1, b.attempts(t, "charge", "order-outage"), "no attempt counted for the outage")
	msgtest.Nothing(t, rig.dead, 200*time.Millisecond)
	require.Zero(t, rig.poison.Stats().DeadLettered)
}

// TestConnectionLostAtCommitIsNotCounted: the connection of the handler's
// transaction is terminated before the inbox commits (a failover, an
// administrator, a network cut). The attempt is not counted, so
// MaxAttempts 1 does not dead-letter the message; its redelivery applies
// it once.
func TestConnectionLostAtCommitIsNotCounted(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t, 8)
	b := postgresBackendIn(t, pool, pgtest.Schema(t, pool))
	var cut atomic.Bool
	rig := startPoisonRig(t, b, middleware.PoisonConfig{MaxAttempts: 1}, func(_ int32, msg *message.Message) error {
		if cut.Swap(true) {
			return nil
		}
		ctx := msg.Context()
		var pid int
		if err := postgres.Tx(ctx).QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&pid); err != nil {
			return err
		}
		_, err := pool.Exec(ctx, `SELECT pg_terminate_backend($1)`, pid)
		return err
	})
	rig.publish(t, "order-cut")
	require.Eventually(t, func() bool { return b.effects(t) == 1 }, 30*time.Second, 10*time.Millisecond)
	require.Equal(t, int32(2), rig.calls.Load(), "run again after the cut")
	require.Equal(t, int64(1), rig.inbox.Stats().Infrastructure)
	require.Equal(t, 1, b.attempts(t, "charge", "order-cut"), "the cut attempt is not counted")
	msgtest.Nothing(t, rig.dead, 200*time.Millisecond)
}

// TestDeadlockIsRetriedInProcess: two messages lock the same two accounts
// in opposite orders; PostgreSQL aborts one with a deadlock (40P01). The
// inbox runs that transaction again at once instead of counting an
// attempt, so MaxAttempts 1 dead-letters nothing and both are applied once.
func TestDeadlockIsRetriedInProcess(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pgtest.Pool(t, 8)
	schema := pgtest.Schema(t, pool)
	b := postgresBackendIn(t, pool, schema)
	accounts := `"` + schema + `".accounts`
	_, err := pool.Exec(ctx, `CREATE TABLE `+accounts+` (id int PRIMARY KEY, balance int NOT NULL); INSERT INTO `+accounts+` VALUES (1, 0), (2, 0)`)
	require.NoError(t, err)

	var both sync.WaitGroup
	both.Add(2)
	var first sync.Map // key → ran once
	rig := startPoisonRig(t, b, middleware.PoisonConfig{MaxAttempts: 1}, func(_ int32, msg *message.Message) error {
		ctx := msg.Context()
		tx := postgres.Tx(ctx)
		from, to := 1, 2
		if middleware.IdempotencyKey(ctx) == "transfer-b" {
			from, to = 2, 1
		}
		if _, err := tx.Exec(ctx, `UPDATE `+accounts+` SET balance = balance - 1 WHERE id = $1`, from); err != nil {
			return err
		}
		if _, again := first.LoadOrStore(middleware.IdempotencyKey(ctx), true); !again {
			both.Done()
			both.Wait() // each holds its first account
		}
		_, err := tx.Exec(ctx, `UPDATE `+accounts+` SET balance = balance + 1 WHERE id = $1`, to)
		return err
	})
	rig.publish(t, "transfer-a")
	rig.publish(t, "transfer-b")
	require.Eventually(t, func() bool { return b.effects(t) == 2 }, 30*time.Second, 10*time.Millisecond)
	require.Equal(t, int64(1), rig.inbox.Stats().ConflictRetries, "the deadlock's loser ran again in process")
	require.Zero(t, rig.inbox.Stats().Failed)
	var sum int
	require.NoError(t, pool.QueryRow(ctx, `SELECT sum(balance) FROM `+accounts).Scan(&sum))
	require.Zero(t, sum, "each transfer applied once")
	msgtest.Nothing(t, rig.dead, 200*time.Millisecond)
}

// TestIsInfrastructure: the sentinels the stores wrap, and nothing else.
func TestIsInfrastructure(t *testing.T) {
	t.Parallel()
	require.True(t, middleware.IsInfrastructure(dedup.ErrUnavailable))
	require.True(t, middleware.IsInfrastructure(dedup.ErrAmbiguous))
	require.True(t, middleware.IsInfrastructure(errors.Join(errors.New("commit"), dedup.ErrConflict)))
	require.True(t, middleware.IsInfrastructure(middleware.ErrDeadLetter))
	require.False(t, middleware.IsInfrastructure(errors.New("card declined")))
	require.False(t, middleware.IsInfrastructure(context.DeadlineExceeded), "a deadline is the attempt's own")
	require.False(t, middleware.IsInfrastructure(middleware.ErrPanicked))
}
