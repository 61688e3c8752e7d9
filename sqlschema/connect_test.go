package sqlschema_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/internal/testing/netfault"
	"github.com/oncemill/oncemill/sqlschema"
)

// TestMigrateServerDoesNotAnswer migrates through a pool, without
// connect_timeout, to a server that accepts connections and never answers:
// with a context without deadline Migrate still returns, after
// DefaultConnectTimeout and well within the generous bound, naming the
// server; with a shorter deadline, after that.
func TestMigrateServerDoesNotAnswer(t *testing.T) {
	t.Parallel()
	const bound = 20 * time.Second
	for _, tc := range []struct {
		name string
		ctx  func() (context.Context, context.CancelFunc)
	}{
		{"no deadline", func() (context.Context, context.CancelFunc) { return context.Background(), func() {} }},
		{"deadline", func() (context.Context, context.CancelFunc) {
			return context.WithTimeout(context.Background(), time.Second)
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			addr := netfault.Silent(t)
			pool, err := pgxpool.New(context.Background(), "postgres://oncemill@"+addr+"/test?sslmode=disable")
			require.NoError(t, err)
			// Registered after the server, so it runs first: closing the
			// pool stops its connection attempt.
			t.Cleanup(pool.Close)

			ctx, cancel := tc.ctx()
			defer cancel()
			start := time.Now()
			err = sqlschema.Migrate(ctx, pool, sqlschema.Config{})
			elapsed := time.Since(start)
			require.Error(t, err)
			require.Less(t, elapsed, bound, "Migrate returned after %s: %v", elapsed, err)
			require.ErrorIs(t, err, context.DeadlineExceeded)
			require.ErrorContains(t, err, "sqlschema: begin migration on "+addr)
			if tc.name == "no deadline" {
				require.ErrorContains(t, err, "no answer within 10s")
			}
			t.Logf("after %s: %v", elapsed.Round(time.Millisecond), err)
		})
	}
}
