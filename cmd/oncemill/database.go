package main

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/go-sql-driver/mysql"
	"github.com/jackc/pgx/v5/pgxpool"
	"modernc.org/sqlite" // the pure-Go SQLite driver, registered as "sqlite"
	sqlite3 "modernc.org/sqlite/lib"

	"github.com/oncemill/oncemill/adapters"
	"github.com/oncemill/oncemill/internal/redact"
	"github.com/oncemill/oncemill/internal/sqldb"
	"github.com/oncemill/oncemill/sqlschema"
)

// databaseURLs is what a flag naming a database takes, for its help and
// its errors.
const databaseURLs = "postgres://user:password@host:5432/db, mysql://user:password@host:3306/db or sqlite:///absolute/path (sqlite://relative/path)"

// schemes are the database URLs' schemes, and the dialect of each.
var schemes = map[string]sqlschema.Dialect{
	"postgres":   sqlschema.Postgres,
	"postgresql": sqlschema.Postgres,
	"mysql":      sqlschema.MySQL,
	"sqlite":     sqlschema.SQLite,
}

// database is an open database of the command: a pgx pool for a
// postgres:// URL, a database/sql handle otherwise, and the dialect of
// oncemill's tables in it. Exactly one of Pool and DB is set; the
// packages' configs take the three as they are.
type database struct {
	Pool    *pgxpool.Pool
	DB      *sql.DB
	Dialect sqlschema.Dialect
}

// Close releases the database.
func (d database) Close() {
	if d.Pool != nil {
		d.Pool.Close()
	}
	if d.DB != nil {
		_ = d.DB.Close()
	}
}

// Ping checks that the database answers.
func (d database) Ping(ctx context.Context) error {
	if d.Pool != nil {
		return d.Pool.Ping(ctx)
	}
	return d.DB.PingContext(ctx)
}

// migrate brings oncemill's tables named by cfg up to date.
func (d database) migrate(ctx context.Context, cfg sqlschema.Config) error {
	if d.Pool != nil {
		return sqlschema.Migrate(ctx, d.Pool, cfg)
	}
	return sqlschema.MigrateSQL(ctx, d.DB, d.Dialect, cfg)
}

// hasTable reports whether the quoted table name exists.
func (d database) hasTable(ctx context.Context, name string) (bool, error) {
	dialect, err := sqldb.For(d.Dialect)
	if err != nil {
		return false, err
	}
	db := sqldb.SQL(d.DB, dialect)
	if d.Pool != nil {
		db = sqldb.Pgx(d.Pool)
	}
	rows, err := db.Query(ctx, "SELECT 1 FROM "+name+" WHERE 1 = 0")
	if dialect.UndefinedTable(err) {
		return false, nil
	}
	if err != nil {
		return false, err
	}
	return true, rows.Close()
}

// dbURL is a checked database URL, not yet connected.
type dbURL struct {
	flag    string // the flag that named it, for errors
	raw     string // the URL, whose password errors leave out
	safe    string // the URL without its password, for errors
	dialect sqlschema.Dialect
	pool    *pgxpool.Config         // a URL that pgx opens
	open    func() (*sql.DB, error) // a URL that database/sql opens
	path    string                  // a SQLite URL's file
}

// parseDatabase checks raw, the URL flag names, before anything connects:
//
//   - postgres:// or postgresql://, as pgx reads it, with a connect
//     timeout of adapters.DefaultConnectTimeout unless it gives one;
//   - mysql://user:password@host:3306/database?param=value, MySQL or
//     MariaDB (see [parseDSN]);
//   - sqlite:///absolute/path or sqlite://relative/path (sqlite:PATH too),
//     a database file, opened with a busy timeout and the WAL journal.
//     Unless create, the file must exist: a command that only reads it
//     must not leave an empty database behind a mistyped path.
//
// Its errors are usage errors that name the flag and never the password.
func parseDatabase(flag, raw string, create bool) (*dbURL, error) {
	u := &dbURL{flag: flag, raw: raw, safe: redact.URL(raw)}
	scheme, rest, _ := strings.Cut(raw, ":")
	u.dialect = schemes[strings.ToLower(scheme)]
	switch u.dialect {
	case sqlschema.Postgres:
		cfg, err := pgxpool.ParseConfig(raw)
		if err != nil {
			return nil, usagef("%s: %v", flag, redact.Error(err, raw))
		}
		if cfg.ConnConfig.ConnectTimeout == 0 {
			// A database that accepts the connection and never answers
			// would otherwise hang the command: adapters.Open's bound.
			cfg.ConnConfig.ConnectTimeout = adapters.DefaultConnectTimeout
		}
		u.pool = cfg
	case sqlschema.MySQL:
		cfg, err := parseDSN(flag, raw)
		if err != nil {
			return nil, err
		}
		u.open = func() (*sql.DB, error) {
			connector, err := mysql.NewConnector(cfg)
			if err != nil {
				return nil, err
			}
			if cfg.Timeout > 0 {
				connector = boundedConnector{Connector: connector, addr: cfg.Addr, bound: cfg.Timeout}
			}
			return sql.OpenDB(connector), nil
		}
	case sqlschema.SQLite:
		path, err := u.file(rest, create)
		if err != nil {
			return nil, err
		}
		u.open = func() (*sql.DB, error) { return sql.Open("sqlite", fileDSN(path)) }
	default:
		if p, err := url.Parse(raw); err == nil && p.Scheme != "" {
			return nil, usagef("%s: unknown scheme %q; want %s", flag, p.Scheme, databaseURLs)
		}
		return nil, usagef("%s: not a database URL; want %s", flag, databaseURLs)
	}
	return u, nil
}

// file checks the path of a sqlite: URL, rest being what follows the
// scheme's colon.
func (u *dbURL) file(rest string, create bool) (string, error) {
	rest, query, _ := strings.Cut(rest, "?")
	if query != "" {
		return "", usagef("%s %s: unknown parameters for sqlite: %s", u.flag, u.safe, redact.Query(query))
	}
	path, err := url.PathUnescape(strings.TrimPrefix(rest, "//"))
	switch {
	case err != nil:
		return "", usagef("%s %s: %v", u.flag, u.safe, err)
	case path == "" || path == ":memory:":
		return "", usagef("%s %s: want the database file, sqlite:///absolute/path or sqlite://relative/path (an in-memory database is private to one connection)", u.flag, u.safe)
	}
	fi, err := os.Stat(path)
	if !create && (err != nil || fi.IsDir()) {
		return "", usagef("%s %s: %q is not the consumer's database file: run the consumer (or sqlschema.MigrateSQLite) first, or correct the path", u.flag, u.safe, path)
	}
	if !create && fi.Size() == 0 {
		// SQLite would take an empty file for a new database and write
		// one into it: a read must leave the file as it found it.
		return "", usagef("%s %s: %q is empty (0 bytes), not the consumer's database file: run the consumer (or sqlschema.MigrateSQLite) first, or correct the path", u.flag, u.safe, path)
	}
	u.path = path
	return path, nil
}

// fileDSN is modernc.org/sqlite's DSN for the database file at path, with
// the settings of dedup/sqlite.Open: a busy timeout, so that a writer
// waits for the one write lock instead of failing; the WAL journal, so
// that readers do not block the writer; foreign keys; and BEGIN IMMEDIATE
// for database/sql's transactions, which take the write lock first.
func fileDSN(path string) string {
	escaped := strings.NewReplacer("%", "%25", "?", "%3f", "#", "%23").Replace(path)
	return "file:" + escaped + "?_pragma=busy_timeout(10000)&_pragma=journal_mode(WAL)&_pragma=foreign_keys(1)&_txlock=immediate"
}

// connect opens the database with at most conns connections and checks
// that it answers.
func (u *dbURL) connect(ctx context.Context, conns int) (database, error) {
	d := database{Dialect: u.dialect}
	var err error
	if u.pool != nil {
		cfg := u.pool.Copy()
		cfg.MaxConns = int32(conns)
		d.Pool, err = pgxpool.NewWithConfig(ctx, cfg)
	} else if d.DB, err = u.open(); err == nil {
		d.DB.SetMaxOpenConns(conns)
	}
	if err == nil {
		err = d.Ping(ctx)
	}
	if err != nil {
		d.Close()
		if u.path != "" {
			return database{}, fmt.Errorf("connect to the database: SQLite file %q: %w%s", u.path, err, sqliteHint(err, u.path))
		}
		return database{}, fmt.Errorf("connect to the database: %w", redact.Error(err, u.raw))
	}
	return d, nil
}

// sqliteHint says what to check when SQLite cannot open or write the
// file at path: it opens a file read-write, and its WAL journal keeps
// two files beside it, even while it only reads.
func sqliteHint(err error, path string) string {
	var e *sqlite.Error
	if !errors.As(err, &e) {
		return ""
	}
	switch e.Code() & 0xff {
	case sqlite3.SQLITE_READONLY, sqlite3.SQLITE_CANTOPEN, sqlite3.SQLITE_PERM:
		return fmt.Sprintf(": the user that runs oncemill must be able to write the file and its folder (SQLite opens it read-write, and its WAL journal keeps %s-wal and %s-shm beside it, even to read)", filepath.Base(path), filepath.Base(path))
	}
	return ""
}

// parseDSN reads a MySQL or MariaDB URL,
//
//	mysql://user:password@host:3306/database?param=value
//
// into go-sql-driver/mysql's config: TCP to host (port 3306 when none is
// given), the user and password percent-decoded, the database the
// connection's own (oncemill's tables are in the --schema database,
// whatever it is), and the parameters go-sql-driver/mysql's DSN
// parameters (tls, timeout, readTimeout, …; one it does not know is a
// session variable to set). The connect timeout (timeout) defaults to
// adapters.DefaultConnectTimeout and bounds the whole connect, the
// server's handshake included (see [boundedConnector]); readTimeout and
// writeTimeout default to [ioTimeout]. A parameter the URL gives wins,
// readTimeout=0 included (no bound). Its errors name the flag and never
// the password.
func parseDSN(flag, raw string) (*mysql.Config, error) {
	u, err := parseURL(flag, raw)
	if err != nil {
		return nil, err
	}
	if u.Opaque != "" || u.Host == "" {
		return nil, usagef("%s: want mysql://user:password@host:3306/database", flag)
	}
	safe := redact.URL(raw)
	// The parameters, checked by the driver as it checks a DSN's.
	cfg, err := mysql.ParseDSN("/?" + u.RawQuery)
	if err != nil {
		return nil, usagef("%s %s: %v", flag, safe, err)
	}
	cfg.Net = "tcp"
	cfg.Addr = u.Host
	if _, _, err := net.SplitHostPort(u.Host); err != nil {
		cfg.Addr = net.JoinHostPort(strings.Trim(u.Host, "[]"), "3306")
	}
	if u.User != nil {
		cfg.User = u.User.Username()
		cfg.Passwd, _ = u.User.Password()
	}
	cfg.DBName = strings.TrimPrefix(u.Path, "/")
	if strings.Contains(cfg.DBName, "/") {
		return nil, usagef("%s %s: the path is one database name", flag, safe)
	}
	if cfg.Timeout == 0 {
		// A server that accepts the connection and never answers would
		// otherwise hang the command: the same bound as adapters.Open.
		cfg.Timeout = adapters.DefaultConnectTimeout
	}
	// go-sql-driver/mysql reads and writes without a deadline unless
	// told: a server that stops answering mid-statement would hang the
	// command, and the driver's COMMIT watches no context.
	q := u.Query()
	if !q.Has("readTimeout") {
		cfg.ReadTimeout = ioTimeout
	}
	if !q.Has("writeTimeout") {
		cfg.WriteTimeout = ioTimeout
	}
	return cfg, nil
}

// ioTimeout is the default readTimeout and writeTimeout of a mysql:// URL:
// the longest the command waits for the server's answer to a statement,
// or for it to take what the command sends. Longer than any statement of
// the command should take on a healthy server.
const ioTimeout = 30 * time.Second

// boundedConnector gives every connect of a database/sql driver at most
// bound, the server's handshake and authentication included:
// go-sql-driver/mysql's own timeout parameter bounds only the TCP dial,
// and the handshake is read until the server answers. The driver closes
// the connection when the context of Connect ends.
type boundedConnector struct {
	driver.Connector
	addr  string
	bound time.Duration
}

func (c boundedConnector) Connect(ctx context.Context) (driver.Conn, error) {
	cctx, cancel := context.WithTimeout(ctx, c.bound)
	defer cancel()
	conn, err := c.Connector.Connect(cctx)
	if err != nil && ctx.Err() == nil && cctx.Err() != nil {
		return nil, fmt.Errorf("the database at %s did not answer within %s: %w", c.addr, c.bound, err)
	}
	return conn, err
}

// parseURL parses raw, the URL flag names, for the command's own reading
// of it; its errors are usage errors that say what is wrong and never
// show the password.
func parseURL(flag, raw string) (*url.URL, error) {
	if err := checkURLText(flag, raw); err != nil {
		return nil, err
	}
	u, err := url.Parse(raw)
	if err != nil {
		reason := err
		var uerr *url.Error
		if errors.As(err, &uerr) {
			reason = uerr.Err // the rest repeats the URL, password and all
		}
		return nil, usagef("%s: cannot parse %q: %s", flag, redact.URL(raw), redact.Text(reason.Error(), raw))
	}
	return u, nil
}

// checkURLText refuses a URL with a control character (a tab, a line
// feed, a DEL pasted into a password), which url.Parse refuses with
// "invalid control character in URL" and adapters with "cannot parse":
// it says which character, in which part of the URL, and how to write
// it, and never shows the password.
func checkURLText(flag, raw string) error {
	for i := 0; i < len(raw); i++ {
		if b := raw[i]; b < 0x20 || b == 0x7f {
			return usagef("%s: the URL has the control character %U %s, which a URL cannot hold: write it percent-escaped, as %%%02X",
				flag, rune(b), urlPart(raw, i), b)
		}
	}
	return nil
}

// urlPart names the part of the URL raw that its byte i is in.
func urlPart(raw string, i int) string {
	start := strings.Index(raw, "//")
	if start < 0 {
		return fmt.Sprintf("at byte %d", i+1)
	}
	if i < start {
		return "in its scheme"
	}
	auth := raw[start+2:]
	end := strings.IndexAny(auth, "/?#")
	if end < 0 {
		end = len(auth)
	}
	pos := i - start - 2
	at := strings.LastIndex(auth[:end], "@")
	switch {
	case pos >= end:
		return "in its path or parameters"
	case at >= 0 && pos < at:
		if colon := strings.Index(auth[:at], ":"); colon >= 0 && pos > colon {
			return "in its password"
		}
		return "in its user name"
	}
	return "in its host"
}
