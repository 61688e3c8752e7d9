package forwarder

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"strings"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/oncemill/oncemill/dedup/sqlstore"
	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/observe"
	"github.com/oncemill/oncemill/sqlschema"
)

// NewSQLTxPublisher returns a publisher that writes into tx, a
// database/sql transaction on a database of dialect d, for applications
// whose data layer is database/sql (GORM, sqlc, sqlx): sqlschema.MySQL
// (MySQL 8.0+, MariaDB 10.6+ through go-sql-driver/mysql; a [Relay] with
// RelayConfig.DB relays the rows) or sqlschema.Postgres (pgx's stdlib or
// lib/pq; a Relay with RelayConfig.Pool relays them). It is the
// [TxPublisher] of [NewTxPublisher] otherwise: its inserts run with ctx,
// it keeps each message's UUID, metadata and partition key, and it starts
// no goroutines. cfg names the outbox table, as given to
// sqlschema.MigrateSQL.
func NewSQLTxPublisher(ctx context.Context, tx *sql.Tx, d sqlschema.Dialect, cfg sqlschema.Config, opts ...TxOption) (*TxPublisher, error) {
	if tx == nil {
		return nil, errors.New("forwarder: NewSQLTxPublisher: tx is nil")
	}
	cfg = cfg.WithDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	var schema wsql.SchemaAdapter
	switch d {
	case sqlschema.MySQL:
		schema = mysqlOutboxSchema{table: sqlschema.NamesFor(d, cfg).Outbox}
	case sqlschema.Postgres:
		// database/sql drivers differ on []byte for jsonb (lib/pq sends
		// it as bytea): the metadata goes as text.
		schema = outboxSchema{table: sqlschema.NamesFor(d, cfg).Outbox, metadataText: true}
	default:
		return nil, fmt.Errorf("forwarder: NewSQLTxPublisher: dialect must be sqlschema.MySQL or sqlschema.Postgres, got %q", d)
	}
	pub, err := wsql.NewPublisher(wsql.TxFromStdSQL(tx), wsql.PublisherConfig{SchemaAdapter: schema}, watermill.NopLogger{})
	if err != nil {
		return nil, fmt.Errorf("forwarder: %w", err)
	}
	var o txOptions
	for _, opt := range opts {
		opt(&o)
	}
	return &TxPublisher{ctx: context.WithoutCancel(ctx), pub: pub, hooks: observe.New(o.hooks...)}, nil
}

// SQLInboxOutbox returns a function for middleware.InboxConfig.Outbox that
// writes a handler's produced messages to topic as outbox rows in the
// inbox's database/sql transaction (the one sqlstore.Tx returns), on a
// database of dialect d, so that the effect and the events it causes
// commit together. It is [InboxOutbox] for a dedup/sqlstore inbox.
func SQLInboxOutbox(topic string, d sqlschema.Dialect, cfg sqlschema.Config, opts ...TxOption) func(ctx context.Context, produced []*message.Message) error {
	return func(ctx context.Context, produced []*message.Message) error {
		tx := sqlstore.Tx(ctx)
		if tx == nil {
			return errors.New("forwarder: SQLInboxOutbox: no database/sql transaction in the context; use it with a sqlstore.Store inbox")
		}
		pub, err := NewSQLTxPublisher(ctx, tx, d, cfg, opts...)
		if err != nil {
			return err
		}
		return pub.Publish(topic, produced...)
	}
}

// mysqlOutboxSchema is the write side of a watermill-sql schema adapter
// for the MySQL outbox table (sqlschema/mysql/002_outbox.up.sql).
type mysqlOutboxSchema struct{ table string }

func (s mysqlOutboxSchema) InsertQuery(params wsql.InsertQueryParams) (wsql.Query, error) {
	var (
		b    strings.Builder
		args = make([]any, 0, 5*len(params.Msgs))
	)
	b.WriteString(`INSERT INTO ` + s.table + ` (topic, uuid, partition_key, payload, metadata, created_at, writer) VALUES `)
	for i, m := range params.Msgs {
		md, err := json.Marshal(m.Metadata)
		if err != nil {
			return wsql.Query{}, fmt.Errorf("encode metadata of %s: %w", m.UUID, err)
		}
		key := delivery.PartitionKeyOf(m)
		if key == "" {
			key = m.UUID
		}
		if i > 0 {
			b.WriteString(", ")
		}
		b.WriteString("(?, ?, ?, ?, ?, UTC_TIMESTAMP(6), CONNECTION_ID())")
		// Binary columns: the strings go as bytes, kept byte for byte.
		args = append(args, []byte(params.Topic), []byte(m.UUID), []byte(key), []byte(m.Payload), md)
	}
	return wsql.Query{Query: b.String(), Args: args}, nil
}

func (mysqlOutboxSchema) SelectQuery(wsql.SelectQueryParams) (wsql.Query, error) {
	return wsql.Query{}, ErrNotForRelay
}

func (mysqlOutboxSchema) UnmarshalMessage(wsql.UnmarshalMessageParams) (wsql.Row, error) {
	return wsql.Row{}, ErrNotForRelay
}

func (mysqlOutboxSchema) SchemaInitializingQueries(wsql.SchemaInitializingQueriesParams) ([]wsql.Query, error) {
	return nil, nil // sqlschema.MigrateSQL creates the table
}

func (mysqlOutboxSchema) SubscribeIsolationLevel() sql.IsolationLevel { return sql.LevelDefault }
