package adapters_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/signal"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/adapters"
	"github.com/oncemill/oncemill/adapters/kafka"
	"github.com/oncemill/oncemill/dedup/postgres"
	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/dlq"
	"github.com/oncemill/oncemill/internal/brokertest"
	"github.com/oncemill/oncemill/internal/pgtest"
	"github.com/oncemill/oncemill/internal/proctest"
	"github.com/oncemill/oncemill/middleware"
	"github.com/oncemill/oncemill/sqlschema"
)

// burstConsumerEnv, when set, makes the test binary run one consumer of
// TestKafkaCrashBurstProcesses (configured by the variable's JSON value,
// a burstConsumer) instead of the tests; see init.
const burstConsumerEnv = "ONCEMILL_TEST_BURST_CONSUMER"

const (
	burstReadyLine = "BURST READY"
	// burstHandlerTime is how long the handler works on each message,
	// inside the inbox's transaction, so that every kill finds messages
	// in flight.
	burstHandlerTime = 800 * time.Millisecond
	// burstPublishEvery is the producer's pace: 5 messages a second.
	burstPublishEvery = 200 * time.Millisecond
	// burstInFlight bounds the messages in flight in a consumer, and is
	// its database pool's size: 20 messages a second, which catches up
	// with the backlog of the burst within seconds.
	burstInFlight = 16
)

// init runs a consumer of the crash-burst test when the environment
// names one; like the restart roles, it must come before TestMain.
func init() {
	raw := os.Getenv(burstConsumerEnv)
	if raw == "" {
		return
	}
	term := make(chan os.Signal, 1)
	signal.Notify(term, syscall.SIGTERM)
	var cfg burstConsumer
	if err := json.Unmarshal([]byte(raw), &cfg); err != nil {
		fmt.Fprintln(os.Stderr, "burst consumer: bad config:", err)
		os.Exit(restartBadSetup)
	}
	code, err := cfg.run(term)
	if err != nil {
		fmt.Fprintln(os.Stderr, "burst consumer:", err)
	}
	os.Exit(code)
}

// burstConsumer is a consumer process of the crash-burst test: the Kafka
// adapter opened by BrokerURL, the poison middleware with the PostgreSQL
// dead-letter table, and the PostgreSQL inbox around a handler that works
// for burstHandlerTime and then inserts one effect row per key, with its
// process id, in the inbox's transaction.
type burstConsumer struct {
	BrokerURL   string
	Group       string
	Topic       string
	DatabaseURL string
	Schema      string
}

func (cfg burstConsumer) run(term <-chan os.Signal) (int, error) {
	ctx := context.Background()
	poolCfg, err := pgxpool.ParseConfig(cfg.DatabaseURL)
	if err != nil {
		return restartBadSetup, err
	}
	poolCfg.MaxConns = burstInFlight
	pool, err := pgxpool.NewWithConfig(ctx, poolCfg)
	if err != nil {
		return restartBadSetup, err
	}
	defer pool.Close()
	store, err := postgres.New(pool, postgres.Config{Schema: cfg.Schema})
	if err != nil {
		return restartBadSetup, err
	}
	dlqPub, err := dlq.NewPublisher(pool, sqlschema.Config{Schema: cfg.Schema})
	if err != nil {
		return restartBadSetup, err
	}
	// Info logs go to the parent, which shows them when a check fails.
	logger := watermill.NewStdLogger(false, false)
	ps, err := adapters.Open(ctx, cfg.BrokerURL, adapters.Options{ConsumerGroup: cfg.Group, Logger: logger})
	if err != nil {
		return restartBadSetup, err
	}
	// A key in flight at several kills is not poison here: the attempts
	// allowed outnumber the kills.
	poison, err := middleware.NewPoison(middleware.PoisonConfig{
		Publisher: dlqPub, Topic: "dlq", MaxAttempts: 100,
		InitialBackoff: 20 * time.Millisecond, MaxBackoff: 200 * time.Millisecond,
	})
	if err != nil {
		return restartBadSetup, errors.Join(err, ps.Close())
	}
	inbox, err := middleware.NewInbox(middleware.InboxConfig{TxStore: store, Consumer: "ledger"})
	if err != nil {
		return restartBadSetup, errors.Join(err, ps.Close())
	}
	effects := pgx.Identifier{cfg.Schema, "effects"}.Sanitize()
	pid := os.Getpid()
	handler := func(msg *message.Message) error {
		ctx := msg.Context()
		select {
		case <-time.After(burstHandlerTime):
		case <-ctx.Done():
			return ctx.Err()
		}
		_, err := postgres.Tx(ctx).Exec(ctx, `INSERT INTO `+effects+` (key, pid) VALUES ($1, $2)`, middleware.IdempotencyKey(ctx), pid)
		return err
	}
	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, logger)
	if err != nil {
		return restartBadSetup, errors.Join(err, ps.Close())
	}
	r.AddMiddleware(poison.Middleware, inbox.Middleware)
	r.AddNoPublisherHandler("ledger", cfg.Topic, ps.Subscriber, handler)
	code := 0
	switch err := proctest.RunRouter(ctx, r, burstReadyLine, term); {
	case errors.Is(err, proctest.ErrRouterNotStarted):
		return restartBadSetup, errors.Join(err, ps.Close())
	case errors.Is(err, proctest.ErrRouterStopped):
		return restartStopped, errors.Join(err, ps.Close())
	case err != nil:
		code = restartBadClose
		fmt.Fprintln(os.Stderr, "burst consumer: router close:", err)
	}
	if err := ps.Close(); err != nil {
		code = restartBadClose
		fmt.Fprintln(os.Stderr, "burst consumer: close:", err)
	}
	return code, nil
}

// TestKafkaCrashBurstProcesses: the embedded Kafka broker in its own
// process (or the cluster named by ONCEMILL_KAFKA_BROKERS), a topic of 4
// partitions fed 5 messages a second, and one dynamic consumer process
// (no instance_id; the kafka:// URL's defaults but for max_in_flight_total,
// with an 0.8 s handler) SIGKILLed 12 times, 4–12 s apart, restarted at
// once each time, as a supervisor restarts a crash loop, and then left
// running. The kills pile up: a consumer is often killed before the
// session of the one killed before it has expired, and while its own
// JoinGroup waits for that expiry.
//
// The liveness bound: the survivor applies its first message within
// twice the session timeout of the last kill, its start included; a
// crash must not cost the group more than the dead member's session,
// however many came before it. The figure is logged. In the end every
// published key is applied exactly once, nothing is dead-lettered and
// the group's lag is 0.
func TestKafkaCrashBurstProcesses(t *testing.T) {
	t.Parallel()
	brokers := kafka.BrokersFromEnv()
	if len(brokers) == 0 {
		brokers = startRestartKafka(t)
	}
	ctx := context.Background()
	id := pgtest.Name(t)
	topic, group := "payments_"+id, "ledger_"+id
	pool := pgtest.Pool(t, 4)
	schema := pgtest.Schema(t, pool)
	q := pgx.Identifier{schema}.Sanitize()
	_, err := pool.Exec(ctx, `CREATE TABLE `+q+`.effects (key text NOT NULL, pid integer NOT NULL, at timestamptz NOT NULL DEFAULT clock_timestamp());
CREATE TABLE `+q+`.published (key text PRIMARY KEY)`)
	require.NoError(t, err)
	count := func(query string, args ...any) int {
		t.Helper()
		var n int
		require.NoError(t, pool.QueryRow(ctx, strings.ReplaceAll(query, "{S}", q), args...).Scan(&n))
		return n
	}
	now := func() time.Time {
		t.Helper()
		var at time.Time
		require.NoError(t, pool.QueryRow(ctx, `SELECT clock_timestamp()`).Scan(&at))
		return at
	}
	createRestartTopic(t, brokers, topic)
	session := kafka.DefaultSessionTimeout
	bound := 2 * session

	cfg := burstConsumer{
		BrokerURL: "kafka://" + strings.Join(brokers, ",") + "?group=" + group + fmt.Sprintf("&max_in_flight_total=%d", burstInFlight),
		Group:     group, Topic: topic, DatabaseURL: pgtest.URL(), Schema: schema,
	}
	raw, err := json.Marshal(cfg)
	require.NoError(t, err)
	var outs []*proctest.Buffer
	defer func() {
		if t.Failed() {
			for i, o := range outs {
				t.Logf("--- consumer process %d ---\n%s", i+1, o.String())
			}
		}
	}()
	start := func() *proctest.Process {
		t.Helper()
		p, err := proctest.Start([]string{burstConsumerEnv + "=" + string(raw)}, burstReadyLine, time.Minute)
		require.NoError(t, err)
		t.Cleanup(func() {
			if !p.Exited() {
				p.Kill()
			}
		})
		outs = append(outs, p.Out)
		return p
	}
	groups := brokertest.NewKafkaGroups(t, brokers)

	// The producer: one message a tick, each its own key, recorded once
	// the broker has it.
	producer, err := adapters.Open(ctx, "kafka://"+strings.Join(brokers, ","), adapters.Options{ConsumerGroup: "producer_" + id})
	require.NoError(t, err)
	defer func() { require.NoError(t, producer.Close()) }()
	var (
		stopProducing = make(chan struct{})
		producing     sync.WaitGroup
		produceErr    error
		stopOnce      sync.Once
	)
	producing.Add(1)
	go func() {
		defer producing.Done()
		tick := time.NewTicker(burstPublishEvery)
		defer tick.Stop()
		for n := 0; ; n++ {
			select {
			case <-stopProducing:
				return
			case <-tick.C:
			}
			key := fmt.Sprintf("pay-%05d", n)
			msg := message.NewMessage(watermill.NewUUID(), []byte(key))
			msg.Metadata.Set(delivery.IdempotencyKey, key)
			if err := producer.Publisher.Publish(topic, msg); err != nil {
				produceErr = fmt.Errorf("publish %s: %w", key, err)
				return
			}
			if _, err := pool.Exec(ctx, `INSERT INTO `+q+`.published (key) VALUES ($1)`, key); err != nil {
				produceErr = fmt.Errorf("record %s: %w", key, err)
				return
			}
		}
	}()
	stopProducer := func() {
		t.Helper()
		stopOnce.Do(func() { close(stopProducing) })
		producing.Wait()
		require.NoError(t, produceErr)
	}
	defer stopProducer()

	// The group's states, as its coordinator describes them, for the log.
	var (
		watchMu   sync.Mutex
		states    []string
		watching  = make(chan struct{})
		watched   sync.WaitGroup
		watchOnce sync.Once
	)
	stopWatching := func() {
		watchOnce.Do(func() { close(watching) })
		watched.Wait()
	}
	defer stopWatching()
	began := time.Now()
	note := func(what string) {
		watchMu.Lock()
		defer watchMu.Unlock()
		states = append(states, fmt.Sprintf("+%5.1fs %s", time.Since(began).Seconds(), what))
	}
	watched.Add(1)
	go func() {
		defer watched.Done()
		prev := ""
		for {
			select {
			case <-watching:
				return
			case <-time.After(100 * time.Millisecond):
			}
			g, err := groups.Group(group, topic)
			what := fmt.Sprintf("%s, %d members", g.State, len(g.Members))
			if err != nil {
				what = err.Error()
			}
			if what != prev {
				note(what)
				prev = what
			}
		}
	}()
	defer func() {
		stopWatching()
		watchMu.Lock()
		defer watchMu.Unlock()
		t.Logf("the group's states:\n  %s", strings.Join(states, "\n  "))
	}()

	// Steady: the first consumer applies messages.
	c := start()
	started := now()
	require.Eventually(t, func() bool { return count(`SELECT count(*) FROM {S}.effects WHERE at > $1`, started) > 0 },
		time.Minute, 50*time.Millisecond, "the first consumer applies messages")

	// The burst: 12 kills, 4–12 s apart, each followed by a restart.
	s := time.Second
	gaps := []time.Duration{4 * s, 5 * s, 4 * s, 9 * s, 4 * s, 6 * s, 12 * s, 4 * s, 5 * s, 7 * s, 4 * s, 6 * s}
	var lastKill time.Time
	last := time.Now()
	for i, gap := range gaps {
		time.Sleep(time.Until(last.Add(gap)))
		last = time.Now()
		lastKill = now()
		c.Kill()
		note(fmt.Sprintf("kill %d", i+1))
		c = start()
	}
	survivor := c.Cmd.Process.Pid

	// The survivor's first effect, at the database's clock.
	var (
		first time.Time
		stall time.Duration
	)
	deadline := time.Now().Add(bound + 10*time.Second)
	for {
		var at *time.Time
		require.NoError(t, pool.QueryRow(ctx, `SELECT min(at) FROM `+q+`.effects WHERE pid = $1`, survivor).Scan(&at))
		if at != nil {
			first = *at
			stall = first.Sub(lastKill)
			note("the survivor's first effect")
			break
		}
		if time.Now().After(deadline) {
			stall = now().Sub(lastKill)
			g, err := groups.Group(group, topic)
			require.FailNowf(t, "the survivor stalled",
				"no effect of the survivor %s after the last of %d kills (session timeout %s, bound %s); the group: %+v (%v)",
				stall.Round(10*time.Millisecond), len(gaps), session, bound, g, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
	t.Logf("after %d kills 4–12 s apart, the survivor applied its first message %.2fs after the last kill (session timeout %s, bound %s)",
		len(gaps), stall.Seconds(), session, bound)
	require.LessOrEqual(t, stall, bound, "the survivor consumes within twice the session timeout of the last kill")

	// Everything published is applied once, and the group is caught up.
	time.Sleep(2 * time.Second)
	stopProducer()
	published := count(`SELECT count(*) FROM {S}.published`)
	require.Eventually(t, func() bool {
		return count(`SELECT count(*) FROM {S}.published p WHERE NOT EXISTS (SELECT 1 FROM {S}.effects e WHERE e.key = p.key)`) == 0
	}, time.Minute, 50*time.Millisecond, "every published message is applied")
	require.Eventually(t, func() bool { return brokertest.KafkaLag(t, brokers, topic, group) == 0 }, 30*time.Second, 100*time.Millisecond,
		"the group's offsets reach the end of every partition")
	require.NoError(t, c.Terminate(restartShutdownBound))
	require.Equal(t, 0, c.Code(), "survivor exit code; output:\n%s", c.Out.String())

	require.Equal(t, published, count(`SELECT count(*) FROM {S}.effects`), "exactly one effect per published message")
	require.Equal(t, published, count(`SELECT count(DISTINCT key) FROM {S}.effects`))
	require.Zero(t, count(`SELECT count(*) FROM {S}.dlq`), "nothing dead-lettered")
	t.Logf("%d messages published, each applied once, by %d consumer processes", published, count(`SELECT count(DISTINCT pid) FROM {S}.effects`))
}
