package dlq_test

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/dedup/postgres"
	"github.com/oncemill/oncemill/dedup/sqlstore"
	"github.com/oncemill/oncemill/dlq"
	"github.com/oncemill/oncemill/internal/testing/mysqltest"
	"github.com/oncemill/oncemill/internal/testing/pgtest"
	"github.com/oncemill/oncemill/sqlschema"
)

// poolAt connects to the test server under another name for its host, or
// to another database, and closes the pool when the test ends.
func poolAt(t *testing.T, host, database string) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(pgtest.URL())
	require.NoError(t, err)
	if host != "" {
		cfg.ConnConfig.Host = host
	}
	if database != "" {
		cfg.ConnConfig.Database = database
	}
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	require.NoError(t, pool.Ping(context.Background()))
	return pool
}

// deadLetterInInbox publishes a dead letter with pub under an inbox
// transaction of db, then rolls the transaction back. It returns the
// entries of the dead-letter table in db as the transaction saw them
// before.
func deadLetterInInbox(t *testing.T, pub *dlq.Publisher, db *pgxpool.Pool, schema string) (seen int) {
	t.Helper()
	ctx := context.Background()
	store, err := postgres.New(db, postgres.Config{Schema: schema})
	require.NoError(t, err)
	inbox, err := store.InboxBegin(ctx)
	require.NoError(t, err)
	m := dead("orders", "billing", "card declined")
	m.SetContext(inbox.WithTx(ctx))
	require.NoError(t, pub.Publish("orders.dlq", m))
	txCtx := inbox.WithTx(ctx)
	require.NoError(t, postgres.Tx(txCtx).QueryRow(txCtx, `SELECT count(*) FROM `+pgx.Identifier{schema, "dlq"}.Sanitize()).Scan(&seen))
	require.NoError(t, inbox.Rollback(ctx))
	return seen
}

// TestPublishSameDatabaseByServerIdentity: an inbox transaction on the
// dead-letter table's server and database shares its dead letter's fate
// though it connected under another host name; one on another database of
// the same server does not.
func TestPublishSameDatabaseByServerIdentity(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	admin := pgtest.Pool(t, 2)
	cfg := sqlschema.Config{Schema: pgtest.Schema(t, admin)}
	table := pgx.Identifier{cfg.Schema, "dlq"}.Sanitize()
	count := func() int {
		t.Helper()
		var n int
		require.NoError(t, admin.QueryRow(ctx, `SELECT count(*) FROM `+table).Scan(&n))
		return n
	}
	host := admin.Config().ConnConfig.Host
	require.Equal(t, "127.0.0.1", host, "the test server is addressed by IP, so localhost names it otherwise")

	// The dead-letter table's pool names the server localhost, the
	// inbox's 127.0.0.1.
	pub, err := dlq.NewPublisher(poolAt(t, "localhost", ""), cfg)
	require.NoError(t, err)
	require.Equal(t, 1, deadLetterInInbox(t, pub, admin, cfg.Schema), "the inbox's transaction holds the dead letter")
	require.Zero(t, count(), "the dead letter rolled back with the inbox's transaction")
	require.Equal(t, 1, deadLetterInInbox(t, pub, admin, cfg.Schema), "again, with the connection's identity known")
	require.Zero(t, count())

	// Another database on the same server: the dead letter goes to the
	// table's database on its own.
	other := pgtest.Name(t)
	_, err = admin.Exec(ctx, `CREATE DATABASE `+pgx.Identifier{other}.Sanitize())
	require.NoError(t, err)
	t.Cleanup(func() {
		_, err := admin.Exec(context.Background(), `DROP DATABASE IF EXISTS `+pgx.Identifier{other}.Sanitize()+` WITH (FORCE)`)
		require.NoError(t, err)
	})
	otherDB := poolAt(t, host, other)
	require.NoError(t, sqlschema.Migrate(ctx, otherDB, cfg))
	require.Zero(t, deadLetterInInbox(t, pub, otherDB, cfg.Schema), "nothing in the other database's transaction")
	require.Equal(t, 1, count(), "written in the table's own database")
}

// TestPublishInTheInboxTransactionOfAnotherMySQLDatabase: on MySQL and
// MariaDB a transaction spans the databases of its server, so a dead
// letter published under an inbox transaction in another database of the
// dead-letter table's server is written in that transaction: it rolls
// back or commits with it. (On PostgreSQL another database is another
// transaction: TestPublishSameDatabaseByServerIdentity; the same database
// on every backend: TestOnEveryBackend's "in the inbox's transaction".)
func TestPublishInTheInboxTransactionOfAnotherMySQLDatabase(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db, name := mysqltest.DB(t, 4)
	cfg := sqlschema.Config{Schema: name}
	require.NoError(t, sqlschema.MigrateSQL(ctx, db, sqlschema.MySQL, cfg))
	pub, err := dlq.NewSQLPublisher(db, sqlschema.MySQL, cfg)
	require.NoError(t, err)
	store, err := dlq.NewSQLStore(db, sqlschema.MySQL, cfg)
	require.NoError(t, err)
	entries := func() int {
		t.Helper()
		list, err := store.List(ctx, dlq.Filter{})
		require.NoError(t, err)
		return len(list)
	}
	// The inbox in another database of the same server.
	otherDB, other := mysqltest.DB(t, 4)
	require.NoError(t, sqlschema.MigrateSQL(ctx, otherDB, sqlschema.MySQL, sqlschema.Config{Schema: other}))
	inbox, err := sqlstore.New(otherDB, sqlstore.Config{Dialect: sqlstore.MySQL, Schema: sqlschema.Config{Schema: other}})
	require.NoError(t, err)
	for _, commit := range []bool{false, true} {
		tx, err := inbox.InboxBegin(ctx)
		require.NoError(t, err)
		m := dead("orders", "billing", "card declined")
		m.SetContext(tx.WithTx(ctx))
		require.NoError(t, pub.Publish("orders.dlq", m))
		var seen int
		require.NoError(t, sqlstore.Tx(tx.WithTx(ctx)).QueryRowContext(ctx, "SELECT COUNT(*) FROM `"+name+"`.dlq").Scan(&seen))
		require.Equal(t, 1, seen, "the inbox's transaction holds the dead letter")
		if commit {
			require.NoError(t, tx.Commit(ctx))
			require.Equal(t, 1, entries(), "committed with the inbox's transaction")
		} else {
			require.NoError(t, tx.Rollback(ctx))
			require.Zero(t, entries(), "rolled back with the inbox's transaction")
		}
	}
}
