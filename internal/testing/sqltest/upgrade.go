package sqltest

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/dedup"
	"github.com/oncemill/oncemill/dedup/deduptest"
	"github.com/oncemill/oncemill/sqlschema"
)

// narrowRecord is the migration that split the inbox's wide row: the
// schema before it held one row per key with the failure state.
const narrowRecord = "inbox_narrow"

// Upgrade is [deduptest.RunUpgrade]'s harness on a fresh database of b:
// the migrations before the inbox's narrow record applied and recorded
// as that release's migrator left them, the records written in the wide
// row's form, then the migrator run, and the store newStore makes on the
// tables.
func Upgrade(b Backend, newStore func(t *testing.T, db Database) dedup.TxStore) deduptest.UpgradeHarness {
	return deduptest.UpgradeHarness{New: func(t *testing.T, records []deduptest.OldRecord) (dedup.TxStore, func(context.Context, dedup.Key) (int, error)) {
		db := b.Open(t, 4).Bare(t)
		db.Schema = db.Schema.WithDefaults()
		db.migrateBefore(t, narrowRecord)
		db.writeWide(t, records)
		db.migrate(t)
		s := db.SQL()
		d := s.Dialect()
		names := d.Names(db.Schema)
		copies := d.Rebind(`SELECT COALESCE(SUM(dead_copies), 0) FROM ` + names.InboxFailures + ` WHERE consumer = ? AND ` + d.Quote("key") + ` = ?`)
		return newStore(t, db), func(ctx context.Context, k dedup.Key) (int, error) {
			var n int
			c, key := d.InboxArgs(k.Consumer, k.Key)
			err := s.QueryRow(ctx, copies, c, key).Scan(&n)
			return n, err
		}
	}}
}

func (db Database) dialect() sqlschema.Dialect {
	if db.Pool != nil {
		return sqlschema.Postgres
	}
	return db.Dialect
}

// migrateBefore applies and records, in db's version table as the
// migrator creates it, every migration before the one named name.
func (db Database) migrateBefore(t *testing.T, name string) {
	t.Helper()
	ctx := t.Context()
	s := db.SQL()
	ms, err := sqlschema.Migrations(db.dialect(), db.Schema)
	require.NoError(t, err)
	names := s.Dialect().Names(db.Schema)
	var versions string
	switch db.dialect() {
	case sqlschema.Postgres:
		schema := pgx.Identifier{db.Schema.Schema}.Sanitize()
		versions = schema + `.oncemill_migrations`
		_, err = s.Exec(ctx, `CREATE SCHEMA IF NOT EXISTS `+schema)
		require.NoError(t, err)
		t.Cleanup(func() {
			_, err := s.Exec(context.Background(), `DROP SCHEMA IF EXISTS `+schema+` CASCADE`)
			require.NoError(t, err)
		})
		_, err = s.Exec(ctx, `CREATE TABLE `+versions+` (version integer PRIMARY KEY, name text NOT NULL,
			applied_at timestamptz NOT NULL DEFAULT now())`)
	case sqlschema.MySQL:
		versions = names.Schema + ".`oncemill_migrations`"
		_, err = s.Exec(ctx, `CREATE TABLE `+versions+` (version INT NOT NULL PRIMARY KEY, name VARCHAR(128) NOT NULL,
			applied_at DATETIME(6) NOT NULL) ENGINE = InnoDB`)
	default:
		versions = `"oncemill_migrations"`
		_, err = s.Exec(ctx, `CREATE TABLE `+versions+` (version INTEGER PRIMARY KEY, name TEXT NOT NULL, applied_at INTEGER NOT NULL)`)
	}
	require.NoError(t, err)
	for _, m := range ms {
		if m.Name == name {
			return
		}
		for _, stmt := range m.Statements(db.dialect()) {
			_, err := s.Exec(ctx, stmt)
			require.NoError(t, err, "%03d_%s", m.Version, m.Name)
		}
		_, err = s.Exec(ctx, s.Dialect().Rebind(`INSERT INTO `+versions+` (version, name, applied_at) VALUES (?, ?, `+s.Dialect().Now()+`)`),
			m.Version, m.Name)
		require.NoError(t, err)
	}
	t.Fatalf("sqltest: no migration %s for %s", name, db.dialect())
}

// writeWide writes records as the inbox stores wrote them before the
// narrow record: one wide row per key, and the start counts.
func (db Database) writeWide(t *testing.T, records []deduptest.OldRecord) {
	t.Helper()
	ctx := t.Context()
	s := db.SQL()
	d := s.Dialect()
	names := d.Names(db.Schema)
	key := d.Quote("key")
	us := func(tm time.Time) any {
		if tm.IsZero() {
			return nil
		}
		return tm.UnixMicro()
	}
	text := func(v string) any {
		if v == "" {
			return nil
		}
		return v
	}
	at := d.FromMicros("?")
	row := d.Rebind(`INSERT INTO ` + names.Inbox + ` (consumer, ` + key + `, status, attempts, token, lease_until, result,
	first_error, last_error, first_failed_at, last_failed_at, created_at, updated_at, done_at, expires_at, dead_at, dead_copies, replay_grant)
VALUES (?, ?, ?, ?, ?, ` + at + `, ?, ?, ?, ` + at + `, ` + at + `, ` + at + `, ` + at + `, ` + at + `, ` + at + `, ` + at + `, ?, ?)`)
	start := d.Rebind(`INSERT INTO ` + names.InboxStarts + ` (consumer, ` + key + `, started, expires_at) VALUES (?, ?, ?, ` + at + `)`)
	now := time.Now()
	expires := now.Add(24 * time.Hour).UnixMicro()
	for _, r := range records {
		c, k := d.InboxArgs(r.Key.Consumer, r.Key.Key)
		if r.Status != "" {
			var done, dead any
			switch r.Status {
			case "done":
				done = now.UnixMicro()
			case "dead":
				dead = now.UnixMicro()
			}
			_, err := s.Exec(ctx, row, c, k, r.Status, r.Attempts, r.Token, us(r.LeaseUntil), r.Result,
				text(r.FirstError), text(r.LastError), us(r.FirstFailedAt), us(r.LastFailedAt), now.UnixMicro(), now.UnixMicro(),
				done, expires, dead, r.DeadCopies, text(r.ReplayGrant))
			require.NoError(t, err, r.Key.Key)
		}
		if r.Started > 0 {
			_, err := s.Exec(ctx, start, c, k, r.Started, expires)
			require.NoError(t, err, r.Key.Key)
		}
	}
}

// migrate runs the migrator of db's family, as a consumer starting on the
// newer release does.
func (db Database) migrate(t *testing.T) {
	t.Helper()
	ctx := t.Context()
	var err error
	switch {
	case db.Pool != nil:
		err = sqlschema.Migrate(ctx, db.Pool, db.Schema)
	case db.Dialect == sqlschema.SQLite:
		err = sqlschema.MigrateSQLite(ctx, db.DB, db.Schema)
	default:
		err = sqlschema.MigrateSQL(ctx, db.DB, db.Dialect, db.Schema)
	}
	require.NoError(t, err)
}
