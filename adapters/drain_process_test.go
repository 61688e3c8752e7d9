package adapters_test

import (
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/dedup/postgres"
	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/internal/testing/pgtest"
	"github.com/oncemill/oncemill/internal/testing/proctest"
	"github.com/oncemill/oncemill/middleware"
)

const (
	// inflightAllIn is printed once every handler of the first consumer
	// runs: all the messages are in flight at once.
	inflightAllIn = "INFLIGHT ALL IN"

	// inflightJobs is how many messages are in flight, with handlers of
	// 1–3s, when the first consumer is sent SIGTERM; the slow message is
	// in flight with them.
	inflightJobs = 50
	inflightSlow = "slow"
	// inflightSlowFor is how long the slow message's handler works in the
	// first consumer: longer than any drain.
	inflightSlowFor = 10 * time.Minute

	// inflightInboxDrain is the inbox's DrainTimeout in the consumers,
	// and inflightDrain the adapters' drain_timeout: the broker side
	// waits for the inbox's drain and the commit after it.
	inflightInboxDrain = 5 * time.Second
	inflightDrain      = 10 * time.Second
	// inflightExitBound is how long a consumer may take to exit after
	// SIGTERM: the adapter's drain, which ends at the latest when
	// inflightDrain has passed, and 2s for what comes after it, the
	// commit of the acked offsets, leaving the group or closing the
	// connection, and the process's exit. The drain itself ends sooner,
	// once every handler has finished or the inbox has cancelled it
	// (inflightInboxDrain), so the bound is generous.
	inflightExitBound = inflightDrain + 2*time.Second
)

// inflightConsumer is a consumer process of TestSigtermInFlightProcesses:
// the standard stack without the poison middleware, with the runs
// recorded and Handlers router handlers on Topic (one subscription each;
// RabbitMQ and SQS hand a subscription one message at a time, Kafka's
// subscriber hands out many), around a handler that inserts the key's
// effect row in the inbox's transaction and then works for the duration
// its message names.
type inflightConsumer struct {
	proctest.Stack
	Handlers int
	// HoldUntilTerm, when set, makes the handlers wait, before they
	// work, until all of them run (the consumer then prints
	// inflightAllIn) and the consumer has been sent SIGTERM: every
	// message is in flight when the shutdown begins, and its handler's
	// work happens during the drain.
	HoldUntilTerm int
	// SlowFirst makes the slow message's handler work inflightSlowFor.
	SlowFirst bool
}

var inflightRole = proctest.NewRole("inflight", func(cfg inflightConsumer, term <-chan os.Signal) error {
	c := &proctest.Consumer{
		Stack: cfg.Stack, RecordRuns: true, Subscriptions: cfg.Handlers, CloseTimeout: inflightDrain, StrictClose: true,
		// A connection for each message in flight, each holding the
		// inbox's transaction while its handler works, and a few more.
		MaxConns: inflightJobs + 6,
		Inbox:    middleware.InboxConfig{DrainTimeout: inflightInboxDrain},
	}
	var held atomic.Int64
	allIn := make(chan struct{})
	effects := cfg.Table("effects")
	return c.Run(term, func(msg *message.Message) error {
		ctx := msg.Context()
		key := middleware.IdempotencyKey(ctx)
		if _, err := postgres.Tx(ctx).Exec(ctx, `INSERT INTO `+effects+` (key) VALUES ($1)`, key); err != nil {
			return err
		}
		if cfg.HoldUntilTerm > 0 {
			if held.Add(1) == int64(cfg.HoldUntilTerm) {
				fmt.Println(inflightAllIn)
				close(allIn)
			}
			for _, wait := range []<-chan struct{}{allIn, c.Terminated()} {
				select {
				case <-wait:
				case <-ctx.Done():
					return fmt.Errorf("held %q: %w", key, ctx.Err())
				}
			}
		}
		ms, err := strconv.Atoi(string(msg.Payload))
		if err != nil {
			return middleware.Permanent(fmt.Errorf("payload %q is no duration: %w", msg.Payload, err))
		}
		d := time.Duration(ms) * time.Millisecond
		if cfg.SlowFirst && key == inflightSlow {
			d = inflightSlowFor
		}
		timer := time.NewTimer(d)
		defer timer.Stop()
		select {
		case <-timer.C:
			return nil
		case <-ctx.Done():
			return fmt.Errorf("work on %q interrupted: %w", key, ctx.Err())
		}
	})
})

// withParams appends URL parameters to rawURL.
func withParams(rawURL, params string) string {
	if strings.Contains(rawURL, "?") {
		return rawURL + "&" + params
	}
	return rawURL + "?" + params
}

// TestSigtermInFlightProcesses: on Kafka, RabbitMQ, SQS and NATS, a
// consumer process with the PostgreSQL inbox holds 50 messages whose
// handlers work 1–3s, and one whose handler works longer than any drain,
// all in flight at once, when it is sent SIGTERM. It drains: it exits 0 within the
// adapter's drain_timeout + 2s; the 50 handlers finish during the drain
// and their effects are committed, and their acks reach the broker; the
// slow handler is cancelled when the inbox's drain ends, and its effect
// rolled back. A second consumer started afterwards applies the slow
// message, once, and nothing else: no message of the 50 runs its handler
// again (a Kafka message acked above the slow one's offset comes again,
// as a duplicate the inbox drops). No attempt was counted against any
// key, and the broker holds nothing at the end.
func TestSigtermInFlightProcesses(t *testing.T) {
	// Not parallel: each consumer holds a database connection per message
	// in flight.
	for _, b := range processBrokers(t, "kafka", "amqp", "sqs", "nats") {
		t.Run(b.name, func(t *testing.T) { runInFlight(t, b) })
	}
}

func runInFlight(t *testing.T, b broker) {
	topic, group, producer := processTopic(t, b, pgtest.Name(t), "jobs_", "workers_")
	db := newProcessDB(t)
	// Kafka's subscriber hands out every key of a partition at once; a
	// RabbitMQ subscription one message at a time and an SQS one at most
	// 10 (max_messages), so those get a subscription per message, each
	// taking one message at a time (prefetch, max_messages); a NATS
	// subscription as many as its max_in_flight.
	handlers, params := 1, "drain_timeout="+inflightDrain.String()
	switch b.name {
	case "amqp":
		handlers, params = inflightJobs+1, params+"&prefetch=1"
	case "sqs":
		handlers, params = inflightJobs+1, params+"&max_messages=1"
	case "nats":
		params += "&max_in_flight=" + strconv.Itoa(inflightJobs+1)
	}
	first := inflightConsumer{
		Stack:    db.Stack(withParams(b.url, params), group, topic, "workers_"+b.name),
		Handlers: handlers, HoldUntilTerm: inflightJobs + 1, SlowFirst: true,
	}
	a := inflightRole.Start(t, first)
	publish := func(key string, work time.Duration) {
		msg := message.NewMessage(watermill.NewUUID(), []byte(strconv.Itoa(int(work.Milliseconds()))))
		msg.Metadata.Set(delivery.IdempotencyKey, key)
		msg.Metadata.Set(delivery.PartitionKey, key)
		require.NoError(t, producer.Publisher.Publish(topic, msg))
	}
	for i := range inflightJobs {
		publish(fmt.Sprintf("job-%d", i), time.Second+time.Duration(i*2000/(inflightJobs-1))*time.Millisecond)
	}
	publish(inflightSlow, time.Second) // slow in the first consumer only

	require.Eventually(t, func() bool { _, ok := a.Out.Line(inflightAllIn); return ok || a.Exited() }, 2*time.Minute, 10*time.Millisecond,
		"not every message in flight in the first consumer")
	_, allIn := a.Out.Line(inflightAllIn)
	require.True(t, allIn, "the first consumer exited; output:\n%s", a.Out.String())
	require.Zero(t, db.Count(t, `SELECT count(*) FROM {S}.effects`), "nothing committed before SIGTERM")
	resA := a.Stop(t, inflightExitBound)

	// What the first consumer left: the 50 effects committed, the slow
	// one rolled back, and on the broker the slow message only (on Kafka,
	// from its offset on, in its partition).
	require.Equal(t, inflightJobs, db.Count(t, `SELECT count(*) FROM {S}.effects`), "every handler that finished in the drain is committed")
	require.Zero(t, db.Count(t, `SELECT count(*) FROM {S}.effects WHERE key = $1`, inflightSlow), "the slow handler's effect is rolled back")
	require.Zero(t, db.Count(t, `SELECT count(*) FROM {S}.inbox WHERE key = $1 AND status = 'done'`, inflightSlow), "the slow key is not done")
	require.Equal(t, inflightJobs+1, db.Count(t, `SELECT count(*) FROM {S}.runs WHERE pid = $1`, a.Cmd.Process.Pid))
	require.Equal(t, int64(inflightJobs), resA.FinishedAtShutdown, "every fast handler finished after SIGTERM")
	require.Equal(t, int64(inflightJobs), resA.Inbox.Applied)
	require.Equal(t, int64(1), resA.Inbox.Abandoned, "the slow attempt is cut short by the shutdown")
	require.Zero(t, resA.Inbox.Failed, "a shutdown is not a failure")
	leftA := b.pending(t, topic, group)
	if b.name == "kafka" {
		require.Positive(t, leftA, "the slow message's offset is not committed")
	} else {
		require.Equal(t, 1, leftA, "every message acked in the drain left the broker, the slow one stayed")
	}

	second := first
	second.HoldUntilTerm, second.SlowFirst = 0, false
	c := inflightRole.Start(t, second)
	require.Eventually(t, func() bool { return db.Count(t, `SELECT count(*) FROM {S}.effects`) >= inflightJobs+1 }, 2*time.Minute, 20*time.Millisecond,
		"the second consumer applies the slow message")
	require.Eventually(t, func() bool { return b.pending(t, topic, group) == 0 }, 2*time.Minute, 100*time.Millisecond,
		"everything acknowledged")
	resC := c.Stop(t, inflightExitBound)

	require.Equal(t, inflightJobs+1, db.Count(t, `SELECT count(*) FROM {S}.effects`), "exactly one effect per key")
	require.Equal(t, inflightJobs+1, db.Count(t, `SELECT count(DISTINCT key) FROM {S}.effects`))
	require.Equal(t, inflightJobs, db.Count(t, `SELECT count(*) FROM {S}.runs WHERE key <> $1`, inflightSlow),
		"no message of the 50 ran its handler again")
	require.Equal(t, inflightJobs, db.Count(t, `SELECT count(DISTINCT key) FROM {S}.runs WHERE key <> $1`, inflightSlow))
	require.Equal(t, 1, db.Count(t, `SELECT count(*) FROM {S}.runs WHERE key = $1 AND pid = $2`, inflightSlow, c.Cmd.Process.Pid),
		"the slow message runs once more, in the second consumer")
	require.Equal(t, 1, db.Count(t, `SELECT count(*) FROM {S}.runs WHERE pid = $1`, c.Cmd.Process.Pid), "and nothing else does")
	require.Equal(t, int64(1), resC.Inbox.Applied)
	require.Equal(t, inflightJobs+1, db.Count(t, `SELECT count(*) FROM {S}.inbox WHERE consumer = $1 AND status = 'done'`, first.Consumer))
	require.Zero(t, db.Count(t, `SELECT count(*) FROM {S}.inbox i LEFT JOIN {S}.inbox_failures f USING (consumer, key) WHERE COALESCE(f.attempts, CASE WHEN i.status = 'done' THEN 1 ELSE 0 END) > 1 OR f.last_error IS NOT NULL`),
		"the cancelled attempt is not counted")
	require.Equal(t, 0, b.pending(t, topic, group), "nothing left on the broker")
	t.Logf("SIGTERM with %d messages in flight on %s: first consumer exited after %s (bound %s), %d effects committed in the drain, %d finished after SIGTERM, %d abandoned; "+
		"left on the broker %d; second consumer: %d run (%d applied, %d duplicates), exited after %s; handler runs of the 50: %d, effects %d",
		inflightJobs+1, b.name, resA.Took.Round(time.Millisecond), inflightExitBound, resA.Inbox.Applied, resA.FinishedAtShutdown, resA.Inbox.Abandoned,
		leftA, resC.Runs, resC.Inbox.Applied, resC.Inbox.Duplicates, resC.Took.Round(time.Millisecond),
		db.Count(t, `SELECT count(*) FROM {S}.runs WHERE key <> $1`, inflightSlow), db.Count(t, `SELECT count(*) FROM {S}.effects`))
}
