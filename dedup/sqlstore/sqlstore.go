package sqlstore

import (
	"context"
	"database/sql"
	"errors"
	"fmt"

	"github.com/oncemill/oncemill/dedup"
	"github.com/oncemill/oncemill/dedup/dedupdriver"
	"github.com/oncemill/oncemill/internal/sqldb"
	"github.com/oncemill/oncemill/sqlschema"
)

// ErrNotMigrated is returned, wrapped, when the inbox table (or its schema)
// does not exist.
var ErrNotMigrated = errors.New("sqlstore: inbox table missing: run sqlschema.MigrateSQL with the same Dialect and Schema")

// Dialect is a database family the store speaks. Use [Postgres] or
// [MySQL]; the zero Dialect is refused by [Config.Validate].
type Dialect struct{ d *sqldb.Dialect }

var (
	// Postgres is PostgreSQL 13 or newer through pgx's stdlib
	// (github.com/jackc/pgx/v5/stdlib) or lib/pq, on the tables of
	// [sqlschema.Postgres]: the same tables and statements as
	// dedup/postgres, so the two stores may share them.
	Postgres = Dialect{sqldb.Postgres}
	// MySQL is MySQL 8.0 or newer, or MariaDB 10.6 or newer, through
	// go-sql-driver/mysql, on the InnoDB tables of [sqlschema.MySQL].
	MySQL = Dialect{sqldb.MySQL}
)

// String returns the dialect's name: "postgres" or "mysql".
func (d Dialect) String() string {
	if d.d == nil {
		return "none"
	}
	return d.d.String()
}

// Schema returns the [sqlschema.Dialect] whose migrations create the
// dialect's tables, for [sqlschema.MigrateSQL].
func (d Dialect) Schema() sqlschema.Dialect {
	if d.d == nil {
		return ""
	}
	return d.d.Name
}

// Config says what the store's database is and where its tables are.
type Config struct {
	// Dialect is the database family of db: [Postgres] (pgx's stdlib or
	// lib/pq) or [MySQL] (go-sql-driver/mysql, MySQL 8 or MariaDB
	// 10.6+). Required.
	Dialect Dialect
	// Schema names the inbox tables, as given to sqlschema.MigrateSQL:
	// its Schema (the PostgreSQL schema, or the MySQL database) and
	// InboxTable. Defaults to sqlschema's defaults ("oncemill", "inbox").
	Schema sqlschema.Config
}

// Validate reports the first field that is missing or not a safe
// identifier; the error names the field.
func (c Config) Validate() error {
	if c.Dialect.d == nil {
		return errors.New("sqlstore: Config.Dialect is required: sqlstore.Postgres or sqlstore.MySQL")
	}
	s := c.Schema.WithDefaults()
	if err := sqlschema.ValidateIdentifier("Schema.Schema", s.Schema); err != nil {
		return fmt.Errorf("sqlstore: %w", err)
	}
	if err := sqlschema.ValidateIdentifier("Schema.InboxTable", s.InboxTable); err != nil {
		return fmt.Errorf("sqlstore: %w", err)
	}
	return nil
}

// Store keeps inbox records in the tables sqlschema.MigrateSQL creates, on
// a *sql.DB. It implements [dedup.TxStore] (its transactions implement
// [dedupdriver.Classifier]), [dedupdriver.Peeker], [dedupdriver.RecordFinder],
// [dedupdriver.KeyLister], [dedupdriver.BeginClaimer] and [dedup.Expirer], and
// keeps hand-out marks (delivery.HandOutMarks); lease mode is not offered. It is
// safe for concurrent use and starts no goroutines.
type Store struct {
	*inbox
	db *sql.DB
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

// New returns a store on db. It does not create the tables: run
// sqlschema.MigrateSQL with cfg.Dialect.Schema() and cfg.Schema first.
func New(db *sql.DB, cfg Config) (*Store, error) {
	if db == nil {
		return nil, errors.New("sqlstore: db is nil")
	}
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	in := sqldb.NewSQLInbox(db, cfg.Dialect.d, sqldb.InboxConfig{Name: "sqlstore", NotMigrated: ErrNotMigrated, Schema: cfg.Schema.WithDefaults()})
	return &Store{inbox: in, db: db}, nil
}

// DB returns the database the store uses.
func (s *Store) DB() *sql.DB { return s.db }

// Tx returns the transaction in which the inbox claimed the message's key;
// a handler writes its effect through it (or through GORM, sqlc or sqlx
// over it) so that the effect and the claim commit together. It returns
// nil when ctx carries none (the handler is not running under an inbox
// with this store).
func Tx(ctx context.Context) *sql.Tx {
	tx, _ := sqldb.InboxTxOf(ctx).(*sql.Tx)
	return tx
}
