package sqllayertest

import (
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/dlq"
	"github.com/oncemill/oncemill/forwarder"
	"github.com/oncemill/oncemill/internal/sqldb"
	"github.com/oncemill/oncemill/retry"
)

// hostile are the bytes users bring that a column may refuse: a NUL, a
// byte that is not UTF-8, a Kafka record key from Java's LongSerializer
// (42, seven NULs) as an adapter copies it into partition_key, and 1 MB.
var hostile = map[string]string{
	"nul":       "order\x00one",
	"not utf-8": "order\xffone",
	"kafka key": "\x00\x00\x00\x00\x00\x00\x00\x2a",
	"1 MB":      strings.Repeat("o", 1<<20),
}

// storableInputs: each hostile value goes through every writer of the SQL
// layer and is stored or refused with a reason, never an error of the
// database, and nothing loops: parked as ordering key, key, UUID, error
// and header (handed back byte for byte, its key found by Waiting);
// dead-lettered as UUID, topic, consumer, key, error and header (its
// identifiers in their bounded form, its text cleaned, the inbox rows of
// its consumer and key looked up without an error: a reopen says the key
// is not dead); written to the outbox and to the scheduled table as
// partition key, UUID and header, and published byte for byte once due;
// as a topic, refused with sqldb.ErrNotStorable before anything is
// written.
func storableInputs(t *testing.T, e *env) {
	ctx := e.ctx()
	var (
		store *retry.Store
		err   error
	)
	if e.Pool != nil {
		store, err = retry.NewStore(e.Pool, e.Schema)
	} else {
		store, err = retry.NewSQLStore(e.DB, e.Dialect, e.Schema)
	}
	require.NoError(t, err)
	pub, dead := e.dlqPublisher(), e.dlqStore()
	broker := e.broker(false)
	got := e.receive(broker, "orders")
	relay := e.relay(broker, nil)

	var outbox []*message.Message
	for name, v := range hostile {
		// Parked.
		m := retry.Message{Consumer: "charge", Topic: "orders", UUID: "u-" + v, Key: v, OrderKey: v, Attempts: 3,
			Error: "gateway said " + v, DueAt: time.Now().Add(time.Hour), Payload: []byte(v),
			Metadata: map[string]string{delivery.PartitionKey: v, "header": v}}
		wrote, err := store.Park(ctx, m)
		require.NoError(t, err, "%s: park", name)
		require.True(t, wrote, "%s: parked", name)
		waiting, err := store.Waiting(ctx, "charge", "orders", v)
		require.NoError(t, err, "%s: waiting", name)
		require.True(t, waiting, "%s: its ordering key is found by its bytes", name)
		parked, err := store.List(ctx, retry.Filter{UUID: m.UUID})
		require.NoError(t, err, "%s: list", name)
		require.Len(t, parked, 1, "%s", name)
		require.Equal(t, m.UUID, parked[0].UUID, "%s: the UUID byte for byte", name)
		require.Equal(t, m.Metadata, parked[0].Metadata, "%s: the metadata byte for byte", name)
		require.Equal(t, []byte(v), parked[0].Payload, "%s", name)
		require.Equal(t, sqldb.CleanText(m.Error), parked[0].Error, "%s: the error as text", name)

		// Dead-lettered.
		letter := message.NewMessage(v, []byte(v))
		for _, k := range []string{delivery.DeadTopic, delivery.DeadConsumer, delivery.DeadKey, delivery.DeadError, "header"} {
			letter.Metadata.Set(k, v)
		}
		require.NoError(t, pub.Publish("dlq", letter), "%s: dead letter", name)
		entries, err := dead.List(ctx, dlq.Filter{Consumer: v})
		require.NoError(t, err, "%s: list dead letters", name)
		require.Len(t, entries, 1, "%s", name)
		en := entries[0]
		require.Equal(t, sqldb.Ident(v), en.UUID, "%s", name)
		require.Equal(t, sqldb.Ident(v), en.Key, "%s", name)
		require.Equal(t, sqldb.CleanText(v), en.Error, "%s", name)
		require.Equal(t, sqldb.CleanText(v), en.Metadata["header"], "%s", name)
		require.Equal(t, []byte(v), en.Payload, "%s: the payload byte for byte", name)
		_, err = dead.Reopen(ctx, en.ID)
		require.ErrorIs(t, err, dlq.ErrNoDeadKey, "%s: its consumer's inbox row is looked up, and is not there", name)

		// The outbox and the scheduled table.
		now, later := message.NewMessage("out-"+v, []byte(v)), message.NewMessage("at-"+v, []byte(v))
		for _, o := range []*message.Message{now, later} {
			o.Metadata.Set(delivery.PartitionKey, v)
			o.Metadata.Set("header", v)
		}
		forwarder.PublishAt(later, time.Now().Add(time.Hour))
		e.write("orders", now, later)
		outbox = append(outbox, now, later)

		err = e.tryWrite(v, message.NewMessage("topic-"+name, nil))
		require.ErrorIs(t, err, sqldb.ErrNotStorable, "%s as a topic", name)
	}

	// The scheduled rows come due, move and go out with the others.
	_, err = e.SQL().Exec(ctx, `UPDATE `+e.SQL().Dialect().Names(e.Schema).Scheduled+` SET due_at = `+e.SQL().Dialect().FromMicros("0"))
	require.NoError(t, err)
	moved, err := relay.PromoteDue(ctx)
	require.NoError(t, err)
	require.Equal(t, len(hostile), moved)
	e.relayAll(relay, len(outbox), 0)
	byUUID := map[string]*message.Message{}
	for _, m := range got.wait(e, len(outbox)) {
		byUUID[m.UUID] = m
	}
	for _, want := range outbox {
		m, ok := byUUID[want.UUID]
		require.True(t, ok, "published with its UUID (%d bytes)", len(want.UUID))
		require.Equal(t, []byte(want.Payload), []byte(m.Payload))
		require.Equal(t, want.Metadata.Get(delivery.PartitionKey), m.Metadata.Get(delivery.PartitionKey), "the partition key byte for byte")
		require.Equal(t, want.Metadata.Get("header"), m.Metadata.Get("header"))
	}
	require.Zero(t, e.lag().Pending)
}

// tryWrite is write, returning the error of the publish.
func (e *env) tryWrite(topic string, msgs ...*message.Message) error {
	e.t.Helper()
	ctx := e.ctx()
	if e.Pool != nil {
		tx, err := e.Pool.Begin(ctx)
		require.NoError(e.t, err)
		defer tx.Rollback(ctx) //nolint:errcheck // rolled back whatever happened
		pub, err := forwarder.NewTxPublisher(ctx, tx, e.Schema)
		require.NoError(e.t, err)
		return pub.Publish(topic, msgs...)
	}
	tx, err := e.DB.BeginTx(ctx, nil)
	require.NoError(e.t, err)
	defer tx.Rollback() //nolint:errcheck // rolled back whatever happened
	pub, err := forwarder.NewSQLTxPublisher(ctx, tx, e.Dialect, e.Schema)
	require.NoError(e.t, err)
	return pub.Publish(topic, msgs...)
}
