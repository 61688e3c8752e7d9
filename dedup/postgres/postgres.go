package postgres

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/oncemill/oncemill/dedup"
	"github.com/oncemill/oncemill/dedup/dedupdriver"
	"github.com/oncemill/oncemill/internal/sqldb"
	"github.com/oncemill/oncemill/internal/typednil"
	"github.com/oncemill/oncemill/sqlschema"
)

// ErrNotMigrated is returned, wrapped, when the inbox table does not exist.
var ErrNotMigrated = errors.New("postgres: inbox table missing: run sqlschema.Migrate with the same Schema and Table")

// DB is what the store needs of PostgreSQL: a *pgxpool.Pool satisfies it.
// Only on a pool does the store pipeline a delivery's first statements.
type DB interface {
	Begin(ctx context.Context) (pgx.Tx, error)
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
}

// Config names the tables: it is [sqlschema.Config], the value
// [sqlschema.Migrate] created them with, so that the migrator, the store,
// the outbox (forwarder) and the dead-letter table (dlq) take one value and
// cannot name different tables. The store reads Schema and InboxTable. The
// zero value is ready to use.
type Config = sqlschema.Config

// Store keeps inbox records in the PostgreSQL tables created by
// [sqlschema.Migrate]. It implements [dedup.TxStore], [dedup.LeaseStore]
// and [dedup.Expirer], and the optional interfaces of dedupdriver; see the
// package documentation. It is safe for concurrent use and starts no
// goroutines.
type Store struct{ *inbox }

type inbox = sqldb.PgxInbox

var (
	_ dedup.TxStore            = (*Store)(nil)
	_ dedup.LeaseStore         = (*Store)(nil)
	_ dedup.Expirer            = (*Store)(nil)
	_ dedupdriver.Peeker       = (*Store)(nil)
	_ dedupdriver.RecordFinder = (*Store)(nil)
	_ dedupdriver.KeyLister    = (*Store)(nil)
	_ dedupdriver.StartClaimer = (*Store)(nil)
	_ dedupdriver.BeginClaimer = (*Store)(nil)
	_ dedupdriver.BatchClaimer = (*Store)(nil)
)

// New returns a store on db. It does not create the tables: run
// [sqlschema.Migrate] with the same Config first.
func New(db DB, cfg Config) (*Store, error) {
	if typednil.Is(db) {
		return nil, errors.New("postgres: db is nil")
	}
	cfg = cfg.WithDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("postgres: %w", err)
	}
	return &Store{sqldb.NewPgxInbox(db, sqldb.InboxConfig{Name: "postgres", NotMigrated: ErrNotMigrated, Schema: cfg})}, nil
}

// Tx returns the transaction in which the inbox claimed the message's key;
// a handler writes its effect through it so that the effect and the claim
// commit together. Its Commit and Rollback are the inbox's: called by the
// handler they do nothing and return an error wrapping dedup.ErrTxOwned.
// It returns nil when ctx carries none (the handler is not running under
// an inbox with this store).
func Tx(ctx context.Context) pgx.Tx {
	tx, _ := sqldb.InboxTxOf(ctx).(pgx.Tx)
	return tx
}
