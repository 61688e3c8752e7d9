package dlq

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/oncemill/oncemill/adapters"
	"github.com/oncemill/oncemill/delivery"
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
	if e.Consumer != "" {
		msg.Metadata.Set(delivery.ReplayConsumer, e.Consumer)
	}
	return msg
}

// columns are the columns of an Entry, in scan order.
const columns = `id, uuid, topic, dlq_topic, consumer, key, attempts, error, permanent,
	first_failed_at, last_failed_at, kafka_partition, kafka_offset, payload, metadata, dead_at`

func scanEntry(row pgx.CollectableRow) (Entry, error) {
	var (
		e           Entry
		first, last *time.Time
		md          []byte
	)
	if err := row.Scan(&e.ID, &e.UUID, &e.Topic, &e.DLQTopic, &e.Consumer, &e.Key, &e.Attempts, &e.Error,
		&e.Permanent, &first, &last, &e.Partition, &e.Offset, &e.Payload, &md, &e.DeadAt); err != nil {
		return Entry{}, err
	}
	if first != nil {
		e.FirstFailedAt = *first
	}
	if last != nil {
		e.LastFailedAt = *last
	}
	if err := json.Unmarshal(md, &e.Metadata); err != nil {
		return Entry{}, fmt.Errorf("entry %d: metadata: %w", e.ID, err)
	}
	if e.Metadata == nil {
		e.Metadata = map[string]string{}
	}
	return e, nil
}

// Store reads and changes the dead-letter table. It is safe for concurrent
// use, by one process or several, and starts no goroutines.
type Store struct {
	pool *pgxpool.Pool
	// my is the table on MySQL ([NewSQLStore]), pool nil then.
	my     *mysqlDLQ
	table  string
	inbox  string
	grants Granter
	// newKeys replays an entry whose key has no record as a new key.
	newKeys bool
}

// NewStore returns a store on the dead-letter table that cfg names
// (cfg.Schema and cfg.DLQTable, as given to [sqlschema.Migrate]). It does
// not create the table. The pool stays the caller's.
func NewStore(pool *pgxpool.Pool, cfg sqlschema.Config) (*Store, error) {
	table, err := tableFor(pool, cfg)
	if err != nil {
		return nil, err
	}
	inbox := sqlschema.NamesFor(sqlschema.Postgres, cfg.WithDefaults()).Inbox
	return &Store{pool: pool, table: table, inbox: inbox, grants: tableGranter{pool: pool, inbox: inbox}}, nil
}

// WithGranter returns a copy of s whose replays write their grants
// through g, the inbox store of the consumers whose dead letters it
// replays, instead of on the inbox table beside the dead-letter table: for
// consumers whose inbox is not that table (Redis, SQLite, another schema).
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
	if s.my != nil {
		return s.my.copiesSince(ctx, e)
	}
	err = s.pool.QueryRow(ctx, `SELECT dead_copies FROM `+s.inbox+` WHERE consumer = $1 AND key = $2 AND status = 'dead'`,
		e.Consumer, e.Key).Scan(&n)
	var pgErr *pgconn.PgError
	switch {
	case errors.Is(err, pgx.ErrNoRows), errors.As(err, &pgErr) && (pgErr.Code == "42P01" || pgErr.Code == "42703"):
		return 0, false, nil // no such key, table or column here
	case err != nil:
		return 0, false, wrap(fmt.Sprintf("copies of entry %d", e.ID), err)
	}
	return n, true, nil
}

// List returns the entries f selects, ordered by id.
func (s *Store) List(ctx context.Context, f Filter) ([]Entry, error) {
	if err := f.Validate(); err != nil {
		return nil, err
	}
	if s.my != nil {
		return s.my.list(ctx, f)
	}
	ids, args := f.selectIDs(s.table)
	rows, err := s.pool.Query(ctx, `SELECT `+columns+` FROM `+s.table+` WHERE id IN (`+ids+`) ORDER BY id`, args...)
	if err != nil {
		return nil, wrap("list", err)
	}
	entries, err := pgx.CollectRows(rows, scanEntry)
	if err != nil {
		return nil, wrap("list", err)
	}
	return entries, nil
}

// Get returns the entry with the given id; the error wraps [ErrNotFound]
// when there is none.
func (s *Store) Get(ctx context.Context, id int64) (Entry, error) {
	if s.my != nil {
		return s.my.get(ctx, id)
	}
	rows, err := s.pool.Query(ctx, `SELECT `+columns+` FROM `+s.table+` WHERE id = $1`, id)
	if err != nil {
		return Entry{}, wrap(fmt.Sprintf("get entry %d", id), err)
	}
	e, err := pgx.CollectExactlyOneRow(rows, scanEntry)
	if errors.Is(err, pgx.ErrNoRows) {
		return Entry{}, fmt.Errorf("%w: %d", ErrNotFound, id)
	}
	if err != nil {
		return Entry{}, wrap(fmt.Sprintf("get entry %d", id), err)
	}
	return e, nil
}

// Count returns how many entries f selects (at most f.Limit when it is
// set).
func (s *Store) Count(ctx context.Context, f Filter) (int, error) {
	if err := f.Validate(); err != nil {
		return 0, err
	}
	if s.my != nil {
		return s.my.count(ctx, f)
	}
	ids, args := f.selectIDs(s.table)
	var n int
	if err := s.pool.QueryRow(ctx, `SELECT count(*) FROM (`+ids+`) s`, args...).Scan(&n); err != nil {
		return 0, wrap("count", err)
	}
	return n, nil
}

// Missing returns those of ids that have no entry, in ascending order and
// without repeats; none when all exist.
func (s *Store) Missing(ctx context.Context, ids []int64) ([]int64, error) {
	if len(ids) == 0 {
		return nil, nil
	}
	if s.my != nil {
		return s.my.missing(ctx, ids)
	}
	rows, err := s.pool.Query(ctx, `SELECT DISTINCT u.id FROM unnest($1::bigint[]) AS u(id)
WHERE NOT EXISTS (SELECT 1 FROM `+s.table+` d WHERE d.id = u.id) ORDER BY u.id`, ids)
	if err != nil {
		return nil, wrap("look up ids", err)
	}
	missing, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	if err != nil {
		return nil, wrap("look up ids", err)
	}
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
// entry twice.
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
	ids, err := s.selectIDs(ctx, f)
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
func (s *Store) selectIDs(ctx context.Context, f Filter) ([]int64, error) {
	if s.my != nil {
		return s.my.selectIDs(ctx, f, "replay: select entries")
	}
	q, args := f.selectIDs(s.table)
	rows, err := s.pool.Query(ctx, q, args...)
	if err != nil {
		return nil, wrap("replay: select entries", err)
	}
	ids, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	if err != nil {
		return nil, wrap("replay: select entries", err)
	}
	return ids, nil
}

// replayOne replays the entry id in its own transaction. It reports false
// when the entry is gone or locked by another replay.
func (s *Store) replayOne(ctx context.Context, pub message.Publisher, id int64) (replayed bool, err error) {
	if s.my != nil {
		return s.my.replayOne(ctx, s, pub, id)
	}
	tx, err := s.pool.Begin(ctx)
	if err != nil {
		return false, wrap(fmt.Sprintf("replay entry %d: begin", id), err)
	}
	defer func() {
		// A no-op after Commit; otherwise the row stays, unlocked.
		if rbErr := tx.Rollback(context.WithoutCancel(ctx)); rbErr != nil && !errors.Is(rbErr, pgx.ErrTxClosed) {
			err = errors.Join(err, fmt.Errorf("dlq: replay entry %d: rollback: %w", id, rbErr))
		}
	}()
	rows, err := tx.Query(ctx, `SELECT `+columns+` FROM `+s.table+` WHERE id = $1 FOR UPDATE SKIP LOCKED`, id)
	if err != nil {
		return false, wrap(fmt.Sprintf("replay entry %d: lock", id), err)
	}
	e, err := pgx.CollectExactlyOneRow(rows, scanEntry)
	if errors.Is(err, pgx.ErrNoRows) {
		// Replayed or purged meanwhile, or being replayed right now.
		return false, nil
	}
	if err != nil {
		return false, wrap(fmt.Sprintf("replay entry %d: lock", id), err)
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
	wctx := context.WithoutCancel(ctx)
	if _, err := tx.Exec(wctx, `DELETE FROM `+s.table+` WHERE id = $1`, id); err != nil {
		return false, wrap(fmt.Sprintf("replay entry %d: published to %q, but delete failed (a later replay publishes it again)", id, e.Topic), err)
	}
	if err := tx.Commit(wctx); err != nil {
		return false, wrap(fmt.Sprintf("replay entry %d: published to %q, but commit failed (a later replay publishes it again)", id, e.Topic), err)
	}
	return true, nil
}

// Purge deletes the entries f selects and returns how many it deleted. An
// empty f is refused with [ErrNoSelection] unless f.All is set.
func (s *Store) Purge(ctx context.Context, f Filter) (int, error) {
	if err := f.selection(); err != nil {
		return 0, err
	}
	if s.my != nil {
		return s.my.purge(ctx, f)
	}
	ids, args := f.selectIDs(s.table)
	tag, err := s.pool.Exec(ctx, `DELETE FROM `+s.table+` WHERE id IN (`+ids+`)`, args...)
	if err != nil {
		return 0, wrap("purge", err)
	}
	return int(tag.RowsAffected()), nil
}
