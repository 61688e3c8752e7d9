package retry

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/oncemill/oncemill/internal/sqldb"
	"github.com/oncemill/oncemill/sqlschema"
)

// ErrNotMigrated is wrapped by the errors of a store whose table does not
// exist: run sqlschema.Migrate (MigrateSQL, MigrateSQLite) to the newest
// version, which creates it.
var ErrNotMigrated = errors.New("retry: the table of parked messages does not exist: run the oncemill migrations (sqlschema.Migrate) to create it")

// ErrNotFound is returned for a parked message that is not there (any
// more): it was retried, cancelled, or never parked.
var ErrNotFound = errors.New("retry: no such parked message")

// ErrNotParkable is wrapped by the error of [Store.Park] for a message
// that cannot be parked: it names no consumer or no topic (no subscriber
// would hand it back), or has no UUID (nothing tells it from another
// message). The message names the field. It is the message's fault, not
// the store's: retrying the park cannot help.
var ErrNotParkable = errors.New("retry: the message cannot be parked")

// ErrNoStore is returned by every method of a *Store that [NewStore] or
// [NewSQLStore] did not make: a nil *Store (a constructor's error that
// was dropped), or a Store{} literal. Its methods never panic.
var ErrNoStore = errors.New("retry: the store is nil or was not made by retry.NewStore or retry.NewSQLStore")

// Message is a parked message: a message whose attempts failed, waiting
// for a delayed retry, or waiting behind one of its ordering key.
type Message struct {
	// ID is the row's id: the order messages of one ordering key are
	// handed back in.
	ID int64
	// Consumer and Topic are the consumer that parked it and the topic it
	// was consumed from; it is handed back to that consumer only, on that
	// topic. Required by [Store.Park].
	//
	// Consumer, Topic, Key and OrderKey are stored, compared and read back
	// in their sqldb.Ident form: as they are when they are UTF-8 text
	// without NUL of at most 512 bytes; otherwise a readable prefix and
	// the SHA-256 of the whole value, so that a binary ordering key (a
	// Kafka record key copied into partition_key) is one key wherever it
	// is compared, and two values stay two. Filters and [Store.Waiting]
	// take the values as given.
	Consumer, Topic string
	// UUID is the message's UUID, handed back byte for byte. Required by
	// [Store.Park]. One message is its Consumer, Topic, UUID and Key: two
	// messages that share a UUID and have different keys are two.
	UUID string
	// Key is the idempotency key the consumer derived, when known; a
	// message parked without one is told from others by its UUID alone.
	Key string
	// OrderKey is the message's ordering key (delivery.PartitionKeyOf),
	// empty when it is parked unordered: a message of an ordering key is
	// handed back only when no message of that key was parked before it.
	OrderKey string
	// Attempts is how many attempts of the message failed so far.
	Attempts int
	// Error is the text of the last failure; empty for a message parked
	// behind another (Behind). NUL and bytes that are not UTF-8 are
	// stored as U+FFFD.
	Error string
	// Behind is true for a message that did not fail itself: it was
	// parked because a message of its ordering key was waiting.
	Behind bool
	// FirstFailedAt and LastFailedAt are the times of the first and the
	// last failed attempt; zero for a message parked behind another.
	FirstFailedAt, LastFailedAt time.Time
	// DueAt is when the message is handed back to its consumer.
	DueAt time.Time
	// ParkedAt is when it was parked.
	ParkedAt time.Time
	// LeasedUntil is set while a copy is out to the consumer: the message
	// is not handed out again before then.
	LeasedUntil *time.Time
	// Version grows with every lease and every re-park.
	Version int64
	// WaitsFor is the id of the message of its ordering key (same
	// consumer and topic) that goes out before it, the lowest such id;
	// 0 when it is first of its key, or unordered. Set by [Store.List];
	// 0 elsewhere.
	WaitsFor int64
	// Payload and Metadata are the message's, as it was consumed, handed
	// back byte for byte (metadata that JSON text cannot hold is kept in
	// the metadata column under sqldb.ExactKey, in base64).
	Payload  []byte
	Metadata map[string]string
}

// Store is the table of parked messages on one database: what the poison
// middleware parks (middleware.PoisonConfig.Retries), what a consumer's
// [Subscriber] hands back, and what operators list, retry now or cancel.
// Make it with [NewStore] (PostgreSQL through pgx) or [NewSQLStore]
// (PostgreSQL, MySQL/MariaDB or SQLite through database/sql). It starts no
// goroutines; it is safe for concurrent use.
type Store struct {
	db    sqldb.DB
	d     *sqldb.Dialect
	names sqlschema.Names
	cols  string
	q     struct {
		park, repark, waiting, heads, lease, byIDs, get, ack, release, counts string
	}
}

// NewStore returns the store of the table that schema names on the
// PostgreSQL database of pool.
func NewStore(pool *pgxpool.Pool, schema sqlschema.Config) (*Store, error) {
	if pool == nil {
		return nil, errors.New("retry: NewStore: pool is nil")
	}
	return newStore(sqldb.Pgx(pool), schema)
}

// NewSQLStore returns the store of the table that schema names on db, a
// database of dialect d through database/sql (sqlschema.Postgres,
// sqlschema.MySQL or sqlschema.SQLite).
func NewSQLStore(db *sql.DB, d sqlschema.Dialect, schema sqlschema.Config) (*Store, error) {
	if db == nil {
		return nil, errors.New("retry: NewSQLStore: db is nil")
	}
	dialect, err := sqldb.For(d)
	if err != nil {
		return nil, fmt.Errorf("retry: NewSQLStore: %w", err)
	}
	return newStore(sqldb.SQL(db, dialect), schema)
}

func newStore(db sqldb.DB, schema sqlschema.Config) (*Store, error) {
	schema = schema.WithDefaults()
	if err := schema.Validate(); err != nil {
		return nil, fmt.Errorf("retry: %w", err)
	}
	d := db.Dialect()
	s := &Store{db: db, d: d, names: d.Names(schema)}
	r, key, errc := s.names.Retries, d.Quote("key"), d.Quote("error")
	s.cols = "id, consumer, topic, uuid, " + key + ", order_key, attempts, " + errc + ", behind, " +
		d.MicrosEach("first_failed_at", "last_failed_at", "due_at", "parked_at", "leased_until") + ", version, payload, metadata"
	q := &s.q
	// One row per message and consumer: a copy parked again (its ack was
	// lost to a crash) is not written twice. A message is its consumer,
	// topic, uuid and key (migration message_identity); the conflict
	// names no target, so that a schema migrated before works too.
	q.park = `INSERT INTO ` + r + ` (consumer, topic, uuid, ` + key + `, order_key, attempts, ` + errc + `, behind,
	first_failed_at, last_failed_at, due_at, parked_at, payload, metadata)
VALUES (?, ?, ?, ?, ?, ?, ?, ?, ` + d.FromMicros("?") + `, ` + d.FromMicros("?") + `, ` + d.FromMicros("?") + `, ` +
		d.FromMicros("?") + `, ?, ` + d.JSON("?") + `)` + d.InsertOnce("", "id")
	q.repark = `UPDATE ` + r + ` SET attempts = ?, ` + errc + ` = ?, behind = ?,
	first_failed_at = COALESCE(first_failed_at, ` + d.FromMicros("?") + `), last_failed_at = ` + d.FromMicros("?") + `,
	due_at = ` + d.FromMicros("?") + `, leased_until = NULL, version = version + 1
WHERE id = ? AND version = ?`
	q.waiting = `SELECT COUNT(*) FROM (SELECT 1 AS one FROM ` + r + `
WHERE consumer = ? AND topic = ? AND order_key = ? LIMIT 1) AS w`
	// The messages that may go out now: due, not out already, and first
	// of their ordering key (a message out holds the ones behind it).
	q.heads = `SELECT r.id FROM ` + r + ` AS r
WHERE r.consumer = ? AND r.topic = ? AND r.due_at <= ` + d.FromMicros("?") + `
AND (r.leased_until IS NULL OR r.leased_until < ` + d.FromMicros("?") + `)
AND (r.order_key IS NULL OR NOT EXISTS (SELECT 1 FROM ` + r + ` AS e
	WHERE e.consumer = r.consumer AND e.topic = r.topic AND e.order_key = r.order_key AND e.id < r.id))
ORDER BY r.due_at, r.id LIMIT ?` + d.LockRow(true)
	q.lease = `UPDATE ` + r + ` SET leased_until = ` + d.FromMicros("?") + `, version = version + 1 WHERE id = ?`
	// A batch goes out in the order heads chose it: by due time.
	q.byIDs = `SELECT ` + s.cols + ` FROM ` + r + ` WHERE id IN (` + d.JSONInts("?") + `) ORDER BY due_at, id`
	q.get = `SELECT ` + s.cols + ` FROM ` + r + ` WHERE id = ?`
	q.ack = `DELETE FROM ` + r + ` WHERE id = ? AND version = ?`
	q.release = `UPDATE ` + r + ` SET leased_until = NULL WHERE id = ? AND version = ?`
	// Due and overdue count the messages that may go out (as heads
	// selects them): first of their ordering key and not out. A message
	// behind another of its key was parked with its park time as due
	// time, and waits for that one, not for a subscriber.
	ready := `(p.order_key IS NULL OR p.id = h.first) AND (p.leased_until IS NULL OR p.leased_until < ` + d.FromMicros("?") + `)`
	q.counts = `SELECT p.consumer, p.topic, COUNT(*),
	SUM(CASE WHEN p.due_at <= ` + d.FromMicros("?") + ` AND ` + ready + ` THEN 1 ELSE 0 END),
	SUM(CASE WHEN p.due_at <= ` + d.FromMicros("?") + ` AND ` + ready + ` THEN 1 ELSE 0 END), ` + d.Micros("MIN(p.due_at)") + `
FROM ` + r + ` AS p LEFT JOIN (SELECT consumer, topic, order_key, MIN(id) AS first FROM ` + r + `
	WHERE order_key IS NOT NULL GROUP BY consumer, topic, order_key) AS h
	ON h.consumer = p.consumer AND h.topic = p.topic AND h.order_key = p.order_key
GROUP BY p.consumer, p.topic ORDER BY p.consumer, p.topic`
	for _, p := range []*string{&q.park, &q.repark, &q.waiting, &q.heads, &q.lease, &q.byIDs, &q.get, &q.ack, &q.release, &q.counts} {
		*p = d.Rebind(*p)
	}
	return s, nil
}

// readCommitted is the level of the transactions that lease rows: on
// MySQL it takes no gap locks, so a lease never holds up a park.
var readCommitted = sqldb.TxOptions{Isolation: sqldb.ReadCommitted}

// Ready returns [ErrNoStore] for a Store the constructors did not make (a
// nil *Store, a Store{}), and nil for one they did: a configuration that
// takes a *Store can tell a store that was never made from one that was
// left out on purpose.
func (s *Store) Ready() error {
	if s == nil || s.db == nil {
		return ErrNoStore
	}
	return nil
}

// text is v as the table stores and compares an identifier: its
// sqldb.Ident form, as an argument of a byte-exact column.
func (s *Store) text(v string) any { return s.d.Text(sqldb.Ident(v)) }

func (s *Store) wrap(op string, err error) error {
	if s.d.UndefinedTable(err) {
		return fmt.Errorf("retry: %s: %w: %w", op, ErrNotMigrated, err)
	}
	return fmt.Errorf("retry: %s: %w", op, err)
}

func micros(t time.Time) any {
	if t.IsZero() {
		return nil
	}
	return t.UnixMicro()
}

// Park writes m, and reports whether it wrote it: false when the message
// (its consumer, topic, UUID and key) is parked already, which leaves that
// row as it is. m.ID, m.Version, m.ParkedAt and m.LeasedUntil are
// ignored; an empty m.OrderKey parks it unordered. A message without a
// consumer, topic or UUID is refused with [ErrNotParkable]; any bytes in
// its fields are stored (see [Message]), never refused by the database.
func (s *Store) Park(ctx context.Context, m Message) (bool, error) {
	if err := s.Ready(); err != nil {
		return false, err
	}
	for _, f := range []struct{ name, v string }{{"Consumer", m.Consumer}, {"Topic", m.Topic}, {"UUID", m.UUID}} {
		if f.v == "" {
			return false, fmt.Errorf("%w: Message.%s is empty", ErrNotParkable, f.name)
		}
	}
	var order any
	if m.OrderKey != "" {
		order = s.text(m.OrderKey)
	}
	payload := m.Payload
	if payload == nil {
		payload = []byte{}
	}
	uuid, exactUUID := sqldb.Ident(m.UUID), ""
	if uuid != m.UUID {
		exactUUID = m.UUID // the column holds its bounded form
	}
	n, err := s.db.Exec(ctx, s.q.park, s.text(m.Consumer), s.text(m.Topic), s.d.Text(uuid), s.text(m.Key), order,
		m.Attempts, sqldb.CleanText(m.Error), m.Behind, micros(m.FirstFailedAt), micros(m.LastFailedAt), m.DueAt.UnixMicro(),
		time.Now().UnixMicro(), payload, sqldb.EncodeMetadata(m.Metadata, exactUUID))
	if err != nil {
		return false, s.wrap("park", err)
	}
	return n > 0, nil
}

// Repark parks again the message that lease handed out and whose attempt
// failed: its attempts, last error and due time are m's, and it is no
// longer out. It reports false when the lease was lost meanwhile (the
// lease ran out and the message went out again, or an operator retried
// or cancelled it): the row is left as it is.
func (s *Store) Repark(ctx context.Context, l Lease, m Message) (bool, error) {
	if err := s.Ready(); err != nil {
		return false, err
	}
	n, err := s.db.Exec(ctx, s.q.repark, m.Attempts, sqldb.CleanText(m.Error), m.Behind, micros(m.FirstFailedAt), micros(m.LastFailedAt),
		m.DueAt.UnixMicro(), l.ID, l.Version)
	if err != nil {
		return false, s.wrap("park again", err)
	}
	return n > 0, nil
}

// Waiting reports whether a message of orderKey is parked for consumer on
// topic: a later message of that key must then wait behind it. The key
// is compared in its stored form (see [Message]): any bytes, a binary
// Kafka key among them, find the messages parked with the same bytes.
func (s *Store) Waiting(ctx context.Context, consumer, topic, orderKey string) (bool, error) {
	if err := s.Ready(); err != nil {
		return false, err
	}
	var n int64
	if err := s.db.QueryRow(ctx, s.q.waiting, s.text(consumer), s.text(topic), s.text(orderKey)).Scan(&n); err != nil {
		return false, s.wrap("look for parked messages of the ordering key", err)
	}
	return n > 0, nil
}

// lease takes up to n messages of consumer and topic that are due and
// first of their ordering key, and leases them until the lease's end.
func (s *Store) lease(ctx context.Context, consumer, topic string, n int, leaseFor time.Duration) ([]Message, error) {
	var out []Message
	err := sqldb.InTx(ctx, s.db, readCommitted, func(tx sqldb.Tx) error {
		now := time.Now()
		rows, err := tx.Query(ctx, s.q.heads, s.text(consumer), s.text(topic), now.UnixMicro(), now.UnixMicro(), n)
		ids, err := sqldb.Collect(rows, err, sqldb.Value[int64])
		if err != nil || len(ids) == 0 {
			return err
		}
		// One statement per row, through its primary key: a batch is
		// small, and the rows are locked already.
		until := now.Add(leaseFor).UnixMicro()
		for _, id := range ids {
			if _, err := tx.Exec(ctx, s.q.lease, until, id); err != nil {
				return err
			}
		}
		b, _ := json.Marshal(ids) // integers always encode
		rows, err = tx.Query(ctx, s.q.byIDs, string(b))
		out, err = sqldb.Collect(rows, err, func(r sqldb.Rows) (Message, error) { return scanMessage(r) })
		return err
	})
	if err != nil {
		return nil, s.wrap("take due messages", err)
	}
	return out, nil
}

// ack deletes the message that lease handed out, once its consumer acked
// it; it does nothing when the message was parked again meanwhile.
func (s *Store) ack(ctx context.Context, l Lease) error {
	if _, err := s.db.Exec(ctx, s.q.ack, l.ID, l.Version); err != nil {
		return s.wrap(fmt.Sprintf("delete parked message %d after its ack", l.ID), err)
	}
	return nil
}

// release ends the lease of a message its consumer nacked: it goes out
// again at the next poll.
func (s *Store) release(ctx context.Context, l Lease) error {
	if _, err := s.db.Exec(ctx, s.q.release, l.ID, l.Version); err != nil {
		return s.wrap(fmt.Sprintf("release parked message %d after its nack", l.ID), err)
	}
	return nil
}

// Get returns the parked message id, or an error wrapping [ErrNotFound].
func (s *Store) Get(ctx context.Context, id int64) (Message, error) {
	if err := s.Ready(); err != nil {
		return Message{}, err
	}
	m, err := scanMessage(s.db.QueryRow(ctx, s.q.get, id))
	if errors.Is(err, sqldb.ErrNoRows) {
		return Message{}, fmt.Errorf("%w: id %d", ErrNotFound, id)
	}
	if err != nil {
		return Message{}, s.wrap(fmt.Sprintf("read parked message %d", id), err)
	}
	return m, nil
}

// Count is what waits for one consumer and topic.
type Count struct {
	Consumer, Topic string
	// Parked counts the messages waiting. Due counts those that may go
	// out now and are not out: their due time has passed, and they are
	// first of their ordering key (a message behind another waits for
	// it, whatever its due time). Overdue counts those of Due whose due
	// time passed more than the overdue threshold ago: a consumer that
	// hands nothing back (its retry subscriber not running) shows here.
	Parked, Due, Overdue int64
	// NextDue is the earliest due time.
	NextDue time.Time
}

// Counts returns what waits, per consumer and topic; a message is
// overdue when it was due more than overdue ago ([DefaultOverdue] is the
// threshold the console, the command and the metrics use).
func (s *Store) Counts(ctx context.Context, overdue time.Duration) ([]Count, error) {
	if err := s.Ready(); err != nil {
		return nil, err
	}
	t := time.Now()
	now := t.UnixMicro()
	rows, err := s.db.Query(ctx, s.q.counts, now, now, t.Add(-overdue).UnixMicro(), now)
	out, err := sqldb.Collect(rows, err, func(r sqldb.Rows) (Count, error) {
		var c Count
		var due, over sql.NullInt64
		err := r.Scan(&c.Consumer, &c.Topic, &c.Parked, &due, &over, sqldb.Time(&c.NextDue))
		c.Due, c.Overdue = due.Int64, over.Int64
		return c, err
	})
	if err != nil {
		return nil, s.wrap("count parked messages", err)
	}
	return out, nil
}

// scanMessage reads a row of cols, and then of extra (the columns a
// query selects after them).
func scanMessage(row sqldb.Row, extra ...any) (Message, error) {
	var (
		m     Message
		order sql.NullString
		md    []byte
		uuid  string
	)
	dest := []any{&m.ID, &m.Consumer, &m.Topic, &m.UUID, &m.Key, &order, &m.Attempts, &m.Error, &m.Behind,
		sqldb.Time(&m.FirstFailedAt), sqldb.Time(&m.LastFailedAt), sqldb.Time(&m.DueAt), sqldb.Time(&m.ParkedAt),
		sqldb.TimeOrNil(&m.LeasedUntil), &m.Version, &m.Payload, &md}
	if err := row.Scan(append(dest, extra...)...); err != nil {
		return Message{}, err
	}
	m.OrderKey = order.String
	if m.Payload == nil {
		m.Payload = []byte{}
	}
	var err error
	if m.Metadata, uuid, err = sqldb.DecodeMetadata(md); err != nil {
		return Message{}, fmt.Errorf("parked message %d: metadata: %w", m.ID, err)
	}
	if uuid != "" {
		m.UUID = uuid // the column holds its bounded form
	}
	return m, nil
}
