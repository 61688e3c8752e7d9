package kafka_test

import (
	"context"
	"fmt"
	"os/exec"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/adapters/kafka"
	"github.com/oncemill/oncemill/dedup/postgres"
	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/dlq"
	"github.com/oncemill/oncemill/internal/testing/msgtest"
	"github.com/oncemill/oncemill/internal/testing/pgtest"
	"github.com/oncemill/oncemill/middleware"
	"github.com/oncemill/oncemill/sqlschema"
)

// kcatRecords is one kcat run: the headers it sets on every record, and
// its records as "key:value" lines.
type kcatRecords struct {
	headers []string
	lines   []string
}

// TestForeignProducer: JSON records that kcat (librdkafka, as a Java,
// Node or Python service would produce them: no Watermill header) writes,
// consumed in a consumer group through a router with the poison
// middleware and the PostgreSQL inbox, whose handler inserts one effect
// row per message. Each distinct idempotency key is applied once, even
// the one kcat produced twice; the key given in the HTTP spelling counts;
// the record without a key header is keyed by its UUID, the UUIDv5 of its
// topic, partition and offset; nothing is dead-lettered. A second group,
// in the key-parallel mode, reads every record again and applies nothing
// more.
func TestForeignProducer(t *testing.T) {
	t.Parallel()
	kcat, err := exec.LookPath("kcat")
	if err != nil {
		pgtest.Unavailable(t, "kcat", fmt.Errorf("not installed (Debian package kcat): %w", err))
	}
	ctx := context.Background()
	pool := pgtest.Pool(t, 8)
	schema := pgtest.Schema(t, pool)
	effects := pgx.Identifier{schema, "effects"}.Sanitize()
	_, err = pool.Exec(ctx, `CREATE TABLE `+effects+` (
		key text NOT NULL, uuid text NOT NULL, topic text NOT NULL, kafka_partition int NOT NULL,
		kafka_offset bigint NOT NULL, partition_key text NOT NULL, payload text NOT NULL)`)
	require.NoError(t, err)

	brokers := Brokers(t)
	topic := uniqueName("foreign")
	createTopic(t, brokers, topic, 3)

	runs := []kcatRecords{
		{[]string{"idempotency_key=order-1", "content-type=application/json"}, []string{
			`customer-1:{"order":1,"amount":1999}`,
			`customer-1:{"order":1,"amount":1999}`, // the same event produced twice
		}},
		{[]string{"idempotency_key=order-2"}, []string{`customer-2:{"order":2,"amount":500}`}},
		{[]string{"Idempotency-Key=order-3"}, []string{`customer-1:{"order":3,"amount":42}`}},
		{nil, []string{`customer-3:{"order":4,"amount":7}`}},
		{[]string{"idempotency_key=order-2"}, []string{`customer-2:{"order":2,"amount":500}`}}, // order-2 sent again later
	}
	records := 0
	for _, r := range runs {
		args := []string{"-P", "-q", "-b", strings.Join(brokers, ","), "-t", topic, "-K:"}
		for _, h := range r.headers {
			args = append(args, "-H", h)
		}
		cmd := exec.Command(kcat, args...)
		cmd.Stdin = strings.NewReader(strings.Join(r.lines, "\n") + "\n")
		out, err := cmd.CombinedOutput()
		require.NoError(t, err, "kcat %s: %s", strings.Join(args, " "), out)
		records += len(r.lines)
	}
	require.Equal(t, int64(records), recordsIn(t, brokers, topic), "kcat wrote every record")

	store, err := postgres.New(pool, postgres.Config{Schema: schema})
	require.NoError(t, err)
	inbox, err := middleware.NewInbox(middleware.InboxConfig{TxStore: store, Consumer: "orders"})
	require.NoError(t, err)
	dlqConfig := sqlschema.Config{Schema: schema}
	dead, err := dlq.NewPublisher(pool, dlqConfig)
	require.NoError(t, err)
	poison, err := middleware.NewPoison(middleware.PoisonConfig{Publisher: dead, Topic: "orders.dlq", MaxAttempts: 3})
	require.NoError(t, err)
	handler := func(msg *message.Message) error {
		ctx := msg.Context()
		_, err := postgres.Tx(ctx).Exec(ctx, `INSERT INTO `+effects+` VALUES ($1, $2, $3, $4, $5, $6, $7)`,
			middleware.IdempotencyKey(ctx), msg.UUID, msg.Metadata.Get(delivery.Topic),
			msg.Metadata.Get(delivery.Partition), msg.Metadata.Get(delivery.Offset),
			msg.Metadata.Get(delivery.PartitionKey), string(msg.Payload))
		return err
	}

	// consume runs a router on a consumer group of its own, with
	// inFlight as MaxInFlightPerPartition, until it has acked every
	// record of the topic.
	consume := func(group string, inFlight int) {
		var acked atomic.Int64
		count := func(h message.HandlerFunc) message.HandlerFunc {
			return func(msg *message.Message) ([]*message.Message, error) {
				out, err := h(msg)
				if err == nil {
					acked.Add(1)
				}
				return out, err
			}
		}
		r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, testLogger())
		require.NoError(t, err)
		r.AddMiddleware(count, poison.Middleware, inbox.Middleware)
		sub := newSubscriber(t, brokers, group, func(c *kafka.SubscriberConfig) { c.MaxInFlightPerPartition = inFlight })
		r.AddConsumerHandler("orders", topic, sub, handler)
		runCtx, stop := context.WithCancel(ctx)
		done := make(chan error, 1)
		go func() { done <- r.Run(runCtx) }()
		defer func() {
			stop()
			require.NoError(t, <-done)
		}()
		select {
		case <-r.Running():
		case err := <-done:
			done <- err
			t.Fatalf("router stopped at start: %v", err)
		}
		msgtest.WaitFor(t, "every record acked by group "+group, func() bool { return acked.Load() >= int64(records) })
	}

	type effect struct {
		key, uuid, partitionKey, payload string
		partition                        int32
		offset                           int64
	}
	rows := func() map[string]effect {
		rs, err := pool.Query(ctx, `SELECT key, uuid, topic, kafka_partition, kafka_offset, partition_key, payload FROM `+effects)
		require.NoError(t, err)
		defer rs.Close()
		got := map[string]effect{}
		for rs.Next() {
			var e effect
			var from string
			require.NoError(t, rs.Scan(&e.key, &e.uuid, &from, &e.partition, &e.offset, &e.partitionKey, &e.payload))
			require.Equal(t, topic, from)
			require.NotContains(t, got, e.key, "key %s applied twice", e.key)
			got[e.key] = e
		}
		require.NoError(t, rs.Err())
		return got
	}
	deadLetters := func() (n int) {
		table := sqlschema.NamesFor(sqlschema.Postgres, dlqConfig.WithDefaults()).DLQ
		require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM `+table).Scan(&n))
		return n
	}

	consume(uniqueName("orders"), 1) // watermill-kafka's consumer
	got := rows()
	require.Len(t, got, 4, "one effect per distinct idempotency key: %v", got)
	for key, e := range got {
		require.Equal(t, kafka.RecordUUID(topic, e.partition, e.offset), e.uuid, "key %s: the UUIDv5 of its record", key)
		require.Equal(t, recordUUID(t, topic+"/"+strconv.Itoa(int(e.partition))+"/"+strconv.FormatInt(e.offset, 10)), e.uuid)
	}
	for key, want := range map[string]struct{ partitionKey, payload string }{
		"order-1": {"customer-1", `{"order":1,"amount":1999}`},
		"order-2": {"customer-2", `{"order":2,"amount":500}`},
		"order-3": {"customer-1", `{"order":3,"amount":42}`},
	} {
		require.Contains(t, got, key)
		require.Equal(t, want.partitionKey, got[key].partitionKey, "key %s: the record key is the partition key", key)
		require.Equal(t, want.payload, got[key].payload)
	}
	var keyless effect
	for key, e := range got {
		if !strings.HasPrefix(key, "order-") {
			keyless = e
		}
	}
	require.Equal(t, keyless.uuid, keyless.key, "without a key header the key is the record's UUID")
	require.Equal(t, "customer-3", keyless.partitionKey)
	require.Equal(t, `{"order":4,"amount":7}`, keyless.payload)
	require.Equal(t, int64(records-4), inbox.Stats().Duplicates, "the copies of order-1 and order-2 were dropped")
	require.Zero(t, deadLetters(), "nothing dead-lettered")

	// Every record delivered again, to a new group and by the
	// key-parallel consumer: the same UUIDs, so nothing more is applied,
	// the keyless record included.
	consume(uniqueName("replay"), 8)
	require.Equal(t, got, rows())
	require.Equal(t, int64(2*records-4), inbox.Stats().Duplicates)
	require.Zero(t, deadLetters())
	require.Zero(t, poison.Stats().DeadLettered)
}

// recordsIn returns how many records the topic's partitions hold.
func recordsIn(t *testing.T, brokers []string, topic string) int64 {
	t.Helper()
	sc := sarama.NewConfig()
	sc.Version = sarama.V2_3_0_0
	client, err := sarama.NewClient(brokers, sc)
	require.NoError(t, err)
	defer func() { require.NoError(t, client.Close()) }()
	partitions, err := client.Partitions(topic)
	require.NoError(t, err)
	var n int64
	for _, p := range partitions {
		newest, err := client.GetOffset(topic, p, sarama.OffsetNewest)
		require.NoError(t, err)
		oldest, err := client.GetOffset(topic, p, sarama.OffsetOldest)
		require.NoError(t, err)
		n += newest - oldest
	}
	return n
}
