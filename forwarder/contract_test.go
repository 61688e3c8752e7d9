package forwarder_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"os"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/adapters/amqp"
	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/forwarder"
	"github.com/oncemill/oncemill/internal/testing/pgtest"
)

// TestRelayRelaysRowsWrittenBySQL: rows inserted by plain SQL, as
// docs/outbox-contract.md tells a writer in another language to insert
// them (topic, uuid, partition_key, payload, metadata; the rest from the
// defaults), in one transaction with the business row, reach RabbitMQ with
// their UUID, payload and metadata, partition and idempotency keys
// included. Rows the relay cannot turn into a message (metadata that is not
// a JSON object of strings, an empty topic, an empty uuid) are
// dead-lettered to the dlq table with the reason, logged, and the rows
// behind them in their lane go out all the same.
func TestRelayRelaysRowsWrittenBySQL(t *testing.T) {
	t.Parallel()
	url := os.Getenv("ONCEMILL_AMQP_URL")
	if url == "" {
		url = "amqp://guest:guest@127.0.0.1:5672/"
	}
	admin, err := amqp091.DialConfig(url, amqp091.Config{Dial: amqp091.DefaultDial(3 * time.Second)})
	if err != nil {
		pgtest.Unavailable(t, "RabbitMQ", err)
	}
	var suffix [6]byte
	_, _ = rand.Read(suffix[:])
	topic := "oncemill-test-relay-contract-" + hex.EncodeToString(suffix[:])
	cfg := amqp.Config{URL: url}
	t.Cleanup(func() {
		ch, err := admin.Channel()
		require.NoError(t, err)
		_, err = ch.QueueDelete(cfg.QueueName(topic), false, false, false)
		require.NoError(t, err)
		require.NoError(t, ch.ExchangeDelete(cfg.ExchangeName(topic), false, false))
		require.NoError(t, ch.Close())
		require.NoError(t, admin.Close())
	})
	require.NoError(t, amqp.Declare(context.Background(), cfg, topic))

	b := setup(t, 4)
	ctx := context.Background()
	outbox := `"` + b.schema.Schema + `".outbox`
	type written struct {
		topic, uuid, key string
		payload          []byte // nil: NULL
		metadata         string
	}
	good := []written{
		{topic, "0b8f7c1e-0001", "order-1", []byte(`{"order":"order-1","status":"paid"}`),
			`{"idempotency_key":"order-1:paid","partition_key":"order-1","traceparent":"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}`},
		{topic, "0b8f7c1e-0002", "order-1", []byte{0, 1, 2, 0xff}, `{"idempotency_key":"order-1:shipped","partition_key":"order-1"}`},
		{topic, "0b8f7c1e-0003", "order-2", nil, `{"idempotency_key":"order-2:paid"}`},
		// Behind a refused row of its own key: it goes out all the same.
		{topic, "0b8f7c1e-0005", "order-bad", []byte("after"), `{"idempotency_key":"order-bad:2","partition_key":"order-bad"}`},
	}
	refused := []written{
		{topic, "0b8f7c1e-0004", "order-bad", []byte("numbers"), `{"idempotency_key":"order-bad:1","attempt":1}`},
		{"", "0b8f7c1e-0006", "order-3", []byte("no topic"), `{"idempotency_key":"order-3:paid"}`},
		{topic, "", "order-4", []byte("no uuid"), `{"idempotency_key":"order-4:paid"}`},
		{topic, "0b8f7c1e-0008", "order-5", []byte("array"), `["idempotency_key","order-5:paid"]`},
	}
	tx, err := b.pool.Begin(ctx)
	require.NoError(t, err)
	_, err = tx.Exec(ctx, `INSERT INTO "`+b.schema.Schema+`".orders (id) VALUES ('order-1')`)
	require.NoError(t, err)
	// In insert order: the refused row of order-bad before its good one.
	for _, w := range []written{good[0], good[1], good[2], refused[0], good[3], refused[1], refused[2], refused[3]} {
		_, err := tx.Exec(ctx, `INSERT INTO `+outbox+` (topic, uuid, partition_key, payload, metadata) VALUES ($1, $2, $3, $4, $5::jsonb)`,
			w.topic, w.uuid, w.key, w.payload, w.metadata)
		require.NoError(t, err)
	}
	require.NoError(t, tx.Commit(ctx))

	pub, err := amqp.NewPublisher(cfg, nil)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, pub.Close()) })
	logs := watermill.NewCaptureLogger()
	// LockOrderedWriters: the rows are one transaction's, and the relay
	// need not wait for every other transaction on the server.
	// Ledger: the ledger records the published rows, not the refused ones.
	run(t, newRelay(t, b, pub, func(c *forwarder.RelayConfig) { c.Logger, c.LockOrderedWriters, c.Ledger = logs, true, true }))
	require.Eventually(t, func() bool { return b.count(t, "outbox") == 0 }, time.Minute, 5*time.Millisecond,
		"the relay empties the outbox, refused rows included")

	sub, err := amqp.NewSubscriber(cfg, nil)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, sub.Close()) })
	subCtx, cancel := context.WithCancel(ctx)
	t.Cleanup(cancel)
	msgs, err := sub.Subscribe(subCtx, topic)
	require.NoError(t, err)
	got := map[string]written{}
	for range good {
		select {
		case m := <-msgs:
			md := map[string]string{}
			for k, v := range m.Metadata {
				md[k] = v
			}
			var w written
			for _, g := range good {
				if g.uuid == m.UUID {
					w = g
				}
			}
			require.NotEmpty(t, w.uuid, "message %s was written", m.UUID)
			require.Equal(t, string(w.payload), string(m.Payload), "message %s: payload byte for byte", m.UUID)
			want := map[string]string{}
			require.NoError(t, json.Unmarshal([]byte(w.metadata), &want))
			for k, v := range want {
				require.Equal(t, v, md[k], "message %s: metadata %s kept", m.UUID, k)
			}
			got[m.UUID] = w
			m.Ack()
		case <-time.After(time.Minute):
			t.Fatalf("received %d of %d messages", len(got), len(good))
		}
	}
	require.Len(t, got, len(good), "each good row arrived once")

	var ledger []string
	lr, err := b.pool.Query(ctx, `SELECT uuid FROM "`+b.schema.Schema+`".outbox_ledger ORDER BY uuid`)
	require.NoError(t, err)
	for lr.Next() {
		var u string
		require.NoError(t, lr.Scan(&u))
		ledger = append(ledger, u)
	}
	require.NoError(t, lr.Err())
	require.Equal(t, []string{good[0].uuid, good[1].uuid, good[2].uuid, good[3].uuid}, ledger, "the ledger holds the published rows only")

	rows, err := b.pool.Query(ctx, `SELECT uuid, topic, consumer, key, error, permanent, payload FROM "`+b.schema.Schema+`".dlq ORDER BY id`)
	require.NoError(t, err)
	type dead struct {
		uuid, topic, consumer, key, error string
		permanent                         bool
		payload                           []byte
	}
	var dlq []dead
	for rows.Next() {
		var d dead
		require.NoError(t, rows.Scan(&d.uuid, &d.topic, &d.consumer, &d.key, &d.error, &d.permanent, &d.payload))
		dlq = append(dlq, d)
	}
	require.NoError(t, rows.Err())
	require.Len(t, dlq, len(refused), "every refused row is dead-lettered, once")
	reasons := []string{"metadata is not a JSON object of strings", "topic is empty", "uuid is empty", "metadata is not a JSON object of strings"}
	for i, d := range dlq {
		require.Equal(t, refused[i].uuid, d.uuid)
		require.Equal(t, refused[i].topic, d.topic)
		require.Equal(t, refused[i].key, d.key)
		require.Equal(t, string(refused[i].payload), string(d.payload))
		require.Equal(t, "relay:"+b.schema.Schema+".outbox", d.consumer)
		require.True(t, d.permanent)
		require.Contains(t, d.error, reasons[i])
	}
	lines := map[string]int{}
	for _, l := range logs.Captured()[watermill.ErrorLogLevel] {
		if l.Msg == "Outbox row refused, dead-lettered" {
			require.ErrorIs(t, l.Err, forwarder.ErrRefusedRow)
			lines[l.Fields["uuid"].(string)]++
		}
	}
	for _, r := range refused {
		require.Equal(t, 1, lines[r.uuid], "one error line for the refused row %q", r.uuid)
	}
}

// TestMySQLRelayRelaysRowsWrittenBySQL is TestRelayRelaysRowsWrittenBySQL
// on MySQL: rows inserted by plain SQL as docs/outbox-contract.md says go
// out with their UUID, payload and metadata; a row whose metadata is not
// JSON at all, or whose topic is empty, is dead-lettered, and the row of
// the same key behind it goes out.
func TestMySQLRelayRelaysRowsWrittenBySQL(t *testing.T) {
	t.Parallel()
	b := setupMySQL(t, 4)
	ctx := context.Background()
	tx, err := b.db.BeginTx(ctx, nil)
	require.NoError(t, err)
	insert := "INSERT INTO `" + b.name + "`.outbox (topic, uuid, partition_key, payload, metadata, created_at) VALUES (?, ?, ?, ?, ?, UTC_TIMESTAMP(6))"
	rows := [][]any{
		{"orders", "u-1", "order-1", []byte("one"), `{"idempotency_key":"order-1:paid","partition_key":"order-1"}`},
		{"orders", "u-2", "order-1", []byte("two"), "not json"},
		{"orders", "u-3", "order-1", nil, `{"idempotency_key":"order-1:shipped","partition_key":"order-1"}`},
		{"", "u-4", "order-2", []byte("four"), `{"idempotency_key":"order-2:paid"}`},
	}
	for _, r := range rows {
		_, err := tx.ExecContext(ctx, insert, r...)
		require.NoError(t, err)
	}
	require.NoError(t, tx.Commit())

	gc := orderedGoChannel(t)
	in := subscribe(t, gc, "orders")
	r := b.relay(t, gc, nil)
	relayAllMySQL(t, r, 2)
	require.Zero(t, b.count(t, "outbox"))
	got := in.snapshot()
	require.Len(t, got, 2)
	require.Equal(t, "u-1", got[0].UUID)
	require.Equal(t, "one", string(got[0].Payload))
	require.Equal(t, "order-1:paid", got[0].Metadata.Get(delivery.IdempotencyKey))
	require.Equal(t, "order-1", got[0].Metadata.Get(delivery.PartitionKey))
	require.Equal(t, "u-3", got[1].UUID)
	require.Empty(t, got[1].Payload, "a NULL payload is an empty one")
	require.Equal(t, "order-1:shipped", got[1].Metadata.Get(delivery.IdempotencyKey))

	var dead []string
	rs, err := b.db.QueryContext(ctx, "SELECT uuid, consumer, `error`, permanent FROM `"+b.name+"`.dlq ORDER BY id")
	require.NoError(t, err)
	for rs.Next() {
		var (
			uuid, consumer, reason string
			permanent              bool
		)
		require.NoError(t, rs.Scan(&uuid, &consumer, &reason, &permanent))
		require.Equal(t, "relay:"+b.name+".outbox", consumer)
		require.True(t, permanent)
		dead = append(dead, uuid+": "+reason)
	}
	require.NoError(t, rs.Err())
	require.Len(t, dead, 2)
	require.Contains(t, dead[0], "u-2: forwarder: outbox row refused: metadata is not a JSON object of strings")
	require.Contains(t, dead[1], "u-4: forwarder: outbox row refused: topic is empty")
}
