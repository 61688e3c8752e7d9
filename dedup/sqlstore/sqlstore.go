package sqlstore

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/oncemill/oncemill/dedup"
	"github.com/oncemill/oncemill/dedup/dedupdriver"
	"github.com/oncemill/oncemill/sqlschema"
)

// ErrNotMigrated is returned, wrapped, when the inbox table (or its schema)
// does not exist.
var ErrNotMigrated = errors.New("sqlstore: inbox table missing: run sqlschema.MigrateSQL with the same Dialect and Schema")

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
// [dedupdriver.KeyLister] and [dedup.Expirer]; lease mode is not offered. It is
// safe for concurrent use and starts no goroutines.
type Store struct {
	db  *sql.DB
	d   dialect
	ops ops
}

var (
	_ dedup.TxStore            = (*Store)(nil)
	_ dedup.Expirer            = (*Store)(nil)
	_ dedupdriver.Peeker       = (*Store)(nil)
	_ dedupdriver.RecordFinder = (*Store)(nil)
	_ dedupdriver.KeyLister    = (*Store)(nil)
	_ dedupdriver.Classifier   = (*inboxTx)(nil)
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
	names := sqlschema.NamesFor(cfg.Dialect.d.schema(), cfg.Schema.WithDefaults())
	return &Store{db: db, d: cfg.Dialect.d, ops: cfg.Dialect.d.ops(names)}, nil
}

// DB returns the database the store uses.
func (s *Store) DB() *sql.DB { return s.db }

type txKey struct{}

// Tx returns the transaction in which the inbox claimed the message's key;
// a handler writes its effect through it (or through GORM, sqlc or sqlx
// over it) so that the effect and the claim commit together. It returns
// nil when ctx carries none (the handler is not running under an inbox
// with this store).
func Tx(ctx context.Context) *sql.Tx {
	tx, _ := ctx.Value(txKey{}).(*sql.Tx)
	return tx
}

// InboxBegin starts the transaction that will hold the claim and the
// effect, on a connection of its own. Taking the connection and BEGIN are
// bounded by ctx; the transaction then lives until Commit or Rollback,
// whatever becomes of ctx: database/sql would roll back a transaction
// whose context ends, and the inbox lets a handler finish and commit
// while its consumer shuts down.
func (s *Store) InboxBegin(ctx context.Context) (dedup.InboxTx, error) {
	conn, err := s.db.Conn(ctx)
	if err != nil {
		return nil, s.interpret(ctx, "begin", err)
	}
	txCtx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	stop := context.AfterFunc(ctx, cancel)
	tx, err := conn.BeginTx(txCtx, nil)
	if !stop() {
		// ctx ended while BEGIN ran: database/sql rolls the transaction
		// back, if it began.
		err = errors.Join(err, ctx.Err())
	}
	if err != nil {
		cancel()
		if tx != nil {
			_ = tx.Rollback() // the outcome is err's
		}
		return nil, errors.Join(s.interpret(ctx, "begin", err), conn.Close())
	}
	return &inboxTx{s: s, conn: conn, tx: tx, cancel: cancel}, nil
}

// InboxStart counts an attempt of key, unless the key is done or dead,
// which it answers instead.
func (s *Store) InboxStart(ctx context.Context, key dedup.Key, window time.Duration) (dedup.Claim, error) {
	c, err := s.ops.start(ctx, s.db, key, window)
	if err != nil {
		return c, s.interpret(ctx, "start", err)
	}
	return c, nil
}

// InboxUnstart takes back one started attempt of key.
func (s *Store) InboxUnstart(ctx context.Context, key dedup.Key) error {
	if err := s.ops.unstart(ctx, s.db, key); err != nil {
		return s.interpret(ctx, "unstart", err)
	}
	return nil
}

// InboxFail records a failed attempt outside any transaction. A done or
// dead key is left alone. A zero f.At is taken as now.
func (s *Store) InboxFail(ctx context.Context, key dedup.Key, f dedup.Failure, window time.Duration) error {
	if err := s.ops.fail(ctx, s.db, key, failure(f), window); err != nil {
		return s.interpret(ctx, "record failure", err)
	}
	return nil
}

// InboxGrantReplay writes grant on key's record if the key is dead, so
// that the replay that carries it may reopen the key.
func (s *Store) InboxGrantReplay(ctx context.Context, key dedup.Key, grant string) (bool, error) {
	if grant == "" {
		return false, fmt.Errorf("sqlstore: grant replay of consumer %q key %q: %w", key.Consumer, key.Key, dedup.ErrNoGrant)
	}
	ok, err := s.ops.grant(ctx, s.db, key, grant)
	if err != nil {
		return false, s.interpret(ctx, "grant replay", err)
	}
	return ok, nil
}

// InboxReopen makes a dead key claimable again with its counts reset, only
// for the grant written on it.
func (s *Store) InboxReopen(ctx context.Context, key dedup.Key, grant string) (bool, error) {
	if grant == "" {
		return false, nil
	}
	ok, err := s.ops.reopen(ctx, s.db, key, grant)
	if err != nil {
		return false, s.interpret(ctx, "reopen", err)
	}
	return ok, nil
}

// InboxReplayGranted reports whether key's record holds grant.
func (s *Store) InboxReplayGranted(ctx context.Context, key dedup.Key, grant string) (bool, error) {
	if grant == "" {
		return false, nil
	}
	ok, err := s.ops.granted(ctx, s.db, key, grant)
	if err != nil {
		return false, s.interpret(ctx, "read replay grant", err)
	}
	return ok, nil
}

// InboxDeadCopy counts a copy of a dead key on its record.
func (s *Store) InboxDeadCopy(ctx context.Context, key dedup.Key) error {
	if err := s.ops.deadCopy(ctx, s.db, key); err != nil {
		return s.interpret(ctx, "count dead copy", err)
	}
	return nil
}

// InboxPeek reads key's committed record, claiming nothing: StateDone with
// the stored result, StateDead, StateInFlight while a live lease of
// dedup/postgres holds it, else StateNew.
func (s *Store) InboxPeek(ctx context.Context, key dedup.Key) (dedup.Claim, error) {
	c, err := s.ops.peek(ctx, s.db, key)
	if err != nil {
		return dedup.Claim{}, s.interpret(ctx, "peek", err)
	}
	return c, nil
}

// InboxHasRecord reports whether key has a record, in any state.
func (s *Store) InboxHasRecord(ctx context.Context, key dedup.Key) (bool, error) {
	ok, err := s.ops.hasRecord(ctx, s.db, key)
	if err != nil {
		return false, s.interpret(ctx, "read record", err)
	}
	return ok, nil
}

// InboxDoneKeys streams the keys consumer completed at or after since, one
// row at a time from the server. With MySQL a key longer than 1024 bytes
// is listed as the digest it is stored as (see the package doc).
func (s *Store) InboxDoneKeys(ctx context.Context, consumer string, since time.Time, fn func(key string) error) error {
	rows, err := s.ops.doneKeys(ctx, s.db, consumer, since)
	if err != nil {
		return s.interpret(ctx, "done keys", err)
	}
	defer rows.Close()
	var key string
	for rows.Next() {
		if err := rows.Scan(&key); err != nil {
			return s.interpret(ctx, "done keys", err)
		}
		if err := fn(key); err != nil {
			return err
		}
	}
	if err := rows.Err(); err != nil {
		return s.interpret(ctx, "done keys", err)
	}
	return nil
}

// InboxDeleteExpired deletes at most limit expired records, and at most
// limit expired start counts, skipping rows another transaction holds.
func (s *Store) InboxDeleteExpired(ctx context.Context, limit int) (int, error) {
	if limit <= 0 {
		return 0, fmt.Errorf("sqlstore: delete expired: limit must be positive, got %d", limit)
	}
	n, err := s.ops.deleteExpired(ctx, s.db, limit)
	if err != nil {
		return 0, s.interpret(ctx, "delete expired", err)
	}
	return n, nil
}

// interpret translates driver errors in one place: a missing table gets a
// hint for the fix, and the infrastructure's errors wrap the dedup
// sentinels (see [classify]). ctx is the context the failed call ran on.
func (s *Store) interpret(ctx context.Context, op string, err error) error {
	if s.d.undefinedTable(err) {
		return fmt.Errorf("sqlstore: %s: %w: %w: %w", op, dedup.ErrUnavailable, ErrNotMigrated, err)
	}
	if class := classify(s.d, err, ctx.Err() != nil); class != nil {
		return fmt.Errorf("sqlstore: %s: %w: %w", op, class, err)
	}
	return fmt.Errorf("sqlstore: %s: %w", op, err)
}

// failure is f as it is stored: an error text both databases take (valid
// UTF-8 without NUL, which PostgreSQL refuses in text), and a time.
func failure(f dedup.Failure) dedup.Failure {
	f.Err = strings.ReplaceAll(strings.ToValidUTF8(f.Err, "\uFFFD"), "\x00", "")
	if f.At.IsZero() {
		f.At = time.Now()
	}
	return f
}

// inboxTx is the claim's transaction, on a connection of its own that
// goes back to the pool when the transaction ends.
type inboxTx struct {
	s      *Store
	conn   *sql.Conn
	tx     *sql.Tx
	cancel context.CancelFunc
	ended  bool
}

func (t *inboxTx) InboxClaim(ctx context.Context, key dedup.Key, window time.Duration) (dedup.Claim, error) {
	c, err := t.s.ops.claim(ctx, t.tx, key, window)
	if err != nil {
		return dedup.Claim{}, t.s.interpret(ctx, "claim", err)
	}
	return c, nil
}

func (t *inboxTx) InboxBury(ctx context.Context, key dedup.Key, f dedup.Failure) error {
	if err := t.s.ops.bury(ctx, t.tx, key, failure(f)); err != nil {
		return t.s.interpret(ctx, "bury", err)
	}
	return nil
}

func (t *inboxTx) InboxComplete(ctx context.Context, key dedup.Key, result []byte) error {
	if result == nil {
		return nil
	}
	if err := t.s.ops.complete(ctx, t.tx, key, result); err != nil {
		return t.s.interpret(ctx, "complete", err)
	}
	return nil
}

func (t *inboxTx) WithTx(ctx context.Context) context.Context {
	return context.WithValue(ctx, txKey{}, t.tx)
}

// Commit commits. database/sql's Commit takes no context: the driver's
// own timeouts bound it (readTimeout for go-sql-driver/mysql). A commit
// whose connection failed after COMMIT may have been sent is ambiguous:
// the transaction may have committed. One whose connection was lost
// before did not commit.
func (t *inboxTx) Commit(ctx context.Context) error {
	if t.ended {
		return fmt.Errorf("sqlstore: commit: %w", sql.ErrTxDone)
	}
	lost := t.lost()
	err := t.tx.Commit()
	if endErr := t.end(); err == nil {
		// Committed: giving the connection back cannot undo that.
		return endErr
	}
	switch {
	case lost:
		return fmt.Errorf("sqlstore: commit: %w: the transaction's connection was lost before the commit: %w", dedup.ErrUnavailable, err)
	case maybeSent(t.s.d, err):
		return fmt.Errorf("sqlstore: commit: %w: %w", dedup.ErrAmbiguous, err)
	}
	return t.s.interpret(ctx, "commit", err)
}

// Rollback rolls back; after Commit or Rollback it does nothing.
func (t *inboxTx) Rollback(context.Context) error {
	if t.ended {
		return nil
	}
	if t.lost() {
		// The transaction ended with its session.
		_ = t.tx.Rollback() // frees database/sql's side; the driver can only fail
		return t.end()
	}
	err := t.tx.Rollback()
	if errors.Is(err, sql.ErrTxDone) {
		err = nil
	}
	if err = errors.Join(err, t.end()); err != nil {
		return fmt.Errorf("sqlstore: rollback: %w", err)
	}
	return nil
}

// end gives the connection back once the transaction has ended.
func (t *inboxTx) end() error {
	t.ended = true
	t.cancel()
	if err := t.conn.Close(); err != nil && !errors.Is(err, sql.ErrConnDone) {
		return err
	}
	return nil
}

// lost asks the transaction's connection, through the driver, whether it
// is closed or broken.
func (t *inboxTx) lost() bool {
	closed := false
	err := t.conn.Raw(func(dc any) error {
		closed = t.s.d.closed(dc)
		return nil
	})
	return err != nil || closed
}

// InboxClassify marks, among the errors the handler returned after
// writing through this transaction, those of the transaction itself. It
// asks the connection, not the error, whether it was lost (the driver
// closed it after a network error, a KILL, a server shutdown):
// unavailability. It reads only the server's own answer (the driver's
// error type and number, see the dialect) for a conflict (serialization
// failure, deadlock, lock wait timeout: a transaction to run again) or a
// session the server ended. An io.EOF or a net.Error from the handler's
// own decoding or HTTP calls is the message's.
func (t *inboxTx) InboxClassify(err error) error {
	switch {
	case err == nil:
		return nil
	case t.lost() || t.s.d.sessionEnded(err):
		if errors.Is(err, dedup.ErrUnavailable) {
			return err
		}
		return fmt.Errorf("%w: the transaction's connection was lost: %w", dedup.ErrUnavailable, err)
	case t.s.d.conflict(err) && !errors.Is(err, dedup.ErrConflict):
		return fmt.Errorf("%w: %w", dedup.ErrConflict, err)
	}
	return err
}
