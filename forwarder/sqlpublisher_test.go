package forwarder_test

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5/stdlib"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/forwarder"
	"github.com/oncemill/oncemill/sqlschema"
)

// TestSQLTxPublisherOnPostgres: events written through database/sql
// (pgx's stdlib) on PostgreSQL are the rows the pgx relay publishes, with
// their UUID, payload and metadata, and roll back with the transaction.
func TestSQLTxPublisherOnPostgres(t *testing.T) {
	t.Parallel()
	b := setup(t, 4)
	db := stdlib.OpenDBFromPool(b.pool)
	t.Cleanup(func() { require.NoError(t, db.Close()) })
	ctx := context.Background()
	kept, dropped := event("k", 1), event("k", 2)
	kept.Metadata.Set("note", "ünïcode ✓")
	for _, tc := range []struct {
		e      string
		commit bool
	}{{dropped.UUID, false}, {kept.UUID, true}} {
		tx, err := db.BeginTx(ctx, nil)
		require.NoError(t, err)
		_, err = tx.ExecContext(ctx, `INSERT INTO "`+b.schema.Schema+`".orders (id) VALUES ($1)`, tc.e)
		require.NoError(t, err)
		pub, err := forwarder.NewSQLTxPublisher(ctx, tx, sqlschema.Postgres, b.schema)
		require.NoError(t, err)
		e := dropped
		if tc.commit {
			e = kept
		}
		require.NoError(t, pub.Publish("orders", e))
		if tc.commit {
			require.NoError(t, tx.Commit())
		} else {
			require.NoError(t, tx.Rollback())
		}
	}
	s := &sink{}
	relayAll(t, newRelay(t, b, s, nil), 1)
	got := s.snapshot()
	require.Len(t, got, 1)
	require.Equal(t, kept.UUID, got[0].UUID)
	require.Equal(t, []byte(kept.Payload), []byte(got[0].Payload))
	require.Equal(t, "ünïcode ✓", got[0].Metadata.Get("note"))
	require.Equal(t, "k", got[0].Metadata.Get("partition_key"))
}
