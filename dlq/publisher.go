package dlq

import (
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/json"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/internal/inboxtx"
	"github.com/oncemill/oncemill/internal/sqldb"
	"github.com/oncemill/oncemill/sqlschema"
)

// Publisher writes dead-lettered messages as rows of the dead-letter table.
// It implements message.Publisher, is safe for concurrent use and starts no
// goroutines.
type Publisher struct {
	t *table

	// mu guards the identities, learnt once for the table's database and
	// once per pgx backend.
	mu       sync.Mutex
	own      *sqldb.Identity
	backends map[string]sqldb.Identity
}

// maxBackends bounds the identities a Publisher keeps of the inbox
// transactions' connections; past it, it forgets them all and learns
// again.
const maxBackends = 1024

var _ message.Publisher = (*Publisher)(nil)

// NewPublisher returns a publisher into the PostgreSQL dead-letter table
// that cfg names (cfg.Schema and cfg.DLQTable, as given to
// [sqlschema.Migrate]), through a pgx pool. It does not create the table.
// The pool stays the caller's: Close does not close it.
func NewPublisher(pool *pgxpool.Pool, cfg sqlschema.Config) (*Publisher, error) {
	t, err := openPool(pool, cfg)
	if err != nil {
		return nil, err
	}
	return &Publisher{t: t}, nil
}

// NewSQLPublisher returns a publisher into the dead-letter table that cfg
// names on db, a database of dialect d through database/sql
// (sqlschema.Postgres, sqlschema.MySQL or sqlschema.SQLite), as
// [NewSQLStore] does. It is the [Publisher] of [NewPublisher] otherwise.
// It does not create the table; Close does not close db.
func NewSQLPublisher(db *sql.DB, d sqlschema.Dialect, cfg sqlschema.Config) (*Publisher, error) {
	t, err := openSQL(db, d, cfg)
	if err != nil {
		return nil, err
	}
	return &Publisher{t: t}, nil
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
// consumer and original topic (same UUID and key: two messages that share
// a UUID and have different keys are two entries), and whose replay was
// not requested, is not written again: a message whose ack was lost after it
// was dead-lettered comes back and is dead-lettered again, and the table
// keeps one entry for it, so that a replay sends it once; a unique index
// keeps it so for writers at the same instant too (two consumers of one
// group dead-lettering the same copy), without an inbox.
//
// When the first message's context carries an inbox transaction on the
// same database (postgres.Tx, sqlstore.Tx or sqlite.Tx of package dedup),
// as the poison middleware's dead-lettering under a key's claim does, the
// rows are written in that transaction, so that the dead letter and the
// key's dead mark commit together (and on SQLite, whose one writer is the
// inbox's transaction, the dead letter does not wait for it). An
// operator's cancel of a parked message (retry.Store.Cancel) carries its
// own transaction the same way, so that the dead letter and the delete of
// the parked row commit together. The same
// database is what the two sessions' server reports, whatever host name
// each connected to (sqldb.Identify): on PostgreSQL its
// pg_control_system() system identifier (where the role may call it, as
// by default), its start time and the database's name; on MySQL the
// server (@@server_uuid, MariaDB's @@server_uid), whose transactions span
// its databases; on SQLite the database file. The dead letter asks, in
// the transaction (through pgx once per connection). topic, the topic the
// publisher was called with, is kept as the entry's DLQTopic; the
// original topic and the other columns come from the delivery.Dead*
// metadata. The statements run with the first message's context, as
// Watermill's SQL publisher does.
//
// Text that PostgreSQL cannot store (invalid UTF-8, NUL characters) is
// stored with U+FFFD in its place, on every database: the error and the
// metadata as that text; the uuid, topic, consumer and key as their
// sqldb.Ident form, which ends in the digest of the whole value when the
// value was not text or was longer than 512 bytes, so that two messages
// whose values differ only there stay two entries. The payload is stored
// as it is.
func (p *Publisher) Publish(topic string, msgs ...*message.Message) error {
	return p.publish(topic, msgs, false)
}

// PublishDistinct writes msgs as [Publisher.Publish] does, except that it
// merges no message into an entry the table holds already: a message
// whose consumer, original topic, uuid and key have an entry (whose
// replay was not requested) is written as an entry of its own, under a
// uuid made unique for it ("<uuid>#dead-letter-<random>"), with its own
// uuid in delivery.DeadUUID, which a replay publishes with.
// retry.Store.Cancel writes an operator's cancelled messages this way:
// it deletes each parked row with its dead letter, and the payload must
// not go with it because an entry of another copy was there.
func (p *Publisher) PublishDistinct(topic string, msgs ...*message.Message) error {
	return p.publish(topic, msgs, true)
}

func (p *Publisher) publish(topic string, msgs []*message.Message, distinct bool) error {
	if len(msgs) == 0 {
		return nil
	}
	args := make([][]any, len(msgs))
	for i, m := range msgs {
		if m == nil {
			return fmt.Errorf("dlq: publish to %q: message %d is nil", topic, i)
		}
		a, err := insertArgs(p.t.d, topic, m)
		if err != nil {
			return fmt.Errorf("dlq: publish %s to %q: %w", m.UUID, topic, err)
		}
		args[i] = a
	}
	ctx := msgs[0].Context()
	op := fmt.Sprintf("publish %d messages to %q", len(msgs), topic)
	write := func(tx sqldb.Executor) error {
		if ptx, ok := sqldb.PgxTx(tx); ok && p.t.d.Pipeline && len(args) > 1 && !distinct {
			// One round trip for all the rows.
			batch := &pgx.Batch{}
			for _, a := range args {
				batch.Queue(p.t.q.insert, a...)
			}
			return ptx.SendBatch(ctx, batch).Close()
		}
		for i, a := range args {
			n, err := tx.Exec(ctx, p.t.q.insert, a...)
			if err != nil {
				return err
			}
			if n == 0 && distinct {
				if err := p.writeApart(ctx, tx, topic, msgs[i]); err != nil {
					return err
				}
			}
		}
		return nil
	}
	if tx := inboxtx.Executor(ctx); tx != nil {
		same, err := p.sameDatabase(ctx, tx)
		if err != nil {
			return p.t.wrap(op, err)
		}
		if same {
			// Dead-lettered under an inbox claim in this database (the
			// poison middleware puts the claim's transaction in the
			// context): the row commits or rolls back with the key's
			// dead mark.
			if err := write(tx); err != nil {
				return p.t.wrap(op+" in the inbox's transaction", err)
			}
			return nil
		}
	}
	if err := sqldb.InTx(ctx, p.t.db, readCommitted, func(tx sqldb.Tx) error { return write(tx) }); err != nil {
		return p.t.wrap(op, err)
	}
	return nil
}

// writeApart writes m, whose entry the table holds already, under a uuid
// made unique for it, with its own uuid in delivery.DeadUUID.
func (p *Publisher) writeApart(ctx context.Context, tx sqldb.Executor, topic string, m *message.Message) error {
	var salt [6]byte
	_, _ = rand.Read(salt[:])
	apart := message.NewMessage(fmt.Sprintf("%s#dead-letter-%x", m.UUID, salt), m.Payload)
	for k, v := range m.Metadata {
		apart.Metadata.Set(k, v)
	}
	if apart.Metadata.Get(delivery.DeadUUID) == "" {
		apart.Metadata.Set(delivery.DeadUUID, m.UUID)
	}
	a, err := insertArgs(p.t.d, topic, apart)
	if err != nil {
		return fmt.Errorf("dlq: publish %s to %q: %w", m.UUID, topic, err)
	}
	n, err := tx.Exec(ctx, p.t.q.insert, a...)
	if err == nil && n == 0 {
		err = fmt.Errorf("dlq: publish %s to %q: the table holds an entry of uuid %q already", m.UUID, topic, apart.UUID)
	}
	return err
}

// sameDatabase reports whether tx runs on the database of the dead-letter
// table. It compares what the servers say of themselves
// (sqldb.Identify), not the host names (localhost and 127.0.0.1 are one
// server; one host may serve several databases). The table's identity is
// learnt once; a pgx connection's once per backend (its process id and
// cancel key); a database/sql transaction's every time.
func (p *Publisher) sameDatabase(ctx context.Context, tx sqldb.Executor) (bool, error) {
	if sqldb.SameAddress(p.t.db, tx) {
		// The inbox's pool and this one reach one address: no statement,
		// and above all no second connection from a pool whose every
		// connection may be held by a handler waiting for its dead letter.
		return true, nil
	}
	p.mu.Lock()
	own := p.own
	p.mu.Unlock()
	if own == nil {
		id, err := sqldb.Identify(ctx, p.t.db)
		if err != nil {
			return false, err
		}
		own = &id
		p.mu.Lock()
		p.own = own
		p.mu.Unlock()
	}
	backend := ""
	if ptx, ok := sqldb.PgxTx(tx); ok {
		if conn := ptx.Conn(); conn != nil && conn.PgConn() != nil {
			pc := conn.PgConn()
			backend = strconv.FormatUint(uint64(pc.PID()), 10) + ":" + string(pc.SecretKey())
		}
	}
	p.mu.Lock()
	id, ok := p.backends[backend]
	p.mu.Unlock()
	if !ok || backend == "" {
		var err error
		if id, err = sqldb.Identify(ctx, tx); err != nil {
			return false, err
		}
		if backend != "" {
			p.mu.Lock()
			if p.backends == nil || len(p.backends) >= maxBackends {
				p.backends = map[string]sqldb.Identity{}
			}
			p.backends[backend] = id
			p.mu.Unlock()
		}
	}
	return own.Same(id), nil
}

// Close does nothing: the pool belongs to the caller. It returns nil.
func (p *Publisher) Close() error { return nil }

// insertArgs parses m's dead-letter metadata into the INSERT's arguments,
// in d's types, through the SQL layer's storable-text rules: the
// identifier columns (uuid, topic, dlq_topic, consumer, key) hold
// sqldb.Ident of the whole value, the error and the metadata their clean
// text (sqldb.CleanText, sqldb.CleanMetadata). Encoding the cleaned
// metadata as JSON cannot fail in practice; the error is returned all the
// same.
func insertArgs(d *sqldb.Dialect, dlqTopic string, m *message.Message) ([]any, error) {
	md := sqldb.CleanMetadata(m.Metadata)
	uuid := sqldb.Ident(m.UUID)
	if _, ok := md[delivery.DeadUUID]; !ok && uuid != sqldb.CleanText(m.UUID) {
		// Too long for the index, or not text: the entry's uuid is its
		// bounded form, and a replay takes the UUID from here.
		md[delivery.DeadUUID] = sqldb.CleanText(m.UUID)
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
	ident := func(key string) any { return d.Text(sqldb.Ident(m.Metadata.Get(key))) }
	return []any{
		d.Text(uuid),
		ident(delivery.DeadTopic),
		d.Text(sqldb.Ident(dlqTopic)),
		ident(delivery.DeadConsumer),
		ident(delivery.DeadKey),
		parseAttempts(get(delivery.DeadAttempts)),
		get(delivery.DeadError),
		parsePermanent(get(delivery.DeadPermanent)),
		parseTime(get(delivery.DeadFirstFailedAt)),
		parseTime(get(delivery.DeadLastFailedAt)),
		parseInt(get(delivery.DeadPartition), 32),
		parseInt(get(delivery.DeadOffset), 64),
		payload,
		string(mdJSON),
	}, nil
}

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

// parseTime reads an RFC 3339 time as microseconds since the epoch;
// garbage is NULL.
func parseTime(s string) any {
	t, err := time.Parse(time.RFC3339Nano, strings.TrimSpace(s))
	if err != nil {
		return nil
	}
	return t.UnixMicro()
}

// parseInt reads a Kafka partition (bits 32) or offset (64); garbage or a
// negative number is NULL.
func parseInt(s string, bits int) any {
	n, err := strconv.ParseInt(strings.TrimSpace(s), 10, bits)
	if err != nil || n < 0 {
		return nil
	}
	return n
}
