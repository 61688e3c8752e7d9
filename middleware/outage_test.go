package middleware_test

import (
	"context"
	"errors"
	"net"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/dedup"
	"github.com/oncemill/oncemill/dedup/postgres"
	"github.com/oncemill/oncemill/dlq"
	"github.com/oncemill/oncemill/internal/testing/msgtest"
	"github.com/oncemill/oncemill/internal/testing/netfault"
	"github.com/oncemill/oncemill/internal/testing/pgtest"
	"github.com/oncemill/oncemill/middleware"
	"github.com/oncemill/oncemill/sqlschema"
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

// testPool connects to the test database with the settings edit makes,
// lazily: it dials when a connection is first needed.
func testPool(t *testing.T, edit func(*pgxpool.Config)) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(pgtest.URL())
	require.NoError(t, err)
	cfg.MaxConns = 4
	edit(cfg)
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	return pool
}

// dialing makes a pool's connections dial the host:port addr returns at
// the time, with a connect timeout.
func dialing(connectTimeout time.Duration, addr func() string) func(*pgxpool.Config) {
	return func(cfg *pgxpool.Config) {
		cfg.ConnConfig.ConnectTimeout = connectTimeout
		cfg.ConnConfig.DialFunc = func(ctx context.Context, network, _ string) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, network, addr())
		}
	}
}

// testServer is the test database's host:port.
func testServer(t *testing.T) string {
	t.Helper()
	cfg, err := pgx.ParseConfig(pgtest.URL())
	require.NoError(t, err)
	return net.JoinHostPort(cfg.Host, strconv.Itoa(int(cfg.Port)))
}

// dlqTable is a DLQ publisher into schema's dead-letter table on pool, and
// a count of its rows.
func dlqTable(t *testing.T, pool *pgxpool.Pool, schema string) (*dlq.Publisher, func() int) {
	t.Helper()
	table, err := dlq.NewPublisher(pool, sqlschema.Config{Schema: schema})
	require.NoError(t, err)
	return table, func() (n int) {
		require.NoError(t, pool.QueryRow(context.Background(), `SELECT count(*) FROM "`+schema+`".dlq`).Scan(&n))
		return n
	}
}

// startCounting is a PostgreSQL store that counts the attempts the inbox
// starts, that is the deliveries it sees.
type startCounting struct {
	*postgres.Store
	starts atomic.Int32
}

func (s *startCounting) InboxStart(ctx context.Context, key dedup.Key, window time.Duration) (dedup.Claim, error) {
	s.starts.Add(1)
	return s.Store.InboxStart(ctx, key, window)
}

// InboxStartClaim counts the start the default pipelining sends with BEGIN
// and the claim.
func (s *startCounting) InboxStartClaim(ctx context.Context, key dedup.Key, window time.Duration) (dedup.Claim, dedup.InboxTx, dedup.Claim, error) {
	s.starts.Add(1)
	return s.Store.InboxStartClaim(ctx, key, window)
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

// TestUnansweringStoreIsNotTheMessagesFault: the inbox's PostgreSQL
// accepts TCP and never answers. Each delivery fails once pgx's connect
// timeout passes, a deadline that is not the message's: the delivery is
// nacked for the infrastructure, not counted, so that MaxAttempts 2 does
// not dead-letter it, however often it comes back. It used to be counted
// and sent for dead-lettering on its second delivery.
func TestUnansweringStoreIsNotTheMessagesFault(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t, 4)
	schema := pgtest.Schema(t, pool)
	b := postgresBackendIn(t, pool, schema)
	silent := netfault.Silent(t)
	store, err := postgres.New(testPool(t, dialing(200*time.Millisecond, func() string { return silent })), postgres.Config{Schema: schema})
	require.NoError(t, err)
	counting := &startCounting{Store: store}
	b.store = counting
	table, dlqRows := dlqTable(t, pool, schema)
	rig := startPoisonRig(t, b, middleware.PoisonConfig{Publisher: table, MaxAttempts: 2}, func(int32, *message.Message) error { return nil })

	rig.publish(t, "order-silent")
	require.Eventually(t, func() bool { return counting.starts.Load() >= 5 }, 60*time.Second, 10*time.Millisecond,
		"the message is delivered again and again")
	ps := rig.poison.Stats()
	require.GreaterOrEqual(t, ps.Infrastructure, int64(4), "each delivery nacked for the infrastructure")
	require.Zero(t, ps.Retried, "no attempt counted")
	require.Zero(t, ps.DeadLettered)
	require.Zero(t, ps.DeadLetterFailed, "no dead-lettering tried")
	require.Zero(t, rig.inbox.Stats().Failed)
	require.Equal(t, int32(0), rig.calls.Load(), "the handler never ran")
	require.Zero(t, dlqRows())
}

// TestAmbiguousCommitIsNotCounted: the COMMIT of the first delivery
// reaches the server and commits, and its connection breaks before the
// answer comes back (a proxy in between cuts it), so that the inbox
// cannot know the outcome. The attempt is not counted, so MaxAttempts 1
// does not dead-letter the message, and its redelivery, through a direct
// connection, finds the key done: the effect is applied once and the
// handler ran once.
func TestAmbiguousCommitIsNotCounted(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t, 4)
	schema := pgtest.Schema(t, pool)
	b := postgresBackendIn(t, pool, schema)
	server := testServer(t)
	proxy := netfault.CutAtCommit(t, server)
	// Through the proxy until it has cut a COMMIT, then direct.
	via := testPool(t, dialing(10*time.Second, func() string {
		select {
		case <-proxy.Cut():
			return server
		default:
			return proxy.Addr()
		}
	}))
	store, err := postgres.New(via, postgres.Config{Schema: schema})
	require.NoError(t, err)
	b.store = store
	table, dlqRows := dlqTable(t, pool, schema)
	rig := startPoisonRig(t, b, middleware.PoisonConfig{Publisher: table, MaxAttempts: 1}, func(int32, *message.Message) error { return nil })

	rig.publish(t, "order-ambiguous")
	require.Eventually(t, func() bool {
		ps := rig.poison.Stats()
		return rig.inbox.Stats().Duplicates > 0 || ps.DeadLettered+ps.AppliedMeanwhile > 0
	}, 30*time.Second, 10*time.Millisecond, "the message is settled")
	require.Equal(t, int64(1), rig.inbox.Stats().Duplicates, "the redelivery is answered as a duplicate")
	select {
	case <-proxy.Cut():
	default:
		t.Fatal("the COMMIT's answer was not cut")
	}
	require.Equal(t, 1, b.effects(t), "the effect committed once")
	require.Equal(t, "done", b.status(t, "charge", "order-ambiguous"))
	require.Equal(t, 1, b.attempts(t, "charge", "order-ambiguous"))
	require.Zero(t, dlqRows())
	require.Equal(t, int32(1), rig.calls.Load(), "the handler ran once")
	is := rig.inbox.Stats()
	require.Zero(t, is.Failed, "the ambiguous attempt is not a failure")
	require.Equal(t, int64(1), is.Infrastructure, "it is the infrastructure's")
	ps := rig.poison.Stats()
	require.Equal(t, int64(1), ps.Infrastructure)
	require.Zero(t, ps.Retried)
	require.Zero(t, ps.DeadLettered)
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

// repeatableRead makes a pool's transactions REPEATABLE READ, where a
// transaction that updates a row another one changed since its snapshot
// fails with a serialization failure (40001).
func repeatableRead(cfg *pgxpool.Config) {
	cfg.ConnConfig.RuntimeParams["default_transaction_isolation"] = "repeatable read"
}

// accountsIn creates an accounts table with account 1 at balance 0 and
// returns its name and a read of that balance.
func accountsIn(t *testing.T, pool *pgxpool.Pool, schema string) (string, func() int) {
	t.Helper()
	accounts := `"` + schema + `".accounts`
	_, err := pool.Exec(context.Background(), `CREATE TABLE `+accounts+` (id int PRIMARY KEY, balance int NOT NULL); INSERT INTO `+accounts+` VALUES (1, 0)`)
	require.NoError(t, err)
	return accounts, func() (n int) {
		require.NoError(t, pool.QueryRow(context.Background(), `SELECT balance FROM `+accounts+` WHERE id = 1`).Scan(&n))
		return n
	}
}

// TestSerializationFailureIsRetriedInProcess: the handler's transaction
// (REPEATABLE READ) updates an account that another transaction changed
// after its snapshot; PostgreSQL aborts it with a serialization failure
// (40001). The inbox runs it again at once instead of counting an
// attempt, so MaxAttempts 1 dead-letters nothing, and it is applied once.
func TestSerializationFailureIsRetriedInProcess(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t, 8)
	schema := pgtest.Schema(t, pool)
	b := postgresBackendIn(t, pool, schema)
	store, err := postgres.New(testPool(t, repeatableRead), postgres.Config{Schema: schema})
	require.NoError(t, err)
	b.store = store
	accounts, balance := accountsIn(t, pool, schema)
	table, dlqRows := dlqTable(t, pool, schema)
	rig := startPoisonRig(t, b, middleware.PoisonConfig{Publisher: table, MaxAttempts: 1}, func(n int32, msg *message.Message) error {
		ctx := msg.Context()
		if n == 1 {
			// The claim took the snapshot; a deposit commits after it.
			if _, err := pool.Exec(ctx, `UPDATE `+accounts+` SET balance = balance + 100 WHERE id = 1`); err != nil {
				return err
			}
		}
		_, err := postgres.Tx(ctx).Exec(ctx, `UPDATE `+accounts+` SET balance = balance - 1 WHERE id = 1`)
		return err
	})
	rig.publish(t, "withdraw-1")
	require.Eventually(t, func() bool { return b.effects(t) == 1 || rig.poison.Stats().DeadLettered > 0 }, 30*time.Second, 10*time.Millisecond)
	require.Zero(t, rig.poison.Stats().DeadLettered)
	require.Equal(t, 1, b.effects(t))
	require.Equal(t, int32(2), rig.calls.Load(), "run again after the serialization failure")
	is := rig.inbox.Stats()
	require.Equal(t, int64(1), is.ConflictRetries, "in process")
	require.Zero(t, is.Failed)
	require.Zero(t, rig.poison.Stats().Retried, "not nacked")
	require.Equal(t, 1, b.attempts(t, "charge", "withdraw-1"), "one attempt counted")
	require.Equal(t, 99, balance(), "the deposit and one withdrawal")
	require.Zero(t, dlqRows())
}

// TestConflictPastTheRetryBoundIsNotCounted: a key whose transaction keeps
// losing serialization failures past the inbox's bound of runs is nacked,
// not counted and not dead-lettered (MaxAttempts 1), however often it
// comes back; once the conflicts stop, it is applied once with one attempt
// counted.
func TestConflictPastTheRetryBoundIsNotCounted(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t, 8)
	schema := pgtest.Schema(t, pool)
	b := postgresBackendIn(t, pool, schema)
	store, err := postgres.New(testPool(t, repeatableRead), postgres.Config{Schema: schema})
	require.NoError(t, err)
	b.store = store
	accounts, _ := accountsIn(t, pool, schema)
	table, dlqRows := dlqTable(t, pool, schema)
	const conflicting = 2 // deliveries that lose every run
	var rig *poisonRig
	rig = startPoisonRig(t, b, middleware.PoisonConfig{Publisher: table, MaxAttempts: 1}, func(_ int32, msg *message.Message) error {
		ctx := msg.Context()
		if rig.poison.Stats().Infrastructure < conflicting {
			if _, err := pool.Exec(ctx, `UPDATE `+accounts+` SET balance = balance + 100 WHERE id = 1`); err != nil {
				return err
			}
		}
		_, err := postgres.Tx(ctx).Exec(ctx, `UPDATE `+accounts+` SET balance = balance - 1 WHERE id = 1`)
		return err
	})
	rig.publish(t, "withdraw-2")
	require.Eventually(t, func() bool { return b.effects(t) == 1 || rig.poison.Stats().DeadLettered > 0 }, 30*time.Second, 10*time.Millisecond)
	require.Equal(t, 1, b.effects(t), "applied, not dead-lettered")
	is, ps := rig.inbox.Stats(), rig.poison.Stats()
	require.Equal(t, int64(conflicting), ps.Infrastructure, "each conflicting delivery nacked for the conflicts")
	require.GreaterOrEqual(t, is.ConflictRetries, int64(conflicting), "each ran again in process first")
	require.Equal(t, int64(conflicting+1), int64(rig.calls.Load())-is.ConflictRetries,
		"every delivery ran once plus its in-process retries")
	require.Zero(t, is.Failed)
	require.Zero(t, ps.Retried, "never counted")
	require.Zero(t, ps.DeadLettered)
	require.Equal(t, 1, b.attempts(t, "charge", "withdraw-2"), "only the attempt that applied it counted")
	require.Equal(t, "done", b.status(t, "charge", "withdraw-2"))
	require.Zero(t, dlqRows())
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
