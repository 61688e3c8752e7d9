package dlq

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/oncemill/oncemill/dedup/postgres"
	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/sqlschema"
)

// Publisher writes dead-lettered messages as rows of the dead-letter table.
// It implements message.Publisher, is safe for concurrent use and starts no
// goroutines.
type Publisher struct {
	pool   *pgxpool.Pool
	insert string
	// my is the table on MySQL ([NewSQLPublisher]), pool nil then.
	my *mysqlPublisher

	// mu guards the identities, learnt once per pool and per backend.
	mu       sync.Mutex
	poolID   *serverID
	backends map[string]serverID
}

// maxBackends bounds the identities a Publisher keeps of the inbox
// transactions' connections; past it, it forgets them all and learns
// again.
const maxBackends = 1024

var _ message.Publisher = (*Publisher)(nil)

// NewPublisher returns a publisher into the dead-letter table that cfg
// names (cfg.Schema and cfg.DLQTable, as given to [sqlschema.Migrate]). It
// does not create the table. The pool stays the caller's: Close does not
// close it.
func NewPublisher(pool *pgxpool.Pool, cfg sqlschema.Config) (*Publisher, error) {
	table, err := tableFor(pool, cfg)
	if err != nil {
		return nil, err
	}
	return &Publisher{
		pool: pool,
		// One entry per message and consumer: a copy dead-lettered again
		// (its ack was lost to a crash or a rebalance) is not written
		// twice, unless the first is on its way back (replay requested).
		// The unique index of migration 009 decides, so that concurrent
		// writers cannot both insert: the later waits for the earlier's
		// commit and then writes nothing.
		insert: `INSERT INTO ` + table + ` (uuid, topic, dlq_topic, consumer, key, attempts, error, permanent,
	first_failed_at, last_failed_at, kafka_partition, kafka_offset, payload, metadata)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14)
ON CONFLICT (consumer, topic, uuid) WHERE replay_requested_at IS NULL DO NOTHING`,
	}, nil
}

// tableFor validates what NewPublisher and NewStore are given and returns
// the quoted dead-letter table.
func tableFor(pool *pgxpool.Pool, cfg sqlschema.Config) (string, error) {
	if pool == nil {
		return "", errors.New("dlq: pool is nil")
	}
	cfg = cfg.WithDefaults()
	if err := cfg.Validate(); err != nil {
		return "", fmt.Errorf("dlq: %w", err)
	}
	return sqlschema.NamesFor(sqlschema.Postgres, cfg).DLQ, nil
}

// DefaultTopic is the dead-letter topic a [Publisher] files entries under
// when middleware.PoisonConfig.Topic is left empty: the table is the
// dead-letter queue, and the topic is only a label on its entries.
const DefaultTopic = "dlq"

// DefaultTopic returns [DefaultTopic]: the poison middleware takes it when
// its Topic is empty.
func (p *Publisher) DefaultTopic() string { return DefaultTopic }

// Publish writes msgs as one row each, in one transaction: all of them or,
// on error, none. A message that the table holds already for the same
// consumer and original topic (same UUID), and whose replay was not
// requested, is not written again: a message whose ack was lost after it
// was dead-lettered comes back and is dead-lettered again, and the table
// keeps one entry for it, so that a replay sends it once; a unique index
// keeps it so for writers at the same instant too (two consumers of one
// group dead-lettering the same copy), without an inbox. When the first message's context carries an inbox
// transaction on the same database (postgres.Tx), as the poison
// middleware's dead-lettering under a key's claim does, the rows are
// written in that transaction, so that the dead letter and the key's dead
// mark commit together. The same database is what the two sessions'
// server reports, whatever host name each connected to: its
// pg_control_system() system identifier (where the role may call it,
// as by default), its start time and the database's name; the first
// dead letter on each connection asks, in the transaction. topic, the topic the publisher was called with, is kept
// as the entry's DLQTopic; the original topic and the other columns come
// from the delivery.Dead* metadata. The statements run with the first
// message's context, as Watermill's SQL publisher does.
//
// Text that PostgreSQL cannot store (invalid UTF-8, NUL characters) is
// stored with U+FFFD in its place; the payload is stored as it is.
func (p *Publisher) Publish(topic string, msgs ...*message.Message) error {
	if len(msgs) == 0 {
		return nil
	}
	for i, m := range msgs {
		if m == nil {
			return fmt.Errorf("dlq: publish to %q: message %d is nil", topic, i)
		}
	}
	if p.my != nil {
		return p.my.publish(topic, msgs)
	}
	batch := &pgx.Batch{}
	for _, m := range msgs {
		args, err := insertArgs(topic, m)
		if err != nil {
			return fmt.Errorf("dlq: publish %s to %q: %w", m.UUID, topic, err)
		}
		batch.Queue(p.insert, args...)
	}
	ctx := msgs[0].Context()
	same := false
	if tx := postgres.Tx(ctx); tx != nil {
		var err error
		if same, err = p.sameDatabase(ctx, tx); err != nil {
			return wrap(fmt.Sprintf("publish %d messages to %q", len(msgs), topic), err)
		}
	}
	if same {
		tx := postgres.Tx(ctx)
		// Dead-lettered under an inbox claim in this database (the poison
		// middleware puts the claim's transaction in the context): the row
		// commits or rolls back with the key's dead mark.
		if err := tx.SendBatch(ctx, batch).Close(); err != nil {
			return wrap(fmt.Sprintf("publish %d messages to %q in the inbox's transaction", len(msgs), topic), err)
		}
		return nil
	}
	err := pgx.BeginFunc(ctx, p.pool, func(tx pgx.Tx) error {
		return tx.SendBatch(ctx, batch).Close()
	})
	if err != nil {
		return wrap(fmt.Sprintf("publish %d messages to %q", len(msgs), topic), err)
	}
	return nil
}

// serverID tells apart where sessions are connected: the server (its
// system identifier, and when it started) and the database.
type serverID struct {
	// system is pg_control_system()'s system_identifier, or 0 where the
	// role may not call pg_control_system().
	system   int64
	started  time.Time
	database string
}

// same reports whether a and b are the same database of the same server.
// Without a system identifier on either side, the server's start time (to
// the microsecond) and the database name decide.
func (a serverID) same(b serverID) bool {
	if a.database != b.database || !a.started.Equal(b.started) {
		return false
	}
	return a.system == 0 || b.system == 0 || a.system == b.system
}

// queryRower is a pool or a transaction.
type queryRower interface {
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// identify reads db's serverID. Each statement is one that cannot fail
// for lack of a privilege, so that a transaction it runs in stays usable.
func identify(ctx context.Context, db queryRower) (serverID, error) {
	var (
		id      serverID
		control bool
	)
	err := db.QueryRow(ctx, `SELECT has_function_privilege('pg_catalog.pg_control_system()', 'EXECUTE'),
	pg_postmaster_start_time(), current_database()`).Scan(&control, &id.started, &id.database)
	if err != nil {
		return serverID{}, fmt.Errorf("identify the server: %w", err)
	}
	if control {
		if err := db.QueryRow(ctx, `SELECT system_identifier FROM pg_catalog.pg_control_system()`).Scan(&id.system); err != nil {
			return serverID{}, fmt.Errorf("identify the server: %w", err)
		}
	}
	return id, nil
}

// sameDatabase reports whether tx runs on the server and database of the
// pool, where the dead-letter table is. It compares what the servers say
// of themselves, not the host names (localhost and 127.0.0.1 are one
// server; one host may serve several databases): the system identifier
// of pg_control_system(), where the role may call it, the server's start
// time and the database's name. The pool's identity is learnt once, each
// connection's once per backend (its process id and cancel key): at most
// two statements in tx the first time a backend dead-letters, none after.
func (p *Publisher) sameDatabase(ctx context.Context, tx pgx.Tx) (bool, error) {
	conn := tx.Conn()
	if conn == nil || conn.PgConn() == nil {
		return false, nil
	}
	pool, err := p.poolIdentity(ctx)
	if err != nil {
		return false, err
	}
	pc := conn.PgConn()
	backend := strconv.FormatUint(uint64(pc.PID()), 10) + ":" + string(pc.SecretKey())
	p.mu.Lock()
	id, ok := p.backends[backend]
	p.mu.Unlock()
	if !ok {
		if id, err = identify(ctx, tx); err != nil {
			return false, err
		}
		p.mu.Lock()
		if p.backends == nil || len(p.backends) >= maxBackends {
			p.backends = map[string]serverID{}
		}
		p.backends[backend] = id
		p.mu.Unlock()
	}
	return pool.same(id), nil
}

// poolIdentity returns the pool's serverID, learnt on first use.
func (p *Publisher) poolIdentity(ctx context.Context) (serverID, error) {
	p.mu.Lock()
	id := p.poolID
	p.mu.Unlock()
	if id != nil {
		return *id, nil
	}
	learnt, err := identify(ctx, p.pool)
	if err != nil {
		return serverID{}, err
	}
	p.mu.Lock()
	p.poolID = &learnt
	p.mu.Unlock()
	return learnt, nil
}

// Close does nothing: the pool belongs to the caller. It returns nil.
func (p *Publisher) Close() error { return nil }

// insertArgs parses m's dead-letter metadata into the INSERT's arguments.
// Encoding the cleaned metadata as JSON cannot fail in practice; the error
// is returned all the same.
func insertArgs(dlqTopic string, m *message.Message) ([]any, error) {
	md := make(map[string]string, len(m.Metadata)+1)
	for k, v := range m.Metadata {
		md[clean(k)] = clean(v)
	}
	uuid := ident(m.UUID)
	if _, ok := md[delivery.DeadUUID]; !ok && uuid != clean(m.UUID) {
		// Too long for the index: the entry's uuid is its bounded form,
		// and a replay takes the whole UUID from here.
		md[delivery.DeadUUID] = clean(m.UUID)
	}
	mdJSON, err := json.Marshal(md)
	if err != nil {
		return nil, fmt.Errorf("encode metadata: %w", err)
	}
	payload := []byte(m.Payload)
	if payload == nil {
		payload = []byte{}
	}
	get := func(key string) string { return md[key] }
	return []any{
		uuid,
		ident(get(delivery.DeadTopic)),
		ident(dlqTopic),
		ident(get(delivery.DeadConsumer)),
		ident(get(delivery.DeadKey)),
		parseAttempts(get(delivery.DeadAttempts)),
		get(delivery.DeadError),
		parsePermanent(get(delivery.DeadPermanent)),
		parseTime(get(delivery.DeadFirstFailedAt)),
		parseTime(get(delivery.DeadLastFailedAt)),
		parsePartition(get(delivery.DeadPartition)),
		parseOffset(get(delivery.DeadOffset)),
		payload,
		mdJSON,
	}, nil
}

// clean makes s storable as PostgreSQL text and jsonb: invalid UTF-8 and
// NUL characters, which neither accepts, become U+FFFD.
func clean(s string) string {
	s = strings.ToValidUTF8(s, "\uFFFD")
	return strings.ReplaceAll(s, "\x00", "\uFFFD")
}

// ident is the form of an identifier (uuid, topic, consumer, key) in a
// column of the dead-letter table: clean, and bounded ([delivery.Bound])
// so that a value of any length fits the table's indexes, on PostgreSQL
// and MySQL alike. The metadata keeps the whole value (the topic,
// consumer and key in their delivery.Dead* fields, the UUID in
// delivery.DeadUUID).
func ident(s string) string { return delivery.Bound(clean(s)) }

// parseAttempts reads an attempt count; garbage or a negative number is 0.
func parseAttempts(s string) int32 {
	n, err := strconv.ParseInt(strings.TrimSpace(s), 10, 32)
	if err != nil || n < 0 {
		return 0
	}
	return int32(n)
}

// parsePermanent reads a boolean; garbage is false.
func parsePermanent(s string) bool {
	b, err := strconv.ParseBool(strings.TrimSpace(s))
	return err == nil && b
}

// parseTime reads an RFC 3339 time; garbage is NULL.
func parseTime(s string) *time.Time {
	t, err := time.Parse(time.RFC3339Nano, strings.TrimSpace(s))
	if err != nil {
		return nil
	}
	return &t
}

// parsePartition reads a Kafka partition; garbage or a negative number is
// NULL.
func parsePartition(s string) *int32 {
	n, err := strconv.ParseInt(strings.TrimSpace(s), 10, 32)
	if err != nil || n < 0 {
		return nil
	}
	p := int32(n)
	return &p
}

// parseOffset reads a Kafka offset; garbage or a negative number is NULL.
func parseOffset(s string) *int64 {
	n, err := strconv.ParseInt(strings.TrimSpace(s), 10, 64)
	if err != nil || n < 0 {
		return nil
	}
	return &n
}

// wrap prefixes a database error with the operation, and marks a missing
// table with ErrNotMigrated.
func wrap(op string, err error) error {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == "42P01" { // undefined_table
		return fmt.Errorf("dlq: %s: %w: %w", op, ErrNotMigrated, err)
	}
	return fmt.Errorf("dlq: %s: %w", op, err)
}
