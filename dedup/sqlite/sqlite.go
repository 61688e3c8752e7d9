package sqlite

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"net/url"
	"strings"
	"time"

	// The pure-Go SQLite driver, registered as "sqlite", used by Open.
	_ "modernc.org/sqlite"

	"github.com/oncemill/oncemill/dedup"
	"github.com/oncemill/oncemill/dedup/dedupdriver"
	"github.com/oncemill/oncemill/internal/sqldb"
	"github.com/oncemill/oncemill/sqlschema"
)

// ErrNotMigrated is returned, wrapped, by [New] when the inbox table does not exist.
var ErrNotMigrated = errors.New("sqlite: inbox table missing: run sqlschema.MigrateSQLite with the same Table")

// BusyTimeout is how long a connection opened by [Open] waits for another
// connection's write lock before it fails with SQLITE_BUSY.
const BusyTimeout = 10 * time.Second

// Config names the inbox table. The zero value is ready to use.
type Config struct {
	// Table is the inbox table's name. Defaults to "inbox".
	Table string
}

func (c Config) withDefaults() Config {
	if c.Table == "" {
		c.Table = sqlschema.DefaultInboxTable
	}
	return c
}

// Validate reports whether the table name is a safe identifier; the error
// names the field.
func (c Config) Validate() error {
	c = c.withDefaults()
	if err := sqlschema.ValidateIdentifier("Table", c.Table); err != nil {
		return fmt.Errorf("sqlite: %w", err)
	}
	return nil
}

func (c Config) schema() sqlschema.Config {
	return sqlschema.Config{InboxTable: c.Table}
}

// Store keeps inbox records in the SQLite tables created by
// [sqlschema.MigrateSQLite]. It implements [dedup.TxStore] (its
// transactions implement [dedupdriver.Classifier]), [dedup.Expirer],
// [dedupdriver.Peeker], [dedupdriver.RecordFinder], [dedupdriver.KeyLister]
// and [dedupdriver.BeginClaimer], and keeps hand-out marks
// (delivery.HandOutMarks). It is safe for concurrent use and starts no
// goroutines.
type Store struct {
	*inbox
	db    *sql.DB
	owned bool // db was opened by Open and is closed by Close
}

type inbox = sqldb.Inbox

var (
	_ dedup.TxStore            = (*Store)(nil)
	_ dedup.Expirer            = (*Store)(nil)
	_ dedupdriver.Peeker       = (*Store)(nil)
	_ dedupdriver.RecordFinder = (*Store)(nil)
	_ dedupdriver.KeyLister    = (*Store)(nil)
	_ dedupdriver.BeginClaimer = (*Store)(nil)
)

func newStore(db *sql.DB, owned bool, cfg Config) *Store {
	in := sqldb.NewSQLInbox(db, sqldb.SQLite, sqldb.InboxConfig{Name: "sqlite", NotMigrated: ErrNotMigrated, Schema: cfg.schema()})
	return &Store{inbox: in, db: db, owned: owned}
}

// Open opens (creating it if needed) the SQLite database file at path with
// the modernc.org/sqlite driver, creates or upgrades the inbox table with
// [sqlschema.MigrateSQLite], and returns a store that owns the database:
// [Store.Close] closes it.
//
// Every connection uses the WAL journal, a busy timeout of [BusyTimeout],
// foreign keys, and BEGIN IMMEDIATE transactions, so that concurrent claims
// wait for the write lock instead of failing. synchronous is left at FULL,
// SQLite's default: a committed effect survives a power loss.
//
// path is a file name, not a URI: it must not contain '?', and must not name
// a private in-memory database (":memory:" or ""), which each pooled
// connection would see as a different, empty database.
func Open(ctx context.Context, path string, cfg Config) (*Store, error) {
	cfg = cfg.withDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	switch {
	case path == "" || path == ":memory:":
		return nil, fmt.Errorf("sqlite: open: path %q is a private in-memory database; use a file (t.TempDir() in tests)", path)
	case strings.ContainsRune(path, '?'):
		return nil, fmt.Errorf("sqlite: open: path %q contains '?': give a file name, not a URI", path)
	}
	db, err := sql.Open("sqlite", path+"?"+dsnParams())
	if err != nil {
		return nil, fmt.Errorf("sqlite: open %s: %w", path, err)
	}
	if err := sqlschema.MigrateSQLite(ctx, db, cfg.schema()); err != nil {
		return nil, errors.Join(fmt.Errorf("sqlite: open %s: %w", path, err), db.Close())
	}
	return newStore(db, true, cfg), nil
}

// dsnParams returns the modernc.org/sqlite DSN parameters Open uses.
func dsnParams() string {
	v := url.Values{}
	v.Add("_pragma", fmt.Sprintf("busy_timeout(%d)", BusyTimeout.Milliseconds()))
	v.Add("_pragma", "journal_mode(WAL)")
	v.Add("_pragma", "foreign_keys(1)")
	v.Set("_txlock", "immediate")
	return v.Encode()
}

// New returns a store on db, a database the caller opened and owns. It does
// not create the table: run [sqlschema.MigrateSQLite] with the same Table
// first. [Store.Close] does not close db.
//
// db may use any SQLite driver with RETURNING and upsert (SQLite 3.35 or
// newer). It should set a busy timeout, or concurrent claims fail with
// SQLITE_BUSY instead of waiting, and should begin transactions with BEGIN
// IMMEDIATE (_txlock=immediate with modernc.org/sqlite or mattn/go-sqlite3),
// so that a transaction holds the write lock from its start.
func New(ctx context.Context, db *sql.DB, cfg Config) (*Store, error) {
	if db == nil {
		return nil, errors.New("sqlite: db is nil")
	}
	cfg = cfg.withDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	// SQLite reports a missing table with a generic code, so the table is
	// looked up once here rather than recognised in error texts later.
	var n int
	err := db.QueryRowContext(ctx, `SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = ?`, cfg.Table).Scan(&n)
	if err != nil {
		return nil, fmt.Errorf("sqlite: look up table %s: %w", cfg.Table, err)
	}
	if n == 0 {
		return nil, fmt.Errorf("sqlite: table %s: %w", cfg.Table, ErrNotMigrated)
	}
	return newStore(db, false, cfg), nil
}

// DB returns the database the store uses, for the application's own
// statements.
func (s *Store) DB() *sql.DB { return s.db }

// Close closes the database if the store was created by [Open]; for a store
// created by [New] it does nothing, as the caller owns the database.
func (s *Store) Close() error {
	if !s.owned {
		return nil
	}
	if err := s.db.Close(); err != nil {
		return fmt.Errorf("sqlite: close: %w", err)
	}
	return nil
}

// Tx returns the transaction in which the inbox claimed the message's key;
// a handler writes its effect through it so that the effect and the claim
// commit together. It returns nil when ctx carries none (the handler is not
// running under an inbox with this store).
func Tx(ctx context.Context) *sql.Tx {
	tx, _ := sqldb.InboxTxOf(ctx).(*sql.Tx)
	return tx
}
