package forwarder

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"hash/crc32"
	"slices"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"

	"github.com/oncemill/oncemill/dedup/postgres"
	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/internal/inboxtx"
	"github.com/oncemill/oncemill/internal/sqldb"
	"github.com/oncemill/oncemill/observe"
	"github.com/oncemill/oncemill/sqlschema"
)

// ErrNotForRelay is returned by the outbox schema adapter's read side:
// the outbox is read by [Relay], never by a watermill-sql subscriber.
var ErrNotForRelay = errors.New("forwarder: the outbox table is read by forwarder.Relay, not by a watermill-sql subscriber")

// TxPublisher writes messages as outbox rows in a caller's transaction, so
// that they commit or roll back with the business rows. Publish keeps each
// message's UUID, metadata, destination topic and partition key
// ([delivery.PartitionKeyOf], else the UUID). It is a watermill-sql v4
// publisher bound to the transaction. It starts no goroutines.
//
// A message marked with [PublishAt] or [Delay] for a time still ahead is
// written to the outbox's scheduled table instead, and the relay moves it
// into the outbox once it is due (see [DueAtKey]); so is one whose time
// has passed while a row of its key that is due waits there.
type TxPublisher struct {
	ctx   context.Context
	tx    wsql.ContextExecutor
	pub   *wsql.Publisher
	hooks observe.Hooks
	// schema writes the outbox; scheduled, made on the first message for
	// the scheduled table, writes that table.
	schema    outboxSchema
	names     sqlschema.Names
	scheduled *wsql.Publisher
}

// TxOption configures a [TxPublisher] (and [InboxOutbox]).
type TxOption func(*txOptions)

type txOptions struct{ hooks []observe.Hook }

// WithHooks gives the publisher hooks that see each event before it is
// written (observe.MessageOutHook, with the writer's context): a trace
// hook puts the writer's trace context into the event's metadata, so that
// the trace goes on through the relay to the consumers.
func WithHooks(hooks ...observe.Hook) TxOption {
	return func(o *txOptions) { o.hooks = append(o.hooks, hooks...) }
}

// NewTxPublisher returns a publisher that writes into tx. Its inserts run
// with ctx, not with the messages' contexts (watermill-sql uses the first
// message's context, and a message's context may already be cancelled).
// cfg names the outbox table, as given to [sqlschema.Migrate].
func NewTxPublisher(ctx context.Context, tx pgx.Tx, cfg sqlschema.Config, opts ...TxOption) (*TxPublisher, error) {
	if tx == nil {
		return nil, errors.New("forwarder: NewTxPublisher: tx is nil")
	}
	return newTxPublisher(ctx, wsql.TxFromPgx(tx), outboxSchema{d: sqldb.Postgres}, cfg, opts)
}

// NewSQLTxPublisher returns a publisher that writes into tx, a
// database/sql transaction on a database of dialect d, for applications
// whose data layer is database/sql (GORM, sqlc, sqlx): sqlschema.Postgres
// (pgx's stdlib or lib/pq), sqlschema.MySQL (MySQL 8.0+, MariaDB 10.6+
// through go-sql-driver/mysql) or sqlschema.SQLite (modernc.org/sqlite);
// a [Relay] with RelayConfig.DB (or, on PostgreSQL, RelayConfig.Pool)
// relays the rows. It is the [TxPublisher] of [NewTxPublisher] otherwise:
// its inserts run with ctx, it keeps each message's UUID, metadata and
// partition key, and it starts no goroutines. cfg names the outbox table,
// as given to sqlschema.MigrateSQL.
func NewSQLTxPublisher(ctx context.Context, tx *sql.Tx, d sqlschema.Dialect, cfg sqlschema.Config, opts ...TxOption) (*TxPublisher, error) {
	if tx == nil {
		return nil, errors.New("forwarder: NewSQLTxPublisher: tx is nil")
	}
	dialect, err := sqldb.For(d)
	if err != nil {
		return nil, fmt.Errorf("forwarder: NewSQLTxPublisher: %w", err)
	}
	return newTxPublisher(ctx, wsql.TxFromStdSQL(tx), outboxSchema{d: dialect, metadataText: true}, cfg, opts)
}

func newTxPublisher(ctx context.Context, tx wsql.ContextExecutor, schema outboxSchema, cfg sqlschema.Config, opts []TxOption) (*TxPublisher, error) {
	cfg = cfg.WithDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	names := schema.d.Names(cfg)
	pub, err := wsql.NewPublisher(tx, wsql.PublisherConfig{SchemaAdapter: schema.on(names.Outbox)}, watermill.NopLogger{})
	if err != nil {
		return nil, fmt.Errorf("forwarder: %w", err)
	}
	var o txOptions
	for _, opt := range opts {
		opt(&o)
	}
	return &TxPublisher{ctx: context.WithoutCancel(ctx), tx: tx, pub: pub, hooks: observe.New(o.hooks...), schema: schema, names: names}, nil
}

// Publish writes msgs to topic as outbox rows in the transaction: the
// messages with no due time into the outbox, those with a due time ahead
// ([PublishAt], [Delay]) into the scheduled table, each table's in their
// order. A message whose due time has passed goes to the outbox as well,
// unless a row of its partition key due by now still waits in the
// scheduled table, as the transaction sees it (one this transaction
// wrote while its due time was ahead, or one committed before and not
// yet moved by a relay): it then goes to the scheduled table, due now,
// behind that row, which it would otherwise overtake. A due time that is
// not an RFC 3339 time fails the call before anything is written.
func (p *TxPublisher) Publish(topic string, msgs ...*message.Message) error {
	if len(msgs) == 0 {
		return nil
	}
	var (
		now    = time.Now()
		copies = make([]*message.Message, len(msgs))
		when   = make([]dueState, len(msgs))
		past   []string // the keys of the messages due by now
	)
	if err := sqldb.CheckWhole("topic", topic, 0); err != nil {
		return fmt.Errorf("forwarder: write outbox rows: %w", err)
	}
	for i, m := range msgs {
		at, ok, err := dueAt(m)
		if err != nil {
			return err
		}
		c := m.Copy()
		c.SetContext(p.ctx)
		p.hooks.MessageOut(p.ctx, observe.OutOutboxWrite, c)
		copies[i] = c
		switch {
		case !ok:
			when[i] = dueNone
		case at.After(now):
			when[i] = dueAhead
		default:
			when[i] = duePast
			past = append(past, partitionKey(c))
		}
	}
	if len(past) > 0 {
		waiting, err := p.keysWaiting(past, now)
		if err != nil {
			return fmt.Errorf("forwarder: write outbox rows for topic %q: %w", topic, err)
		}
		for i, c := range copies {
			if when[i] == duePast && waiting[sqldb.Ident(partitionKey(c))] {
				when[i] = dueAhead
			}
		}
	}
	var immediate, scheduled []*message.Message
	for i, c := range copies {
		if when[i] == dueAhead {
			scheduled = append(scheduled, c)
		} else {
			immediate = append(immediate, c)
		}
	}
	if len(immediate) > 0 {
		if err := p.pub.Publish(topic, immediate...); err != nil {
			return fmt.Errorf("forwarder: write outbox rows for topic %q: %w", topic, err)
		}
	}
	if len(scheduled) > 0 {
		if err := p.publishScheduled(topic, scheduled); err != nil {
			return fmt.Errorf("forwarder: write scheduled outbox rows for topic %q: %w", topic, err)
		}
	}
	return nil
}

// dueState is where Publish writes a message: dueNone and duePast to the
// outbox, dueAhead to the scheduled table.
type dueState uint8

const (
	dueNone  dueState = iota // no due time
	duePast                  // a due time already past
	dueAhead                 // a due time ahead, or behind a row that waits
)

// partitionKey is the key msg's row is ordered by: its partition key,
// else its UUID.
func partitionKey(msg *message.Message) string {
	if key := delivery.PartitionKeyOf(msg); key != "" {
		return key
	}
	return msg.UUID
}

// keysWaiting returns which of keys, in their stored form (sqldb.Ident),
// have a row in the scheduled table due by now (the writer's clock, which decided what is due), as the
// transaction sees it: rows a relay has not moved into the outbox yet,
// which a row of the key written now into the outbox would overtake. A
// relay moving such a row holds it until it commits, so the row is seen
// in one table or the other, never in neither. On a schema migrated
// before the scheduled table the error wraps [ErrNoScheduledTable].
func (p *TxPublisher) keysWaiting(keys []string, now time.Time) (map[string]bool, error) {
	stored := make([]string, len(keys))
	for i, k := range keys {
		stored[i] = sqldb.Ident(k) // as InsertQuery writes it
	}
	keys = slices.Compact(slices.Sorted(slices.Values(stored)))
	d := p.schema.d
	q := d.Rebind(`SELECT DISTINCT partition_key FROM ` + p.names.Scheduled +
		` WHERE due_at <= ` + d.FromMicros("?") + ` AND partition_key IN ` + sqldb.List(len(keys)))
	rs, err := p.tx.QueryContext(p.ctx, q, append([]any{now.UnixMicro()}, d.Texts(keys)...)...)
	if d.UndefinedTable(err) {
		return nil, fmt.Errorf("look for due scheduled rows: %w (%s): %w", ErrNoScheduledTable, p.names.Scheduled, err)
	}
	if err != nil {
		return nil, fmt.Errorf("look for due scheduled rows: %w", err)
	}
	waiting := map[string]bool{}
	for rs.Next() {
		var key string
		if err := rs.Scan(&key); err != nil {
			_ = rs.Close()
			return nil, fmt.Errorf("look for due scheduled rows: %w", err)
		}
		waiting[key] = true
	}
	if r, ok := rs.(interface{ Err() error }); ok && r.Err() != nil {
		_ = rs.Close()
		return nil, fmt.Errorf("look for due scheduled rows: %w", r.Err())
	}
	if err := rs.Close(); err != nil {
		return nil, fmt.Errorf("look for due scheduled rows: %w", err)
	}
	return waiting, nil
}

// publishScheduled writes msgs into the scheduled table. On a schema
// migrated before the table, the error wraps [ErrNoScheduledTable]; on
// PostgreSQL the transaction is then aborted, as after any failed
// statement.
func (p *TxPublisher) publishScheduled(topic string, msgs []*message.Message) error {
	if p.scheduled == nil {
		pub, err := wsql.NewPublisher(p.tx, wsql.PublisherConfig{SchemaAdapter: p.schema.onScheduled(p.names.Scheduled)}, watermill.NopLogger{})
		if err != nil {
			return err
		}
		p.scheduled = pub
	}
	err := p.scheduled.Publish(topic, msgs...)
	if p.schema.d.UndefinedTable(err) {
		return fmt.Errorf("%w (%s): %w", ErrNoScheduledTable, p.names.Scheduled, err)
	}
	return err
}

// Close closes the publisher; the transaction is the caller's.
func (p *TxPublisher) Close() error {
	if p.scheduled != nil {
		return errors.Join(p.pub.Close(), p.scheduled.Close())
	}
	return p.pub.Close()
}

// outboxSchema is the write side of a watermill-sql schema adapter for
// the outbox table: one table for every topic.
type outboxSchema struct {
	d *sqldb.Dialect
	// metadataText sends the metadata as text rather than bytes, for
	// database/sql drivers (lib/pq sends bytes as bytea, SQLite stores
	// them as a BLOB).
	metadataText bool
	// insert starts the INSERT; row is one row's values.
	insert, row string
	// due: the rows go to the scheduled table, with their due time.
	due bool
}

// on returns s writing into table, the outbox (or, from onScheduled,
// the scheduled table).
func (s outboxSchema) on(table string) outboxSchema {
	cols, row := "topic, uuid, partition_key, payload, metadata", "?, ?, ?, ?, ?"
	if s.d.WriterHashes() {
		// The lane, which the database does not generate.
		cols, row = cols+", lane", row+", ?"
	}
	if recordsWriter(s.d) {
		// The outbox of a database whose relay reads rows in flight
		// records their writing session, which the relay's Lag names
		// while the row holds back the rows behind it; its created_at
		// has no default.
		cols, row = cols+", created_at, writer", row+", "+s.d.Now()+", "+s.d.SessionID()
	}
	if s.due {
		cols, row = cols+", due_at", row+", "+s.d.FromMicros("?")
	}
	s.insert, s.row = `INSERT INTO `+table+` (`+cols+`) VALUES `, "("+row+")"
	return s
}

// onScheduled returns s writing into table, the scheduled table: the
// outbox's columns and the due time.
func (s outboxSchema) onScheduled(table string) outboxSchema {
	s.due = true
	return s.on(table)
}

// recordsWriter reports whether the outbox of d has the columns
// created_at and writer for the writer to fill: the database's relay
// reads rows in flight, and names their writer.
func recordsWriter(d *sqldb.Dialect) bool { return d.ReadUncommitted && !d.Snapshots }

func (s outboxSchema) InsertQuery(params wsql.InsertQueryParams) (wsql.Query, error) {
	var (
		b    strings.Builder
		args = make([]any, 0, 6*len(params.Msgs))
		// written is the rows' write, the earliest due time a scheduled
		// row gets.
		written = time.Now()
	)
	b.WriteString(s.insert)
	for i, m := range params.Msgs {
		// The SQL layer's storable rules: the partition key (which orders
		// and hashes the row, and is never published from the column) in
		// its sqldb.Ident form; the metadata, and a UUID its column holds
		// in that form, byte for byte through sqldb.EncodeMetadata, which
		// the relay decodes. A binary Kafka key in partition_key, a NUL in
		// a header or a UUID of any length is written, never refused by
		// the database.
		uuid, exactUUID := sqldb.Ident(m.UUID), ""
		if uuid != m.UUID {
			exactUUID = m.UUID
		}
		md := []byte(sqldb.EncodeMetadata(m.Metadata, exactUUID))
		key := sqldb.Ident(partitionKey(m))
		if i > 0 {
			b.WriteString(", ")
		}
		b.WriteString(s.row)
		var metadata any = md
		if s.metadataText {
			metadata = s.d.Text(string(md))
		}
		// Text: MySQL's binary columns take bytes, kept byte for byte.
		args = append(args, s.d.Text(params.Topic), s.d.Text(uuid), s.d.Text(key), []byte(m.Payload), metadata)
		if s.d.WriterHashes() {
			args = append(args, int64(crc32.ChecksumIEEE([]byte(key))%lanes))
		}
		if s.due {
			at, _, err := dueAt(m)
			if err != nil {
				return wsql.Query{}, err
			}
			if at.Before(written) {
				// Due already (see Publish): due now, so that it goes
				// behind the key's rows due before it.
				at = written
			}
			args = append(args, at.UnixMicro())
		}
	}
	return wsql.Query{Query: s.d.Rebind(b.String()), Args: args}, nil
}

func (outboxSchema) SelectQuery(wsql.SelectQueryParams) (wsql.Query, error) {
	return wsql.Query{}, ErrNotForRelay
}

func (outboxSchema) UnmarshalMessage(wsql.UnmarshalMessageParams) (wsql.Row, error) {
	return wsql.Row{}, ErrNotForRelay
}

func (outboxSchema) SchemaInitializingQueries(wsql.SchemaInitializingQueriesParams) ([]wsql.Query, error) {
	return nil, nil // sqlschema.Migrate creates the table
}

func (outboxSchema) SubscribeIsolationLevel() sql.IsolationLevel { return sql.LevelDefault }

// InboxOutbox returns a function for middleware.InboxConfig.Outbox that
// writes a handler's produced messages to topic as outbox rows in the
// inbox's PostgreSQL transaction (the one postgres.Tx returns), so that the
// effect and the events it causes commit together.
func InboxOutbox(topic string, cfg sqlschema.Config, opts ...TxOption) func(ctx context.Context, produced []*message.Message) error {
	return func(ctx context.Context, produced []*message.Message) error {
		tx := postgres.Tx(ctx)
		if tx == nil {
			return errors.New("forwarder: InboxOutbox: no PostgreSQL transaction in the context; use it with a postgres.Store inbox")
		}
		pub, err := NewTxPublisher(ctx, tx, cfg, opts...)
		if err != nil {
			return err
		}
		return pub.Publish(topic, produced...)
	}
}

// SQLInboxOutbox returns a function for middleware.InboxConfig.Outbox that
// writes a handler's produced messages to topic as outbox rows in the
// inbox's database/sql transaction (the one sqlstore.Tx or sqlite.Tx
// returns), on a database of dialect d, so that the effect and the events
// it causes commit together. It is [InboxOutbox] for a dedup/sqlstore or
// dedup/sqlite inbox.
func SQLInboxOutbox(topic string, d sqlschema.Dialect, cfg sqlschema.Config, opts ...TxOption) func(ctx context.Context, produced []*message.Message) error {
	return func(ctx context.Context, produced []*message.Message) error {
		_, tx := inboxtx.Of(ctx)
		if tx == nil {
			return errors.New("forwarder: SQLInboxOutbox: no database/sql transaction in the context; use it with a sqlstore.Store or sqlite.Store inbox")
		}
		pub, err := NewSQLTxPublisher(ctx, tx, d, cfg, opts...)
		if err != nil {
			return err
		}
		return pub.Publish(topic, produced...)
	}
}
