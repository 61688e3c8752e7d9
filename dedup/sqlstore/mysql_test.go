package sqlstore_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/dedup"
	"github.com/oncemill/oncemill/dedup/sqlstore"
	"github.com/oncemill/oncemill/internal/testing/mysqltest"
)

// TestMySQLDSNSettings: the store's answers do not depend on the DSN's
// settings: client-side interpolation, found rows instead of changed
// rows in the counts, parseTime, a session time zone far from UTC.
func TestMySQLDSNSettings(t *testing.T) {
	t.Parallel()
	b := open(t, "mysql", 4)
	cfg := mysqltest.Config(t, b.schema.Schema)
	cfg.InterpolateParams, cfg.ClientFoundRows, cfg.ParseTime = true, true, true
	loc, err := time.LoadLocation("Pacific/Kiritimati") // UTC+14
	require.NoError(t, err)
	cfg.Loc = loc
	// A session zone far from UTC too, on the other side of it: MariaDB
	// takes offsets up to +13:00 only.
	// MariaDB takes session offsets up to +13:00.
	cfg.Params = map[string]string{"time_zone": "'+13:00'"}
	store, err := sqlstore.New(mysqltest.Open(t, cfg, 4), sqlstore.Config{Dialect: sqlstore.MySQL, Schema: b.schema})
	require.NoError(t, err)
	b.store = store
	ctx := context.Background()

	key := dedup.Key{Consumer: "billing", Key: "order-dsn"}
	failedAt := time.Now().Add(-time.Minute).Truncate(time.Microsecond)
	for i := 1; i <= 2; i++ {
		start, err := store.InboxStart(ctx, key, time.Hour)
		require.NoError(t, err)
		// The start counted is taken back; the failure is counted on the
		// key's record, which the claim below reports.
		require.Equal(t, dedup.Claim{State: dedup.StateNew, Attempts: 1}, start, "start %d", i)
		require.NoError(t, store.InboxUnstart(ctx, key))
		require.NoError(t, store.InboxFail(ctx, key, dedup.Failure{Err: "boom", At: failedAt}, time.Hour))
	}
	tx, err := store.InboxBegin(ctx)
	require.NoError(t, err)
	c, err := tx.InboxClaim(ctx, key, time.Hour)
	require.NoError(t, err)
	require.Equal(t, dedup.StateNew, c.State, "found rows do not make a reclaim look like a duplicate")
	require.Equal(t, 3, c.Attempts)
	require.True(t, c.FirstFailedAt.Equal(failedAt), "first failure %s, want %s", c.FirstFailedAt, failedAt)
	require.NoError(t, b.effect(tx.WithTx(ctx), key.Key))
	require.NoError(t, tx.Commit(ctx))

	require.Equal(t, dedup.StateDone, b.apply(t, key, nil), "found rows do not make a duplicate look new")
	require.Equal(t, dedup.StateNew, b.apply(t, dedup.Key{Consumer: "billing", Key: "order-new"}, nil))
	require.Equal(t, 2, b.effects(t, ""))

	peek, err := store.InboxPeek(ctx, key)
	require.NoError(t, err)
	require.Equal(t, dedup.StateDone, peek.State, "the window is the server's UTC, not the session's zone")
	var keys []string
	require.NoError(t, store.InboxDoneKeys(ctx, "billing", time.Now().Add(-time.Minute), func(k string) error {
		keys = append(keys, k)
		return nil
	}))
	require.ElementsMatch(t, []string{"order-dsn", "order-new"}, keys)
}
