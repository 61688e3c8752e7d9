package dlq

import (
	"context"
	"crypto/sha256"
	"database/sql"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/go-sql-driver/mysql"

	"github.com/oncemill/oncemill/dedup"
	"github.com/oncemill/oncemill/dedup/dedupdriver"
	"github.com/oncemill/oncemill/dedup/sqlstore"
	"github.com/oncemill/oncemill/sqlschema"
)

// The dead-letter table on MySQL 8.0+ and MariaDB 10.6+ through
// database/sql (go-sql-driver/mysql), the InnoDB table of
// sqlschema/mysql/003_dlq.up.sql: every statement of that dialect is in
// this file.
//
// Times go to and come from the server as microseconds since the epoch
// ({AT} and {US}), so neither the session's time zone nor the DSN's
// parseTime and loc matter; the columns hold UTC. Transactions that lock
// entries are READ COMMITTED, which takes no gap locks: a replay in flight
// holds its entry only, and never keeps a dead letter from being written.
// A statement that deletes entries by id reaches each through the primary
// key (a JSON_TABLE of the ids joined to it): a DELETE that scans waits on
// every entry it passes that a replay holds, and the optimizer scans a
// small table rather than use the key for an IN list.

// NewSQLStore returns a store on the dead-letter table that cfg names
// (cfg.Schema, the MySQL database, and cfg.DLQTable, as given to
// sqlschema.MigrateSQL), on db, a database of dialect d: sqlschema.MySQL
// (MySQL 8.0+ or MariaDB 10.6+ through go-sql-driver/mysql; a PostgreSQL
// table is read through [NewStore]). It is the [Store] of NewStore
// otherwise; its replays grant on the inbox table beside the dead-letter
// table (dedup/sqlstore's, the same cfg) unless [Store.WithGranter] says
// otherwise. It does not create the table. The db stays the caller's.
func NewSQLStore(db *sql.DB, d sqlschema.Dialect, cfg sqlschema.Config) (*Store, error) {
	m, err := newMySQLDLQ(db, d, cfg)
	if err != nil {
		return nil, err
	}
	grants, err := m.granter()
	if err != nil {
		return nil, err
	}
	return &Store{table: m.names.DLQ, inbox: m.names.Inbox, grants: grants, my: m}, nil
}

// NewSQLPublisher returns a publisher into the dead-letter table that cfg
// names on db, a database of dialect d (sqlschema.MySQL), as
// [NewSQLStore] does. It is the [Publisher] of [NewPublisher] otherwise:
// one entry per message, consumer and original topic, and, when the first
// message's context carries an inbox transaction (sqlstore.Tx) on the
// same server, written in it. It does not create the table; Close does not
// close db.
func NewSQLPublisher(db *sql.DB, d sqlschema.Dialect, cfg sqlschema.Config) (*Publisher, error) {
	m, err := newMySQLDLQ(db, d, cfg)
	if err != nil {
		return nil, err
	}
	return &Publisher{my: &mysqlPublisher{m: m}}, nil
}

// NewSQLReplaySubscriber returns a [ReplaySubscriber] on the dead-letter
// table that schema names on db, a database of dialect d
// (sqlschema.MySQL), as [NewReplaySubscriber] does for a pgx pool; cfg is
// copied, defaulted and validated. Its Granter defaults to the inbox table
// beside the dead-letter table.
func NewSQLReplaySubscriber(db *sql.DB, d sqlschema.Dialect, schema sqlschema.Config, cfg ReplaySubscriberConfig) (*ReplaySubscriber, error) {
	m, err := newMySQLDLQ(db, d, schema)
	if err != nil {
		return nil, err
	}
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if cfg.Granter == nil {
		if cfg.Granter, err = m.granter(); err != nil {
			return nil, err
		}
	}
	return &ReplaySubscriber{table: m.names.DLQ, cfg: cfg, my: m, closing: make(chan struct{})}, nil
}

// mysqlDLQ is the dead-letter table on MySQL, and the statements on it.
type mysqlDLQ struct {
	db    *sql.DB
	cfg   sqlschema.Config
	names sqlschema.Names
	q     mysqlDLQSQL
}

type mysqlDLQSQL struct {
	// columns are an Entry's, in scan order.
	columns string
	insert  string
	// remove deletes the entries of a JSON array of ids.
	remove string
	// removeOne deletes one entry by id.
	removeOne string
	// lockOne locks one entry by id, skipping it when another
	// transaction holds it.
	lockOne string
	// nextReplay locks the first requested entry of a consumer and topic.
	nextReplay string
	// withdraw takes an entry's replay request back (withdrawRequest).
	withdraw withdrawSQL
	// copies reads a dead key's copies on the inbox table.
	copies string
}

func newMySQLDLQ(db *sql.DB, d sqlschema.Dialect, cfg sqlschema.Config) (*mysqlDLQ, error) {
	if db == nil {
		return nil, errors.New("dlq: db is nil")
	}
	if d != sqlschema.MySQL {
		return nil, fmt.Errorf("dlq: dialect must be sqlschema.MySQL, got %q (a PostgreSQL dead-letter table is read through a pgx pool: NewStore, NewPublisher)", d)
	}
	cfg = cfg.WithDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("dlq: %w", err)
	}
	names := sqlschema.NamesFor(d, cfg)
	r := strings.NewReplacer("{T}", names.DLQ, "{I}", names.Inbox,
		"{US}", "TIMESTAMPDIFF(MICROSECOND, TIMESTAMP'1970-01-01 00:00:00', ",
		"{AT}", "TIMESTAMPADD(MICROSECOND, ?, TIMESTAMP'1970-01-01 00:00:00')")
	columns := r.Replace("id, uuid, topic, dlq_topic, consumer, `key`, attempts, `error`, permanent,\n" +
		"    {US}first_failed_at), {US}last_failed_at), kafka_partition, kafka_offset, payload, metadata, {US}dead_at)")
	return &mysqlDLQ{db: db, cfg: cfg, names: names, q: mysqlDLQSQL{
		columns: columns,
		// One entry per message, consumer and original topic: the unique
		// once_key of migration 003 decides, so that of concurrent
		// writers the later waits for the earlier's commit and then
		// writes nothing (the update changes nothing).
		insert: r.Replace("INSERT INTO {T} (uuid, topic, dlq_topic, consumer, `key`, attempts, `error`, permanent,\n" +
			"    first_failed_at, last_failed_at, kafka_partition, kafka_offset, payload, metadata, dead_at)\n" +
			"VALUES (?, ?, ?, ?, ?, ?, ?, ?, {AT}, {AT}, ?, ?, ?, ?, UTC_TIMESTAMP(6))\n" +
			"ON DUPLICATE KEY UPDATE id = id"),
		remove: r.Replace("DELETE d FROM JSON_TABLE(?, '$[*]' COLUMNS (id BIGINT PATH '$')) AS j\n" +
			"STRAIGHT_JOIN {T} AS d ON d.id = j.id"),
		removeOne:  r.Replace("DELETE FROM {T} WHERE id = ?"),
		lockOne:    "SELECT " + columns + r.Replace(" FROM {T} WHERE id = ? FOR UPDATE SKIP LOCKED"),
		nextReplay: "SELECT " + columns + r.Replace(" FROM {T}\nWHERE consumer = ? AND topic = ? AND replay_requested_at IS NOT NULL\nORDER BY id LIMIT 1 FOR UPDATE SKIP LOCKED"),
		withdraw: withdrawSQL{
			twin:   r.Replace("SELECT b.id FROM {T} AS a STRAIGHT_JOIN {T} AS b ON " + twinOf + "\nWHERE a.id = ? FOR UPDATE"),
			adopt:  r.Replace("UPDATE {T} AS a, {T} AS b\nSET " + adoptNewer("a.", "`") + "\nWHERE a.id = ? AND b.id = ?"),
			remove: r.Replace("DELETE FROM {T} WHERE id = ?"),
			clear:  r.Replace("UPDATE {T} SET replay_requested_at = NULL WHERE id = ?"),
		},
		copies: r.Replace("SELECT dead_copies FROM {I} WHERE consumer = ? AND `key` = ? AND status = 'dead'"),
	}}, nil
}

// granter is the inbox table beside the dead-letter table.
func (m *mysqlDLQ) granter() (Granter, error) {
	store, err := sqlstore.New(m.db, sqlstore.Config{Dialect: sqlstore.MySQL, Schema: m.cfg})
	if err != nil {
		return nil, fmt.Errorf("dlq: the inbox table's store: %w", err)
	}
	return sqlTableGranter{store: store, inbox: m.names.Inbox}, nil
}

// sqlTableGranter writes grants on the MySQL inbox table through its
// store; a missing table holds no record.
type sqlTableGranter struct {
	store *sqlstore.Store
	inbox string
}

var _ dedupdriver.RecordFinder = sqlTableGranter{}

func (g sqlTableGranter) InboxGrantReplay(ctx context.Context, key dedup.Key, grant string) (bool, error) {
	ok, err := g.store.InboxGrantReplay(ctx, key, grant)
	if errors.Is(err, sqlstore.ErrNotMigrated) {
		return false, nil
	}
	return ok, err
}

func (g sqlTableGranter) InboxHasRecord(ctx context.Context, key dedup.Key) (bool, error) {
	ok, err := g.store.InboxHasRecord(ctx, key)
	if errors.Is(err, sqlstore.ErrNotMigrated) {
		return false, nil
	}
	return ok, err
}

// String names the table, for errors.
func (g sqlTableGranter) String() string { return "the MySQL inbox table " + g.inbox }

// mysqlWrap prefixes a database error with the operation, and marks a
// missing table or database with ErrNotMigrated.
func mysqlWrap(op string, err error) error {
	var me *mysql.MySQLError
	if errors.As(err, &me) && (me.Number == 1146 || me.Number == 1049) { // ER_NO_SUCH_TABLE, ER_BAD_DB_ERROR
		return fmt.Errorf("dlq: %s: %w: %w", op, ErrNotMigrated, err)
	}
	return fmt.Errorf("dlq: %s: %w", op, err)
}

// micros is t as microseconds since the epoch.
func micros(t time.Time) int64 { return t.UnixMicro() }

func fromMicros(n int64) time.Time { return time.UnixMicro(n).UTC() }

// mysqlWhere renders f as a WHERE clause (empty when f selects
// everything) and its arguments.
func (f Filter) mysqlWhere() (string, []any) {
	var (
		conds []string
		args  []any
	)
	if len(f.IDs) > 0 {
		conds = append(conds, "id IN ("+placeholders(len(f.IDs))+")")
		for _, id := range f.IDs {
			args = append(args, id)
		}
	}
	// Strings are cleaned as the publisher cleans what it stores, so that
	// they match what was stored; the columns are binary, compared byte
	// for byte.
	if f.Topic != "" {
		conds, args = append(conds, "topic = ?"), append(args, []byte(ident(f.Topic)))
	}
	if f.Consumer != "" {
		conds, args = append(conds, "consumer = ?"), append(args, []byte(ident(f.Consumer)))
	}
	if f.ErrorContains != "" {
		conds, args = append(conds, "LOCATE(LOWER(?), LOWER(`error`)) > 0"), append(args, clean(f.ErrorContains))
	}
	at := "TIMESTAMPADD(MICROSECOND, ?, TIMESTAMP'1970-01-01 00:00:00')"
	if !f.Since.IsZero() {
		conds, args = append(conds, "dead_at >= "+at), append(args, micros(f.Since))
	}
	if !f.Until.IsZero() {
		conds, args = append(conds, "dead_at <= "+at), append(args, micros(f.Until))
	}
	if len(conds) == 0 {
		return "", nil
	}
	return " WHERE " + strings.Join(conds, " AND "), args
}

// mysqlSelect renders a query of what f selects, in id order, with the
// limit applied.
func (f Filter) mysqlSelect(what, table string) (string, []any) {
	where, args := f.mysqlWhere()
	q := "SELECT " + what + " FROM " + table + where + " ORDER BY id"
	if f.Limit > 0 {
		q += " LIMIT ?"
		args = append(args, f.Limit)
	}
	return q, args
}

func placeholders(n int) string {
	return strings.TrimSuffix(strings.Repeat("?, ", n), ", ")
}

// rowScanner is *sql.Row or *sql.Rows.
type rowScanner interface{ Scan(dest ...any) error }

func scanMySQLEntry(row rowScanner) (Entry, error) {
	var (
		e                                        Entry
		uuid, topic, dlqTopic, consumer, key, md []byte
		first, last, offset                      sql.NullInt64
		partition                                sql.NullInt32
		dead                                     int64
	)
	if err := row.Scan(&e.ID, &uuid, &topic, &dlqTopic, &consumer, &key, &e.Attempts, &e.Error, &e.Permanent,
		&first, &last, &partition, &offset, &e.Payload, &md, &dead); err != nil {
		return Entry{}, err
	}
	e.UUID, e.Topic, e.DLQTopic, e.Consumer, e.Key = string(uuid), string(topic), string(dlqTopic), string(consumer), string(key)
	if first.Valid {
		e.FirstFailedAt = fromMicros(first.Int64)
	}
	if last.Valid {
		e.LastFailedAt = fromMicros(last.Int64)
	}
	if partition.Valid {
		e.Partition = &partition.Int32
	}
	if offset.Valid {
		e.Offset = &offset.Int64
	}
	if e.Payload == nil {
		e.Payload = []byte{}
	}
	e.DeadAt = fromMicros(dead)
	if err := json.Unmarshal(md, &e.Metadata); err != nil {
		return Entry{}, fmt.Errorf("entry %d: metadata: %w", e.ID, err)
	}
	if e.Metadata == nil {
		e.Metadata = map[string]string{}
	}
	return e, nil
}

func collectEntries(rows *sql.Rows) ([]Entry, error) {
	defer rows.Close()
	var out []Entry
	for rows.Next() {
		e, err := scanMySQLEntry(rows)
		if err != nil {
			return nil, err
		}
		out = append(out, e)
	}
	if err := rows.Err(); err != nil {
		return nil, err
	}
	return out, rows.Close()
}

func collectIDs(rows *sql.Rows) ([]int64, error) {
	defer rows.Close()
	var out []int64
	for rows.Next() {
		var id int64
		if err := rows.Scan(&id); err != nil {
			return nil, err
		}
		out = append(out, id)
	}
	if err := rows.Err(); err != nil {
		return nil, err
	}
	return out, rows.Close()
}

func (m *mysqlDLQ) list(ctx context.Context, f Filter) ([]Entry, error) {
	q, args := f.mysqlSelect(m.q.columns, m.names.DLQ)
	rows, err := m.db.QueryContext(ctx, q, args...)
	if err != nil {
		return nil, mysqlWrap("list", err)
	}
	entries, err := collectEntries(rows)
	if err != nil {
		return nil, mysqlWrap("list", err)
	}
	return entries, nil
}

func (m *mysqlDLQ) get(ctx context.Context, id int64) (Entry, error) {
	e, err := scanMySQLEntry(m.db.QueryRowContext(ctx, "SELECT "+m.q.columns+" FROM "+m.names.DLQ+" WHERE id = ?", id))
	if errors.Is(err, sql.ErrNoRows) {
		return Entry{}, fmt.Errorf("%w: %d", ErrNotFound, id)
	}
	if err != nil {
		return Entry{}, mysqlWrap(fmt.Sprintf("get entry %d", id), err)
	}
	return e, nil
}

func (m *mysqlDLQ) selectIDs(ctx context.Context, f Filter, op string) ([]int64, error) {
	q, args := f.mysqlSelect("id", m.names.DLQ)
	rows, err := m.db.QueryContext(ctx, q, args...)
	if err != nil {
		return nil, mysqlWrap(op, err)
	}
	ids, err := collectIDs(rows)
	if err != nil {
		return nil, mysqlWrap(op, err)
	}
	return ids, nil
}

func (m *mysqlDLQ) count(ctx context.Context, f Filter) (int, error) {
	q, args := f.mysqlSelect("id", m.names.DLQ)
	var n int
	if err := m.db.QueryRowContext(ctx, "SELECT COUNT(*) FROM ("+q+") s", args...).Scan(&n); err != nil {
		return 0, mysqlWrap("count", err)
	}
	return n, nil
}

func (m *mysqlDLQ) missing(ctx context.Context, ids []int64) ([]int64, error) {
	found, err := m.selectIDs(ctx, Filter{IDs: ids}, "look up ids")
	if err != nil {
		return nil, err
	}
	have := make(map[int64]bool, len(found))
	for _, id := range found {
		have[id] = true
	}
	var missing []int64
	for _, id := range ids {
		if !have[id] {
			missing = append(missing, id)
			have[id] = true // once
		}
	}
	sortIDs(missing)
	return missing, nil
}

func sortIDs(ids []int64) {
	for i := 1; i < len(ids); i++ {
		for j := i; j > 0 && ids[j] < ids[j-1]; j-- {
			ids[j], ids[j-1] = ids[j-1], ids[j]
		}
	}
}

// begin starts a READ COMMITTED transaction on a connection of its own,
// taken with ctx; the transaction then lives until it ends, whatever
// becomes of ctx (database/sql would roll back one whose context ends,
// and an entry a broker took must still be deleted). release ends the
// connection's use.
func (m *mysqlDLQ) begin(ctx context.Context) (tx *sql.Tx, release func(), err error) {
	conn, err := m.db.Conn(ctx)
	if err != nil {
		return nil, nil, err
	}
	tx, err = conn.BeginTx(context.WithoutCancel(ctx), &sql.TxOptions{Isolation: sql.LevelReadCommitted})
	if err != nil {
		return nil, nil, errors.Join(err, conn.Close())
	}
	return tx, func() { _ = conn.Close() }, nil
}

// replayOne replays the entry id in its own transaction, as the
// PostgreSQL Store's does. It reports false when the entry is gone or
// locked by another replay.
func (m *mysqlDLQ) replayOne(ctx context.Context, s *Store, pub message.Publisher, id int64) (replayed bool, err error) {
	tx, release, err := m.begin(ctx)
	if err != nil {
		return false, mysqlWrap(fmt.Sprintf("replay entry %d: begin", id), err)
	}
	defer release()
	defer func() {
		// A no-op after Commit; otherwise the row stays, unlocked.
		if rbErr := tx.Rollback(); rbErr != nil && !errors.Is(rbErr, sql.ErrTxDone) {
			err = errors.Join(err, fmt.Errorf("dlq: replay entry %d: rollback: %w", id, rbErr))
		}
	}()
	e, err := scanMySQLEntry(tx.QueryRowContext(ctx, m.q.lockOne, id))
	if errors.Is(err, sql.ErrNoRows) {
		// Replayed or purged meanwhile, or being replayed right now.
		return false, nil
	}
	if err != nil {
		return false, mysqlWrap(fmt.Sprintf("replay entry %d: lock", id), err)
	}
	if e.Topic == "" {
		return false, fmt.Errorf("dlq: replay entry %d (uuid %s): %w", id, e.UUID, ErrNoTopic)
	}
	grant, err := grantReplay(ctx, s.grants, e, s.newKeys)
	if err != nil {
		return false, err
	}
	msg := e.Message(grant)
	msg.SetContext(ctx)
	if err := pub.Publish(e.Topic, msg); err != nil {
		return false, fmt.Errorf("dlq: replay entry %d (uuid %s) to %q: %w", id, e.UUID, e.Topic, err)
	}
	// The broker has the message: delete the entry even if ctx ends now,
	// or the next replay publishes it again.
	if _, err := tx.ExecContext(context.WithoutCancel(ctx), m.q.removeOne, id); err != nil {
		return false, mysqlWrap(fmt.Sprintf("replay entry %d: published to %q, but delete failed (a later replay publishes it again)", id, e.Topic), err)
	}
	if err := tx.Commit(); err != nil {
		return false, mysqlWrap(fmt.Sprintf("replay entry %d: published to %q, but commit failed (a later replay publishes it again)", id, e.Topic), err)
	}
	return true, nil
}

// removeIDs deletes the entries ids in tx, one primary-key lookup each.
func (m *mysqlDLQ) removeIDs(ctx context.Context, tx *sql.Tx, ids []int64) (int, error) {
	idsJSON, err := json.Marshal(ids)
	if err != nil {
		return 0, err
	}
	res, err := tx.ExecContext(ctx, m.q.remove, string(idsJSON))
	if err != nil {
		return 0, err
	}
	n, err := res.RowsAffected()
	return int(n), err
}

func (m *mysqlDLQ) purge(ctx context.Context, f Filter) (int, error) {
	ids, err := m.selectIDs(ctx, f, "purge")
	if err != nil || len(ids) == 0 {
		return 0, err
	}
	tx, release, err := m.begin(ctx)
	if err != nil {
		return 0, mysqlWrap("purge: begin", err)
	}
	defer release()
	n, err := m.removeIDs(ctx, tx, ids)
	if err == nil {
		err = tx.Commit()
	}
	if err != nil {
		return 0, errors.Join(mysqlWrap("purge", err), ignoreDone(tx.Rollback()))
	}
	return n, nil
}

func ignoreDone(err error) error {
	if errors.Is(err, sql.ErrTxDone) {
		return nil
	}
	return err
}

func (m *mysqlDLQ) counts(ctx context.Context) ([]Count, error) {
	rows, err := m.db.QueryContext(ctx, strings.NewReplacer("{T}", m.names.DLQ).Replace(
		"SELECT consumer, topic, COUNT(*), TIMESTAMPDIFF(MICROSECOND, TIMESTAMP'1970-01-01 00:00:00', MIN(dead_at)) FROM {T}\n"+
			"GROUP BY consumer, topic ORDER BY consumer, topic"))
	if err != nil {
		return nil, mysqlWrap("count by consumer and topic", err)
	}
	defer rows.Close()
	var counts []Count
	for rows.Next() {
		var (
			c               Count
			consumer, topic []byte
			oldest          int64
		)
		if err := rows.Scan(&consumer, &topic, &c.Entries, &oldest); err != nil {
			return nil, mysqlWrap("count by consumer and topic", err)
		}
		c.Consumer, c.Topic, c.Oldest = string(consumer), string(topic), fromMicros(oldest)
		counts = append(counts, c)
	}
	if err := rows.Err(); err != nil {
		return nil, mysqlWrap("count by consumer and topic", err)
	}
	return counts, nil
}

func (m *mysqlDLQ) requestReplay(ctx context.Context, f Filter) (int, error) {
	ids, err := m.selectIDs(ctx, f, "request replay")
	if err != nil || len(ids) == 0 {
		return 0, err
	}
	idsJSON, err := json.Marshal(ids)
	if err != nil {
		return 0, fmt.Errorf("dlq: request replay: %w", err)
	}
	// An UPDATE in READ COMMITTED: it neither waits on nor blocks what
	// it does not change.
	tx, release, err := m.begin(ctx)
	if err != nil {
		return 0, mysqlWrap("request replay: begin", err)
	}
	defer release()
	res, err := tx.ExecContext(ctx, strings.NewReplacer("{T}", m.names.DLQ).Replace(
		"UPDATE JSON_TABLE(?, '$[*]' COLUMNS (id BIGINT PATH '$')) AS j STRAIGHT_JOIN {T} AS d ON d.id = j.id\n"+
			"SET d.replay_requested_at = UTC_TIMESTAMP(6) WHERE d.replay_requested_at IS NULL"), string(idsJSON))
	var n int64
	if err == nil {
		if n, err = res.RowsAffected(); err == nil {
			err = tx.Commit()
		}
	}
	if err != nil {
		return 0, errors.Join(mysqlWrap("request replay", err), ignoreDone(tx.Rollback()))
	}
	return int(n), nil
}

// The sizes of the MySQL inbox table's key columns (sqlschema/mysql/
// 001_inbox.up.sql): a longer consumer or key is stored as its SHA-256
// digest, as the inbox store stores it.
const (
	mysqlInboxMaxConsumer = 255
	mysqlInboxMaxKey      = 1024
)

func inboxStored(s string, max int) string {
	if len(s) <= max {
		return s
	}
	sum := sha256.Sum256([]byte(s))
	return "sha256:" + hex.EncodeToString(sum[:])
}

func (m *mysqlDLQ) copiesSince(ctx context.Context, e Entry) (int, bool, error) {
	var n int
	err := m.db.QueryRowContext(ctx, m.q.copies,
		inboxStored(e.Consumer, mysqlInboxMaxConsumer), inboxStored(e.Key, mysqlInboxMaxKey)).Scan(&n)
	var me *mysql.MySQLError
	switch {
	case errors.Is(err, sql.ErrNoRows), errors.As(err, &me) && (me.Number == 1146 || me.Number == 1054):
		return 0, false, nil // no such key, table or column here
	case err != nil:
		return 0, false, mysqlWrap(fmt.Sprintf("copies of entry %d", e.ID), err)
	}
	return n, true, nil
}

// nextReplay locks the first requested entry of consumer and topic in a
// transaction of its own, which the caller ends: ok is false when there
// is none.
func (m *mysqlDLQ) nextReplay(ctx context.Context, consumer, topic string) (tx *sql.Tx, release func(), e Entry, ok bool, err error) {
	tx, release, err = m.begin(ctx)
	if err != nil {
		return nil, nil, Entry{}, false, mysqlWrap("replay: begin", err)
	}
	e, err = scanMySQLEntry(tx.QueryRowContext(ctx, m.q.nextReplay, []byte(consumer), []byte(topic)))
	if err != nil {
		rbErr := ignoreDone(tx.Rollback())
		release()
		if errors.Is(err, sql.ErrNoRows) {
			return nil, nil, Entry{}, false, rbErr
		}
		return nil, nil, Entry{}, false, errors.Join(mysqlWrap("replay: read", err), rbErr)
	}
	return tx, release, e, true, nil
}

// withdrawReplay takes back e's replay request in tx and commits, and
// returns the id of the entry the message is left with (withdrawRequest).
func (m *mysqlDLQ) withdrawReplay(ctx context.Context, tx *sql.Tx, e Entry) (kept int64, err error) {
	kept, err = withdrawRequest(ctx, m.q.withdraw, withdrawTx{
		exec: func(ctx context.Context, query string, args ...any) error {
			_, err := tx.ExecContext(ctx, query, args...)
			return err
		},
		queryID: func(ctx context.Context, query string, arg int64) (int64, bool, error) {
			var id int64
			err := tx.QueryRowContext(ctx, query, arg).Scan(&id)
			if errors.Is(err, sql.ErrNoRows) {
				return 0, false, nil
			}
			return id, err == nil, err
		},
	}, e.ID)
	if err == nil {
		err = tx.Commit()
	}
	if err != nil {
		return 0, mysqlWrap(fmt.Sprintf("replay entry %d: withdraw the request", e.ID), err)
	}
	return kept, nil
}

// mysqlPublisher writes dead letters into the MySQL table.
type mysqlPublisher struct {
	m *mysqlDLQ

	// mu guards the server's identity, learnt once.
	mu               sync.Mutex
	variable, server string
}

// publish writes msgs, one row each, in one transaction: the inbox's
// (sqlstore.Tx of the first message's context) when it is on the server
// of the dead-letter table, else one of its own.
func (p *mysqlPublisher) publish(topic string, msgs []*message.Message) error {
	args := make([][]any, len(msgs))
	for i, m := range msgs {
		a, err := insertArgs(topic, m)
		if err != nil {
			return fmt.Errorf("dlq: publish %s to %q: %w", m.UUID, topic, err)
		}
		args[i] = mysqlInsertArgs(a)
	}
	ctx := msgs[0].Context()
	op := fmt.Sprintf("publish %d messages to %q", len(msgs), topic)
	if tx := sqlstore.Tx(ctx); tx != nil {
		same, err := p.sameServer(ctx, tx)
		if err != nil {
			return mysqlWrap(op, err)
		}
		if same {
			// Dead-lettered under an inbox claim on this server (the
			// poison middleware puts the claim's transaction in the
			// context): the row commits or rolls back with the key's
			// dead mark.
			for _, a := range args {
				if _, err := tx.ExecContext(ctx, p.m.q.insert, a...); err != nil {
					return mysqlWrap(op+" in the inbox's transaction", err)
				}
			}
			return nil
		}
	}
	tx, release, err := p.m.begin(ctx)
	if err != nil {
		return mysqlWrap(op+": begin", err)
	}
	defer release()
	for _, a := range args {
		if _, err = tx.ExecContext(ctx, p.m.q.insert, a...); err != nil {
			break
		}
	}
	if err == nil {
		err = tx.Commit()
	}
	if err != nil {
		return errors.Join(mysqlWrap(op, err), ignoreDone(tx.Rollback()))
	}
	return nil
}

// mysqlInsertArgs turns the PostgreSQL insert's arguments (insertArgs)
// into the MySQL one's: times as microseconds since the epoch, the
// binary columns as bytes.
func mysqlInsertArgs(a []any) []any {
	out := append([]any(nil), a...)
	for _, i := range []int{0, 1, 2, 3, 4} { // uuid, topic, dlq_topic, consumer, key
		out[i] = []byte(a[i].(string))
	}
	for _, i := range []int{8, 9} { // first_failed_at, last_failed_at
		if t := a[i].(*time.Time); t != nil {
			out[i] = micros(*t)
		} else {
			out[i] = nil
		}
	}
	for _, i := range []int{10, 11} { // kafka_partition, kafka_offset
		switch v := a[i].(type) {
		case *int32:
			if v == nil {
				out[i] = nil
			} else {
				out[i] = *v
			}
		case *int64:
			if v == nil {
				out[i] = nil
			} else {
				out[i] = *v
			}
		}
	}
	out[13] = string(a[13].([]byte)) // metadata, JSON text
	return out
}

// sameServer reports whether tx runs on the server of the dead-letter
// table. MySQL's transactions span the server's databases, so the server
// decides, by what it says of itself: @@server_uuid on MySQL,
// @@server_uid on MariaDB. It asks once per dead letter, in tx (a
// variable the other family does not know is an error that leaves tx
// as it was, and means another server).
func (p *mysqlPublisher) sameServer(ctx context.Context, tx *sql.Tx) (bool, error) {
	p.mu.Lock()
	variable, id := p.variable, p.server
	p.mu.Unlock()
	if variable == "" {
		var err error
		if variable, id, err = serverIdentity(ctx, p.m.db); err != nil {
			return false, err
		}
		p.mu.Lock()
		p.variable, p.server = variable, id
		p.mu.Unlock()
	}
	var theirs string
	if err := tx.QueryRowContext(ctx, "SELECT "+variable).Scan(&theirs); err != nil {
		var me *mysql.MySQLError
		if errors.As(err, &me) && me.Number == 1193 { // ER_UNKNOWN_SYSTEM_VARIABLE
			return false, nil
		}
		return false, fmt.Errorf("identify the inbox's server: %w", err)
	}
	return theirs == id, nil
}

// serverIdentity returns the variable that names db's server and its
// value.
func serverIdentity(ctx context.Context, db *sql.DB) (variable, id string, err error) {
	var version string
	if err := db.QueryRowContext(ctx, "SELECT VERSION()").Scan(&version); err != nil {
		return "", "", fmt.Errorf("identify the server: %w", err)
	}
	variable = "@@server_uuid"
	if strings.Contains(strings.ToLower(version), "mariadb") {
		variable = "@@server_uid"
	}
	if err := db.QueryRowContext(ctx, "SELECT "+variable).Scan(&id); err != nil {
		return "", "", fmt.Errorf("identify the server: %w", err)
	}
	return variable, id, nil
}

// deliverOneMySQL is deliverOne on MySQL: it hands out the first requested
// entry, if any, and ends its transaction with the message's ack (delete)
// or nack (keep).
func (r *ReplaySubscriber) deliverOneMySQL(ctx context.Context, topic string, out chan<- *message.Message) (delivered bool, err error) {
	tx, release, e, ok, err := r.my.nextReplay(ctx, r.cfg.Consumer, topic)
	if err != nil || !ok {
		return false, err
	}
	defer release()
	defer func() {
		// A no-op after Commit; otherwise the entry stays, unlocked.
		if rbErr := ignoreDone(tx.Rollback()); rbErr != nil {
			err = errors.Join(err, mysqlWrap("replay: rollback", rbErr))
		}
	}()
	// A fresh grant for every delivery, committed before the consumer can
	// see the message: a copy handed out before and nacked no longer
	// reopens the key.
	grant, err := grantReplay(ctx, r.cfg.Granter, e, false)
	if errors.Is(err, ErrNoDeadKey) {
		// Delivered, the copy would be acked as a dead copy where the key
		// is dead, and the entry deleted; asked again at every poll, it
		// would hold up the replays behind it. The request is withdrawn,
		// the entry stays.
		kept, werr := r.my.withdrawReplay(ctx, tx, e)
		if werr != nil {
			return false, errors.Join(err, werr)
		}
		r.cfg.Logger.Error("Replay refused, its request withdrawn; the entry stays", err,
			watermill.LogFields{"consumer": r.cfg.Consumer, "topic": topic, "entry": kept, "message_uuid": e.UUID})
		return true, nil
	}
	if err != nil {
		return false, err
	}
	msg := e.Message(grant)
	msgCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	msg.SetContext(msgCtx)
	select {
	case out <- msg:
	case <-ctx.Done():
		return false, nil
	case <-r.closing:
		return false, nil
	}
	select {
	case <-msg.Acked():
	case <-msg.Nacked():
		return true, nil
	case <-ctx.Done():
		return true, nil
	case <-r.closing:
		return true, nil
	}
	// The consumer took it durably: the entry goes, even if ctx ends now.
	wctx, wcancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer wcancel()
	if _, err := tx.ExecContext(wctx, r.my.q.removeOne, e.ID); err != nil {
		return true, mysqlWrap(fmt.Sprintf("replay entry %d: delete after ack (it is delivered again, a duplicate to the inbox)", e.ID), err)
	}
	if err := tx.Commit(); err != nil {
		return true, mysqlWrap(fmt.Sprintf("replay entry %d: commit after ack (it is delivered again, a duplicate to the inbox)", e.ID), err)
	}
	r.cfg.Logger.Info("Dead letter replayed to its consumer", watermill.LogFields{"consumer": r.cfg.Consumer, "topic": topic, "entry": e.ID, "message_uuid": e.UUID})
	return true, nil
}
