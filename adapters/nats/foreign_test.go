package nats_test

import (
	"bufio"
	"context"
	"encoding/json"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/adapters/nats"
	"github.com/oncemill/oncemill/dedup/postgres"
	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/dlq"
	"github.com/oncemill/oncemill/internal/testing/msgtest"
	"github.com/oncemill/oncemill/internal/testing/nodetest"
	"github.com/oncemill/oncemill/internal/testing/pgtest"
	"github.com/oncemill/oncemill/middleware"
	"github.com/oncemill/oncemill/sqlschema"
)

// nodeProducer installs testdata/nodeproducer (the npm package nats, at
// the version its lock file pins) in a directory of the test's own and
// returns a function that runs its producer on msgs against server and
// returns the stream's ack of each.
func nodeProducer(t *testing.T) func(server string, msgs []nodeMsg) []nodeAck {
	t.Helper()
	node, dir := nodetest.Install(t, filepath.Join("testdata", "nodeproducer"), "producer.js", "the npm package nats")
	return func(server string, msgs []nodeMsg) []nodeAck {
		t.Helper()
		spec, err := json.Marshal(msgs)
		require.NoError(t, err)
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		cmd := exec.CommandContext(ctx, node, "producer.js", server, string(spec))
		cmd.Dir = dir
		var stderr strings.Builder
		cmd.Stderr = &stderr
		out, err := cmd.Output()
		require.NoError(t, err, "node producer.js: %s", stderr.String())
		var acks []nodeAck
		sc := bufio.NewScanner(strings.NewReader(string(out)))
		for sc.Scan() {
			var a nodeAck
			require.NoError(t, json.Unmarshal(sc.Bytes(), &a), "producer output %q", sc.Text())
			acks = append(acks, a)
		}
		require.Len(t, acks, len(msgs), "an ack per message; output:\n%s", out)
		return acks
	}
}

// nodeMsg is one message for the Node producer.
type nodeMsg struct {
	Subject string      `json:"subject"`
	Data    string      `json:"data"`
	MsgID   string      `json:"msgId,omitempty"`
	Headers [][2]string `json:"headers,omitempty"`
}

// nodeAck is the stream's ack of one publish of the Node producer.
type nodeAck struct {
	Stream    string `json:"stream"`
	Seq       uint64 `json:"seq"`
	Duplicate bool   `json:"duplicate"`
}

// TestForeignProducer: a Node service publishes with the npm package nats
// (nats.js) as the producer contract says: the topic as subject, the
// idempotency key as Nats-Msg-Id (the msgID publish option) and in the
// idempotency_key header, the payload as data, no Watermill header. The
// messages are consumed in a group through a router with the poison
// middleware and the PostgreSQL inbox, whose handler inserts one effect
// row per message. Each key is applied once: a publish repeated with the
// same Nats-Msg-Id is dropped by JetStream (its ack says duplicate), and
// one repeated with another Nats-Msg-Id (a retry after the duplicate
// window, or a producer that sets one per attempt) reaches the consumer
// and is dropped by the inbox by its idempotency_key. A message with a
// Nats-Msg-Id and no idempotency_key header is keyed by its Nats-Msg-Id;
// one with neither by "<stream>:<sequence>", the same on every delivery.
// Other headers are metadata, a repeated one with its values joined by
// ", ". Nothing is dead-lettered; a second group reads every message
// again and applies nothing more.
func TestForeignProducer(t *testing.T) {
	t.Parallel()
	produce := nodeProducer(t)
	a := newAdmin(t)
	topic := a.topic(".orders")
	cfg := a.config()
	cfg.CreateStreams = false // streams are the operator's
	stream := cfg.StreamName(topic)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	_, err := a.js.CreateStream(ctx, jetstream.StreamConfig{Name: stream, Subjects: []string{topic}, Storage: jetstream.FileStorage, Duplicates: 2 * time.Minute})
	cancel()
	require.NoError(t, err)

	keyed := func(key string, extra ...[2]string) [][2]string {
		return append([][2]string{{delivery.IdempotencyKey, key}}, extra...)
	}
	msgs := []nodeMsg{
		{Subject: topic, Data: `{"order":1,"amount":1999}`, MsgID: "order-1", Headers: keyed("order-1", [2]string{"content-type", "application/json"})},
		{Subject: topic, Data: `{"order":1,"amount":1999}`, MsgID: "order-1", Headers: keyed("order-1", [2]string{"content-type", "application/json"})}, // retried at once
		{Subject: topic, Data: `{"order":2,"amount":500}`, MsgID: "order-2", Headers: keyed("order-2", [2]string{"x-tag", "a"}, [2]string{"x-tag", "b"})},
		{Subject: topic, Data: `{"order":1,"amount":1999}`, MsgID: "order-1/attempt-2", Headers: keyed("order-1")}, // another Nats-Msg-Id, the same key
		{Subject: topic, Data: `{"order":3,"amount":42}`, MsgID: "order-3"},                                        // no idempotency_key header
		{Subject: topic, Data: `{"order":4,"amount":7}`},                                                           // neither
	}
	acks := produce(a.url, msgs)
	for i, ack := range acks {
		require.Equal(t, stream, ack.Stream, "message %d went to the topic's stream", i)
		require.Equal(t, i == 1, ack.Duplicate, "message %d: only the retry with the same Nats-Msg-Id is a duplicate", i)
	}
	bare := stream + ":" + strconv.FormatUint(acks[5].Seq, 10)

	pool := pgtest.Pool(t, 8)
	schema := pgtest.Schema(t, pool)
	effects := pgx.Identifier{schema, "effects"}.Sanitize()
	_, err = pool.Exec(context.Background(), `CREATE TABLE `+effects+` (key text NOT NULL, uuid text NOT NULL, payload text NOT NULL, content_type text NOT NULL, tags text NOT NULL)`)
	require.NoError(t, err)
	store, err := postgres.New(pool, postgres.Config{Schema: schema})
	require.NoError(t, err)
	inbox, err := middleware.NewInbox(middleware.InboxConfig{TxStore: store, Consumer: "orders"})
	require.NoError(t, err)
	dlqConfig := sqlschema.Config{Schema: schema}
	deadLetters, err := dlq.NewPublisher(pool, dlqConfig)
	require.NoError(t, err)
	poison, err := middleware.NewPoison(middleware.PoisonConfig{Publisher: deadLetters, Topic: "orders.dlq", MaxAttempts: 3})
	require.NoError(t, err)
	handler := func(msg *message.Message) error {
		ctx := msg.Context()
		_, err := postgres.Tx(ctx).Exec(ctx, `INSERT INTO `+effects+` VALUES ($1, $2, $3, $4, $5)`,
			middleware.IdempotencyKey(ctx), msg.UUID, string(msg.Payload), msg.Metadata.Get("content-type"), msg.Metadata.Get("x-tag"))
		return err
	}
	consume := func(group string) {
		t.Helper()
		sub := subscriber(t, nats.SubscriberConfig{Config: cfg, ConsumerGroup: group})
		r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, testLogger())
		require.NoError(t, err)
		r.AddMiddleware(poison.Middleware, inbox.Middleware)
		r.AddConsumerHandler("orders", topic, sub, handler)
		runCtx, stop := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() { done <- r.Run(runCtx) }()
		defer func() {
			stop()
			require.NoError(t, <-done)
		}()
		<-r.Running()
		msgtest.WaitFor(t, "group "+group+" acks every message", func() bool {
			info := a.consumer(stream, group)
			return info.NumPending == 0 && info.NumAckPending == 0
		})
	}

	type effect struct{ uuid, payload, contentType, tags string }
	rows := func() map[string]effect {
		t.Helper()
		rs, err := pool.Query(context.Background(), `SELECT key, uuid, payload, content_type, tags FROM `+effects)
		require.NoError(t, err)
		defer rs.Close()
		got := map[string]effect{}
		for rs.Next() {
			var key string
			var e effect
			require.NoError(t, rs.Scan(&key, &e.uuid, &e.payload, &e.contentType, &e.tags))
			require.NotContains(t, got, key, "key %s applied twice", key)
			got[key] = e
		}
		require.NoError(t, rs.Err())
		return got
	}
	deadCount := func() (n int) {
		table := sqlschema.NamesFor(sqlschema.Postgres, dlqConfig.WithDefaults()).DLQ
		require.NoError(t, pool.QueryRow(context.Background(), `SELECT count(*) FROM `+table).Scan(&n))
		return n
	}

	consume("billing")
	got := rows()
	require.Equal(t, map[string]effect{
		"order-1": {uuid: "order-1", payload: `{"order":1,"amount":1999}`, contentType: "application/json"},
		"order-2": {uuid: "order-2", payload: `{"order":2,"amount":500}`, tags: "a, b"},
		"order-3": {uuid: "order-3", payload: `{"order":3,"amount":42}`},
		bare:      {uuid: bare, payload: `{"order":4,"amount":7}`},
	}, got, "one effect per key, keyed by idempotency_key, else Nats-Msg-Id, else stream and sequence")
	require.Equal(t, int64(1), inbox.Stats().Duplicates, "the copy of order-1 with another Nats-Msg-Id is dropped by the inbox")
	require.Zero(t, deadCount(), "nothing dead-lettered")

	consume("billing-again")
	require.Equal(t, got, rows(), "a second group applies nothing more")
	stored := len(msgs) - 1 // JetStream dropped one
	require.Equal(t, int64(1+stored), inbox.Stats().Duplicates, "every message the second group read was a duplicate")
}
