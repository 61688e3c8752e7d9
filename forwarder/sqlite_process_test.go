package forwarder_test

import (
	"context"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/dedup/sqlite"
	"github.com/oncemill/oncemill/internal/testing/sqltest"
	"github.com/oncemill/oncemill/sqlschema"
)

// TestSQLiteRelaySIGKILL: writers commit (and roll back) events in a
// SQLite file while a relay process publishes them to RabbitMQ and is
// SIGKILLed, again and again, and restarted (one relay per file at a
// time); a consumer with a SQLite inbox in the same file applies each
// event as an effect row. Counted from outside, in the file the effects
// commit to: every committed event applied once (0 lost, 0 doubled), each
// key's in its commit order (0 order violations), no rolled-back one; the
// copies a killed relay had published and not deleted reach the consumer
// again, and its inbox absorbs them. Each writer locks the file (BEGIN
// IMMEDIATE) to read its key's sequence.
func TestSQLiteRelaySIGKILL(t *testing.T) {
	t.Parallel()
	path := filepath.Join(t.TempDir(), "shop.db")
	db := sqltest.OpenSQLite(t, path)
	ctx := context.Background()
	require.NoError(t, sqlschema.MigrateSQLite(ctx, db, sqlschema.Config{}))
	store, err := sqlite.New(ctx, db, sqlite.Config{})
	require.NoError(t, err)
	testRelaySIGKILL(t, relayKill{
		db: db,
		tables: []string{
			`CREATE TABLE orders (id TEXT PRIMARY KEY, seq INTEGER NOT NULL DEFAULT 0)`,
			`CREATE TABLE effects (n INTEGER PRIMARY KEY AUTOINCREMENT, uuid TEXT NOT NULL, key TEXT NOT NULL, seq INTEGER NOT NULL)`,
		},
		inbox: store, inboxTx: sqlite.Tx,
		relay:  relayProcess{Driver: "sqlite", DSN: sqltest.DSN(path), Dialect: sqlschema.SQLite},
		relays: 1, writerSeed: 17, killSeed: [2]uint64{3, 4}, pause: true,
	})
}
