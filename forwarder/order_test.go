package forwarder_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/forwarder"
	"github.com/oncemill/oncemill/internal/testing/pgtest"
	"github.com/oncemill/oncemill/sqlschema"
)

// privateOutbox is an outbox on a private PostgreSQL server: the schedules
// below depend on which transactions are open on the whole server, which
// the shared server's other tests would change.
type privateOutbox struct {
	server *pgtest.Server
	pool   *pgxpool.Pool
	b      bundle
}

// newPrivateOutbox starts a private server with the postgresql.conf lines
// settings, and migrates an outbox into it.
func newPrivateOutbox(t *testing.T, settings ...string) privateOutbox {
	t.Helper()
	srv := pgtest.StartServer(t, settings...)
	cfg, err := pgxpool.ParseConfig(srv.URL())
	require.NoError(t, err)
	cfg.MaxConns = 8
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	schema := sqlschema.Config{Schema: "shop"}
	require.NoError(t, sqlschema.Migrate(context.Background(), pool, schema))
	_, err = pool.Exec(context.Background(), `CREATE TABLE shop.orders (id text PRIMARY KEY, status text NOT NULL DEFAULT 'new');
CREATE TABLE shop.audit (at timestamptz NOT NULL DEFAULT clock_timestamp())`)
	require.NoError(t, err)
	return privateOutbox{server: srv, pool: pool, b: bundle{pool: pool, schema: schema}}
}

// order resets order 1 to "new" and empties the outbox.
func (o privateOutbox) reset(t *testing.T) {
	t.Helper()
	_, err := o.pool.Exec(context.Background(), `INSERT INTO shop.orders VALUES ('1', 'new') ON CONFLICT (id) DO UPDATE SET status = 'new';
DELETE FROM shop.outbox`)
	require.NoError(t, err)
}

// begin opens a transaction and returns it with its backend's pid.
func (o privateOutbox) begin(t *testing.T) (pgx.Tx, uint32) {
	t.Helper()
	tx, err := o.pool.Begin(context.Background())
	require.NoError(t, err)
	t.Cleanup(func() { _ = tx.Rollback(context.Background()) })
	return tx, tx.Conn().PgConn().PID()
}

// xid is tx's transaction id; asking assigns one, as a first write does.
func xid(t *testing.T, tx pgx.Tx) uint64 {
	t.Helper()
	var id uint64
	require.NoError(t, tx.QueryRow(context.Background(), `SELECT pg_current_xact_id()::text::bigint`).Scan(&id))
	return id
}

// setStatus sets order 1's status in tx (taking its row lock) and writes
// the status as order 1's event in tx.
func (o privateOutbox) setStatus(t *testing.T, tx pgx.Tx, status string) error {
	ctx := context.Background()
	if _, err := tx.Exec(ctx, `UPDATE shop.orders SET status = $1 WHERE id = '1'`, status); err != nil {
		return err
	}
	pub, err := forwarder.NewTxPublisher(ctx, tx, o.b.schema)
	if err != nil {
		return err
	}
	e := event("order-1", 0)
	e.Metadata.Set("status", status)
	return pub.Publish("orders", e)
}

func statuses(s *sink) []string {
	var out []string
	for _, m := range s.snapshot() {
		out = append(out, m.Metadata.Get("status"))
	}
	return out
}

// waitedForLock runs the first schedule of the reorder tests: T2 writes
// first (an audit row) and so takes the lower transaction id; T1 marks
// order 1 paid and commits while T2 waits for the order's lock; T2 then
// marks it shipped. Paid happened first. It returns once T2 has written
// shipped, uncommitted; the function it returns commits T2.
func (o privateOutbox) waitedForLock(t *testing.T) (commitShipped func() error) {
	t.Helper()
	ctx := context.Background()
	t2, pid2 := o.begin(t)
	_, err := t2.Exec(ctx, `INSERT INTO shop.audit DEFAULT VALUES`)
	require.NoError(t, err)
	t1, _ := o.begin(t)
	require.Less(t, xid(t, t2), xid(t, t1), "the schedule gives T2 the lower transaction id")
	require.NoError(t, o.setStatus(t, t1, "paid"))

	wrote, commit, shipped := make(chan error, 1), make(chan struct{}), make(chan error, 1)
	go func() {
		err := o.setStatus(t, t2, "shipped")
		wrote <- err
		if err == nil {
			<-commit
			err = t2.Commit(ctx)
		}
		shipped <- err
	}()
	// T2 blocks on the order's row lock, which T1 holds.
	require.Eventually(t, func() bool {
		var blocked bool
		require.NoError(t, o.pool.QueryRow(ctx, `SELECT cardinality(pg_blocking_pids($1)) > 0`, int(pid2)).Scan(&blocked))
		return blocked
	}, 30*time.Second, 5*time.Millisecond, "T2 waits for T1's lock")
	require.NoError(t, t1.Commit(ctx))
	require.NoError(t, <-wrote)
	return func() error {
		close(commit)
		return <-shipped
	}
}

// longOpen runs the second schedule of the reorder tests: order 1 was
// created (an event free to go); Early writes first; Long opens and stays
// open; Late marks the order paid and commits; Early then marks it shipped
// and commits. It returns Long, still open, and its backend's pid.
func (o privateOutbox) longOpen(t *testing.T) (pgx.Tx, uint32) {
	t.Helper()
	ctx := context.Background()
	created, _ := o.begin(t)
	require.NoError(t, o.setStatus(t, created, "created"))
	require.NoError(t, created.Commit(ctx))
	early, _ := o.begin(t)
	_, err := early.Exec(ctx, `INSERT INTO shop.audit DEFAULT VALUES`)
	require.NoError(t, err)
	long, longPID := o.begin(t)
	_, err = long.Exec(ctx, `INSERT INTO shop.audit DEFAULT VALUES`)
	require.NoError(t, err)
	late, _ := o.begin(t)
	require.NoError(t, o.setStatus(t, late, "paid"))
	require.NoError(t, late.Commit(ctx))
	require.NoError(t, o.setStatus(t, early, "shipped"))
	require.NoError(t, early.Commit(ctx))
	return long, longPID
}

// TestKeyOrderIsInsertOrder: a key's events go out in the order their rows
// were inserted, which for writers that lock the key's business row is the
// order they committed, whatever their transaction ids.
func TestKeyOrderIsInsertOrder(t *testing.T) {
	t.Parallel()
	o := newPrivateOutbox(t)
	ctx := context.Background()

	// T2 writes first (an audit row) and so takes the lower transaction
	// id; T1 marks the order paid and commits while T2 waits for the
	// order's lock; T2 then marks it shipped. Paid happened first.
	t.Run("a writer that waited for the lock", func(t *testing.T) {
		o.reset(t)
		commitShipped := o.waitedForLock(t)
		require.NoError(t, commitShipped())

		s := &sink{}
		relayAll(t, newRelay(t, o.b, s, nil), 2)
		require.Equal(t, []string{"paid", "shipped"}, statuses(s))
	})

	// Order 1 was created (an event free to go); Early writes first; Long
	// opens and stays open; Late marks the order paid and commits; Early
	// then marks it shipped and commits. Paid must wait for Long (Late's id
	// is younger), and shipped, inserted after it, must wait behind it
	// although Early's id is older than Long's.
	t.Run("a later row of an older transaction waits behind an earlier one", func(t *testing.T) {
		o.reset(t)
		long, longPID := o.longOpen(t)

		s := &sink{}
		r := newRelay(t, o.b, s, nil)
		for range 3 {
			_, err := r.RelayBatch(ctx)
			require.NoError(t, err)
		}
		require.Equal(t, []string{"created"}, statuses(s), "only the event before paid may go out while Long is open")
		lag, err := r.Lag(ctx)
		require.NoError(t, err)
		require.Equal(t, 2, lag.Pending)
		require.Equal(t, 1, lag.Waiting, "paid waits on Long")
		require.NotNil(t, lag.HeldBy)
		require.Equal(t, int(longPID), lag.HeldBy.PID)

		require.NoError(t, long.Commit(ctx))
		relayAll(t, r, 2)
		require.Equal(t, []string{"created", "paid", "shipped"}, statuses(s))
	})
}

// TestLagNamesTheTransactionThatHoldsTheOutbox: a transaction left open in
// another database of the same server holds every outbox row committed
// after it; Lag names it (pid, database, state, age), and the relay logs it
// while the stall lasts.
func TestLagNamesTheTransactionThatHoldsTheOutbox(t *testing.T) {
	t.Parallel()
	o := newPrivateOutbox(t)
	ctx := context.Background()
	o.reset(t)
	_, err := o.pool.Exec(ctx, `CREATE DATABASE reporting`)
	require.NoError(t, err)
	otherTx, otherPID := o.openIn(t, "reporting")

	o.b.write(t, "orders", event("order-1", 1), event("order-2", 2))
	logger := &lineLogger{}
	s := &sink{}
	r := newRelay(t, o.b, s, func(c *forwarder.RelayConfig) {
		c.StallWarning = 200 * time.Millisecond
		c.Logger = logger
	})
	run(t, r)

	require.Eventually(t, func() bool { return len(logger.stalls()) > 0 }, 30*time.Second, 20*time.Millisecond,
		"the relay logs the stall")
	lag, err := r.Lag(ctx)
	require.NoError(t, err)
	require.Equal(t, 2, lag.Pending)
	require.Equal(t, 2, lag.Waiting)
	require.NotNil(t, lag.HeldBy)
	require.Equal(t, otherPID, lag.HeldBy.PID)
	require.Equal(t, "reporting", lag.HeldBy.Database)
	require.Equal(t, "idle in transaction", lag.HeldBy.State)
	require.Positive(t, lag.HeldBy.Age)
	require.Empty(t, s.snapshot(), "nothing went out while the transaction was open")
	for _, l := range logger.stalls() {
		require.Equal(t, otherPID, l.fields["holder_pid"], "the log line names the transaction")
		require.Equal(t, "reporting", l.fields["holder_database"])
	}

	require.NoError(t, otherTx.Commit(ctx))
	require.Eventually(t, func() bool { return len(s.snapshot()) == 2 }, 30*time.Second, 10*time.Millisecond,
		"the rows go out once it ends")
	lag, err = r.Lag(ctx)
	require.NoError(t, err)
	require.Zero(t, lag.Pending)
	require.Nil(t, lag.HeldBy)
}
