package adapters_test

import (
	"hash/crc32"
	"os"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/adapters/sqs"
	"github.com/oncemill/oncemill/dedup/postgres"
	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/internal/testing/brokertest"
	"github.com/oncemill/oncemill/internal/testing/pgtest"
	"github.com/oncemill/oncemill/internal/testing/proctest"
	"github.com/oncemill/oncemill/middleware"
)

// ledgerConsumer is a consumer process of TestKeyOrderAcrossProcesses:
// the standard stack with the poison middleware around a handler that
// records an account's version, with its process id, in the inbox's
// transaction, then works a little.
type ledgerConsumer struct {
	proctest.Stack
}

var ledgerRole = proctest.NewRole("ledger", func(cfg ledgerConsumer, term <-chan os.Signal) error {
	c := &proctest.Consumer{Stack: cfg.Stack, Poison: &middleware.PoisonConfig{
		Topic: "dlq", InitialBackoff: 20 * time.Millisecond, MaxBackoff: 200 * time.Millisecond,
	}}
	ledger := cfg.Table("ledger")
	pid := os.Getpid()
	return c.Run(term, func(msg *message.Message) error {
		ctx := msg.Context()
		account := delivery.PartitionKeyOf(msg)
		if _, err := postgres.Tx(ctx).Exec(ctx, `INSERT INTO `+ledger+` (account, version, pid) VALUES ($1, $2::int, $3)`,
			account, string(msg.Payload), pid); err != nil {
			return err
		}
		select {
		case <-time.After(time.Duration(5+crc32.ChecksumIEEE([]byte(middleware.IdempotencyKey(ctx)))%16) * time.Millisecond):
			return nil
		case <-ctx.Done():
			return ctx.Err()
		}
	})
})

// TestKeyOrderAcrossProcesses: on each broker with the setup that orders a
// key across the processes of a consumer group (Kafka: its partitions;
// RabbitMQ: single_active_consumer=true; SQS: a FIFO queue, the account
// its message group; NATS: max_ack_pending=1), 21 accounts of 4 versions
// each, published interleaved (an odd number of accounts, so that a broker
// that deals messages out to its consumers in turn splits each account's
// versions between them), consumed by two consumer processes, one of
// which is SIGKILLed midway and started again: every version is applied
// once, each account's in the order published, by the processes between
// them, nothing is dead-lettered and nothing is left on the broker.
func TestKeyOrderAcrossProcesses(t *testing.T) {
	t.Parallel()
	const accounts, versions = 21, 4
	type setup struct {
		params string // URL parameters
		fifo   bool   // a FIFO topic
	}
	setups := map[string]setup{
		"kafka": {},
		"amqp":  {params: "single_active_consumer=true"},
		"sqs":   {params: "visibility_timeout=5s", fifo: true},
		"nats":  {params: "max_ack_pending=1"},
	}
	eachProcessBroker(t, func(t *testing.T, b broker) {
		s := setups[b.name]
		b.url = withParams(b.url, s.params)
		id := pgtest.Name(t)
		if s.fifo {
			id += sqs.FIFOSuffix // the topic's queue is a FIFO queue
		}
		topic, group, producer := processTopic(t, b, id, "accounts_", "ledger_")
		db := proctest.NewDB(t, `CREATE TABLE {S}.ledger (seq bigserial PRIMARY KEY, account text NOT NULL, version int NOT NULL, pid int NOT NULL)`)
		cfg := ledgerConsumer{Stack: db.Stack(b.url, group, topic, "ledger")}

		// Both subscribe before anything is published, so that RabbitMQ
		// has its queue; the first, subscribed first (Start waits until
		// its router runs), is the queue's active consumer.
		first := ledgerRole.Start(t, cfg)
		second := ledgerRole.Start(t, cfg)
		brokertest.PublishKeyed(t, producer.Publisher, topic, accounts, versions)

		applied := func() int { return db.Count(t, `SELECT count(*) FROM {S}.ledger`) }
		require.Eventually(t, func() bool { return applied() >= accounts*versions/4 }, time.Minute, 5*time.Millisecond,
			"a quarter applied; output:\n%s\n%s", first.Out.String(), second.Out.String())
		first.Kill()
		first = ledgerRole.Start(t, cfg)
		require.Eventually(t, func() bool { return applied() >= accounts*versions }, 2*time.Minute, 10*time.Millisecond,
			"every version applied; output:\n%s\n%s", first.Out.String(), second.Out.String())
		require.Eventually(t, func() bool { return b.pending(t, topic, group) == 0 }, time.Minute, 50*time.Millisecond,
			"everything acknowledged")
		first.Stop(t, restartShutdownBound)
		second.Stop(t, restartShutdownBound)

		require.Equal(t, accounts*versions, applied(), "each version applied once")
		require.Equal(t, accounts*versions, db.Count(t, `SELECT count(DISTINCT (account, version)) FROM {S}.ledger`))
		require.Zero(t, db.Count(t, `SELECT count(*) FROM {S}.dlq`), "nothing dead-lettered")
		// Each account's versions by the order they were applied in.
		outOfOrder := db.Count(t, `SELECT count(*) FROM (SELECT account, array_agg(version ORDER BY seq) AS vs FROM {S}.ledger GROUP BY account) a
WHERE vs <> ARRAY(SELECT generate_series(1, $1))`, versions)
		require.Zero(t, outOfOrder, "accounts applied out of order")
		require.Equal(t, accounts, db.Count(t, `SELECT count(DISTINCT account) FROM {S}.ledger`))
		processes := db.Count(t, `SELECT count(DISTINCT pid) FROM {S}.ledger`)
		t.Logf("%s (%s): %d accounts × %d versions applied once each, in order, by %d processes, across a SIGKILL",
			b.name, s.params, accounts, versions, processes)
	}, "kafka", "amqp", "sqs", "nats")
}
