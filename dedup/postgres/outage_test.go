package postgres_test

import (
	"context"
	"fmt"
	"io"
	"net"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/dedup"
	"github.com/oncemill/oncemill/dedup/dedupdriver"
	"github.com/oncemill/oncemill/dedup/postgres"
	"github.com/oncemill/oncemill/internal/testing/netfault"
	"github.com/oncemill/oncemill/internal/testing/pgtest"
)

// upstream is the test server's host:port.
func upstream(t *testing.T) string {
	t.Helper()
	cfg, err := pgx.ParseConfig(pgtest.URL())
	require.NoError(t, err)
	return net.JoinHostPort(cfg.Host, strconv.Itoa(int(cfg.Port)))
}

// poolVia is a pool with the test server's settings whose connections dial
// addr instead, giving up a connect after connectTimeout.
func poolVia(t *testing.T, addr string, connectTimeout time.Duration) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(pgtest.URL())
	require.NoError(t, err)
	cfg.MaxConns = 2
	cfg.ConnConfig.ConnectTimeout = connectTimeout
	cfg.ConnConfig.DialFunc = func(ctx context.Context, network, _ string) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, network, addr)
	}
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	return pool
}

// TestUnansweringServerIsUnavailable: a server that accepts TCP and never
// answers makes every call fail once pgx's connect timeout passes. That
// deadline is the driver's, not the caller's: the error wraps
// dedup.ErrUnavailable, so that the inbox does not count it against the
// message. It used to be taken for the caller's own deadline.
func TestUnansweringServerIsUnavailable(t *testing.T) {
	t.Parallel()
	b := setup(t, 2)
	store, err := postgres.New(poolVia(t, netfault.Silent(t), 100*time.Millisecond), postgres.Config{Schema: b.schema})
	require.NoError(t, err)
	key := dedup.Key{Consumer: "c", Key: "k"}
	// The caller's own context has a deadline, far off.
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()

	_, err = store.InboxStart(ctx, key, time.Hour)
	require.ErrorIs(t, err, dedup.ErrUnavailable)
	require.ErrorIs(t, err, context.DeadlineExceeded, "pgx's connect timeout")
	_, err = store.InboxBegin(ctx)
	require.ErrorIs(t, err, dedup.ErrUnavailable)
	_, _, _, err = store.InboxStartClaim(ctx, key, time.Hour)
	require.ErrorIs(t, err, dedup.ErrUnavailable)
	_, _, err = store.InboxBeginClaim(ctx, key, time.Hour, dedupdriver.ClaimHint{})
	require.ErrorIs(t, err, dedup.ErrUnavailable)
	_, err = store.LeaseClaim(ctx, key, time.Second, time.Hour)
	require.ErrorIs(t, err, dedup.ErrUnavailable)
	require.NoError(t, ctx.Err(), "the caller's deadline did not pass")
}

// TestCallersOwnDeadlineIsNotUnavailable: a deadline of the caller's own
// context (Watermill's Timeout middleware on the message) is the
// message's, not the store's: a claim that waits on a row another
// transaction holds until the caller's deadline passes, and a call made
// after it passed, do not wrap dedup.ErrUnavailable. (A deadline the
// handler returns is never given to InboxClassify: the inbox asks the
// transaction only while the handler's context is alive.)
func TestCallersOwnDeadlineIsNotUnavailable(t *testing.T) {
	t.Parallel()
	b := setup(t, 4)
	ctx := context.Background()
	key := dedup.Key{Consumer: "c", Key: "held"}

	holder, err := b.store.InboxBegin(ctx)
	require.NoError(t, err)
	_, err = holder.InboxClaim(ctx, key, time.Hour)
	require.NoError(t, err)
	defer func() { require.NoError(t, holder.Rollback(ctx)) }()

	for _, pipelined := range []bool{false, true} {
		t.Run("pipelined="+strconv.FormatBool(pipelined), func(t *testing.T) {
			if pipelined {
				short, cancel := context.WithTimeout(ctx, 500*time.Millisecond)
				defer cancel()
				_, _, err = b.store.InboxBeginClaim(short, key, time.Hour, dedupdriver.ClaimHint{})
			} else {
				tx, berr := b.store.InboxBegin(ctx)
				require.NoError(t, berr)
				short, cancel := context.WithTimeout(ctx, 500*time.Millisecond)
				defer cancel()
				_, err = tx.InboxClaim(short, key, time.Hour)
				_ = tx.Rollback(ctx) // the deadline closed its connection
			}
			require.ErrorIs(t, err, context.DeadlineExceeded, "the claim waited on the held row until the deadline")
			require.NotErrorIs(t, err, dedup.ErrUnavailable)
		})
	}

	past, cancel := context.WithDeadline(ctx, time.Now().Add(-time.Second))
	defer cancel()
	_, err = b.store.InboxStart(past, dedup.Key{Consumer: "c", Key: "late"}, time.Hour)
	require.ErrorIs(t, err, context.DeadlineExceeded)
	require.NotErrorIs(t, err, dedup.ErrUnavailable)
}

// TestCommitAnswerLostIsAmbiguous: the COMMIT reaches the server, which
// commits, and the connection breaks before its answer comes back. The
// commit returns an error wrapping dedup.ErrAmbiguous (an error without
// it would be counted as the message's failure), and the server holds
// the key done with its effect: the redelivery finds a duplicate.
func TestCommitAnswerLostIsAmbiguous(t *testing.T) {
	t.Parallel()
	b := setup(t, 4)
	b.createEffects(t)
	ctx := context.Background()
	for _, pipelined := range []bool{false, true} {
		t.Run("pipelined="+strconv.FormatBool(pipelined), func(t *testing.T) {
			proxy := netfault.CutAtCommit(t, upstream(t))
			via := poolVia(t, proxy.Addr(), 10*time.Second)
			store, err := postgres.New(via, postgres.Config{Schema: b.schema})
			require.NoError(t, err)
			key := dedup.Key{Consumer: "c", Key: "ambiguous-" + strconv.FormatBool(pipelined)}

			var tx dedup.InboxTx
			if pipelined {
				var start dedup.Claim
				start, tx, _, err = store.InboxStartClaim(ctx, key, time.Hour)
				require.NoError(t, err)
				require.Equal(t, dedup.StateNew, start.State)
			} else {
				tx, err = store.InboxBegin(ctx)
				require.NoError(t, err)
				var c dedup.Claim
				c, err = tx.InboxClaim(ctx, key, time.Hour)
				require.NoError(t, err)
				require.Equal(t, dedup.StateNew, c.State)
			}
			hctx := tx.WithTx(ctx)
			_, err = postgres.Tx(hctx).Exec(hctx, `INSERT INTO "`+b.schema+`".effects (key) VALUES ($1)`, key.Key)
			require.NoError(t, err)
			err = tx.Commit(ctx)
			require.ErrorIs(t, err, dedup.ErrAmbiguous)
			require.ErrorIs(t, err, dedup.ErrUnavailable, "ambiguous is a kind of unavailable")
			require.NoError(t, tx.Rollback(ctx), "nothing left to roll back")
			select {
			case <-proxy.Cut():
			default:
				t.Fatal("the proxy did not cut the COMMIT's answer")
			}

			r, ok := b.row(t, key)
			require.True(t, ok)
			require.Equal(t, "done", r.status, "the server committed")
			var n int
			require.NoError(t, b.pool.QueryRow(ctx, `SELECT count(*) FROM "`+b.schema+`".effects WHERE key = $1`, key.Key).Scan(&n))
			require.Equal(t, 1, n, "with its effect")
			requireIdle(t, via)
		})
	}
}

// TestClassifyAsksTheConnection: of the errors a handler returns after
// writing through the inbox's transaction, only those of the transaction
// itself are the infrastructure's. An io.EOF from decoding an empty body
// and a refused HTTP call are the message's while the connection is
// healthy, whatever they wrap; once the server has closed the
// transaction's connection, its failed statement is unavailability.
func TestClassifyAsksTheConnection(t *testing.T) {
	t.Parallel()
	b := setup(t, 4)
	ctx := context.Background()
	tx, err := b.store.InboxBegin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }() // its connection is gone by then
	c := tx.(dedupdriver.Classifier)

	decode := fmt.Errorf("decode order: %w", io.EOF)
	refused := &net.OpError{Op: "dial", Net: "tcp", Err: syscall.ECONNREFUSED}
	for _, err := range []error{decode, fmt.Errorf("payment API: %w", refused), io.ErrUnexpectedEOF} {
		require.NotErrorIs(t, c.InboxClassify(err), dedup.ErrUnavailable, "%v", err)
		require.NotErrorIs(t, c.InboxClassify(err), dedup.ErrConflict, "%v", err)
	}

	conn := postgres.Tx(tx.WithTx(ctx))
	_, err = b.pool.Exec(ctx, `SELECT pg_terminate_backend($1)`, conn.Conn().PgConn().PID())
	require.NoError(t, err)
	_, err = conn.Exec(ctx, `SELECT 1`)
	require.Error(t, err)
	require.ErrorIs(t, c.InboxClassify(err), dedup.ErrUnavailable, "the transaction's connection was lost")
	require.ErrorIs(t, c.InboxClassify(decode), dedup.ErrUnavailable,
		"whatever the handler returns once its transaction's connection is gone")
}
