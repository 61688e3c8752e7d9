package forwarder_test

import (
	"context"
	"path/filepath"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/stdlib" // also the "pgx" driver of the relay processes
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/dedup/sqlite"
	"github.com/oncemill/oncemill/dedup/sqlstore"
	"github.com/oncemill/oncemill/internal/testing/mysqltest"
	"github.com/oncemill/oncemill/internal/testing/pgtest"
	"github.com/oncemill/oncemill/internal/testing/sqltest"
	"github.com/oncemill/oncemill/sqlschema"
)

// scheduleDelay is how far ahead the relay-kill tests below schedule each
// event: several kills land while rows wait, and while they are moved.
const scheduleDelay = 300 * time.Millisecond

// TestScheduledRelaySIGKILL: testRelaySIGKILL with every event scheduled
// 300ms after its write, on PostgreSQL (database/sql, two relays),
// MariaDB (two relays) and SQLite (one): relays SIGKILLed while rows wait
// in the scheduled table, or are being moved into the outbox, lose none
// (a move is one transaction), double none (the consumer's inbox absorbs
// what a killed relay had published and not deleted), publish none before
// its due time, and each key's in its write order (one delay for all, so
// its due order), the events a writer held up past its delay (a loaded
// machine) writes after their due time included.
func TestScheduledRelaySIGKILL(t *testing.T) {
	t.Parallel()
	t.Run("postgres-sql", func(t *testing.T) {
		t.Parallel()
		pool := pgtest.Pool(t, 16)
		name := pgtest.Schema(t, pool)
		db := stdlib.OpenDBFromPool(pool)
		t.Cleanup(func() { require.NoError(t, db.Close()) })
		schema := sqlschema.Config{Schema: name}
		store, err := sqlstore.New(db, sqlstore.Config{Dialect: sqlstore.Postgres, Schema: schema})
		require.NoError(t, err)
		q := pgx.Identifier{name}.Sanitize()
		testRelaySIGKILL(t, relayKill{
			db: db, schema: schema,
			tables: []string{
				`CREATE TABLE ` + q + `.orders (id text PRIMARY KEY, seq integer NOT NULL DEFAULT 0)`,
				`CREATE TABLE ` + q + `.effects (n bigserial PRIMARY KEY, uuid text NOT NULL, "key" text NOT NULL, seq integer NOT NULL)`,
			},
			inbox: store, inboxTx: sqlstore.Tx,
			relay:  relayProcess{Driver: "pgx", DSN: pgtest.URL(), Dialect: sqlschema.Postgres, Schema: name, LanesPerBatch: 4},
			relays: 2, writerSeed: 21, killSeed: [2]uint64{5, 6}, delay: scheduleDelay,
		})
	})
	t.Run("mariadb", func(t *testing.T) {
		t.Parallel()
		b := setupMySQL(t, 16)
		store, err := sqlstore.New(b.db, sqlstore.Config{Dialect: sqlstore.MySQL, Schema: b.schema})
		require.NoError(t, err)
		testRelaySIGKILL(t, relayKill{
			db: b.db, schema: b.schema,
			tables: []string{"CREATE TABLE `" + b.name + "`.effects (n BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY, " +
				"uuid VARCHAR(64) NOT NULL, `key` VARCHAR(64) NOT NULL, seq INT NOT NULL) ENGINE = InnoDB"},
			inbox: store, inboxTx: sqlstore.Tx,
			relay: relayProcess{Driver: "mysql", DSN: mysqltest.Config(t, b.name).FormatDSN(), Dialect: sqlschema.MySQL,
				Schema: b.name, LanesPerBatch: 4},
			relays: 2, writerSeed: 23, killSeed: [2]uint64{7, 8}, delay: scheduleDelay,
		})
	})
	t.Run("sqlite", func(t *testing.T) {
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
			relays: 1, writerSeed: 25, killSeed: [2]uint64{9, 10}, pause: true, delay: scheduleDelay,
		})
	})
}
