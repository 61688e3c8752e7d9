package sqlstore_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"io"
	"log"
	"testing"
	"time"

	"github.com/go-sql-driver/mysql"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/stdlib"
	_ "github.com/lib/pq" // registers "postgres"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/oncemill/oncemill/dedup"
	"github.com/oncemill/oncemill/dedup/sqlstore"
	"github.com/oncemill/oncemill/internal/testing/mysqltest"
	"github.com/oncemill/oncemill/internal/testing/pgtest"
	"github.com/oncemill/oncemill/sqlschema"
)

func TestMain(m *testing.M) {
	// go-sql-driver/mysql logs every connection the tests cut.
	_ = mysql.SetLogger(log.New(io.Discard, "", 0))
	goleak.VerifyTestMain(m)
}

// backend is the store on one database and driver, with what a test needs
// to look at the database behind it.
type backend struct {
	name    string
	dialect sqlstore.Dialect
	db      *sql.DB
	store   *sqlstore.Store
	schema  sqlschema.Config
	names   sqlschema.Names
	// ph returns the placeholder of the i-th argument (1-based).
	ph func(i int) string
	// sessionID returns the server's id of the session q runs on.
	sessionID string
	// kill ends session id from another connection.
	kill func(t *testing.T, id int64)
}

// each runs fn on every dialect and driver: PostgreSQL through pgx's
// stdlib and through lib/pq, MariaDB (or MySQL) through go-sql-driver.
// Each gets its own schema or database.
func each(t *testing.T, maxConns int, fn func(t *testing.T, b backend)) {
	for _, name := range []string{"pgx", "pq", "mysql"} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			fn(t, open(t, name, maxConns))
		})
	}
}

func open(t *testing.T, name string, maxConns int) backend {
	t.Helper()
	ctx := context.Background()
	var b backend
	b.name = name
	switch name {
	case "pgx", "pq":
		pgtest.Pool(t, 1) // fails or skips the test when PostgreSQL is down
		var db *sql.DB
		if name == "pgx" {
			cfg, err := pgx.ParseConfig(pgtest.URL())
			require.NoError(t, err)
			db = stdlib.OpenDB(*cfg)
		} else {
			var err error
			db, err = sql.Open("postgres", pgtest.URL())
			require.NoError(t, err)
		}
		db.SetMaxOpenConns(maxConns)
		t.Cleanup(func() { require.NoError(t, db.Close()) })
		b.db, b.dialect = db, sqlstore.Postgres
		b.schema = sqlschema.Config{Schema: pgtest.Name(t)}
		t.Cleanup(func() {
			_, err := db.ExecContext(context.Background(), `DROP SCHEMA IF EXISTS "`+b.schema.Schema+`" CASCADE`)
			require.NoError(t, err)
		})
		b.ph = func(i int) string { return fmt.Sprintf("$%d", i) }
		b.sessionID = `SELECT pg_backend_pid()`
		b.kill = func(t *testing.T, id int64) {
			_, err := db.ExecContext(context.Background(), `SELECT pg_terminate_backend($1)`, id)
			require.NoError(t, err)
		}
	case "mysql":
		var database string
		b.db, database = mysqltest.DB(t, maxConns)
		b.dialect = sqlstore.MySQL
		b.schema = sqlschema.Config{Schema: database}
		b.ph = func(int) string { return "?" }
		b.sessionID = `SELECT CONNECTION_ID()`
		b.kill = func(t *testing.T, id int64) {
			_, err := b.db.ExecContext(context.Background(), fmt.Sprintf("KILL %d", id))
			require.NoError(t, err)
		}
	}
	require.NoError(t, sqlschema.MigrateSQL(ctx, b.db, b.dialect.Schema(), b.schema))
	b.names = sqlschema.NamesFor(b.dialect.Schema(), b.schema.WithDefaults())
	store, err := sqlstore.New(b.db, sqlstore.Config{Dialect: b.dialect, Schema: b.schema})
	require.NoError(t, err)
	b.store = store
	_, err = b.db.ExecContext(ctx, `CREATE TABLE `+b.table("effects")+` (k TEXT NOT NULL)`)
	require.NoError(t, err)
	return b
}

// table is the quoted name of a table in the backend's schema.
func (b backend) table(name string) string {
	if b.dialect == sqlstore.MySQL {
		return b.names.Schema + ".`" + name + "`"
	}
	return b.names.Schema + `."` + name + `"`
}

// col quotes the key column, a reserved word in MySQL.
func (b backend) key() string {
	if b.dialect == sqlstore.MySQL {
		return "`key`"
	}
	return "key"
}

// effect writes key's effect row through the inbox's transaction in ctx.
func (b backend) effect(ctx context.Context, key string) error {
	tx := sqlstore.Tx(ctx)
	if tx == nil {
		return errors.New("no transaction in the context")
	}
	_, err := tx.ExecContext(ctx, `INSERT INTO `+b.table("effects")+` (k) VALUES (`+b.ph(1)+`)`, key)
	return err
}

// effects counts the committed effect rows of key ("" for all).
func (b backend) effects(t *testing.T, key string) int {
	t.Helper()
	var n int
	q := `SELECT COUNT(*) FROM ` + b.table("effects")
	args := []any{}
	if key != "" {
		q += ` WHERE k = ` + b.ph(1)
		args = append(args, key)
	}
	require.NoError(t, b.db.QueryRowContext(context.Background(), q, args...).Scan(&n))
	return n
}

// record is a key's row in the inbox table.
type record struct {
	status            string
	attempts          int
	firstErr, lastErr sql.NullString
	result            []byte
	deadCopies        int
}

// row reads key's record; ok is false when it has none.
func (b backend) row(t *testing.T, key dedup.Key) (record, bool) {
	t.Helper()
	var r record
	err := b.db.QueryRowContext(context.Background(), `SELECT i.status, COALESCE(f.attempts, CASE WHEN i.status = 'done' THEN 1 ELSE 0 END), f.first_error, f.last_error, i.result, COALESCE(f.dead_copies, 0) FROM `+
		b.names.Inbox+` i LEFT JOIN `+b.names.InboxFailures+` f ON f.consumer = i.consumer AND f.`+b.key()+` = i.`+b.key()+`
		WHERE i.consumer = `+b.ph(1)+` AND i.`+b.key()+` = `+b.ph(2), key.Consumer, key.Key).
		Scan(&r.status, &r.attempts, &r.firstErr, &r.lastErr, &r.result, &r.deadCopies)
	if errors.Is(err, sql.ErrNoRows) {
		return record{}, false
	}
	require.NoError(t, err)
	return r, true
}

// starts reads the started-and-unfinished attempts of key, 0 if none.
func (b backend) starts(t *testing.T, key dedup.Key) int {
	t.Helper()
	var n int
	err := b.db.QueryRowContext(context.Background(), `SELECT started FROM `+b.names.InboxStarts+
		` WHERE consumer = `+b.ph(1)+` AND `+b.key()+` = `+b.ph(2), key.Consumer, key.Key).Scan(&n)
	if !errors.Is(err, sql.ErrNoRows) {
		require.NoError(t, err)
	}
	return n
}

// apply runs one attempt of key as the inbox does: claim, effect through
// the transaction, commit; it reports the claim's state.
func (b backend) apply(t *testing.T, key dedup.Key, result []byte) dedup.State {
	t.Helper()
	ctx := context.Background()
	tx, err := b.store.InboxBegin(ctx)
	require.NoError(t, err)
	defer func() { require.NoError(t, tx.Rollback(ctx)) }()
	c, err := tx.InboxClaim(ctx, key, time.Hour)
	require.NoError(t, err)
	if c.State != dedup.StateNew {
		return c.State
	}
	require.NoError(t, b.effect(tx.WithTx(ctx), key.Key))
	require.NoError(t, tx.InboxComplete(ctx, key, result))
	require.NoError(t, tx.Commit(ctx))
	return c.State
}
