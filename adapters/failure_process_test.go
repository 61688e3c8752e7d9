package adapters_test

import (
	"context"
	"fmt"
	"hash/crc32"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/adapters"
	"github.com/oncemill/oncemill/dedup/postgres"
	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/internal/testing/pgtest"
	"github.com/oncemill/oncemill/internal/testing/proctest"
	"github.com/oncemill/oncemill/middleware"
)

const (
	killerKey        = "killer"
	crashMaxAttempts = 3
	crashGood        = 50

	drainKeys  = 300
	drainKills = 4
	// shutdownBound is how long a child may take to exit after SIGTERM:
	// the router's CloseTimeout plus the inbox's FinishTimeout, and then
	// some.
	shutdownBound = 20 * time.Second
)

// failureConsumer is a consumer process of TestCrashLoopProcesses and
// TestSigtermDrainProcesses: the standard stack, with the poison
// middleware and the runs recorded, around a handler that writes one
// effect row per key in the inbox's transaction.
type failureConsumer struct {
	proctest.Stack
	// Mode is "crash" (the handler kills the process on killerKey) or
	// "drain" (each message takes 20–50 ms).
	Mode        string
	DLQTopic    string
	MaxAttempts int
}

var failureRole = proctest.NewRole("failure", func(cfg failureConsumer, term <-chan os.Signal) error {
	c := &proctest.Consumer{Stack: cfg.Stack, RecordRuns: true, Poison: &middleware.PoisonConfig{
		Topic: cfg.DLQTopic, MaxAttempts: cfg.MaxAttempts,
		InitialBackoff: 50 * time.Millisecond, MaxBackoff: 50 * time.Millisecond,
	}}
	effects := cfg.Table("effects")
	return c.Run(term, func(msg *message.Message) error {
		ctx := msg.Context()
		key := middleware.IdempotencyKey(ctx)
		if cfg.Mode == "crash" && key == killerKey {
			os.Exit(proctest.ExitKilled) // as an OOM kill would: nothing runs after this
		}
		if cfg.Mode == "drain" && finishesRegardless(key) {
			// This handler ignores cancellation: what it started, it
			// finishes, and the inbox must commit it.
			ctx = context.WithoutCancel(ctx)
		}
		if _, err := postgres.Tx(ctx).Exec(ctx, `INSERT INTO `+effects+` (key) VALUES ($1)`, key); err != nil {
			return err
		}
		if cfg.Mode != "drain" {
			return nil
		}
		return work(ctx, key)
	})
})

// finishesRegardless reports whether the drain handler finishes key's work
// even when the consumer shuts down meanwhile (half the keys), rather than
// stopping with the message's context (the other half).
func finishesRegardless(key string) bool {
	return crc32.ChecksumIEEE([]byte(key))%2 == 0
}

// work is the drain handler's 20–50 ms of work after its effect: with a
// context that shutdown cancels, it stops (the attempt is cut short and
// rolled back); with a detached one, it finishes (and its effect must be
// committed although the message's context is gone).
func work(ctx context.Context, key string) error {
	timer := time.NewTimer(time.Duration(20+crc32.ChecksumIEEE([]byte(key))%31) * time.Millisecond)
	defer timer.Stop()
	select {
	case <-timer.C:
		return nil
	case <-ctx.Done():
		return fmt.Errorf("work on %q interrupted: %w", key, ctx.Err())
	}
}

// newProcessDB is a fresh schema for the children of one test: oncemill's
// tables and the handler's effects and runs.
func newProcessDB(t *testing.T) *proctest.DB {
	return proctest.NewDB(t, `CREATE TABLE {S}.effects (key text NOT NULL);
CREATE TABLE {S}.runs (key text NOT NULL, pid integer NOT NULL, at timestamptz NOT NULL DEFAULT clock_timestamp())`)
}

// processBrokers are the brokers a child process can reach.
func processBrokers(t *testing.T, names ...string) []broker {
	var bs []broker
	for _, name := range names {
		switch name {
		case "kafka":
			bs = append(bs, kafkaBroker(t))
		case "amqp":
			bs = append(bs, amqpBroker(t))
		case "sqs":
			bs = append(bs, sqsBroker(t))
		case "nats":
			bs = append(bs, natsBroker(t))
		case "nats_embedded":
			bs = append(bs, natsEmbeddedBroker(t))
		}
	}
	return bs
}

// eachProcessBroker runs run on each broker of names in a parallel
// subtest.
func eachProcessBroker(t *testing.T, run func(t *testing.T, b broker), names ...string) {
	for _, b := range processBrokers(t, names...) {
		t.Run(b.name, func(t *testing.T) {
			t.Parallel()
			run(t, b)
		})
	}
}

// processTopic is a topic and a group of the test's own on b, their
// prefixes followed by id, and a producer on b: the producer is closed,
// then the broker's cleanup of topic and group run, when the test ends.
func processTopic(t *testing.T, b broker, id, topicPrefix, groupPrefix string) (topic, group string, producer *adapters.PubSub) {
	t.Helper()
	topic, group = topicPrefix+id, groupPrefix+id
	if b.cleanup != nil {
		t.Cleanup(func() { b.cleanup(t, topic, group) })
	}
	producer = b.open(t, "producer_"+id)
	t.Cleanup(func() { closeQuietly(t, producer) })
	return topic, group, producer
}

// TestCrashLoopProcesses: on Kafka, RabbitMQ and NATS (the machine's
// server and an embedded one in the test's process), a message whose
// handler kills its process (os.Exit, as an OOM kill would), published
// ahead of 50 good ones in the same partition, and a consumer process
// restarted each time it dies. The process dies exactly MaxAttempts times; the next
// delivery dead-letters the message without running the handler (the
// error says why: every attempt died); the killer has no effect and its
// key is dead; every good message is applied once, and the broker holds
// nothing unacknowledged.
func TestCrashLoopProcesses(t *testing.T) {
	t.Parallel()
	eachProcessBroker(t, runCrashLoop, "kafka", "amqp", "nats", "nats_embedded")
}

func runCrashLoop(t *testing.T, b broker) {
	ctx := context.Background()
	id := pgtest.Name(t)
	topic, group, producer := processTopic(t, b, id, "pay_", "ledger_")
	db := newProcessDB(t)
	cfg := failureConsumer{
		Stack: db.Stack(b.url, group, topic, "ledger_"+b.name),
		Mode:  "crash", DLQTopic: "dlq_" + id, MaxAttempts: crashMaxAttempts,
	}

	// The first consumer subscribes before anything is published, so that
	// RabbitMQ has its queue.
	c := failureRole.Start(t, cfg)
	publish := func(key string) {
		msg := message.NewMessage(watermill.NewUUID(), []byte(key))
		msg.Metadata.Set(delivery.IdempotencyKey, key)
		msg.Metadata.Set(delivery.PartitionKey, "account-7")
		require.NoError(t, producer.Publisher.Publish(topic, msg))
	}
	publish(killerKey)
	for i := range crashGood {
		publish(fmt.Sprintf("good-%d", i))
	}

	buried := func() bool {
		return db.Count(t, `SELECT count(*) FROM {S}.dlq WHERE key = $1`, killerKey) > 0
	}
	var exits []int
	deadline := time.Now().Add(3 * time.Minute)
	for !buried() {
		require.True(t, time.Now().Before(deadline), "killer not dead-lettered after 3 minutes; exits %v", exits)
		if !c.Exited() {
			select {
			case <-c.Done():
			case <-time.After(20 * time.Millisecond):
			}
			continue
		}
		exits = append(exits, c.Code())
		require.Equal(t, proctest.ExitKilled, c.Code(), "a child died of something else; output:\n%s", c.Out.String())
		require.LessOrEqual(t, len(exits), crashMaxAttempts, "the killer ran more than MaxAttempts times")
		c = failureRole.Start(t, cfg) // restart it, as a supervisor would
	}

	require.Eventually(t, func() bool { return db.Count(t, `SELECT count(*) FROM {S}.effects`) >= crashGood }, 2*time.Minute, 20*time.Millisecond,
		"the good messages behind the killer are applied")
	require.Eventually(t, func() bool { return b.pending(t, topic, group) == 0 }, time.Minute, 100*time.Millisecond,
		"everything acknowledged, the killer included")
	stats := c.Stop(t, shutdownBound)

	require.Equal(t, []int{proctest.ExitKilled, proctest.ExitKilled, proctest.ExitKilled}, exits, "the child died exactly MaxAttempts times")
	require.Equal(t, crashMaxAttempts, db.Count(t, `SELECT count(*) FROM {S}.runs WHERE key = $1`, killerKey),
		"the killer's handler ran MaxAttempts times, and not on the delivery that dead-lettered it")
	require.Zero(t, db.Count(t, `SELECT count(*) FROM {S}.effects WHERE key = $1`, killerKey), "the killer has no effect")
	require.Equal(t, crashGood, db.Count(t, `SELECT count(*) FROM {S}.effects`), "each good key applied once")
	require.Equal(t, crashGood, db.Count(t, `SELECT count(DISTINCT key) FROM {S}.effects`))
	require.Equal(t, 0, b.pending(t, topic, group), "nothing left on the broker")

	var (
		entries, attempts int
		errText, status   string
	)
	require.NoError(t, db.Pool.QueryRow(ctx, db.Q(`SELECT count(*), max(attempts), max(error) FROM {S}.dlq WHERE key = $1`), killerKey).
		Scan(&entries, &attempts, &errText))
	require.Equal(t, 1, entries, "dead-lettered exactly once")
	require.Equal(t, 1, db.Count(t, `SELECT count(*) FROM {S}.dlq`), "nothing else dead-lettered")
	require.Contains(t, errText, middleware.ErrCrashLoop.Error())
	require.Equal(t, crashMaxAttempts, attempts)
	require.NoError(t, db.Pool.QueryRow(ctx, db.Q(`SELECT status FROM {S}.inbox WHERE consumer = $1 AND key = $2`), cfg.Consumer, killerKey).Scan(&status))
	require.Equal(t, "dead", status, "the killer's key is recorded dead")
	require.Equal(t, int64(1), stats.Inbox.CrashLooped)
	require.Equal(t, int64(1), stats.Poison.DeadLettered)
	t.Logf("crash loop on %s: the killer's handler ran %d times, each a child death (exit codes %v), then a later delivery was dead-lettered without running; "+
		"%d attempts recorded, 1 dead letter with %q, 0 effects of it, %d good keys applied once; last child exited %s after SIGTERM",
		b.name, crashMaxAttempts, exits, attempts, firstLine(errText), crashGood, stats.Took.Round(time.Millisecond))
}

// TestSigtermDrainProcesses: on Kafka, RabbitMQ, SQS and NATS, 300 keys
// whose handler takes 20–50 ms each, sent in five chunks, and a consumer
// process sent SIGTERM four times mid-stream (each time while a handler of
// the latest chunk runs), restarted each time, and finally left to drain. Every
// child exits 0 within shutdownBound of its SIGTERM; every key is applied
// exactly once; no attempt was counted against any key (a shutdown never
// is: no key has more than one attempt or a recorded error), nothing is
// dead-lettered, and the broker holds nothing unacknowledged.
func TestSigtermDrainProcesses(t *testing.T) {
	t.Parallel()
	eachProcessBroker(t, runDrain, "kafka", "amqp", "sqs", "nats")
}

func runDrain(t *testing.T, b broker) {
	id := pgtest.Name(t)
	topic, group, producer := processTopic(t, b, id, "orders_", "billing_")
	db := newProcessDB(t)
	cfg := failureConsumer{
		Stack: db.Stack(b.url, group, topic, "billing_"+b.name),
		Mode:  "drain", DLQTopic: "dlq_" + id, MaxAttempts: 3,
	}

	c := failureRole.Start(t, cfg)
	// The keys go out in drainKills+1 chunks, the next one just before
	// each SIGTERM: a fast consumer (Kafka's 64 in flight drain 300 keys in
	// well under a second) would otherwise be done before the later kills.
	sent := 0
	publishUpTo := func(n int) {
		for ; sent < n; sent++ {
			msg := message.NewMessage(watermill.NewUUID(), []byte(fmt.Sprint(sent)))
			msg.Metadata.Set(delivery.IdempotencyKey, fmt.Sprintf("order-%d", sent))
			require.NoError(t, producer.Publisher.Publish(topic, msg))
		}
	}
	chunk := func(kill int) int { return kill * drainKeys / (drainKills + 1) }

	effects := func() int { return db.Count(t, `SELECT count(*) FROM {S}.effects`) }
	var (
		total   proctest.Stats
		slowest time.Duration
	)
	add := func(s proctest.Stats) {
		slowest = max(slowest, s.Took)
		total.Deliveries += s.Deliveries
		total.Inbox.Applied += s.Inbox.Applied
		total.Inbox.Duplicates += s.Inbox.Duplicates
		total.Inbox.Abandoned += s.Inbox.Abandoned
		total.Inbox.Failed += s.Inbox.Failed
		total.FinishedAtShutdown += s.FinishedAtShutdown
		total.Poison.DeadLettered += s.Poison.DeadLettered
	}
	for kill := 1; kill <= drainKills; kill++ {
		// Mid-stream: the keys of the chunks so far sent, the later ones
		// not yet.
		publishUpTo(chunk(kill))
		// And while a handler runs: a run of this child whose effect has
		// not committed yet.
		require.Eventually(t, func() bool {
			return db.Count(t, `SELECT count(*) FROM {S}.runs r WHERE r.pid = $1 AND NOT EXISTS (SELECT 1 FROM {S}.effects e WHERE e.key = r.key)`,
				c.Cmd.Process.Pid) > 0
		}, 2*time.Minute, time.Millisecond, "kill %d: no handler running", kill)
		add(c.Stop(t, shutdownBound))
		require.Less(t, effects(), drainKeys, "kill %d came after the end", kill)
		c = failureRole.Start(t, cfg)
	}
	publishUpTo(drainKeys)
	require.Eventually(t, func() bool { return effects() >= drainKeys }, 3*time.Minute, 20*time.Millisecond,
		"the last child drains everything")
	require.Eventually(t, func() bool { return b.pending(t, topic, group) == 0 }, 2*time.Minute, 100*time.Millisecond,
		"everything acknowledged")
	add(c.Stop(t, shutdownBound))

	require.Equal(t, drainKeys, effects(), "exactly one effect per key")
	require.Equal(t, drainKeys, db.Count(t, `SELECT count(DISTINCT key) FROM {S}.effects`))
	require.Equal(t, drainKeys, db.Count(t, `SELECT count(*) FROM {S}.inbox WHERE consumer = $1 AND status = 'done'`, cfg.Consumer))
	require.Zero(t, db.Count(t, `SELECT count(*) FROM {S}.inbox i LEFT JOIN {S}.inbox_failures f USING (consumer, key) WHERE COALESCE(f.attempts, CASE WHEN i.status = 'done' THEN 1 ELSE 0 END) > 1 OR f.last_error IS NOT NULL OR i.status <> 'done'`),
		"a shutdown is never counted as an attempt")
	dead := db.Count(t, `SELECT count(*) FROM {S}.dlq`)
	require.Zero(t, dead, "nothing dead-lettered")
	require.Zero(t, total.Inbox.Failed)
	require.Positive(t, total.Inbox.Abandoned+total.FinishedAtShutdown,
		"some SIGTERM came while a handler ran: cut short (not counted) or finished (committed)")
	require.Equal(t, int64(drainKeys), total.Inbox.Applied)
	require.Equal(t, 0, b.pending(t, topic, group), "nothing left on the broker")
	// A handler that finished while its consumer shut down was committed:
	// such a key never ran twice.
	rows, err := db.Pool.Query(context.Background(), db.Q(`SELECT key, count(*) FROM {S}.runs GROUP BY key`))
	require.NoError(t, err)
	runsOf := map[string]int{}
	for rows.Next() {
		var key string
		var n int
		require.NoError(t, rows.Scan(&key, &n))
		runsOf[key] = n
	}
	require.NoError(t, rows.Err())
	require.Len(t, runsOf, drainKeys)
	runs := 0
	for key, n := range runsOf {
		runs += n
		if finishesRegardless(key) {
			require.Equal(t, 1, n, "key %s finished its only run, yet ran again", key)
		}
	}
	t.Logf("drain on %s: %d deliveries, %d handler runs, %d effects, %d dead letters, %d kills; %d attempts cut short by shutdown (not counted), %d finished during shutdown (committed), %d duplicates; slowest exit after SIGTERM %s",
		b.name, total.Deliveries, runs, effects(), dead, drainKills, total.Inbox.Abandoned, total.FinishedAtShutdown,
		total.Inbox.Duplicates, slowest.Round(time.Millisecond))
}

func firstLine(s string) string {
	line, _, _ := strings.Cut(s, "\n")
	return line
}
