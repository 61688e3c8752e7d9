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
	sqlitedriver "modernc.org/sqlite"
	sqlite3 "modernc.org/sqlite/lib"

	"github.com/oncemill/oncemill/dedup"
	"github.com/oncemill/oncemill/dedup/dedupdriver"
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

// Store keeps inbox records in a SQLite table created by
// [sqlschema.MigrateSQLite]. It implements [dedup.TxStore] and
// [dedup.Expirer], and is safe for concurrent use. It starts no goroutines.
type Store struct {
	db    *sql.DB
	owned bool // db was opened by Open and is closed by Close
	q     queries
}

var (
	_ dedup.TxStore            = (*Store)(nil)
	_ dedup.Expirer            = (*Store)(nil)
	_ dedupdriver.Peeker       = (*Store)(nil)
	_ dedupdriver.RecordFinder = (*Store)(nil)
	_ dedupdriver.Classifier   = (*inboxTx)(nil)
	_ dedupdriver.KeyLister    = (*Store)(nil)
)

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
	return &Store{db: db, owned: true, q: newQueries(cfg)}, nil
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
	return &Store{db: db, q: newQueries(cfg)}, nil
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

type txKey struct{}

// Tx returns the transaction in which the inbox claimed the message's key;
// a handler writes its effect through it so that the effect and the claim
// commit together. It returns nil when ctx carries none (the handler is not
// running under an inbox with this store).
func Tx(ctx context.Context) *sql.Tx {
	tx, _ := ctx.Value(txKey{}).(*sql.Tx)
	return tx
}

// InboxBegin starts the transaction that will hold the claim and the effect.
// It ends, rolled back, if ctx is done before Commit: the inbox begins it on
// a context that outlives the message's cancellation for its drain.
func (s *Store) InboxBegin(ctx context.Context) (dedup.InboxTx, error) {
	tx, err := s.db.BeginTx(ctx, nil)
	if err != nil {
		return nil, interpret("begin", err)
	}
	return &inboxTx{tx: tx, q: &s.q}, nil
}

// InboxStart counts an attempt of key in the starts table, in a statement
// that commits at once, unless the key is done or dead.
func (s *Store) InboxStart(ctx context.Context, key dedup.Key, window time.Duration) (dedup.Claim, error) {
	var (
		status      string
		c           dedup.Claim
		firstFailed sql.NullInt64
	)
	err := s.db.QueryRowContext(ctx, s.q.startRead, key.Consumer, key.Key).Scan(&status, &c.Attempts, &c.Result, &firstFailed)
	switch {
	case err == nil:
		if firstFailed.Valid {
			c.FirstFailedAt = time.UnixMicro(firstFailed.Int64)
		}
		c.State = dedup.StateDone
		if status == "dead" {
			c.State, c.Result = dedup.StateDead, nil
		}
		return c, nil
	case !errors.Is(err, sql.ErrNoRows):
		return dedup.Claim{}, interpret("start", err)
	}
	if err := s.db.QueryRowContext(ctx, s.q.start, key.Consumer, key.Key, micros(time.Now().Add(window))).Scan(&c.Attempts); err != nil {
		return dedup.Claim{}, interpret("start", err)
	}
	c.State = dedup.StateNew
	return c, nil
}

// InboxUnstart takes back one started attempt of key.
func (s *Store) InboxUnstart(ctx context.Context, key dedup.Key) error {
	if _, err := s.db.ExecContext(ctx, s.q.unstart, key.Consumer, key.Key); err != nil {
		return interpret("unstart", err)
	}
	return nil
}

// InboxGrantReplay writes grant on key's row if the key is dead, so that
// the replay that carries it may reopen the key.
func (s *Store) InboxGrantReplay(ctx context.Context, key dedup.Key, grant string) (bool, error) {
	if grant == "" {
		return false, fmt.Errorf("sqlite: grant replay of consumer %q key %q: %w", key.Consumer, key.Key, dedup.ErrNoGrant)
	}
	res, err := s.db.ExecContext(ctx, s.q.grant, grant, micros(time.Now()), key.Consumer, key.Key)
	if err != nil {
		return false, interpret("grant replay", err)
	}
	n, err := res.RowsAffected()
	if err != nil {
		return false, fmt.Errorf("sqlite: grant replay: rows affected: %w", err)
	}
	return n == 1, nil
}

// InboxReopen makes a dead key claimable again with its counts reset, only
// for the grant written on it.
func (s *Store) InboxReopen(ctx context.Context, key dedup.Key, grant string) (bool, error) {
	if grant == "" {
		return false, nil
	}
	res, err := s.db.ExecContext(ctx, s.q.reopen, micros(time.Now()), key.Consumer, key.Key, grant)
	if err != nil {
		return false, interpret("reopen", err)
	}
	n, err := res.RowsAffected()
	if err != nil {
		return false, fmt.Errorf("sqlite: reopen: rows affected: %w", err)
	}
	if n != 1 {
		return false, nil
	}
	if _, err := s.db.ExecContext(ctx, s.q.clearStart, key.Consumer, key.Key); err != nil {
		return false, interpret("reopen", err)
	}
	return true, nil
}

// InboxReplayGranted reports whether key's row holds grant.
func (s *Store) InboxReplayGranted(ctx context.Context, key dedup.Key, grant string) (bool, error) {
	if grant == "" {
		return false, nil
	}
	var ok bool
	if err := s.db.QueryRowContext(ctx, s.q.granted, key.Consumer, key.Key, grant).Scan(&ok); err != nil {
		return false, interpret("read replay grant", err)
	}
	return ok, nil
}

// InboxDeadCopy counts a copy of a dead key on its record.
func (s *Store) InboxDeadCopy(ctx context.Context, key dedup.Key) error {
	if _, err := s.db.ExecContext(ctx, s.q.deadCopy, key.Consumer, key.Key); err != nil {
		return interpret("count dead copy", err)
	}
	return nil
}

// InboxFail records a failed attempt outside any transaction. A done or
// dead key is left alone. A zero f.At is taken as now.
func (s *Store) InboxFail(ctx context.Context, key dedup.Key, f dedup.Failure, window time.Duration) error {
	now := time.Now()
	at := f.At
	if at.IsZero() {
		at = now
	}
	_, err := s.db.ExecContext(ctx, s.q.fail,
		key.Consumer, key.Key, f.Err, f.Err, micros(at), micros(at),
		micros(now), micros(now), micros(now.Add(window)))
	if err != nil {
		return interpret("record failure", err)
	}
	return nil
}

// InboxDeleteExpired deletes at most limit expired records in one statement.
func (s *Store) InboxDeleteExpired(ctx context.Context, limit int) (int, error) {
	if limit <= 0 {
		return 0, fmt.Errorf("sqlite: delete expired: limit must be positive, got %d", limit)
	}
	now := micros(time.Now())
	if _, err := s.db.ExecContext(ctx, s.q.deleteExpiredStarts, now, limit); err != nil {
		return 0, interpret("delete expired starts", err)
	}
	res, err := s.db.ExecContext(ctx, s.q.deleteExpired, now, limit)
	if err != nil {
		return 0, interpret("delete expired", err)
	}
	n, err := res.RowsAffected()
	if err != nil {
		return 0, fmt.Errorf("sqlite: delete expired: rows affected: %w", err)
	}
	return int(n), nil
}

type inboxTx struct {
	tx *sql.Tx
	q  *queries
}

func (t *inboxTx) InboxClaim(ctx context.Context, key dedup.Key, window time.Duration) (dedup.Claim, error) {
	now := time.Now()
	var (
		attempts    int
		firstFailed sql.NullInt64
	)
	err := t.tx.QueryRowContext(ctx, t.q.claim,
		key.Consumer, key.Key, micros(now), micros(now), micros(now), micros(now.Add(window))).
		Scan(&attempts, &firstFailed)
	if err == nil {
		// The start count commits (is deleted) with the effect.
		if _, err := t.tx.ExecContext(ctx, t.q.clearStart, key.Consumer, key.Key); err != nil {
			return dedup.Claim{}, interpret("claim", err)
		}
		c := dedup.Claim{State: dedup.StateNew, Attempts: attempts}
		if firstFailed.Valid {
			c.FirstFailedAt = time.UnixMicro(firstFailed.Int64)
		}
		return c, nil
	}
	if !errors.Is(err, sql.ErrNoRows) {
		return dedup.Claim{}, interpret("claim", err)
	}
	// The upsert changed nothing: the key is done. This transaction has
	// held the write lock since the upsert, so the row cannot have changed.
	var (
		status string
		result []byte
	)
	if err := t.tx.QueryRowContext(ctx, t.q.read, key.Consumer, key.Key).Scan(&status, &attempts, &result); err != nil {
		return dedup.Claim{}, interpret("claim", err)
	}
	if status == "dead" {
		return dedup.Claim{State: dedup.StateDead, Attempts: attempts}, nil
	}
	if status != "done" {
		return dedup.Claim{}, fmt.Errorf("sqlite: claim: key %q of consumer %q is %q after the claim changed nothing", key.Key, key.Consumer, status)
	}
	return dedup.Claim{State: dedup.StateDone, Attempts: attempts, Result: result}, nil
}

func (t *inboxTx) InboxBury(ctx context.Context, key dedup.Key, f dedup.Failure) error {
	now := time.Now()
	at := f.At
	if at.IsZero() {
		at = now
	}
	if _, err := t.tx.ExecContext(ctx, t.q.bury, f.Err, micros(at), micros(now), key.Consumer, key.Key); err != nil {
		return interpret("bury", err)
	}
	return nil
}

func (t *inboxTx) InboxComplete(ctx context.Context, key dedup.Key, result []byte) error {
	if result == nil {
		return nil
	}
	if _, err := t.tx.ExecContext(ctx, t.q.complete, result, key.Consumer, key.Key); err != nil {
		return interpret("complete", err)
	}
	return nil
}

func (t *inboxTx) WithTx(ctx context.Context) context.Context {
	return context.WithValue(ctx, txKey{}, t.tx)
}

func (t *inboxTx) Commit(context.Context) error {
	if err := t.tx.Commit(); err != nil {
		return interpret("commit", err)
	}
	return nil
}

func (t *inboxTx) Rollback(context.Context) error {
	if err := t.tx.Rollback(); err != nil && !errors.Is(err, sql.ErrTxDone) {
		return fmt.Errorf("sqlite: rollback: %w", err)
	}
	return nil
}

// queries holds the store's SQL, rendered once for the configured table.
// Every statement is parameterised; only the validated table name is
// spliced in.
type queries struct {
	claim, read, complete, fail, deleteExpired string
	peek, doneKeys, hasRecord                  string

	start, startRead, unstart, clearStart, deleteExpiredStarts string
	bury, reopen, deadCopy                                     string
	grant, granted                                             string
}

func newQueries(cfg Config) queries {
	names := sqlschema.NamesFor(sqlschema.SQLite, cfg.schema())
	r := strings.NewReplacer("{T}", names.Inbox, "{S}", names.InboxStarts)
	return queries{
		// Arguments: consumer, key, expires_at. Run after startRead found
		// the key neither done nor dead.
		start: r.Replace(`INSERT INTO {S} (consumer, key, started, expires_at) VALUES (?, ?, 1, ?)
ON CONFLICT (consumer, key) DO UPDATE SET started = started + 1, expires_at = excluded.expires_at
RETURNING started`),

		// Arguments: consumer, key.
		startRead: r.Replace(`SELECT status, attempts, result, first_failed_at FROM {T}
WHERE consumer = ? AND key = ? AND status IN ('done', 'dead')`),

		// Arguments: consumer, key.
		unstart: r.Replace(`UPDATE {S} SET started = started - 1 WHERE consumer = ? AND key = ? AND started > 0`),

		// Arguments: consumer, key.
		clearStart: r.Replace(`DELETE FROM {S} WHERE consumer = ? AND key = ?`),

		// Arguments: now, limit.
		deleteExpiredStarts: r.Replace(`DELETE FROM {S} WHERE rowid IN (
	SELECT rowid FROM {S} WHERE expires_at < ? LIMIT ?)`),

		// Arguments: error, failed_at, now, consumer, key.
		// The claim that took the key for burying counted itself as an
		// attempt; the bury takes that back.
		// It clears the key's replay grant: a grant reopens a key once.
		bury: r.Replace(`UPDATE {T} SET status = 'dead', dead_at = ?3, result = NULL, done_at = NULL,
	attempts = MAX(attempts - 1, 0), replay_grant = NULL,
	first_error = COALESCE(first_error, ?1), first_failed_at = COALESCE(first_failed_at, ?2),
	last_error = ?1, last_failed_at = ?2, updated_at = ?3
WHERE consumer = ?4 AND key = ?5`),

		// Arguments: now, consumer, key, grant.
		reopen: r.Replace(`UPDATE {T} SET status = 'failed', attempts = 0, dead_at = NULL, lease_until = NULL, updated_at = ?
WHERE consumer = ? AND key = ? AND status = 'dead' AND replay_grant = ?`),

		// Arguments: grant, now, consumer, key.
		grant: r.Replace(`UPDATE {T} SET replay_grant = ?, updated_at = ? WHERE consumer = ? AND key = ? AND status = 'dead'`),

		// Arguments: consumer, key, grant.
		granted: r.Replace(`SELECT EXISTS (SELECT 1 FROM {T} WHERE consumer = ? AND key = ? AND replay_grant = ?)`),

		// Arguments: consumer, key.
		deadCopy: r.Replace(`UPDATE {T} SET dead_copies = dead_copies + 1 WHERE consumer = ? AND key = ? AND status = 'dead'`),

		// The claim writes the row as 'done' at once: it only becomes
		// visible when the transaction commits, together with the effect.
		// No row returned means the key was done already.
		// Arguments: consumer, key, created_at, updated_at, done_at,
		// expires_at.
		claim: r.Replace(`INSERT INTO {T} (consumer, key, status, attempts, created_at, updated_at, done_at, expires_at)
VALUES (?, ?, 'done', 1, ?, ?, ?, ?)
ON CONFLICT (consumer, key) DO UPDATE
SET status = 'done', attempts = attempts + 1, lease_until = NULL,
    updated_at = excluded.updated_at, done_at = excluded.done_at, expires_at = excluded.expires_at
WHERE status NOT IN ('done', 'dead')
RETURNING attempts, first_failed_at`),

		// Arguments: consumer, key, now.
		peek: r.Replace(`SELECT status, attempts, result, first_failed_at FROM {T}
WHERE consumer = ? AND key = ? AND expires_at > ?`),

		// Arguments: consumer, key. Any row, expired or not: a claim
		// reads the row until cleanup deletes it.
		hasRecord: r.Replace(`SELECT EXISTS (SELECT 1 FROM {T} WHERE consumer = ? AND key = ?)`),

		// Arguments: consumer, since, now.
		doneKeys: r.Replace(`SELECT key FROM {T}
WHERE consumer = ? AND status = 'done' AND done_at >= ? AND expires_at > ?`),

		// Arguments: consumer, key.
		read: r.Replace(`SELECT status, attempts, result FROM {T} WHERE consumer = ? AND key = ?`),

		// Arguments: result, consumer, key.
		complete: r.Replace(`UPDATE {T} SET result = ? WHERE consumer = ? AND key = ?`),

		// Arguments: consumer, key, first_error, last_error,
		// first_failed_at, last_failed_at, created_at, updated_at,
		// expires_at.
		fail: r.Replace(`INSERT INTO {T} (consumer, key, status, attempts,
	first_error, last_error, first_failed_at, last_failed_at, created_at, updated_at, expires_at)
VALUES (?, ?, 'failed', 1, ?, ?, ?, ?, ?, ?, ?)
ON CONFLICT (consumer, key) DO UPDATE
SET status = 'failed', attempts = attempts + 1, lease_until = NULL,
    first_error = COALESCE(first_error, excluded.first_error),
    first_failed_at = COALESCE(first_failed_at, excluded.first_failed_at),
    last_error = excluded.last_error, last_failed_at = excluded.last_failed_at,
    updated_at = excluded.updated_at, expires_at = excluded.expires_at
WHERE status NOT IN ('done', 'dead')`),

		// Arguments: now, limit.
		deleteExpired: r.Replace(`DELETE FROM {T} WHERE rowid IN (
	SELECT rowid FROM {T} WHERE expires_at < ? LIMIT ?)`),
	}
}

// micros is the stored form of a time: microseconds since the Unix epoch.
func micros(t time.Time) int64 { return t.UnixMicro() }

// interpret wraps driver errors in one place; a busy or locked database
// wraps dedup.ErrConflict (see [classify]).
func interpret(op string, err error) error {
	if unusable(err) {
		return fmt.Errorf("sqlite: %s: %w: %w", op, dedup.ErrUnavailable, err)
	}
	if class := classify(err); class != nil {
		return fmt.Errorf("sqlite: %s: %w: %w", op, class, err)
	}
	return fmt.Errorf("sqlite: %s: %w", op, err)
}

// unusable reports whether err, SQLite's answer to one of the store's own
// statements, says that the store cannot use its table: it is missing
// (dropped after New, whose check it passed; SQLite reports it with the
// generic SQLITE_ERROR, so its text is read), or the database cannot be
// written (SQLITE_READONLY: a read-only file or connection). That is the
// operator's to put right, never the message's: the inbox nacks without
// counting. It is never asked of the handler's own statements.
func unusable(err error) bool {
	var e *sqlitedriver.Error
	if !errors.As(err, &e) {
		return false
	}
	switch e.Code() & 0xff {
	case sqlite3.SQLITE_READONLY, sqlite3.SQLITE_PERM, sqlite3.SQLITE_AUTH, sqlite3.SQLITE_CANTOPEN:
		return true
	case sqlite3.SQLITE_ERROR:
		return strings.Contains(e.Error(), "no such table")
	}
	return false
}

// classify returns dedup.ErrConflict when the database was busy or locked
// by another writer past the busy timeout (SQLITE_BUSY, SQLITE_LOCKED and
// their extended codes): the transaction can run again, and it says nothing
// about the message. I/O errors, a full disk and the like are not retried
// here: they are not the message's fault either, but they do not pass by
// themselves, and counting them ends in the dead-letter queue rather than a
// consumer spinning on a broken disk.
func classify(err error) error {
	var e *sqlitedriver.Error
	if errors.As(err, &e) {
		switch e.Code() & 0xff { // the primary result code
		case sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED:
			return dedup.ErrConflict
		}
	}
	return nil
}

// InboxClassify marks a busy or locked database, SQLite's own answer,
// among the errors the handler returned after writing through this
// transaction: a conflict to run again. An embedded database has no
// connection to lose; any other error is the message's.
func (t *inboxTx) InboxClassify(err error) error {
	if class := classify(err); class != nil && !errors.Is(err, class) {
		return fmt.Errorf("%w: %w", class, err)
	}
	return err
}
