package netfault_test

import (
	"context"
	"errors"
	"net"
	"net/url"
	"strconv"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/oncemill/oncemill/internal/testing/netfault"
	"github.com/oncemill/oncemill/internal/testing/pgtest"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// TestCutAtCommit: through the proxy, statements and their answers pass
// (a client asking for TLS falls back to a plain connection); a COMMIT
// reaches the server and commits, and its connection breaks before the
// answer comes back; other connections go on; Close ends them.
func TestCutAtCommit(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	direct := pgtest.Pool(t, 2)
	table := pgx.Identifier{pgtest.Name(t)}.Sanitize()
	_, err := direct.Exec(ctx, `CREATE TABLE `+table+` (n int NOT NULL)`)
	require.NoError(t, err)
	t.Cleanup(func() {
		if _, err := direct.Exec(context.Background(), `DROP TABLE `+table); err != nil {
			t.Errorf("drop %s: %v", table, err)
		}
	})
	rows := func() (n int) {
		require.NoError(t, direct.QueryRow(ctx, `SELECT count(*) FROM `+table).Scan(&n))
		return n
	}

	cfg, err := pgx.ParseConfig(pgtest.URL())
	require.NoError(t, err)
	proxy := netfault.CutAtCommit(t, net.JoinHostPort(cfg.Host, strconv.Itoa(int(cfg.Port))))
	u, err := url.Parse(pgtest.URL())
	require.NoError(t, err)
	u.Host = proxy.Addr()
	q := u.Query()
	q.Set("sslmode", "prefer")
	u.RawQuery = q.Encode()
	connect := func() *pgx.Conn {
		c, err := pgx.Connect(ctx, u.String())
		require.NoError(t, err)
		t.Cleanup(func() { _ = c.Close(context.Background()) })
		return c
	}

	other := connect()
	var one int
	require.NoError(t, other.QueryRow(ctx, `SELECT $1::int`, 1).Scan(&one))
	require.Equal(t, 1, one)

	cut := connect()
	tx, err := cut.Begin(ctx)
	require.NoError(t, err)
	_, err = tx.Exec(ctx, `INSERT INTO `+table+` VALUES (1)`)
	require.NoError(t, err)
	err = tx.Commit(ctx)
	require.Error(t, err, "the COMMIT's answer never arrives")
	var pgErr *pgconn.PgError
	require.False(t, errors.As(err, &pgErr), "not an answer of the server: %v", err)
	require.True(t, cut.IsClosed())
	select {
	case <-proxy.Cut():
	default:
		t.Fatal("Cut not closed after the cut")
	}
	require.Equal(t, 1, rows(), "the server committed")

	// Another connection is not cut; statements outside a transaction
	// commit without a COMMIT.
	_, err = other.Exec(ctx, `INSERT INTO `+table+` VALUES (2)`)
	require.NoError(t, err)
	require.Equal(t, 2, rows())
	tx, err = other.Begin(ctx)
	require.NoError(t, err)
	require.NoError(t, tx.Rollback(ctx), "a ROLLBACK is answered")

	proxy.Close()
	require.Error(t, other.Ping(ctx), "Close closes the connections")
}
