package dlq

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/oncemill/oncemill/internal/sqldb"
	"github.com/oncemill/oncemill/sqlschema"
)

// table is the dead-letter table on one database, with the inbox table
// beside it, and the statements on them: written once, with '?' and the
// dialect's builders, and put in the dialect's placeholders once here.
//
// Times go to and come from the database as microseconds since the epoch
// (Dialect.Micros, Dialect.FromMicros), whatever the columns hold.
// Transactions that lock entries are READ COMMITTED, which on MySQL takes
// no gap locks: a replay in flight holds its entry only, and never keeps a
// dead letter from being written.
type table struct {
	db    sqldb.DB
	d     *sqldb.Dialect
	names sqlschema.Names
	// cols are an Entry's columns, in scan order.
	cols string
	q    struct {
		insert, get, lockOne, nextReplay, removeOne, removeIDs, request, counts string
		twin, adopt, clear, grant, hasRecord, copies                            string
		beatUpdate, beatInsert, replayer, replayers, pending                    string
		reopen, reopenFailure, forgetStarts                                     string
	}
}

// readCommitted is the transactions' level: see table.
var readCommitted = sqldb.TxOptions{Isolation: sqldb.ReadCommitted}

// openPool is the table that cfg names through a pgx pool.
func openPool(pool *pgxpool.Pool, cfg sqlschema.Config) (*table, error) {
	if pool == nil {
		return nil, errors.New("dlq: pool is nil")
	}
	return newTable(sqldb.Pgx(pool), cfg)
}

// openSQL is the table that cfg names on db, a database/sql database of
// dialect d.
func openSQL(db *sql.DB, d sqlschema.Dialect, cfg sqlschema.Config) (*table, error) {
	if db == nil {
		return nil, errors.New("dlq: db is nil")
	}
	dialect, err := sqldb.For(d)
	if err != nil {
		return nil, fmt.Errorf("dlq: %w", err)
	}
	return newTable(sqldb.SQL(db, dialect), cfg)
}

func newTable(db sqldb.DB, cfg sqlschema.Config) (*table, error) {
	cfg = cfg.WithDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("dlq: %w", err)
	}
	d := db.Dialect()
	t := &table{db: db, d: d, names: d.Names(cfg)}
	dlq, inbox, key, errc := t.names.DLQ, t.names.Inbox, d.Quote("key"), d.Quote("error")
	t.cols = "id, uuid, topic, dlq_topic, consumer, " + key + ", attempts, " + errc + ", permanent, " +
		d.Micros("first_failed_at") + ", " + d.Micros("last_failed_at") + ", kafka_partition, kafka_offset, payload, metadata, " + d.Micros("dead_at")
	q := &t.q
	// One entry per message and consumer: a copy dead-lettered again (its
	// ack was lost to a crash or a rebalance) is not written twice, unless
	// the first is on its way back (replay requested). The table's unique
	// index once_idx decides, so that concurrent writers cannot both
	// insert: the later waits for the earlier's commit and then writes
	// nothing. A message is its consumer, topic, uuid and key (migration
	// message_identity): two messages of one UUID are two entries. The
	// conflict names no target, so that the insert works against the
	// index of (consumer, topic, uuid) of a schema not yet migrated too.
	q.insert = `INSERT INTO ` + dlq + ` (uuid, topic, dlq_topic, consumer, ` + key + `, attempts, ` + errc + `, permanent,
	first_failed_at, last_failed_at, kafka_partition, kafka_offset, payload, metadata, dead_at)
VALUES (?, ?, ?, ?, ?, ?, ?, ?, ` + d.FromMicros("?") + `, ` + d.FromMicros("?") + `, ?, ?, ?, ` + d.JSON("?") + `, ` + d.Now() + `)` +
		d.InsertOnce("", "id")
	q.get = `SELECT ` + t.cols + ` FROM ` + dlq + ` WHERE id = ?`
	q.lockOne = q.get + d.LockRow(true)
	q.nextReplay = `SELECT ` + t.cols + ` FROM ` + dlq + `
WHERE consumer = ? AND topic = ? AND replay_requested_at IS NOT NULL
ORDER BY id LIMIT 1` + d.LockRow(true)
	q.removeOne = `DELETE FROM ` + dlq + ` WHERE id = ?`
	q.removeIDs = d.ByIDs(dlq, "", "")
	q.request = d.ByIDs(dlq, "replay_requested_at = "+d.Now(), "replay_requested_at IS NULL")
	q.counts = `SELECT consumer, topic, COUNT(*), ` + d.Micros("MIN(dead_at)") + ` FROM ` + dlq + `
GROUP BY consumer, topic ORDER BY consumer, topic`
	q.twin = `SELECT b.id FROM ` + dlq + ` AS a JOIN ` + dlq + ` AS b ON ` + twinOf(d) + ` WHERE a.id = ?` + d.LockRow(false)
	q.adopt = d.UpdateFrom(dlq, adoptNewer(d), "a.id = ? AND b.id = ?")
	q.clear = `UPDATE ` + dlq + ` SET replay_requested_at = NULL WHERE id = ?`
	// A key's failure state (attempts, the dead mark's details, the
	// replay grant, dead copies) is on its row of the inbox's failure
	// table; the inbox table's row says whether it is dead.
	failures := t.names.InboxFailures
	q.grant = `UPDATE ` + failures + ` SET replay_grant = ?, updated_at = ` + d.Now() + `
WHERE (consumer, ` + key + `) IN (SELECT consumer, ` + key + ` FROM ` + inbox + ` WHERE consumer = ? AND ` + key + ` = ? AND status = 'dead')`
	q.hasRecord = `SELECT COUNT(*) FROM ` + inbox + ` WHERE consumer = ? AND ` + key + ` = ?`
	q.copies = `SELECT COALESCE(f.dead_copies, 0) FROM ` + inbox + ` i LEFT JOIN ` + failures + ` f ON f.consumer = i.consumer AND f.` + key + ` = i.` + key + `
WHERE i.consumer = ? AND i.` + key + ` = ? AND i.status = 'dead'`
	// Reopen for the next copy, whatever its payload: the dead key is made
	// a failed one with no attempts, as the inbox stores reopen it for a
	// granted replay, and its started attempts are forgotten, or the copy
	// would be taken for a crash loop.
	q.reopen = `UPDATE ` + inbox + ` SET status = 'failed', lease_until = NULL WHERE consumer = ? AND ` + key + ` = ? AND status = 'dead'`
	q.reopenFailure = `UPDATE ` + failures + ` SET attempts = 0, dead_at = NULL, replay_grant = NULL, updated_at = ` + d.Now() + `
WHERE consumer = ? AND ` + key + ` = ?`
	q.forgetStarts = `DELETE FROM ` + t.names.InboxStarts + ` WHERE consumer = ? AND ` + key + ` = ?`
	t.replayerQueries(d)
	for _, s := range []*string{&q.insert, &q.get, &q.lockOne, &q.nextReplay, &q.removeOne, &q.removeIDs, &q.request,
		&q.counts, &q.twin, &q.adopt, &q.clear, &q.grant, &q.hasRecord, &q.copies,
		&q.beatUpdate, &q.beatInsert, &q.replayer, &q.replayers, &q.pending, &q.reopen, &q.reopenFailure, &q.forgetStarts} {
		*s = d.Rebind(*s)
	}
	return t, nil
}

// scanEntry reads a row of t.cols.
func scanEntry(row sqldb.Row) (Entry, error) {
	var (
		e  Entry
		md []byte
	)
	if err := row.Scan(&e.ID, &e.UUID, &e.Topic, &e.DLQTopic, &e.Consumer, &e.Key, &e.Attempts, &e.Error,
		&e.Permanent, sqldb.Time(&e.FirstFailedAt), sqldb.Time(&e.LastFailedAt), &e.Partition, &e.Offset, &e.Payload, &md,
		sqldb.Time(&e.DeadAt)); err != nil {
		return Entry{}, err
	}
	if e.Payload == nil {
		e.Payload = []byte{}
	}
	if err := json.Unmarshal(md, &e.Metadata); err != nil {
		return Entry{}, fmt.Errorf("entry %d: metadata: %w", e.ID, err)
	}
	if e.Metadata == nil {
		e.Metadata = map[string]string{}
	}
	return e, nil
}

// idsJSON is ids as the JSON array that Dialect.JSONInts and ByIDs take.
func idsJSON(ids []int64) string {
	b, _ := json.Marshal(ids) // integers always encode
	return string(b)
}

// exec runs q in a READ COMMITTED transaction of its own and returns the
// rows it affected: on MySQL an UPDATE or DELETE that way neither waits on
// nor blocks what it does not change.
func (t *table) exec(ctx context.Context, q string, args ...any) (n int64, err error) {
	err = sqldb.InTx(ctx, t.db, readCommitted, func(tx sqldb.Tx) error {
		n, err = tx.Exec(ctx, q, args...)
		return err
	})
	return n, err
}

// held is an entry taken for a replay. Where the database locks rows
// (Dialect.SkipLocked) its row stays locked, in tx, until the replay ends,
// and replays running at once skip it. A database with one writer
// (SQLite) locks no rows, and its write lock must not be held while a
// broker or a handler takes the message: nothing is held, tx is nil, and
// replays running at once may both hand the entry out, under its UUID,
// which the consumer's inbox absorbs.
type held struct {
	Entry
	t  *table
	tx sqldb.Tx
}

// take reads the entry that q (ending with Dialect.LockRow) selects; nil
// when there is none, or another transaction holds it.
func (t *table) take(ctx context.Context, q string, args ...any) (*held, error) {
	h := &held{t: t}
	var ex sqldb.Executor = t.db
	if t.d.SkipLocked {
		tx, err := t.db.Begin(ctx, readCommitted)
		if err != nil {
			return nil, fmt.Errorf("begin: %w", err)
		}
		h.tx, ex = tx, tx
	}
	e, err := scanEntry(ex.QueryRow(ctx, q, args...))
	if err != nil {
		rbErr := h.release(context.WithoutCancel(ctx))
		if errors.Is(err, sqldb.ErrNoRows) {
			return nil, rbErr
		}
		return nil, errors.Join(err, rbErr)
	}
	h.Entry = e
	return h, nil
}

// done runs f in the entry's transaction, or where it holds none in a
// transaction of its own, and commits.
func (h *held) done(ctx context.Context, f func(sqldb.Executor) error) error {
	if h.tx == nil {
		return sqldb.InTx(ctx, h.t.db, readCommitted, func(tx sqldb.Tx) error { return f(tx) })
	}
	if err := f(h.tx); err != nil {
		return err
	}
	return h.tx.Commit(ctx)
}

// release ends the entry's transaction, if it is still open: the entry
// stays, unlocked.
func (h *held) release(ctx context.Context) error {
	if h.tx == nil {
		return nil
	}
	return h.tx.Rollback(ctx)
}

// wrap prefixes a database error with the operation, and marks a missing
// table with ErrNotMigrated.
func (t *table) wrap(op string, err error) error {
	if t.d.UndefinedTable(err) {
		return fmt.Errorf("dlq: %s: %w: %w", op, ErrNotMigrated, err)
	}
	return fmt.Errorf("dlq: %s: %w", op, err)
}
