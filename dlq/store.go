package dlq

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/oncemill/oncemill/adapters"
	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/internal/sqldb"
	"github.com/oncemill/oncemill/sqlschema"
)

var (
	// ErrNotFound is returned, wrapped, by [Store.Get] for an id with no
	// entry.
	ErrNotFound = errors.New("dlq: no such entry")
	// ErrNoTopic is returned, wrapped, by [Store.Replay] for an entry that
	// has no original topic (its message carried no delivery.DeadTopic):
	// there is nowhere to replay it to.
	ErrNoTopic = errors.New("dlq: cannot replay without a topic")
	// ErrNotMigrated is returned, wrapped, when the dead-letter table does
	// not exist.
	ErrNotMigrated = errors.New("dlq: dead-letter table missing: run sqlschema.Migrate with the same Schema and DLQTable")
)

// Entry is one dead-lettered message: a row of the dead-letter table.
type Entry struct {
	// ID numbers entries in the order they were written.
	ID int64 `json:"id"`
	// UUID is the message's UUID, kept on replay. A UUID longer than
	// delivery.MaxBoundBytes is held in its delivery.Bound form (the
	// whole one is in Metadata's delivery.DeadUUID, which a replay uses),
	// and so are Topic, DLQTopic, Consumer and Key.
	UUID string `json:"uuid"`
	// Topic is the topic the message was consumed from
	// (delivery.DeadTopic), where a replay publishes it; "" when unknown.
	Topic string `json:"topic"`
	// DLQTopic is the topic the dead-letter publisher was called with.
	DLQTopic string `json:"dlq_topic"`
	// Consumer is the consumer (handler) that gave up on the message.
	Consumer string `json:"consumer"`
	// Key is the idempotency key the consumer derived, when known.
	Key string `json:"key"`
	// Attempts is how many attempts were made; 0 when unknown.
	Attempts int `json:"attempts"`
	// Error is the text of the last error.
	Error string `json:"error"`
	// Permanent is true when the last error was permanent.
	Permanent bool `json:"permanent"`
	// FirstFailedAt is the time of the first failed attempt; zero when
	// unknown.
	FirstFailedAt time.Time `json:"first_failed_at,omitzero"`
	// LastFailedAt is the time of the last failed attempt; zero when
	// unknown.
	LastFailedAt time.Time `json:"last_failed_at,omitzero"`
	// Partition is the original's Kafka partition; nil when unknown.
	Partition *int32 `json:"kafka_partition,omitempty"`
	// Offset is the original's Kafka offset; nil when unknown.
	Offset *int64 `json:"kafka_offset,omitempty"`
	// Payload is the message's payload.
	Payload []byte `json:"payload"`
	// Metadata is the message's full metadata as it was dead-lettered,
	// the delivery.Dead* keys included.
	Metadata map[string]string `json:"metadata"`
	// DeadAt is when the entry was written.
	DeadAt time.Time `json:"dead_at"`
}

// Message returns the message a replay of e publishes: e's UUID (the
// whole one, [delivery.DeadUUID], where the uuid column holds a bounded
// form) and payload, and its metadata without the facts of the failed delivery
// ([delivery.IsDeliveryFact]: the dead-letter fields, any replay marker,
// and the topic, partition, offset, attempt count and decode error the
// adapter set), so that the replay is counted and decoded afresh. It
// carries [delivery.Replay] set to grant, the replay grant written on the
// dead key's record ([Granter]; [Store.Replay] and [ReplaySubscriber] write
// one for every replay): the consumer's inbox reopens the dead key for
// this message, and for no copy whose grant the record does not hold. It
// carries [delivery.ReplayConsumer] with the entry's consumer, when known:
// the inboxes of the topic's other consumers that find grant on that
// consumer's record ack it without running. With an empty grant the
// message carries no replay marker.
func (e Entry) Message(grant string) *message.Message {
	uuid := e.UUID
	if full := e.Metadata[delivery.DeadUUID]; full != "" {
		uuid = full // the column holds a bounded or per-row form
	}
	msg := message.NewMessage(uuid, append([]byte(nil), e.Payload...))
	for k, v := range e.Metadata {
		if !delivery.IsDeliveryFact(k) {
			msg.Metadata.Set(k, v)
		}
	}
	if grant == "" {
		return msg
	}
	msg.Metadata.Set(delivery.Replay, grant)
	msg.Metadata.Set(ReplayedFrom, strconv.FormatInt(e.ID, 10))
	if e.Consumer != "" {
		msg.Metadata.Set(delivery.ReplayConsumer, e.Consumer)
	}
	return msg
}

// ReplayedFrom is the metadata key a replayed message carries with the id
// of the entry it was replayed from ([Entry.Message]). It is no fact of
// one delivery: a replay that dies again keeps it in its new entry, whose
// [Entry.ReplayedFrom] says where it came from.
const ReplayedFrom = "oncemill_replayed_from"

// ReplayedFrom returns the id of the entry e's message was replayed from,
// when it died again after a replay; ok is false for a first death.
func (e Entry) ReplayedFrom() (id int64, ok bool) {
	id, err := strconv.ParseInt(e.Metadata[ReplayedFrom], 10, 64)
	return id, err == nil && id > 0
}

// Hopeless says why a replay of e would only die again, or "" when it
// may succeed: an entry without a key failed to give one, and its replay
// fails the same way; a permanent error fails the same payload again
// unless the handler changed since. A corrected payload is sent by the
// producer after [Store.Reopen].
func (e Entry) Hopeless() string {
	switch {
	case e.Key == "":
		return "it has no key: its replay fails to give one again, and is dead-lettered again"
	case e.Permanent:
		return "its error is permanent: its replay fails the same way unless the handler changed; " +
			"for corrected data, reopen the key and have the producer send the message again"
	}
	return ""
}

// Store reads and changes the dead-letter table. It is safe for concurrent
// use, by one process or several, and starts no goroutines.
type Store struct {
	t      *table
	grants Granter
	// newKeys replays an entry whose key has no record as a new key.
	newKeys bool
}

// NewStore returns a store on the PostgreSQL dead-letter table that cfg
// names (cfg.Schema and cfg.DLQTable, as given to [sqlschema.Migrate]),
// through a pgx pool. It does not create the table. The pool stays the
// caller's.
func NewStore(pool *pgxpool.Pool, cfg sqlschema.Config) (*Store, error) {
	t, err := openPool(pool, cfg)
	if err != nil {
		return nil, err
	}
	return &Store{t: t, grants: tableGranter{t}}, nil
}

// NewSQLStore returns a store on the dead-letter table that cfg names
// (cfg.Schema, the PostgreSQL schema or MySQL database, and cfg.DLQTable,
// as given to sqlschema.MigrateSQL) on db, a database of dialect d
// through database/sql: sqlschema.Postgres (pgx's stdlib or lib/pq),
// sqlschema.MySQL (MySQL 8.0+ or MariaDB 10.6+ through
// go-sql-driver/mysql) or sqlschema.SQLite (modernc.org/sqlite). It is the
// [Store] of [NewStore] otherwise. It does not create the table. The db
// stays the caller's.
func NewSQLStore(db *sql.DB, d sqlschema.Dialect, cfg sqlschema.Config) (*Store, error) {
	t, err := openSQL(db, d, cfg)
	if err != nil {
		return nil, err
	}
	return &Store{t: t, grants: tableGranter{t}}, nil
}

// WithGranter returns a copy of s whose replays write their grants
// through g, the inbox store of the consumers whose dead letters it
// replays, instead of on the inbox table beside the dead-letter table: for
// consumers whose inbox is not that table (Redis, another database or schema).
// A nil g is refused with an error naming it.
func (s *Store) WithGranter(g Granter) (*Store, error) {
	if g == nil {
		return nil, errors.New("dlq: WithGranter: granter is nil")
	}
	c := *s
	c.grants = g
	return &c, nil
}

// WithNewKeys returns a copy of s whose replays also publish the entries
// whose key has no record in the granter's store, which [Store.Replay]
// otherwise refuses with [ErrNoDeadKey]: for a key whose record expired
// after the dedup window, the copy runs as a new key. Use it only when the
// granter is the consumer's inbox store: a consumer whose key is dead in
// another store acks the copy without running.
func (s *Store) WithNewKeys() *Store {
	c := *s
	c.newKeys = true
	return &c
}

// CopiesSince returns how many copies of e's key reached e's consumer
// after it was dead-lettered: the inbox acks them without running and
// counts them on the dead key, in the inbox table that cfg names beside
// the dead-letter table. ok is false when there is no such record: the
// inbox table is elsewhere, or the key is no longer dead (replayed, or
// expired after its window).
func (s *Store) CopiesSince(ctx context.Context, e Entry) (n int, ok bool, err error) {
	consumer, key, ok := s.t.d.InboxLookup(e.Consumer, e.Key)
	if !ok {
		return 0, false, nil // not text: no inbox holds it
	}
	err = s.t.db.QueryRow(ctx, s.t.q.copies, consumer, key).Scan(&n)
	switch {
	case errors.Is(err, sqldb.ErrNoRows), s.t.d.UndefinedTable(err), s.t.d.UndefinedColumn(err):
		return 0, false, nil // no such key, table or column here
	case err != nil:
		return 0, false, s.t.wrap(fmt.Sprintf("copies of entry %d", e.ID), err)
	}
	return n, true, nil
}

// List returns the entries f selects, ordered by id.
func (s *Store) List(ctx context.Context, f Filter) ([]Entry, error) {
	if err := f.Validate(); err != nil {
		return nil, err
	}
	q, args := f.query(s.t, s.t.cols)
	rows, err := s.t.db.Query(ctx, q, args...)
	entries, err := sqldb.Collect(rows, err, func(r sqldb.Rows) (Entry, error) { return scanEntry(r) })
	if err != nil {
		return nil, s.t.wrap("list", err)
	}
	return entries, nil
}

// Get returns the entry with the given id; the error wraps [ErrNotFound]
// when there is none.
func (s *Store) Get(ctx context.Context, id int64) (Entry, error) {
	e, err := scanEntry(s.t.db.QueryRow(ctx, s.t.q.get, id))
	if errors.Is(err, sqldb.ErrNoRows) {
		return Entry{}, fmt.Errorf("%w: %d", ErrNotFound, id)
	}
	if err != nil {
		return Entry{}, s.t.wrap(fmt.Sprintf("get entry %d", id), err)
	}
	return e, nil
}

// Count returns how many entries f selects (at most f.Limit when it is
// set).
func (s *Store) Count(ctx context.Context, f Filter) (int, error) {
	if err := f.Validate(); err != nil {
		return 0, err
	}
	q, args := f.query(s.t, "id")
	var n int
	if err := s.t.db.QueryRow(ctx, `SELECT COUNT(*) FROM (`+q+`) s`, args...).Scan(&n); err != nil {
		return 0, s.t.wrap("count", err)
	}
	return n, nil
}

// Missing returns those of ids that have no entry, in ascending order and
// without repeats; none when all exist.
func (s *Store) Missing(ctx context.Context, ids []int64) ([]int64, error) {
	if len(ids) == 0 {
		return nil, nil
	}
	found, err := s.selectIDs(ctx, Filter{IDs: ids}, "look up ids")
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
	slices.Sort(missing)
	return missing, nil
}

// Replay publishes the entries f selects to pub, in id order, and deletes
// them. Each entry takes its own transaction: the row is locked (FOR
// UPDATE SKIP LOCKED), a replay grant is written on its dead key (see
// [Granter]; the write commits before the publish), the entry is published
// to its original topic with its original UUID, payload and metadata and
// the grant (see [Entry.Message]), then deleted, and the transaction
// commits. Each replay writes a fresh grant, so the copy an earlier replay
// of the entry published no longer reopens the key once a later one is
// granted. An entry that another replay or purge holds or has
// already removed is skipped, so replays running at once never publish an
// entry twice. On SQLite, whose one writer must not wait on a broker,
// nothing is locked while the entry is published and deleted: replays
// running at once may both publish it, under its UUID, which the
// consumer's inbox absorbs.
//
// Replay stops at the first entry it cannot replay — pub fails, the
// entry has no topic ([ErrNoTopic]), or its key is not dead in the
// granter's store and has no record there ([ErrNoDeadKey]: the
// consumer's inbox is elsewhere, or the record expired; see
// [Store.WithGranter] and [Store.WithNewKeys]) — and returns how many
// entries it replayed with the error; that entry and the ones after it
// stay, and nothing is published for them. An entry with no consumer or
// key is published as a plain message. A commit
// that fails after pub took the message leaves the entry in the table, to be
// published again, with the same UUID, by a later replay.
//
// progress, when not nil, is called with (0, total) before the first entry
// and after each entry with the number of entries handled so far, skipped
// ones included; total is how many entries f selected at the start.
//
// A pub that lives inside this process (adapters.CheckDurable: the
// publisher adapters.Open returns for kafka:// or nats:// with no host, a
// non-persistent GoChannel) is refused with an error wrapping
// adapters.ErrInProcess before anything is read: the entries are deleted
// once published. A persistent GoChannel is accepted, for tests and demos.
//
// An empty f is refused with [ErrNoSelection] unless f.All is set.
func (s *Store) Replay(ctx context.Context, pub message.Publisher, f Filter, progress func(done, total int)) (int, error) {
	if pub == nil {
		return 0, errors.New("dlq: replay: publisher is nil")
	}
	if err := adapters.CheckDurable(pub); err != nil {
		return 0, fmt.Errorf("dlq: replay: the publisher would lose the entries, which are deleted once published: %w; nothing replayed", err)
	}
	if err := f.selection(); err != nil {
		return 0, err
	}
	ids, err := s.selectIDs(ctx, f, "replay: select entries")
	if err != nil {
		return 0, err
	}
	if progress != nil {
		progress(0, len(ids))
	}
	replayed := 0
	for i, id := range ids {
		if err := ctx.Err(); err != nil {
			return replayed, fmt.Errorf("dlq: replay stopped after %d entries: %w", replayed, err)
		}
		ok, err := s.replayOne(ctx, pub, id)
		if err != nil {
			return replayed, err
		}
		if ok {
			replayed++
		}
		if progress != nil {
			progress(i+1, len(ids))
		}
	}
	return replayed, nil
}

// selectIDs returns the ids f selects, in id order.
func (s *Store) selectIDs(ctx context.Context, f Filter, op string) ([]int64, error) {
	q, args := f.query(s.t, "id")
	rows, err := s.t.db.Query(ctx, q, args...)
	ids, err := sqldb.Collect(rows, err, func(r sqldb.Rows) (id int64, err error) {
		return id, r.Scan(&id)
	})
	if err != nil {
		return nil, s.t.wrap(op, err)
	}
	return ids, nil
}

// replayOne replays the entry id in its own transaction. It reports false
// when the entry is gone or locked by another replay.
func (s *Store) replayOne(ctx context.Context, pub message.Publisher, id int64) (replayed bool, err error) {
	h, err := s.t.take(ctx, s.t.q.lockOne, id)
	if err != nil {
		return false, s.t.wrap(fmt.Sprintf("replay entry %d: lock", id), err)
	}
	if h == nil {
		// Replayed or purged meanwhile, or being replayed right now.
		return false, nil
	}
	defer func() {
		// A no-op after the delete; otherwise the row stays, unlocked.
		if rbErr := h.release(context.WithoutCancel(ctx)); rbErr != nil {
			err = errors.Join(err, fmt.Errorf("dlq: replay entry %d: rollback: %w", id, rbErr))
		}
	}()
	e := h.Entry
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
	wctx := context.WithoutCancel(ctx)
	if err := h.done(wctx, func(tx sqldb.Executor) error {
		_, err := tx.Exec(wctx, s.t.q.removeOne, id)
		return err
	}); err != nil {
		return false, s.t.wrap(fmt.Sprintf("replay entry %d: published to %q, but delete failed (a later replay publishes it again)", id, e.Topic), err)
	}
	return true, nil
}

// Purge deletes the entries f selects and returns how many it deleted. An
// empty f is refused with [ErrNoSelection] unless f.All is set.
func (s *Store) Purge(ctx context.Context, f Filter) (int, error) {
	if err := f.selection(); err != nil {
		return 0, err
	}
	return s.onSelected(ctx, f, "purge", "DELETE FROM "+s.t.names.DLQ, "", s.t.q.removeIDs)
}

// onSelected runs write ("DELETE FROM …" or "UPDATE … SET …") on the
// entries f selects that also meet cond, and returns how many rows it
// changed: one statement where the database lets a write select its rows
// from its own table (WriteFromSelf); elsewhere the ids are read first
// and written by id with byIDs.
func (s *Store) onSelected(ctx context.Context, f Filter, op, write, cond, byIDs string) (int, error) {
	var (
		n   int64
		err error
	)
	if s.t.d.WriteFromSelf {
		sel, args := f.query(s.t, "id")
		q := write + " WHERE id IN (" + sel + ")"
		if cond != "" {
			q += " AND " + cond
		}
		n, err = s.t.exec(ctx, q, args...)
	} else {
		var ids []int64
		if ids, err = s.selectIDs(ctx, f, op); err != nil || len(ids) == 0 {
			return 0, err
		}
		n, err = s.t.exec(ctx, byIDs, idsJSON(ids))
	}
	if err != nil {
		return 0, s.t.wrap(op, err)
	}
	return int(n), nil
}
