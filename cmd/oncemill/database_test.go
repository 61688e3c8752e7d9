package main

import (
	"context"
	"database/sql"
	"encoding/json"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/internal/testing/mysqltest"
	"github.com/oncemill/oncemill/internal/testing/pgtest"
	"github.com/oncemill/oncemill/sqlschema"
)

// mysqlURL is the MySQL/MariaDB test server as a mysql:// URL whose
// connection's database is the DSN's.
func mysqlURL(t *testing.T) string {
	t.Helper()
	mc := mysqltest.Config(t, "")
	u := url.URL{Scheme: "mysql", Host: mc.Addr, Path: "/" + mc.DBName}
	if _, _, err := net.SplitHostPort(mc.Addr); err != nil {
		u.Host = net.JoinHostPort(mc.Addr, "3306")
	}
	if mc.Passwd != "" {
		u.User = url.UserPassword(mc.User, mc.Passwd)
	} else {
		u.User = url.User(mc.User)
	}
	return u.String()
}

// TestOpenDatabase: each scheme opens its database as the packages' configs
// take it ({Pool | DB, Dialect}), on which oncemill's tables migrate and
// are found, and a missing one is told apart. A SQLite file is found by an
// absolute or a relative path, is created only when asked, and runs with
// the busy timeout and the WAL journal.
func TestOpenDatabase(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	dir := t.TempDir()
	cwd, err := os.Getwd()
	require.NoError(t, err)
	relative, err := filepath.Rel(cwd, filepath.Join(dir, "relative.db"))
	require.NoError(t, err)
	require.False(t, filepath.IsAbs(relative))

	admin := pgtest.Pool(t, 1)
	pgSchema := pgtest.Name(t)
	t.Cleanup(func() {
		_, err := admin.Exec(context.Background(), `DROP SCHEMA IF EXISTS `+pgx.Identifier{pgSchema}.Sanitize()+` CASCADE`)
		require.NoError(t, err)
	})

	for _, tc := range []struct {
		name    string
		url     string
		schema  string
		dialect sqlschema.Dialect
		pool    bool
		file    string // the SQLite file the URL names
	}{
		{"postgres", pgtest.URL(), pgSchema, sqlschema.Postgres, true, ""},
		{"postgresql", "postgresql" + pgtest.URL()[len("postgres"):], pgSchema, sqlschema.Postgres, true, ""},
		{"mariadb", mysqlURL(t), mysqltest.Database(t), sqlschema.MySQL, false, ""},
		{"sqlite absolute", "sqlite://" + filepath.Join(dir, "absolute.db"), "", sqlschema.SQLite, false, filepath.Join(dir, "absolute.db")},
		{"sqlite relative", "sqlite://" + filepath.ToSlash(relative), "", sqlschema.SQLite, false, filepath.Join(dir, "relative.db")},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if tc.file != "" {
				_, err := parseDatabase("--database", tc.url, false)
				require.ErrorContains(t, err, "run the consumer (or sqlschema.MigrateSQLite) first", "a reader does not create the file")
				_, err = os.Stat(tc.file)
				require.ErrorIs(t, err, os.ErrNotExist)
			}
			u, err := parseDatabase("--database", tc.url, true)
			require.NoError(t, err)
			db, err := u.connect(ctx, 2)
			require.NoError(t, err)
			defer db.Close()
			require.Equal(t, tc.dialect, db.Dialect)
			require.Equal(t, tc.pool, db.Pool != nil, "pgx for PostgreSQL")
			require.Equal(t, !tc.pool, db.DB != nil, "database/sql for the others")

			cfg := sqlschema.Config{Schema: tc.schema}
			require.NoError(t, db.migrate(ctx, cfg))
			names := sqlschema.NamesFor(db.Dialect, cfg.WithDefaults())
			none := sqlschema.NamesFor(db.Dialect, sqlschema.Config{Schema: tc.schema, OutboxTable: "no_such_table"}.WithDefaults()).Outbox
			for table, want := range map[string]bool{names.Outbox: true, names.DLQ: true, names.Ledger: true, none: false} {
				found, err := db.hasTable(ctx, table)
				require.NoError(t, err, table)
				require.Equal(t, want, found, table)
			}
			if tc.file == "" {
				return
			}
			_, err = os.Stat(tc.file)
			require.NoError(t, err, "the file the URL names")
			var mode string
			var busy int
			require.NoError(t, db.DB.QueryRowContext(ctx, "PRAGMA journal_mode").Scan(&mode))
			require.NoError(t, db.DB.QueryRowContext(ctx, "PRAGMA busy_timeout").Scan(&busy))
			require.Equal(t, "wal", mode)
			require.Equal(t, 10*time.Second, time.Duration(busy)*time.Millisecond)

			// Now that it exists, a reader opens it.
			u, err = parseDatabase("--database", tc.url, false)
			require.NoError(t, err)
			again, err := u.connect(ctx, 1)
			require.NoError(t, err)
			again.Close()
		})
	}
}

// TestParseDatabaseErrors: a URL that names no database the command opens
// is a usage error, before anything connects, that names the flag and the
// fix and never the password.
func TestParseDatabaseErrors(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	for _, tc := range []struct {
		flag, url string
		want      []string
	}{
		{"--database", "cassandra://app:secret@h/db", []string{`--database: unknown scheme "cassandra"`, "sqlite:///absolute/path", "mysql://", "postgres://"}},
		{"--database", "host=db user=app password=secret", []string{"--database: not a database URL", "postgres://"}},
		{"--inbox-database", "postgres://app:secret@h:notaport/db", []string{"--inbox-database: "}},
		{"--database", "mysql://app:secret@h/db?timeout=never", []string{"--database mysql://app:xxxxx@h/db?timeout=never: "}},
		{"--database", "mysql:secret@h", []string{"--database: want mysql://user:password@host:3306/database"}},
		{"--database", "sqlite://:memory:", []string{"--database sqlite://:memory:: want the database file", "sqlite:///absolute/path", "in-memory"}},
		{"--database", "sqlite:", []string{"want the database file"}},
		{"--database", "sqlite://" + filepath.Join(dir, "missing.db"), []string{`"` + filepath.Join(dir, "missing.db") + `" is not the consumer's database file`, "run the consumer (or sqlschema.MigrateSQLite) first"}},
		{"--database", "sqlite://" + dir, []string{"is not the consumer's database file", "sqlschema.MigrateSQLite"}},
		{"--database", "sqlite://" + filepath.Join(dir, "x.db") + "?mode=memory", []string{"unknown parameters for sqlite"}},
	} {
		_, err := parseDatabase(tc.flag, tc.url, false)
		require.Error(t, err, tc.url)
		var u usageError
		require.ErrorAs(t, err, &u, tc.url)
		for _, want := range tc.want {
			require.Contains(t, err.Error(), want, tc.url)
		}
		require.NotContains(t, err.Error(), "secret", tc.url)
	}

	// Through the command: one line, exit status 2, nothing created.
	missing := filepath.Join(dir, "typo.db")
	r := oncemill(t, nil, "dlq", "list", "--database", "sqlite://"+missing)
	require.Equal(t, exitUsage, r.code, r.stderr)
	requireOneLine(t, r.stderr)
	require.Contains(t, r.stderr, "oncemill dlq list: --database sqlite://"+missing+": ")
	require.Contains(t, r.stderr, "run the consumer (or sqlschema.MigrateSQLite) first")
	_, err := os.Stat(missing)
	require.ErrorIs(t, err, os.ErrNotExist)
}

// TestDLQListOnSQLite: "oncemill dlq list --database sqlite:///…" lists the
// dead letter of a consumer's SQLite file, as text and as JSON.
func TestDLQListOnSQLite(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	file := filepath.Join(t.TempDir(), "consumer.db")
	db, err := sql.Open("sqlite", file)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, db.Close()) })
	require.NoError(t, sqlschema.MigrateSQLite(ctx, db, sqlschema.Config{}))
	deadAt := time.Date(2026, 3, 1, 10, 4, 5, 0, time.UTC)
	res, err := db.ExecContext(ctx, `INSERT INTO "dlq" (uuid, topic, dlq_topic, consumer, key, attempts, error, payload, metadata, dead_at)
		VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)`,
		"0b9d3c5e-8f1a-4c62-9d7e-3a1f2b4c5d6e", "orders.created", "dead-letters", "charge", "order-17", 3,
		"card declined", []byte(`{"order":17}`), `{"idempotency_key":"order-17"}`, deadAt.UnixMicro())
	require.NoError(t, err)
	id, err := res.LastInsertId()
	require.NoError(t, err)

	r := oncemill(t, nil, "dlq", "list", "--database", "sqlite://"+file)
	require.Equal(t, exitOK, r.code, r.stderr)
	require.Equal(t, []int64{id}, listedIDs(t, r.stdout))
	for _, want := range []string{"2026-03-01T10:04:05Z", "orders.created", "charge", "order-17", "card declined"} {
		require.Contains(t, r.stdout, want)
	}

	r = oncemill(t, nil, "dlq", "list", "--json", "--consumer", "charge", "--database", "sqlite://"+file)
	require.Equal(t, exitOK, r.code, r.stderr)
	var listed []map[string]any
	require.NoError(t, json.Unmarshal([]byte(r.stdout), &listed))
	require.Len(t, listed, 1)
	require.Equal(t, "0b9d3c5e-8f1a-4c62-9d7e-3a1f2b4c5d6e", listed[0]["uuid"])
	require.Equal(t, "orders.created", listed[0]["topic"])
	require.Equal(t, `{"order":17}`, listed[0]["payload"])
	require.EqualValues(t, 3, listed[0]["attempts"])
}

// TestURLControlCharacterNamed: a URL flag whose password holds a control
// character (a tab or a line feed pasted with it) is refused with the
// character, the part of the URL and how to write it, where it was
// refused with "cannot parse" and no reason; the password never shows.
func TestURLControlCharacterNamed(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"publish", "--topic", "t", "--broker", "amqp://guest:s3cr\x01et@127.0.0.1:5672/", "x"},
			"oncemill publish: --broker: the URL has the control character U+0001 in its password, which a URL cannot hold: write it percent-escaped, as %01; nothing sent"},
		{[]string{"dlq", "list", "--database", "mysql://root:s3cr\tet@127.0.0.1:3306/test"},
			"oncemill dlq list: --database: the URL has the control character U+0009 in its password, which a URL cannot hold: write it percent-escaped, as %09"},
		{[]string{"dlq", "replay", "1", "--database", pgtest.URL(), "--inbox", "redis://:s3cr\x7fet@127.0.0.1:6379"},
			"oncemill dlq replay: --inbox: the URL has the control character U+007F in its password, which a URL cannot hold: write it percent-escaped, as %7F"},
		{[]string{"relay", "--database", pgtest.URL(), "--broker", "amqp://gu\nest:s3cret@127.0.0.1:5672/"},
			"oncemill relay: --broker: the URL has the control character U+000A in its user name, which a URL cannot hold: write it percent-escaped, as %0A; nothing relayed"},
		{[]string{"dlq", "list", "--database", "mysql://root:s3cret@127.0.0.1:3306/te\rst"},
			"oncemill dlq list: --database: the URL has the control character U+000D in its path or parameters"},
	} {
		r := oncemill(t, nil, tc.args...)
		require.Equal(t, exitUsage, r.code, "%q: %s", tc.args, r.stderr)
		require.Contains(t, r.stderr, tc.want, tc.args)
		require.NotContains(t, r.stderr, "s3cr", "the password never shows")
		requireOneLine(t, r.stderr)
	}
}
