package reconcile_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/dedup"
	"github.com/oncemill/oncemill/dedup/sqlstore"
	"github.com/oncemill/oncemill/internal/testing/mysqltest"
	"github.com/oncemill/oncemill/internal/testing/pgtest"
	"github.com/oncemill/oncemill/reconcile"
	"github.com/oncemill/oncemill/sqlschema"
)

const consumer = "billing"

// ledgerRow is one event the relay published, ago before now.
type ledgerRow struct {
	uuid, topic, key string
	ago              time.Duration
}

// pgLedger writes ledger rows into a PostgreSQL schema.
func pgLedger(t *testing.T, pool *pgxpool.Pool, schema string, rows ...ledgerRow) {
	t.Helper()
	table := sqlschema.NamesFor(sqlschema.Postgres, sqlschema.Config{Schema: schema}.WithDefaults()).Ledger
	b := &pgx.Batch{}
	for _, r := range rows {
		b.Queue(`INSERT INTO `+table+` (uuid, topic, partition_key, idempotency_key, published_at)
VALUES ($1, $2, $3, $4, now() - $5::float8 * interval '1 second')`, r.uuid, r.topic, r.key, r.key, r.ago.Seconds())
	}
	require.NoError(t, pool.SendBatch(context.Background(), b).Close())
}

// inboxSide writes a consumer's inbox rows and dead letters, in either
// database.
type inboxSide interface {
	// key writes an inbox row of consumer c in status, done ago before
	// now when done.
	key(t *testing.T, c, key, status string, ago time.Duration)
	// dead writes a dead letter of consumer c.
	dead(t *testing.T, c, uuid, key string)
	tables() reconcile.Tables
}

type pgInbox struct {
	pool   *pgxpool.Pool
	schema string
}

func (p pgInbox) names() sqlschema.Names {
	return sqlschema.NamesFor(sqlschema.Postgres, sqlschema.Config{Schema: p.schema}.WithDefaults())
}

func (p pgInbox) key(t *testing.T, c, key, status string, ago time.Duration) {
	t.Helper()
	_, err := p.pool.Exec(context.Background(), `INSERT INTO `+p.names().Inbox+` (consumer, key, status, done_at, expires_at)
VALUES ($1, $2, $3, CASE WHEN $3 = 'done' THEN now() - $4::float8 * interval '1 second' END, now() + interval '7 days')`, c, key, status, ago.Seconds())
	require.NoError(t, err)
}

func (p pgInbox) dead(t *testing.T, c, uuid, key string) {
	t.Helper()
	_, err := p.pool.Exec(context.Background(), `INSERT INTO `+p.names().DLQ+` (uuid, topic, consumer, key, error) VALUES ($1, 'orders', $2, $3, 'boom')`, uuid, c, key)
	require.NoError(t, err)
}

func (p pgInbox) tables() reconcile.Tables {
	return reconcile.Tables{Pool: p.pool, Schema: sqlschema.Config{Schema: p.schema}}
}

type mysqlInbox struct {
	db     *sql.DB
	schema string
}

func (m mysqlInbox) names() sqlschema.Names {
	return sqlschema.NamesFor(sqlschema.MySQL, sqlschema.Config{Schema: m.schema}.WithDefaults())
}

func (m mysqlInbox) key(t *testing.T, c, key, status string, ago time.Duration) {
	t.Helper()
	_, err := m.db.ExecContext(context.Background(), "INSERT INTO "+m.names().Inbox+" (consumer, `key`, status, done_at, expires_at)"+
		" VALUES (?, ?, ?, IF(? = 'done', UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND, NULL), UTC_TIMESTAMP(6) + INTERVAL 7 DAY)",
		c, key, status, status, ago.Microseconds())
	require.NoError(t, err)
}

func (m mysqlInbox) dead(t *testing.T, c, uuid, key string) {
	t.Helper()
	_, err := m.db.ExecContext(context.Background(), "INSERT INTO "+m.names().DLQ+" (uuid, topic, dlq_topic, consumer, `key`, `error`, payload, metadata, dead_at)"+
		" VALUES (?, 'orders', '', ?, ?, 'boom', '', '{}', UTC_TIMESTAMP(6))", uuid, c, key)
	require.NoError(t, err)
}

func (m mysqlInbox) tables() reconcile.Tables {
	return reconcile.Tables{DB: m.db, Dialect: sqlschema.MySQL, Schema: sqlschema.Config{Schema: m.schema}}
}

func newPGInbox(t *testing.T, pool *pgxpool.Pool) inboxSide {
	return pgInbox{pool: pool, schema: pgtest.Schema(t, pool)}
}

func newMySQLInbox(t *testing.T) inboxSide {
	db, name := mysqltest.DB(t, 4)
	require.NoError(t, sqlschema.MigrateSQL(context.Background(), db, sqlschema.MySQL, sqlschema.Config{Schema: name}))
	return mysqlInbox{db: db, schema: name}
}

// TestCheck classifies each way an event can end in a consumer: applied,
// dead in the inbox or in the dead-letter table (by key, or by UUID for a
// letter without a key), in flight, failing, absent; and reads only the
// window and the consumer's topics. The ledger is on PostgreSQL, the
// inbox on PostgreSQL (the same database and another schema) or MySQL.
func TestCheck(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t, 4)
	for _, side := range []struct {
		name string
		new  func(t *testing.T) inboxSide
	}{
		{"postgres", func(t *testing.T) inboxSide { return newPGInbox(t, pool) }},
		{"mysql", newMySQLInbox},
	} {
		t.Run(side.name, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			ledgerSchema := pgtest.Schema(t, pool)
			in := side.new(t)
			old := 10 * time.Minute
			pgLedger(t, pool, ledgerSchema,
				ledgerRow{"u-applied", "orders", "k-applied", old},
				ledgerRow{"u-dead", "orders", "k-dead", old},
				ledgerRow{"u-letter", "orders", "k-letter", old},
				ledgerRow{"u-keyless", "orders", "k-keyless", old},
				ledgerRow{"u-inflight", "orders", "k-inflight", old + time.Second},
				ledgerRow{"u-failing", "orders", "k-failing", old + 2*time.Second},
				ledgerRow{"u-absent", "orders", "k-absent", old + 3*time.Second},
				ledgerRow{"u-other", "orders", "k-other", old + 4*time.Second},
				ledgerRow{"u-payment", "payments", "k-payment", old + 5*time.Second},
				// Younger than the grace, older than the window: not checked.
				ledgerRow{"u-young", "orders", "k-young", time.Minute},
				ledgerRow{"u-ancient", "orders", "k-ancient", 48 * time.Hour},
			)
			in.key(t, consumer, "k-applied", "done", 9*time.Minute)
			in.key(t, consumer, "k-dead", "dead", 0)
			in.dead(t, consumer, "u-letter", "k-letter")
			in.dead(t, consumer, "u-keyless", "")
			in.key(t, consumer, "k-inflight", "processing", 0)
			in.key(t, consumer, "k-failing", "failed", 0)
			// Another consumer applied k-other; ours did not.
			in.key(t, "shipping", "k-other", "done", 9*time.Minute)
			// Done in the window with no ledger row: only --strict sees it;
			// done after the window: not even it.
			in.key(t, consumer, "k-ghost", "done", 8*time.Minute)
			in.key(t, consumer, "k-late-ghost", "done", time.Minute)

			cfg := reconcile.Config{
				Ledger:   reconcile.Tables{Pool: pool, Schema: sqlschema.Config{Schema: ledgerSchema}},
				Inbox:    in.tables(),
				Consumer: consumer,
				Topics:   []string{"orders"},
			}
			rep, err := reconcile.Check(ctx, cfg)
			require.NoError(t, err)
			require.Equal(t, 8, rep.Checked, "the orders events of the window")
			require.Equal(t, 2, rep.Lost)
			require.Equal(t, 2, rep.Stuck)
			require.Equal(t, []string{"u-other ", "u-absent ", "u-failing failed", "u-inflight processing"}, described(rep.Missing), "oldest first")
			require.Zero(t, rep.UnexplainedKeys, "not strict")
			require.False(t, rep.OK())
			require.WithinDuration(t, time.Now().Add(-old-4*time.Second), rep.Missing[0].PublishedAt, time.Minute)
			require.Equal(t, "orders", rep.Missing[0].Topic)
			require.Equal(t, "k-other", rep.Missing[0].Key)

			// Every topic: the payment is lost too.
			all := cfg
			all.Topics = nil
			rep, err = reconcile.Check(ctx, all)
			require.NoError(t, err)
			require.Equal(t, 9, rep.Checked)
			require.Equal(t, 3, rep.Lost)

			strict := cfg
			strict.Strict = true
			rep, err = reconcile.Check(ctx, strict)
			require.NoError(t, err)
			require.Equal(t, 1, rep.UnexplainedKeys)
			require.Len(t, rep.Unexplained, 1)
			require.Equal(t, "k-ghost", rep.Unexplained[0].Key)
			require.WithinDuration(t, time.Now().Add(-8*time.Minute), rep.Unexplained[0].DoneAt, time.Minute)

			// Limit keeps the oldest findings and counts them all.
			limited := cfg
			limited.Limit = 1
			rep, err = reconcile.Check(ctx, limited)
			require.NoError(t, err)
			require.Equal(t, []string{"u-other "}, described(rep.Missing))
			require.Equal(t, 4, rep.MissingEvents())

			// The consumer catches up: nothing is missing.
			in.key(t, consumer, "k-absent", "done", 0)
			in.key(t, consumer, "k-other", "done", 0)
			in.dead(t, consumer, "u-inflight", "k-inflight")
			in.dead(t, consumer, "u-failing", "k-failing")
			rep, err = reconcile.Check(ctx, cfg)
			require.NoError(t, err)
			require.True(t, rep.OK(), "%+v", rep)
			require.Equal(t, 8, rep.Checked)
		})
	}
}

func described(events []reconcile.Event) []string {
	out := make([]string, len(events))
	for i, e := range events {
		out[i] = e.UUID + " " + e.Inbox
	}
	return out
}

// TestCheckPages walks more events than a page, all published at the
// same instant, so that the walk's (published_at, uuid) cursor is what
// keeps an event from being read twice or skipped.
func TestCheckPages(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pgtest.Pool(t, 4)
	schema := pgtest.Schema(t, pool)
	const events = 2500
	table := sqlschema.NamesFor(sqlschema.Postgres, sqlschema.Config{Schema: schema}.WithDefaults())
	_, err := pool.Exec(ctx, `INSERT INTO `+table.Ledger+` (uuid, topic, partition_key, idempotency_key, published_at)
SELECT 'u-' || i, 'orders', 'p', 'k-' || i, now() - interval '1 hour' FROM generate_series(1, $1) i`, events)
	require.NoError(t, err)
	// Every key applied but three.
	_, err = pool.Exec(ctx, `INSERT INTO `+table.Inbox+` (consumer, key, status, done_at, expires_at)
SELECT $1, 'k-' || i, 'done', now() - interval '30 minutes', now() + interval '1 day' FROM generate_series(1, $2) i WHERE i NOT IN (7, 1500, 2500)`, consumer, events)
	require.NoError(t, err)
	rep, err := reconcile.Check(ctx, reconcile.Config{
		Ledger:   reconcile.Tables{Pool: pool, Schema: sqlschema.Config{Schema: schema}},
		Consumer: consumer,
		Strict:   true,
	})
	require.NoError(t, err)
	require.Equal(t, events, rep.Checked)
	require.Equal(t, 3, rep.Lost)
	require.ElementsMatch(t, []string{"u-7 ", "u-1500 ", "u-2500 "}, described(rep.Missing))
	require.Zero(t, rep.UnexplainedKeys)
}

// TestCheckCannotRun: a missing table is an error, never a report of
// lost events.
func TestCheckCannotRun(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pgtest.Pool(t, 2)
	schema := pgtest.Schema(t, pool)
	_, err := pool.Exec(ctx, `DROP TABLE `+sqlschema.NamesFor(sqlschema.Postgres, sqlschema.Config{Schema: schema}.WithDefaults()).Ledger)
	require.NoError(t, err)
	rep, err := reconcile.Check(ctx, reconcile.Config{Ledger: reconcile.Tables{Pool: pool, Schema: sqlschema.Config{Schema: schema}}, Consumer: consumer})
	require.ErrorIs(t, err, reconcile.ErrNoLedger)
	require.ErrorContains(t, err, "outbox_ledger")
	require.Zero(t, rep.MissingEvents())

	// On MySQL: a database without oncemill's tables.
	db, _ := mysqltest.DB(t, 2)
	_, err = reconcile.Check(ctx, reconcile.Config{Ledger: reconcile.Tables{DB: db, Dialect: sqlschema.MySQL, Schema: sqlschema.Config{Schema: "no_such_database"}}, Consumer: consumer})
	require.ErrorIs(t, err, reconcile.ErrNoLedger)

	// A missing inbox table is an error too, not ErrNoLedger.
	_, err = pool.Exec(ctx, `DROP TABLE `+sqlschema.NamesFor(sqlschema.Postgres, sqlschema.Config{Schema: schema}.WithDefaults()).Inbox+` CASCADE`)
	require.NoError(t, err)
	ledgerSchema := pgtest.Schema(t, pool)
	pgLedger(t, pool, ledgerSchema, ledgerRow{"u-1", "orders", "k-1", time.Hour})
	_, err = reconcile.Check(ctx, reconcile.Config{
		Ledger:   reconcile.Tables{Pool: pool, Schema: sqlschema.Config{Schema: ledgerSchema}},
		Inbox:    reconcile.Tables{Pool: pool, Schema: sqlschema.Config{Schema: schema}},
		Consumer: consumer,
	})
	require.ErrorContains(t, err, "read the inbox")
	require.NotErrorIs(t, err, reconcile.ErrNoLedger)
}

func TestConfigValidate(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t, 1)
	ok := reconcile.Config{Ledger: reconcile.Tables{Pool: pool}, Consumer: consumer}
	require.NoError(t, ok.Validate())
	for field, mutate := range map[string]func(*reconcile.Config){
		"Ledger.Pool":   func(c *reconcile.Config) { c.Ledger.Pool = nil },
		"Ledger.Schema": func(c *reconcile.Config) { c.Ledger.Schema.Schema = `bad"name` },
		"Inbox.Dialect": func(c *reconcile.Config) { c.Inbox.DB = &sql.DB{} },
		"Consumer":      func(c *reconcile.Config) { c.Consumer = "" },
		"Topics[1]":     func(c *reconcile.Config) { c.Topics = []string{"orders", ""} },
		"Grace":         func(c *reconcile.Config) { c.Grace = -time.Second },
		"Since (1m0s)":  func(c *reconcile.Config) { c.Since = time.Minute },
		"Limit":         func(c *reconcile.Config) { c.Limit = -1 },
	} {
		c := ok
		mutate(&c)
		err := c.Validate()
		require.ErrorIs(t, err, reconcile.ErrInvalidConfig, field)
		require.ErrorContains(t, err, field)
		_, checkErr := reconcile.Check(context.Background(), c)
		require.True(t, errors.Is(checkErr, reconcile.ErrInvalidConfig), fmt.Sprint(field, checkErr))
	}
}

// TestCheckMySQLLedger reads the ledger on MySQL, as the MySQL relay
// keeps it (DATETIME(6) in UTC), against an inbox there too.
func TestCheckMySQLLedger(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	in := newMySQLInbox(t).(mysqlInbox)
	for _, r := range []ledgerRow{
		{"u-applied", "orders", "k-applied", 10 * time.Minute},
		{"u-absent", "orders", "k-absent", 9 * time.Minute},
		{"u-young", "orders", "k-young", time.Minute},
	} {
		_, err := in.db.ExecContext(ctx, "INSERT INTO "+in.names().Ledger+" (uuid, topic, partition_key, idempotency_key, published_at)"+
			" VALUES (?, ?, ?, ?, UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND)", r.uuid, r.topic, r.key, r.key, r.ago.Microseconds())
		require.NoError(t, err)
	}
	in.key(t, consumer, "k-applied", "done", 8*time.Minute)
	in.key(t, consumer, "k-ghost", "done", 7*time.Minute)
	rep, err := reconcile.Check(ctx, reconcile.Config{Ledger: in.tables(), Consumer: consumer, Strict: true})
	require.NoError(t, err)
	require.Equal(t, 2, rep.Checked)
	require.Equal(t, []string{"u-absent "}, described(rep.Missing))
	require.WithinDuration(t, time.Now().Add(-9*time.Minute), rep.Missing[0].PublishedAt, time.Minute)
	require.Equal(t, 1, rep.UnexplainedKeys)
	require.Equal(t, "k-ghost", rep.Unexplained[0].Key)
}

// TestCheckMySQLLongKey: the MySQL inbox keeps a key longer than its
// column (1024 bytes) as its SHA-256 digest; reconcile finds such a key,
// applied through the store as a handler's transaction applies it, by
// the same digest, and does not report its event missing. A long
// consumer name (over 255 bytes) is kept the same way.
func TestCheckMySQLLongKey(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	in := newMySQLInbox(t).(mysqlInbox)
	store, err := sqlstore.New(in.db, sqlstore.Config{Dialect: sqlstore.MySQL, Schema: sqlschema.Config{Schema: in.schema}})
	require.NoError(t, err)
	long, absent := strings.Repeat("k", 2000), strings.Repeat("a", 2000)
	longConsumer := strings.Repeat("c", 300)
	for _, c := range []string{consumer, longConsumer} {
		tx, err := store.InboxBegin(ctx)
		require.NoError(t, err)
		claim, err := tx.InboxClaim(ctx, dedup.Key{Consumer: c, Key: long}, time.Hour)
		require.NoError(t, err)
		require.Equal(t, dedup.StateNew, claim.State)
		require.NoError(t, tx.InboxComplete(ctx, dedup.Key{Consumer: c, Key: long}, nil))
		require.NoError(t, tx.Commit(ctx))
	}
	for _, r := range []ledgerRow{
		{"u-long", "orders", long, 10 * time.Minute},
		{"u-absent", "orders", absent, 10 * time.Minute},
	} {
		_, err := in.db.ExecContext(ctx, "INSERT INTO "+in.names().Ledger+" (uuid, topic, partition_key, idempotency_key, published_at)"+
			" VALUES (?, ?, ?, ?, UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND)", r.uuid, r.topic, r.key, r.key, r.ago.Microseconds())
		require.NoError(t, err)
	}
	for _, c := range []string{consumer, longConsumer} {
		rep, err := reconcile.Check(ctx, reconcile.Config{Ledger: in.tables(), Consumer: c, Grace: time.Minute})
		require.NoError(t, err)
		require.Equal(t, 2, rep.Checked)
		require.Equal(t, 1, rep.Lost, "only the absent key is lost, consumer of %d bytes", len(c))
		require.Zero(t, rep.Stuck)
		require.Len(t, rep.Missing, 1)
		require.Equal(t, "u-absent", rep.Missing[0].UUID, "the applied 2000-byte key is found by its digest")
	}
}
