package sqlstore_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"io"
	"net"
	"net/url"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/dedup"
	"github.com/oncemill/oncemill/dedup/dedupdriver"
	"github.com/oncemill/oncemill/dedup/sqlstore"
	"github.com/oncemill/oncemill/internal/testing/mysqltest"
	"github.com/oncemill/oncemill/internal/testing/netfault"
	"github.com/oncemill/oncemill/internal/testing/pgtest"
)

// sessionOf returns the server's id of the session the inbox's
// transaction in hctx runs on.
func (b backend) sessionOf(t *testing.T, hctx context.Context) int64 {
	t.Helper()
	var id int64
	require.NoError(t, sqlstore.Tx(hctx).QueryRowContext(hctx, b.sessionID).Scan(&id))
	return id
}

// TestClassifyAsksTheConnection: of the errors a handler returns after
// writing through the inbox's transaction, only those of the transaction
// itself are the infrastructure's. An io.EOF from decoding an empty body
// and a refused HTTP call are the message's while the connection is
// healthy, whatever they wrap; once the server has ended the
// transaction's session (pg_terminate_backend, KILL), its failed
// statement, and anything else the handler returns, is unavailability.
func TestClassifyAsksTheConnection(t *testing.T) {
	t.Parallel()
	each(t, 4, func(t *testing.T, b backend) {
		ctx := context.Background()
		tx, err := b.store.InboxBegin(ctx)
		require.NoError(t, err)
		defer func() { _ = tx.Rollback(ctx) }() // its connection is gone by then
		c := tx.(dedupdriver.Classifier)
		hctx := tx.WithTx(ctx)

		decode := fmt.Errorf("decode order: %w", io.EOF)
		refused := &net.OpError{Op: "dial", Net: "tcp", Err: syscall.ECONNREFUSED}
		for _, err := range []error{decode, fmt.Errorf("payment API: %w", refused), io.ErrUnexpectedEOF, sql.ErrConnDone} {
			require.NotErrorIs(t, c.InboxClassify(err), dedup.ErrUnavailable, "%v", err)
			require.NotErrorIs(t, c.InboxClassify(err), dedup.ErrConflict, "%v", err)
		}
		// The handler's own statement error is the message's too.
		_, err = sqlstore.Tx(hctx).ExecContext(hctx, `INSERT INTO `+b.table("missing")+` (k) VALUES ('x')`)
		require.Error(t, err)
		require.NotErrorIs(t, c.InboxClassify(err), dedup.ErrUnavailable)
		require.NoError(t, tx.Rollback(ctx))

		tx, err = b.store.InboxBegin(ctx)
		require.NoError(t, err)
		c = tx.(dedupdriver.Classifier)
		hctx = tx.WithTx(ctx)
		b.kill(t, b.sessionOf(t, hctx))
		_, err = sqlstore.Tx(hctx).ExecContext(hctx, `SELECT 1`)
		require.Error(t, err)
		require.ErrorIs(t, c.InboxClassify(err), dedup.ErrUnavailable, "the transaction's session was ended: %v", err)
		require.ErrorIs(t, c.InboxClassify(decode), dedup.ErrUnavailable,
			"whatever the handler returns once its transaction's connection is gone")
		require.NoError(t, tx.Rollback(ctx), "the connection is dropped, not returned")
	})
}

// TestSessionLostBeforeCommitIsUnavailable: a transaction whose session
// ended before COMMIT did not commit: the commit says unavailable, not
// ambiguous, and nothing of the attempt is in the database.
func TestSessionLostBeforeCommitIsUnavailable(t *testing.T) {
	t.Parallel()
	each(t, 4, func(t *testing.T, b backend) {
		ctx := context.Background()
		key := dedup.Key{Consumer: "c", Key: "lost"}
		tx, err := b.store.InboxBegin(ctx)
		require.NoError(t, err)
		_, err = tx.InboxClaim(ctx, key, time.Hour)
		require.NoError(t, err)
		hctx := tx.WithTx(ctx)
		require.NoError(t, b.effect(hctx, key.Key))
		b.kill(t, b.sessionOf(t, hctx))
		// A statement finds the connection gone (the driver closes it).
		_, _ = sqlstore.Tx(hctx).ExecContext(hctx, `SELECT 1`)
		err = tx.Commit(ctx)
		require.ErrorIs(t, err, dedup.ErrUnavailable)
		require.NotErrorIs(t, err, dedup.ErrAmbiguous)
		require.NoError(t, tx.Rollback(ctx))
		_, ok := b.row(t, key)
		require.False(t, ok)
		require.Zero(t, b.effects(t, key.Key))
	})
}

// TestCommitAnswerLostIsAmbiguous: COMMIT reaches the server, which
// commits, and the connection breaks before its answer comes back. The
// commit wraps dedup.ErrAmbiguous (an error without it would be counted
// as the message's failure), and the server holds the key done with its
// effect: the redelivery finds a duplicate.
func TestCommitAnswerLostIsAmbiguous(t *testing.T) {
	t.Parallel()
	each(t, 4, func(t *testing.T, b backend) {
		ctx := context.Background()
		via, cut := b.viaCommitCutter(t)
		store, err := sqlstore.New(via, sqlstore.Config{Dialect: b.dialect, Schema: b.schema})
		require.NoError(t, err)
		key := dedup.Key{Consumer: "c", Key: "ambiguous"}

		tx, err := store.InboxBegin(ctx)
		require.NoError(t, err)
		c, err := tx.InboxClaim(ctx, key, time.Hour)
		require.NoError(t, err)
		require.Equal(t, dedup.StateNew, c.State)
		require.NoError(t, b.effect(tx.WithTx(ctx), key.Key))
		err = tx.Commit(ctx)
		require.ErrorIs(t, err, dedup.ErrAmbiguous)
		require.ErrorIs(t, err, dedup.ErrUnavailable, "ambiguous is a kind of unavailable")
		require.NoError(t, tx.Rollback(ctx), "nothing left to roll back")
		select {
		case <-cut:
		default:
			t.Fatal("the proxy did not cut the COMMIT's answer")
		}
		r, ok := b.row(t, key)
		require.True(t, ok)
		require.Equal(t, "done", r.status, "the server committed")
		require.Equal(t, 1, b.effects(t, key.Key), "with its effect")
	})
}

// viaCommitCutter opens the backend's database and driver through a proxy
// that loses the answer to the first COMMIT.
func (b backend) viaCommitCutter(t *testing.T) (*sql.DB, <-chan struct{}) {
	t.Helper()
	if b.name == "mysql" {
		proxy := mysqltest.CutAtCommit(t, b.upstream(t))
		return b.openVia(t, proxy.Addr(), ""), proxy.Cut()
	}
	proxy := netfault.CutAtCommit(t, b.upstream(t))
	return b.openVia(t, proxy.Addr(), ""), proxy.Cut()
}

// upstream is the host:port of the backend's server.
func (b backend) upstream(t *testing.T) string {
	t.Helper()
	if b.name == "mysql" {
		return mysqltest.Config(t, "").Addr
	}
	u, err := url.Parse(pgtest.URL())
	require.NoError(t, err)
	return u.Host
}

// openVia opens the backend's database with its driver, dialing addr
// instead of the server, as user (see [backend.storeUser]; "" is the test
// server's own).
func (b backend) openVia(t *testing.T, addr, user string) *sql.DB {
	t.Helper()
	switch b.name {
	case "mysql":
		cfg := mysqltest.Config(t, b.schema.Schema)
		if user != "" {
			cfg.User, cfg.Passwd = user, ""
		}
		cfg.Addr = addr
		return mysqltest.Open(t, cfg, 4)
	case "pgx":
		cfg, err := pgx.ParseConfig(pgtest.URL())
		require.NoError(t, err)
		cfg.DialFunc = func(ctx context.Context, network, _ string) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, network, addr)
		}
		if user != "" {
			cfg.RuntimeParams["role"] = user
		}
		db := stdlib.OpenDB(*cfg)
		t.Cleanup(func() { require.NoError(t, db.Close()) })
		return db
	default:
		u, err := url.Parse(pgtest.URL())
		require.NoError(t, err)
		u.Host = addr
		if user != "" {
			q := u.Query()
			q.Set("role", user) // lib/pq sends a parameter it does not know in the startup message
			u.RawQuery = q.Encode()
		}
		db, err := sql.Open("postgres", u.String())
		require.NoError(t, err)
		t.Cleanup(func() { require.NoError(t, db.Close()) })
		return db
	}
}

// TestDeadlockIsAConflict: two inbox transactions whose handlers lock two
// rows in opposite orders deadlock; the server aborts one (PostgreSQL
// 40P01, MySQL 1213), which the transaction classifies as a conflict to
// run again, not as the message's failure.
func TestDeadlockIsAConflict(t *testing.T) {
	t.Parallel()
	each(t, 6, func(t *testing.T, b backend) {
		ctx := context.Background()
		locks := b.table("locks")
		_, err := b.db.ExecContext(ctx, `CREATE TABLE `+locks+` (id INT PRIMARY KEY)`)
		require.NoError(t, err)
		_, err = b.db.ExecContext(ctx, `INSERT INTO `+locks+` (id) VALUES (1), (2)`)
		require.NoError(t, err)
		lock := func(tx dedup.InboxTx, id int) error {
			hctx := tx.WithTx(ctx)
			_, err := sqlstore.Tx(hctx).ExecContext(hctx, `UPDATE `+locks+` SET id = id WHERE id = `+b.ph(1), id)
			return err
		}
		first, err := b.store.InboxBegin(ctx)
		require.NoError(t, err)
		second, err := b.store.InboxBegin(ctx)
		require.NoError(t, err)
		require.NoError(t, lock(first, 1))
		require.NoError(t, lock(second, 2))
		firstDone, secondDone := make(chan error, 1), make(chan error, 1)
		go func() { firstDone <- lock(first, 2) }()
		go func() { secondDone <- lock(second, 1) }()
		// One is the victim; the other waits until the victim's
		// transaction ends. Each error is classified before its
		// transaction rolls back, as the inbox does.
		check := func(tx dedup.InboxTx, err error) bool {
			if err == nil {
				return false
			}
			c := tx.(dedupdriver.Classifier)
			require.ErrorIs(t, c.InboxClassify(err), dedup.ErrConflict, "%v", err)
			require.NotErrorIs(t, c.InboxClassify(err), dedup.ErrUnavailable)
			require.NotErrorIs(t, c.InboxClassify(errors.New("card declined")), dedup.ErrConflict)
			return true
		}
		victims := 0
		for range 2 {
			var (
				tx  dedup.InboxTx
				err error
			)
			select {
			case err = <-firstDone:
				tx = first
			case err = <-secondDone:
				tx = second
			}
			if check(tx, err) {
				victims++
			}
			require.NoError(t, tx.Rollback(ctx)) // frees the other
		}
		require.GreaterOrEqual(t, victims, 1, "the server broke the deadlock")
	})
}

// TestCallersOwnDeadlineIsNotUnavailable: a deadline of the caller's own
// context (Watermill's Timeout middleware on the message) is the
// message's, not the store's: a claim that waits on a row another
// transaction holds until the caller's deadline passes does not wrap
// dedup.ErrUnavailable.
func TestCallersOwnDeadlineIsNotUnavailable(t *testing.T) {
	t.Parallel()
	each(t, 4, func(t *testing.T, b backend) {
		ctx := context.Background()
		key := dedup.Key{Consumer: "c", Key: "held"}
		holder, err := b.store.InboxBegin(ctx)
		require.NoError(t, err)
		defer func() { require.NoError(t, holder.Rollback(ctx)) }()
		_, err = holder.InboxClaim(ctx, key, time.Hour)
		require.NoError(t, err)

		tx, err := b.store.InboxBegin(ctx)
		require.NoError(t, err)
		short, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
		defer cancel()
		_, err = tx.InboxClaim(short, key, time.Hour)
		_ = tx.Rollback(ctx) // the deadline may have closed its connection
		require.Error(t, err, "the claim waited on the held row until the deadline")
		if b.name != "pq" { // lib/pq returns the server's 57014 query_canceled
			require.ErrorIs(t, err, context.DeadlineExceeded)
		}
		require.NotErrorIs(t, err, dedup.ErrUnavailable)
	})
}

// TestTransactionOutlivesItsContext: the inbox begins the transaction on
// the message's context and lets the handler finish and commit after the
// router cancelled it (the drain): database/sql would roll back a
// transaction whose context ends, so the store's does not end with it.
func TestTransactionOutlivesItsContext(t *testing.T) {
	t.Parallel()
	each(t, 4, func(t *testing.T, b backend) {
		msgCtx, cancel := context.WithCancel(context.Background())
		key := dedup.Key{Consumer: "c", Key: "drained"}
		tx, err := b.store.InboxBegin(msgCtx)
		require.NoError(t, err)
		_, err = tx.InboxClaim(msgCtx, key, time.Hour)
		require.NoError(t, err)
		cancel() // the router closes
		drain := context.WithoutCancel(msgCtx)
		require.NoError(t, b.effect(tx.WithTx(drain), key.Key))
		require.NoError(t, tx.Commit(drain))
		require.Equal(t, 1, b.effects(t, key.Key))

		_, err = b.store.InboxBegin(msgCtx)
		require.ErrorIs(t, err, context.Canceled)
		require.NotErrorIs(t, err, dedup.ErrUnavailable, "the caller's own cancellation")
	})
}

// TestUnreachableServerIsUnavailable: a store whose server refuses
// connections fails every call with dedup.ErrUnavailable, so that the
// inbox does not count it against the message.
func TestUnreachableServerIsUnavailable(t *testing.T) {
	t.Parallel()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	addr := l.Addr().String()
	require.NoError(t, l.Close()) // nothing listens there now
	for _, tc := range []struct {
		name    string
		dialect sqlstore.Dialect
		open    func() *sql.DB
	}{
		{"pgx", sqlstore.Postgres, func() *sql.DB {
			cfg, err := pgx.ParseConfig("postgres://postgres@" + addr + "/test?sslmode=disable&connect_timeout=2")
			require.NoError(t, err)
			return stdlib.OpenDB(*cfg)
		}},
		{"pq", sqlstore.Postgres, func() *sql.DB {
			db, err := sql.Open("postgres", "postgres://postgres@"+addr+"/test?sslmode=disable&connect_timeout=2")
			require.NoError(t, err)
			return db
		}},
		{"mysql", sqlstore.MySQL, func() *sql.DB {
			db, err := sql.Open("mysql", "root@tcp("+addr+")/test?timeout=2s")
			require.NoError(t, err)
			return db
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			db := tc.open()
			defer db.Close()
			store, err := sqlstore.New(db, sqlstore.Config{Dialect: tc.dialect})
			require.NoError(t, err)
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			key := dedup.Key{Consumer: "c", Key: "k"}
			start, err := store.InboxStart(ctx, key, time.Hour)
			require.ErrorIs(t, err, dedup.ErrUnavailable)
			require.Equal(t, dedup.Claim{}, start, "nothing was sent")
			_, err = store.InboxBegin(ctx)
			require.ErrorIs(t, err, dedup.ErrUnavailable)
			require.ErrorIs(t, store.InboxFail(ctx, key, dedup.Failure{Err: "x"}, time.Hour), dedup.ErrUnavailable)
		})
	}
}
