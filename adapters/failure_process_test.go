package adapters_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"hash/crc32"
	"os"
	"os/signal"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/adapters"
	"github.com/oncemill/oncemill/dedup/postgres"
	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/dlq"
	"github.com/oncemill/oncemill/internal/pgtest"
	"github.com/oncemill/oncemill/internal/proctest"
	"github.com/oncemill/oncemill/middleware"
	"github.com/oncemill/oncemill/sqlschema"
)

// childEnv, when set in the environment, makes the test binary run one
// child consumer (configured by the variable's JSON value, a childConfig)
// instead of the tests; see TestMain.
const childEnv = "ONCEMILL_TEST_CHILD_CONSUMER"

const (
	// Exit codes of a child consumer.
	childKilled   = 3 // the handler met the killer key and called os.Exit
	childBadSetup = 4 // it could not start
	childBadClose = 5 // the router did not close cleanly

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

// childConfig is what a child consumer is told by its parent.
type childConfig struct {
	// Mode is "crash" (the handler kills the process on killerKey) or
	// "drain" (each message takes 20–50 ms).
	Mode        string
	BrokerURL   string
	Group       string
	Topic       string
	DLQTopic    string
	DatabaseURL string
	Schema      string
	Consumer    string
	MaxAttempts int
}

// childStats is what a child prints on its last line when it exits
// cleanly.
type childStats struct {
	Deliveries int64 // messages the router handed to the handler chain
	// FinishedAtShutdown counts handler runs that returned nil after the
	// consumer began to shut down: the inbox commits them on a detached
	// context.
	FinishedAtShutdown int64
	Inbox              middleware.InboxStats
	Poison             middleware.PoisonStats
}

const (
	childReady = "CHILD READY"
	childDone  = "CHILD STATS "
)

// runChild is a consumer process: broker, PostgreSQL inbox, poison
// middleware with a PostgreSQL dead-letter table, and a handler that writes
// one effect row per key in the inbox's transaction (and one run row per
// handler run outside it). It runs until SIGTERM, then closes the router
// and exits 0.
func runChild(raw string) int {
	var cfg childConfig
	if err := json.Unmarshal([]byte(raw), &cfg); err != nil {
		fmt.Fprintln(os.Stderr, "child: bad config:", err)
		return childBadSetup
	}
	// Registered first: a SIGTERM that comes while the consumer starts is
	// handled once it runs.
	term := make(chan os.Signal, 1)
	signal.Notify(term, syscall.SIGTERM)

	code, err := consume(cfg, term)
	if err != nil {
		fmt.Fprintln(os.Stderr, "child:", err)
	}
	return code
}

func consume(cfg childConfig, term <-chan os.Signal) (int, error) {
	ctx := context.Background()
	poolCfg, err := pgxpool.ParseConfig(cfg.DatabaseURL)
	if err != nil {
		return childBadSetup, err
	}
	poolCfg.MaxConns = 8
	pool, err := pgxpool.NewWithConfig(ctx, poolCfg)
	if err != nil {
		return childBadSetup, err
	}
	defer pool.Close()
	// The test's own bookkeeping (the runs table) has a pool of its own:
	// a handler that took a second connection from the inbox's pool while
	// the inbox holds one would deadlock once every connection is held by
	// a waiting handler, with the Kafka subscriber's 64 messages in flight
	// per partition.
	books, err := pgxpool.NewWithConfig(ctx, poolCfg.Copy())
	if err != nil {
		return childBadSetup, err
	}
	defer books.Close()
	store, err := postgres.New(pool, postgres.Config{Schema: cfg.Schema})
	if err != nil {
		return childBadSetup, err
	}
	dlqPub, err := dlq.NewPublisher(pool, sqlschema.Config{Schema: cfg.Schema})
	if err != nil {
		return childBadSetup, err
	}
	ps, err := adapters.Open(ctx, cfg.BrokerURL, adapters.Options{ConsumerGroup: cfg.Group})
	if err != nil {
		return childBadSetup, err
	}
	poison, err := middleware.NewPoison(middleware.PoisonConfig{
		Publisher: dlqPub, Topic: cfg.DLQTopic, MaxAttempts: cfg.MaxAttempts,
		InitialBackoff: 50 * time.Millisecond, MaxBackoff: 50 * time.Millisecond,
	})
	if err != nil {
		return childBadSetup, errors.Join(err, ps.Close())
	}
	inbox, err := middleware.NewInbox(middleware.InboxConfig{TxStore: store, Consumer: cfg.Consumer})
	if err != nil {
		return childBadSetup, errors.Join(err, ps.Close())
	}
	schema := pgx.Identifier{cfg.Schema}.Sanitize()
	// terminated is closed when SIGTERM comes, before the router's close:
	// the inbox hands the handler a context that outlives the message's
	// cancellation, so the handler cannot tell the shutdown from it.
	terminated := make(chan struct{})
	routerTerm := make(chan os.Signal, 1)
	relayStop, relayDone := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(relayDone)
		select {
		case sig := <-term:
			close(terminated)
			routerTerm <- sig
		case <-relayStop:
		}
	}()
	defer func() { close(relayStop); <-relayDone }()
	var deliveries, finishedAtShutdown atomic.Int64
	counting := func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			deliveries.Add(1)
			return h(msg)
		}
	}
	handler := func(msg *message.Message) error {
		ctx := msg.Context()
		key := middleware.IdempotencyKey(ctx)
		// The run is recorded outside the transaction, so that it stays
		// whatever becomes of the attempt.
		if _, err := books.Exec(context.WithoutCancel(ctx), `INSERT INTO `+schema+`.runs (key, pid) VALUES ($1, $2)`, key, os.Getpid()); err != nil {
			return err
		}
		if cfg.Mode == "crash" && key == killerKey {
			os.Exit(childKilled) // as an OOM kill would: nothing runs after this
		}
		if cfg.Mode == "drain" && finishesRegardless(key) {
			// This handler ignores cancellation: what it started, it
			// finishes, and the inbox must commit it.
			ctx = context.WithoutCancel(ctx)
		}
		if _, err := postgres.Tx(ctx).Exec(ctx, `INSERT INTO `+schema+`.effects (key) VALUES ($1)`, key); err != nil {
			return err
		}
		if cfg.Mode != "drain" {
			return nil
		}
		if err := work(ctx, key); err != nil {
			return err
		}
		select {
		case <-terminated:
			finishedAtShutdown.Add(1)
		default:
		}
		return nil
	}

	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
	if err != nil {
		return childBadSetup, errors.Join(err, ps.Close())
	}
	r.AddMiddleware(counting, poison.Middleware, inbox.Middleware)
	r.AddNoPublisherHandler(cfg.Consumer, cfg.Topic, ps.Subscriber, handler)
	code := 0
	switch err := proctest.RunRouter(ctx, r, childReady, routerTerm); {
	case errors.Is(err, proctest.ErrRouterNotStarted):
		return childBadSetup, errors.Join(err, ps.Close())
	case errors.Is(err, proctest.ErrRouterStopped):
		return childBadClose, errors.Join(err, ps.Close())
	case err != nil:
		code = childBadClose
		fmt.Fprintln(os.Stderr, "child: router close:", err)
	}
	if err := ps.Close(); err != nil {
		fmt.Fprintln(os.Stderr, "child: close broker:", err)
	}
	stats, err := json.Marshal(childStats{
		Deliveries: deliveries.Load(), FinishedAtShutdown: finishedAtShutdown.Load(),
		Inbox: inbox.Stats(), Poison: poison.Stats(),
	})
	if err != nil {
		return childBadClose, err
	}
	fmt.Println(childDone + string(stats))
	return code, nil
}

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

// child is a running child consumer.
type child struct{ *proctest.Process }

// startChild starts a child consumer and waits until its router runs.
func startChild(t *testing.T, cfg childConfig) *child {
	t.Helper()
	raw, err := json.Marshal(cfg)
	require.NoError(t, err)
	p, err := proctest.Start([]string{childEnv + "=" + string(raw)}, childReady, time.Minute)
	require.NoError(t, err)
	t.Cleanup(func() {
		if !p.Exited() {
			p.Kill()
			t.Logf("child %d killed at the end of the test; output:\n%s", p.Cmd.Process.Pid, p.Out.String())
		}
	})
	return &child{p}
}

// terminate sends SIGTERM and waits for the child to exit, which it must
// do within shutdownBound and with code 0. It returns how long it took and
// the stats the child printed.
func (c *child) terminate(t *testing.T) (time.Duration, childStats) {
	t.Helper()
	start := time.Now()
	require.NoError(t, c.Terminate(shutdownBound))
	took := time.Since(start)
	require.Equal(t, 0, c.Code(), "child exit code; output:\n%s", c.Out.String())
	return took, c.stats(t)
}

// stats reads the stats line a child printed when it exited cleanly.
func (c *child) stats(t *testing.T) childStats {
	t.Helper()
	line, ok := c.Out.Line(childDone)
	require.True(t, ok, "child printed no stats; output:\n%s", c.Out.String())
	var s childStats
	require.NoError(t, json.Unmarshal([]byte(line), &s))
	return s
}

// processDB is a fresh schema for the children of one test: oncemill's
// tables (inbox, dead-letter table) and the handler's effects and runs.
type processDB struct {
	pool   *pgxpool.Pool
	schema string // unquoted
	q      string // quoted
}

func newProcessDB(t *testing.T) processDB {
	t.Helper()
	pool := pgtest.Pool(t, 4)
	schema := pgtest.Schema(t, pool)
	q := pgx.Identifier{schema}.Sanitize()
	_, err := pool.Exec(context.Background(), `CREATE TABLE `+q+`.effects (key text NOT NULL);
CREATE TABLE `+q+`.runs (key text NOT NULL, pid integer NOT NULL, at timestamptz NOT NULL DEFAULT clock_timestamp())`)
	require.NoError(t, err)
	return processDB{pool: pool, schema: schema, q: q}
}

func (db processDB) count(t *testing.T, query string, args ...any) int {
	t.Helper()
	var n int
	require.NoError(t, db.pool.QueryRow(context.Background(), strings.ReplaceAll(query, "{S}", db.q), args...).Scan(&n))
	return n
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
	for _, b := range processBrokers(t, "kafka", "amqp", "nats", "nats_embedded") {
		t.Run(b.name, func(t *testing.T) {
			t.Parallel()
			runCrashLoop(t, b)
		})
	}
}

func runCrashLoop(t *testing.T, b broker) {
	ctx := context.Background()
	id := pgtest.Name(t)
	topic, group := "pay_"+id, "ledger_"+id
	producer := b.open(t, "producer_"+id)
	defer closeQuietly(t, producer)
	if b.cleanup != nil {
		t.Cleanup(func() { b.cleanup(t, topic, group) })
	}
	db := newProcessDB(t)
	cfg := childConfig{
		Mode: "crash", BrokerURL: b.url, Group: group, Topic: topic, DLQTopic: "dlq_" + id,
		DatabaseURL: pgtest.URL(), Schema: db.schema, Consumer: "ledger_" + b.name, MaxAttempts: crashMaxAttempts,
	}

	// The first consumer subscribes before anything is published, so that
	// RabbitMQ has its queue.
	c := startChild(t, cfg)
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
		return db.count(t, `SELECT count(*) FROM {S}.dlq WHERE key = $1`, killerKey) > 0
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
		require.Equal(t, childKilled, c.Code(), "a child died of something else; output:\n%s", c.Out.String())
		require.LessOrEqual(t, len(exits), crashMaxAttempts, "the killer ran more than MaxAttempts times")
		c = startChild(t, cfg) // restart it, as a supervisor would
	}

	require.Eventually(t, func() bool { return db.count(t, `SELECT count(*) FROM {S}.effects`) >= crashGood }, 2*time.Minute, 20*time.Millisecond,
		"the good messages behind the killer are applied")
	require.Eventually(t, func() bool { return b.pending(t, topic, group) == 0 }, time.Minute, 100*time.Millisecond,
		"everything acknowledged, the killer included")
	took, stats := c.terminate(t)

	require.Equal(t, []int{childKilled, childKilled, childKilled}, exits, "the child died exactly MaxAttempts times")
	require.Equal(t, crashMaxAttempts, db.count(t, `SELECT count(*) FROM {S}.runs WHERE key = $1`, killerKey),
		"the killer's handler ran MaxAttempts times, and not on the delivery that dead-lettered it")
	require.Zero(t, db.count(t, `SELECT count(*) FROM {S}.effects WHERE key = $1`, killerKey), "the killer has no effect")
	require.Equal(t, crashGood, db.count(t, `SELECT count(*) FROM {S}.effects`), "each good key applied once")
	require.Equal(t, crashGood, db.count(t, `SELECT count(DISTINCT key) FROM {S}.effects`))
	require.Equal(t, 0, b.pending(t, topic, group), "nothing left on the broker")

	var (
		entries, attempts int
		errText, status   string
	)
	require.NoError(t, db.pool.QueryRow(ctx, `SELECT count(*), max(attempts), max(error) FROM `+db.q+`.dlq WHERE key = $1`, killerKey).
		Scan(&entries, &attempts, &errText))
	require.Equal(t, 1, entries, "dead-lettered exactly once")
	require.Equal(t, 1, db.count(t, `SELECT count(*) FROM {S}.dlq`), "nothing else dead-lettered")
	require.Contains(t, errText, middleware.ErrCrashLoop.Error())
	require.Equal(t, crashMaxAttempts, attempts)
	require.NoError(t, db.pool.QueryRow(ctx, `SELECT status FROM `+db.q+`.inbox WHERE consumer = $1 AND key = $2`, cfg.Consumer, killerKey).Scan(&status))
	require.Equal(t, "dead", status, "the killer's key is recorded dead")
	require.Equal(t, int64(1), stats.Inbox.CrashLooped)
	require.Equal(t, int64(1), stats.Poison.DeadLettered)
	t.Logf("crash loop on %s: the killer's handler ran %d times, each a child death (exit codes %v), then a later delivery was dead-lettered without running; "+
		"%d attempts recorded, 1 dead letter with %q, 0 effects of it, %d good keys applied once; last child exited %s after SIGTERM",
		b.name, crashMaxAttempts, exits, attempts, firstLine(errText), crashGood, took.Round(time.Millisecond))
}

// TestSigtermDrainProcesses: on Kafka, RabbitMQ, SQS and NATS, 300 keys
// whose handler takes 20–50 ms each, and a consumer process sent SIGTERM
// four times mid-stream, restarted each time, and finally left to drain. Every
// child exits 0 within shutdownBound of its SIGTERM; every key is applied
// exactly once; no attempt was counted against any key (a shutdown never
// is: no key has more than one attempt or a recorded error), nothing is
// dead-lettered, and the broker holds nothing unacknowledged.
func TestSigtermDrainProcesses(t *testing.T) {
	t.Parallel()
	for _, b := range processBrokers(t, "kafka", "amqp", "sqs", "nats") {
		t.Run(b.name, func(t *testing.T) {
			t.Parallel()
			runDrain(t, b)
		})
	}
}

func runDrain(t *testing.T, b broker) {
	id := pgtest.Name(t)
	topic, group := "orders_"+id, "billing_"+id
	producer := b.open(t, "producer_"+id)
	defer closeQuietly(t, producer)
	if b.cleanup != nil {
		t.Cleanup(func() { b.cleanup(t, topic, group) })
	}
	db := newProcessDB(t)
	cfg := childConfig{
		Mode: "drain", BrokerURL: b.url, Group: group, Topic: topic, DLQTopic: "dlq_" + id,
		DatabaseURL: pgtest.URL(), Schema: db.schema, Consumer: "billing_" + b.name, MaxAttempts: 3,
	}

	c := startChild(t, cfg)
	for k := range drainKeys {
		msg := message.NewMessage(watermill.NewUUID(), []byte(fmt.Sprint(k)))
		msg.Metadata.Set(delivery.IdempotencyKey, fmt.Sprintf("order-%d", k))
		require.NoError(t, producer.Publisher.Publish(topic, msg))
	}

	effects := func() int { return db.count(t, `SELECT count(*) FROM {S}.effects`) }
	var (
		total   childStats
		slowest time.Duration
	)
	add := func(took time.Duration, s childStats) {
		slowest = max(slowest, took)
		total.Deliveries += s.Deliveries
		total.Inbox.Applied += s.Inbox.Applied
		total.Inbox.Duplicates += s.Inbox.Duplicates
		total.Inbox.Abandoned += s.Inbox.Abandoned
		total.Inbox.Failed += s.Inbox.Failed
		total.FinishedAtShutdown += s.FinishedAtShutdown
		total.Poison.DeadLettered += s.Poison.DeadLettered
	}
	for kill := 1; kill <= drainKills; kill++ {
		// Mid-stream: after some more effects, well before the end.
		want := kill * drainKeys / (drainKills + 2)
		require.Eventually(t, func() bool { return effects() >= want }, 2*time.Minute, 10*time.Millisecond,
			"kill %d: fewer than %d effects", kill, want)
		// And while a handler runs: a run of this child whose effect has
		// not committed yet.
		require.Eventually(t, func() bool {
			return db.count(t, `SELECT count(*) FROM {S}.runs r WHERE r.pid = $1 AND NOT EXISTS (SELECT 1 FROM {S}.effects e WHERE e.key = r.key)`,
				c.Cmd.Process.Pid) > 0
		}, 2*time.Minute, time.Millisecond, "kill %d: no handler running", kill)
		took, s := c.terminate(t)
		add(took, s)
		require.Less(t, effects(), drainKeys, "kill %d came after the end", kill)
		c = startChild(t, cfg)
	}
	require.Eventually(t, func() bool { return effects() >= drainKeys }, 3*time.Minute, 20*time.Millisecond,
		"the last child drains everything")
	require.Eventually(t, func() bool { return b.pending(t, topic, group) == 0 }, 2*time.Minute, 100*time.Millisecond,
		"everything acknowledged")
	add(c.terminate(t))

	require.Equal(t, drainKeys, effects(), "exactly one effect per key")
	require.Equal(t, drainKeys, db.count(t, `SELECT count(DISTINCT key) FROM {S}.effects`))
	require.Equal(t, drainKeys, db.count(t, `SELECT count(*) FROM {S}.inbox WHERE consumer = $1 AND status = 'done'`, cfg.Consumer))
	require.Zero(t, db.count(t, `SELECT count(*) FROM {S}.inbox WHERE attempts > 1 OR last_error IS NOT NULL OR status <> 'done'`),
		"a shutdown is never counted as an attempt")
	dead := db.count(t, `SELECT count(*) FROM {S}.dlq`)
	require.Zero(t, dead, "nothing dead-lettered")
	require.Zero(t, total.Inbox.Failed)
	require.Positive(t, total.Inbox.Abandoned+total.FinishedAtShutdown,
		"some SIGTERM came while a handler ran: cut short (not counted) or finished (committed)")
	require.Equal(t, int64(drainKeys), total.Inbox.Applied)
	require.Equal(t, 0, b.pending(t, topic, group), "nothing left on the broker")
	// A handler that finished while its consumer shut down was committed:
	// such a key never ran twice.
	rows, err := db.pool.Query(context.Background(), `SELECT key, count(*) FROM `+db.q+`.runs GROUP BY key`)
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
