package adapters_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/signal"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/adapters"
	"github.com/oncemill/oncemill/adapters/kafka"
	"github.com/oncemill/oncemill/adapters/kafka/embedded"
	"github.com/oncemill/oncemill/dedup/postgres"
	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/dlq"
	"github.com/oncemill/oncemill/internal/brokertest"
	"github.com/oncemill/oncemill/internal/pgtest"
	"github.com/oncemill/oncemill/internal/proctest"
	"github.com/oncemill/oncemill/middleware"
	"github.com/oncemill/oncemill/sqlschema"
)

// restartRoleEnv, when set, makes the test binary run one process of the
// restart tests instead of the tests (see init): "kafka", the embedded
// broker, which prints its address and runs until SIGTERM, or
// "consumer", configured by restartConsumerEnv's JSON value, a
// restartConsumer.
const (
	restartRoleEnv     = "ONCEMILL_TEST_RESTART_ROLE"
	restartConsumerEnv = "ONCEMILL_TEST_RESTART_CONSUMER"
)

const (
	// Exit codes of a process of the restart tests.
	restartBadSetup = 4
	restartBadClose = 5
	restartStopped  = 6 // the router stopped by itself

	restartKafkaLine = "RESTART KAFKA "
	restartReadyLine = "RESTART READY"

	// restartPublishEvery is the producer's pace: 50 messages a second,
	// over 4 partitions.
	restartPublishEvery = 20 * time.Millisecond
	// restartPartitions is the partition count of the broker's topics.
	restartPartitions = 4
	// restartStallSlack is what the longest stall may exceed the
	// session timeout by: the rebalance's JoinGroup and SyncGroup, and
	// the first fetch of a moved partition.
	restartStallSlack = 2 * time.Second
	// restartShutdownBound is how long a consumer may take to exit after
	// SIGTERM: the router's CloseTimeout, and then some.
	restartShutdownBound = 20 * time.Second
)

// init runs a process of the restart tests when the environment names
// one; it must come before TestMain, which knows nothing of these roles.
func init() {
	if role := os.Getenv(restartRoleEnv); role != "" {
		os.Exit(runRestartRole(role))
	}
}

func runRestartRole(role string) int {
	// Registered first: a SIGTERM that comes while the process starts is
	// handled once it runs.
	term := make(chan os.Signal, 1)
	signal.Notify(term, syscall.SIGTERM)
	var (
		code int
		err  error
	)
	switch role {
	case "kafka":
		code, err = serveRestartKafka(term)
	case "consumer":
		var cfg restartConsumer
		if err := json.Unmarshal([]byte(os.Getenv(restartConsumerEnv)), &cfg); err != nil {
			fmt.Fprintln(os.Stderr, "restart consumer: bad config:", err)
			return restartBadSetup
		}
		code, err = cfg.run(term)
	default:
		code, err = restartBadSetup, fmt.Errorf("unknown role %q", role)
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "restart %s: %v\n", role, err)
	}
	return code
}

// serveRestartKafka runs the embedded broker in this process, so that
// the consumers reach it over the network as they would a cluster, and
// so that killing a consumer kills nothing of the broker. Topics have
// restartPartitions partitions; the broker accepts session timeouts from
// 1s.
func serveRestartKafka(term <-chan os.Signal) (int, error) {
	cluster, err := embedded.Start(embedded.Config{DefaultPartitions: restartPartitions, GroupMinSessionTimeout: time.Second})
	if err != nil {
		return restartBadSetup, err
	}
	fmt.Println(restartKafkaLine + strings.Join(cluster.Addrs(), ","))
	<-term
	if err := cluster.Close(); err != nil {
		return restartBadClose, err
	}
	return 0, nil
}

// restartConsumer is a consumer process: the Kafka adapter opened by
// BrokerURL, the poison middleware with the PostgreSQL dead-letter table,
// and the PostgreSQL inbox around a handler that inserts one effect row
// per key in the inbox's transaction, with the partition and the member
// that applied it.
type restartConsumer struct {
	BrokerURL   string
	Group       string
	Topic       string
	DatabaseURL string
	Schema      string
	Member      string // "a" or "b", whatever process runs it
}

func (cfg restartConsumer) run(term <-chan os.Signal) (int, error) {
	ctx := context.Background()
	poolCfg, err := pgxpool.ParseConfig(cfg.DatabaseURL)
	if err != nil {
		return restartBadSetup, err
	}
	poolCfg.MaxConns = 8
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
	// Info logs go to the parent, which shows them when a check fails and
	// looks in them for read timeouts.
	logger := watermill.NewStdLogger(false, false)
	ps, err := adapters.Open(ctx, cfg.BrokerURL, adapters.Options{ConsumerGroup: cfg.Group, Logger: logger})
	if err != nil {
		return restartBadSetup, err
	}
	poison, err := middleware.NewPoison(middleware.PoisonConfig{
		Publisher: dlqPub, Topic: "dlq", MaxAttempts: 5,
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
		part, err := strconv.Atoi(msg.Metadata.Get(delivery.Partition))
		if err != nil {
			return fmt.Errorf("partition metadata: %w", err)
		}
		_, err = postgres.Tx(ctx).Exec(ctx, `INSERT INTO `+effects+` (key, part, member, pid) VALUES ($1, $2, $3, $4)`,
			middleware.IdempotencyKey(ctx), part, cfg.Member, pid)
		return err
	}
	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, logger)
	if err != nil {
		return restartBadSetup, errors.Join(err, ps.Close())
	}
	r.AddMiddleware(poison.Middleware, inbox.Middleware)
	r.AddNoPublisherHandler("ledger", cfg.Topic, ps.Subscriber, handler)
	code := 0
	switch err := proctest.RunRouter(ctx, r, restartReadyLine, term); {
	case errors.Is(err, proctest.ErrRouterNotStarted):
		return restartBadSetup, errors.Join(err, ps.Close())
	case errors.Is(err, proctest.ErrRouterStopped):
		return restartStopped, errors.Join(err, ps.Close())
	case err != nil:
		code = restartBadClose
		fmt.Fprintln(os.Stderr, "restart consumer: router close:", err)
	}
	if err := ps.Close(); err != nil {
		code = restartBadClose
		fmt.Fprintln(os.Stderr, "restart consumer: close:", err)
	}
	return code, nil
}

// startRestartKafka starts the broker process and returns its address;
// the process is stopped when the test ends.
func startRestartKafka(t *testing.T) []string {
	t.Helper()
	p, err := proctest.Start([]string{restartRoleEnv + "=kafka"}, restartKafkaLine, time.Minute)
	require.NoError(t, err)
	t.Cleanup(func() {
		if err := p.Terminate(10 * time.Second); err != nil {
			t.Errorf("broker process: %v", err)
		}
	})
	addrs, ok := p.Out.Line(restartKafkaLine)
	require.True(t, ok)
	return strings.Split(addrs, ",")
}

// createRestartTopic creates topic with restartPartitions partitions.
func createRestartTopic(t *testing.T, brokers []string, topic string) {
	t.Helper()
	cfg := sarama.NewConfig()
	cfg.Version = sarama.V2_3_0_0
	admin, err := sarama.NewClusterAdmin(brokers, cfg)
	require.NoError(t, err)
	defer admin.Close()
	require.NoError(t, admin.CreateTopic(topic, &sarama.TopicDetail{NumPartitions: restartPartitions, ReplicationFactor: 1}, false))
}

// restartMember is one consumer slot of a scenario, restarted under the
// same name (and instance id, for static members) after each kill.
type restartMember struct {
	name string
	cfg  restartConsumer
	cur  *proctest.Process
	// outs are the outputs of the processes that ran in the slot, the
	// current one last.
	outs []*proctest.Buffer
}

func (m *restartMember) start(t *testing.T) {
	t.Helper()
	raw, err := json.Marshal(m.cfg)
	require.NoError(t, err)
	p, err := proctest.Start([]string{restartRoleEnv + "=consumer", restartConsumerEnv + "=" + string(raw)}, restartReadyLine, time.Minute)
	require.NoError(t, err, "member %s", m.name)
	t.Cleanup(func() {
		if !p.Exited() {
			p.Kill()
		}
	})
	m.cur = p
	m.outs = append(m.outs, p.Out)
}

// terminate sends SIGTERM and waits for a clean exit.
func (m *restartMember) terminate(t *testing.T) {
	t.Helper()
	require.NoError(t, m.cur.Terminate(restartShutdownBound), "member %s", m.name)
	require.Equal(t, 0, m.cur.Code(), "member %s exit code; output:\n%s", m.name, m.cur.Out.String())
}

// output is everything the slot's processes printed.
func (m *restartMember) output() string {
	var b strings.Builder
	for i, o := range m.outs {
		fmt.Fprintf(&b, "--- %s, process %d ---\n%s", m.name, i+1, o.String())
	}
	return b.String()
}

// restartScenario is one run of TestKafkaRestartProcesses.
type restartScenario struct {
	name string
	// params are the kafka:// URL's parameters besides the group.
	params string
	// session is the session timeout they give.
	session time.Duration
	// static gives each member an instance_id.
	static bool
	// kills are the intervals between the SIGKILLs of member b, the first
	// counted from when the group is steady; b is restarted at once after
	// each.
	kills []time.Duration
}

// TestKafkaRestartProcesses: the embedded Kafka broker in its own
// process (or the cluster named by ONCEMILL_KAFKA_BROKERS), a topic of 4
// partitions fed 50 messages a second, and two
// consumer processes in one group (the kafka:// URL's defaults: the
// key-parallel subscriber with 64 messages in flight per partition, a
// PostgreSQL inbox). One member is SIGKILLed and restarted at once,
// repeatedly, as in a crash loop; then a member is sent SIGTERM. After
// each event, the longest stall (the longest time during which messages
// were waiting and none was applied) is printed, for the whole group and
// for the worst partition, and after every kill both must stay within
// the session timeout plus restartStallSlack: a killed member's
// partitions move once its session expires, and the group re-forms
// however often the member restarts. A dynamic member sent SIGTERM leaves the
// group (LeaveGroup) before it exits, so its partitions move long before
// the session timeout; a static member (instance_id) restarted within the
// session timeout gets its partitions back without a rebalance, and one
// sent SIGTERM stays in the group until its session expires. In the end
// every key is applied exactly once, nothing is dead-lettered, and the
// group's lag is 0.
func TestKafkaRestartProcesses(t *testing.T) {
	t.Parallel()
	// A cluster named by the environment must accept 2s sessions
	// (group.min.session.timeout.ms), as docker-compose.yml's does.
	brokers := kafka.BrokersFromEnv()
	if len(brokers) == 0 {
		brokers = startRestartKafka(t)
	}
	s := time.Second
	for _, sc := range []restartScenario{
		{
			// A short session timeout, which the embedded broker allows:
			// 7 kills 3–8 s apart.
			name: "dynamic_2s", params: "session_timeout=2s", session: 2 * s,
			kills: []time.Duration{4 * s, 3 * s, 6 * s, 4 * s, 8 * s, 3 * s, 5 * s},
		},
		{
			// The URL's defaults, one kill further apart than the
			// session timeout. A burst of kills closer together is
			// TestKafkaCrashBurstProcesses.
			name: "dynamic_defaults", session: kafka.DefaultSessionTimeout,
			kills: []time.Duration{4 * s, kafka.DefaultSessionTimeout + 4*s},
		},
		{
			// Static members (instance_id) restarted within their
			// session timeout, the default.
			name: "static_defaults", session: kafka.DefaultSessionTimeout, static: true,
			kills: []time.Duration{4 * s, 5 * s, 4 * s},
		},
	} {
		t.Run(sc.name, func(t *testing.T) {
			t.Parallel()
			runRestarts(t, brokers, sc)
		})
	}
}

// restartEvent is a kill or a SIGTERM, at the database's clock.
type restartEvent struct {
	what string
	at   time.Time
}

func runRestarts(t *testing.T, brokers []string, sc restartScenario) {
	ctx := context.Background()
	id := pgtest.Name(t)
	topic, group := "payments_"+id, "ledger_"+id
	pool := pgtest.Pool(t, 4)
	schema := pgtest.Schema(t, pool)
	q := pgx.Identifier{schema}.Sanitize()
	_, err := pool.Exec(ctx, `CREATE TABLE `+q+`.effects (key text NOT NULL, part integer NOT NULL, member text NOT NULL, pid integer NOT NULL, at timestamptz NOT NULL DEFAULT clock_timestamp());
CREATE TABLE `+q+`.published (key text PRIMARY KEY, at timestamptz NOT NULL DEFAULT clock_timestamp())`)
	require.NoError(t, err)
	count := func(query string) int {
		t.Helper()
		var n int
		require.NoError(t, pool.QueryRow(ctx, strings.ReplaceAll(query, "{S}", q)).Scan(&n))
		return n
	}
	now := func() time.Time {
		t.Helper()
		var at time.Time
		require.NoError(t, pool.QueryRow(ctx, `SELECT clock_timestamp()`).Scan(&at))
		return at
	}

	base := "kafka://" + strings.Join(brokers, ",") + "?group=" + group
	if sc.params != "" {
		base += "&" + sc.params
	}
	members := map[string]*restartMember{}
	for _, name := range []string{"a", "b"} {
		cfg := restartConsumer{BrokerURL: base, Group: group, Topic: topic, DatabaseURL: pgtest.URL(), Schema: schema, Member: name}
		if sc.static {
			cfg.BrokerURL += "&instance_id=ledger-" + name
		}
		members[name] = &restartMember{name: name, cfg: cfg}
	}
	createRestartTopic(t, brokers, topic)
	a, b := members["a"], members["b"]
	defer func() {
		if t.Failed() {
			t.Logf("consumer output:\n%s\n%s", a.output(), b.output())
		}
	}()
	a.start(t)
	b.start(t)
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
	)
	producing.Add(1)
	go func() {
		defer producing.Done()
		tick := time.NewTicker(restartPublishEvery)
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
		select {
		case <-stopProducing:
		default:
			close(stopProducing)
		}
		producing.Wait()
		require.NoError(t, produceErr)
	}
	defer stopProducer()

	// Steady: both members apply messages.
	started := now()
	require.Eventually(t, func() bool {
		var n int
		require.NoError(t, pool.QueryRow(ctx, `SELECT count(DISTINCT member) FROM `+q+`.effects WHERE at > $1`, started).Scan(&n))
		return n == 2
	}, time.Minute, 50*time.Millisecond, "both members apply messages")
	steady := now()
	before := groups.Describe(t, group, topic)
	require.Equal(t, "Stable", before.State)
	require.Len(t, before.Members, 2)
	if sc.static {
		require.Equal(t, []string{"ledger-a", "ledger-b"}, before.InstanceIDs(), "the broker knows the members by their instance ids")
	} else {
		require.Equal(t, []string{"", ""}, before.InstanceIDs(), "dynamic members")
	}

	// The static members' group must not rebalance while b restarts.
	var (
		watching   = make(chan struct{})
		watched    sync.WaitGroup
		statesMu   sync.Mutex
		rebalances []string
		stopOnce   sync.Once
	)
	stopWatching := func() {
		stopOnce.Do(func() { close(watching) })
		watched.Wait()
	}
	defer stopWatching()
	if sc.static {
		watched.Add(1)
		go func() {
			defer watched.Done()
			for {
				select {
				case <-watching:
					return
				case <-time.After(20 * time.Millisecond):
				}
				g, err := groups.Group(group, topic)
				if err == nil && g.State == "Stable" {
					continue
				}
				what := g.State
				if err != nil {
					what = err.Error()
				}
				statesMu.Lock()
				rebalances = append(rebalances, fmt.Sprintf("%s at %s", what, time.Now().Format("15:04:05.000")))
				statesMu.Unlock()
			}
		}()
	}

	events := []restartEvent{{what: "steady", at: steady}}
	last := time.Now()
	for i, gap := range sc.kills {
		time.Sleep(time.Until(last.Add(gap)))
		last = time.Now()
		events = append(events, restartEvent{what: fmt.Sprintf("kill %d of b", i+1), at: now()})
		b.cur.Kill()
		b.start(t)
	}
	if sc.static {
		stopWatching()
		statesMu.Lock()
		require.Empty(t, rebalances, "a static member restarted within the session timeout rejoins without a rebalance")
		statesMu.Unlock()
		after := groups.Describe(t, group, topic)
		require.Equal(t, "Stable", after.State)
		require.Equal(t, []string{"ledger-a", "ledger-b"}, after.InstanceIDs())
		require.Equal(t, before.Assignment(), after.Assignment(), "each static member keeps its partitions")
	}

	// A member sent SIGTERM, a dynamic one leaves the group as it closes,
	// a static one stays until its session expires. b goes for static
	// members (its partitions wait for it), a for dynamic ones (the
	// member that never died, the group's leader most likely).
	term, other := a, b
	if sc.static {
		term, other = b, a
	}
	time.Sleep(time.Until(last.Add(max(4*time.Second, sc.session+time.Second))))
	events = append(events, restartEvent{what: "SIGTERM of " + term.name, at: now()})
	term.terminate(t)
	afterTerm := groups.Describe(t, group, topic)
	if sc.static {
		require.Contains(t, afterTerm.InstanceIDs(), "ledger-"+term.name, "a static member sends no LeaveGroup: it is in the group after it exited")
	} else {
		require.Len(t, afterTerm.Members, 1, "a dynamic member left the group before it exited (LeaveGroup): %+v", afterTerm)
	}
	// The survivor takes everything over, and runs a little on its own.
	require.Eventually(t, func() bool {
		g, err := groups.Group(group, topic)
		return err == nil && g.State == "Stable" && len(g.Members) == 1 && len(g.Members[0].Partitions) == restartPartitions
	}, sc.session+10*time.Second, 50*time.Millisecond, "%s takes every partition", other.name)
	time.Sleep(2 * time.Second)

	stopProducer()
	published := count(`SELECT count(*) FROM {S}.published`)
	require.Eventually(t, func() bool {
		return count(`SELECT count(*) FROM {S}.published p WHERE NOT EXISTS (SELECT 1 FROM {S}.effects e WHERE e.key = p.key)`) == 0
	}, time.Minute, 50*time.Millisecond, "every published message is applied")
	require.Eventually(t, func() bool { return brokertest.KafkaLag(t, brokers, topic, group) == 0 }, 30*time.Second, 100*time.Millisecond,
		"the group's offsets reach the end of every partition")
	other.terminate(t)

	require.Equal(t, published, count(`SELECT count(*) FROM {S}.effects`), "exactly one effect per published message")
	require.Equal(t, published, count(`SELECT count(DISTINCT key) FROM {S}.effects`))
	require.Equal(t, restartPartitions, count(`SELECT count(DISTINCT part) FROM {S}.effects`))
	require.Zero(t, count(`SELECT count(*) FROM {S}.dlq`), "nothing dead-lettered")
	require.Zero(t, brokertest.KafkaLag(t, brokers, topic, group), "nothing left on the broker")
	for _, m := range members {
		require.NotContains(t, m.output(), "i/o timeout", "no request of member %s timed out", m.name)
	}

	// The stalls, from the effects and publish times.
	rows, err := pool.Query(ctx, `SELECT e.part, p.at, e.at FROM `+q+`.effects e JOIN `+q+`.published p USING (key)`)
	require.NoError(t, err)
	var done []restartApplied
	for rows.Next() {
		var a restartApplied
		require.NoError(t, rows.Scan(&a.part, &a.published, &a.applied))
		done = append(done, a)
	}
	require.NoError(t, rows.Err())
	require.Len(t, done, published)
	whole := restartStalls(done, steady)
	parts := map[int][]restartStall{}
	for p := range restartPartitions {
		parts[p] = restartStalls(slices.DeleteFunc(slices.Clone(done), func(a restartApplied) bool { return a.part != p }), steady)
	}

	// Each event's longest stalls, for the whole group and for the worst
	// partition, among the stalls between it and the next event.
	type eventStalls struct {
		restartEvent
		group, partition time.Duration
	}
	var report strings.Builder
	fmt.Fprintf(&report, "%s (session timeout %s, %d messages):", sc.name, sc.session, published)
	var measured []eventStalls
	for i, ev := range events {
		end := time.Now().Add(time.Hour)
		if i+1 < len(events) {
			end = events[i+1].at
		}
		es := eventStalls{restartEvent: ev, group: restartLongestOverlapping(whole, ev.at, end)}
		for _, ps := range parts {
			es.partition = max(es.partition, restartLongestOverlapping(ps, ev.at, end))
		}
		measured = append(measured, es)
		fmt.Fprintf(&report, "\n  %-13s +%5.1fs: whole group stalled %5.2fs at most, a partition %5.2fs",
			ev.what, ev.at.Sub(steady).Seconds(), es.group.Seconds(), es.partition.Seconds())
	}
	t.Log(report.String())

	bound := sc.session + restartStallSlack
	for _, es := range measured {
		// The spec: whatever the kills, the group re-forms within the
		// session timeout and a little.
		require.LessOrEqual(t, es.group, bound, "%s: the group's longest stall is within the session timeout plus %s", es.what, restartStallSlack)
		switch {
		case !strings.HasPrefix(es.what, "SIGTERM"):
			require.LessOrEqual(t, es.partition, bound, "%s: a killed member's partitions move, or come back, within the session timeout plus %s", es.what, restartStallSlack)
		case sc.static:
			// No LeaveGroup: the partitions of the member sent SIGTERM
			// wait for its session to expire, and for the survivor's
			// next heartbeat to hear of the rebalance.
			require.GreaterOrEqual(t, es.partition, sc.session-time.Second, "%s: a static member's partitions wait out its session", es.what)
			require.LessOrEqual(t, es.partition, bound+sc.session/3, es.what)
		default:
			// LeaveGroup: the survivor hears of the rebalance at its
			// next heartbeat, a third of the session timeout later.
			require.Less(t, es.partition, sc.session/2+time.Second, "%s: a member sent SIGTERM leaves the group, its partitions move long before its session would expire", es.what)
		}
	}
}

// restartApplied is a message's partition, publish time and effect time.
type restartApplied struct {
	part               int
	published, applied time.Time
}

// restartStall is a time during which messages were waiting and none was
// applied.
type restartStall struct {
	start time.Time
	d     time.Duration
}

// restartStalls returns the stalls among done that end after from: the
// gaps between consecutive effects while a message that was published
// before the later effect was not yet applied, each counted from the
// earlier effect or the message's publication, whichever is later.
func restartStalls(done []restartApplied, from time.Time) []restartStall {
	slices.SortFunc(done, func(x, y restartApplied) int { return x.applied.Compare(y.applied) })
	// waiting[i] is the earliest publication among done[i:].
	waiting := make([]time.Time, len(done))
	for i := len(done) - 1; i >= 0; i-- {
		waiting[i] = done[i].published
		if i+1 < len(done) && waiting[i+1].Before(waiting[i]) {
			waiting[i] = waiting[i+1]
		}
	}
	var stalls []restartStall
	for i := 0; i+1 < len(done); i++ {
		next := done[i+1].applied
		start := done[i].applied
		if waiting[i+1].After(start) {
			start = waiting[i+1]
		}
		if next.After(start) && next.After(from) {
			if start.Before(from) {
				start = from
			}
			stalls = append(stalls, restartStall{start: start, d: next.Sub(start)})
		}
	}
	return stalls
}

// restartLongestOverlapping is the longest of stalls that overlaps [from, to).
func restartLongestOverlapping(stalls []restartStall, from, to time.Time) time.Duration {
	var longest time.Duration
	for _, s := range stalls {
		if s.start.Before(to) && s.start.Add(s.d).After(from) {
			longest = max(longest, s.d)
		}
	}
	return longest
}

// TestKafkaRestartCloseLeavesGroup: in both subscriber modes
// (watermill-kafka's one at a time, max_in_flight=1, and the key-parallel
// one, the default), closing the router closes the subscriber, which
// leaves the group (LeaveGroup) before Close returns: the broker has
// dropped the member by then, instead of a session timeout later. With
// instance_id the broker knows the member by it, and keeps it after Close
// (a static member sends no LeaveGroup) until its session expires. The
// broker has Kafka's default minimum session timeout, 6s, which the
// URL's default session timeout meets.
func TestKafkaRestartCloseLeavesGroup(t *testing.T) {
	t.Parallel()
	cluster, err := embedded.Start(embedded.Config{DefaultPartitions: restartPartitions})
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, cluster.Close()) })
	groups := brokertest.NewKafkaGroups(t, cluster.Addrs())
	for _, mode := range []struct{ name, params string }{
		{"one_at_a_time", "&max_in_flight=1"},
		{"key_parallel", ""},
	} {
		for _, static := range []bool{false, true} {
			name := mode.name + "/dynamic"
			if static {
				name = mode.name + "/static"
			}
			t.Run(name, func(t *testing.T) {
				t.Parallel()
				id := pgtest.Name(t)
				topic, group := "payments_"+id, "ledger_"+id
				url := "kafka://" + strings.Join(cluster.Addrs(), ",") + "?group=" + group + mode.params
				want := []string{""}
				if static {
					url += "&instance_id=ledger-0"
					want = []string{"ledger-0"}
				}
				ps, err := adapters.Open(context.Background(), url, adapters.Options{})
				require.NoError(t, err)
				r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
				require.NoError(t, err)
				r.AddNoPublisherHandler("ledger", topic, ps.Subscriber, func(*message.Message) error { return nil })
				done := make(chan error, 1)
				go func() { done <- r.Run(context.Background()) }()
				<-r.Running()

				var joined brokertest.KafkaGroup
				require.Eventually(t, func() bool {
					g, err := groups.Group(group, topic) // GROUP_ID_NOT_FOUND until the first join
					joined = g
					return err == nil && g.State == "Stable" && len(g.Members) == 1 && len(g.Members[0].Partitions) == restartPartitions
				}, 30*time.Second, 20*time.Millisecond, "the subscriber joins and is assigned every partition")
				require.Equal(t, want, joined.InstanceIDs(), "the subscriber joined with the URL's instance_id")

				require.NoError(t, r.Close())
				require.NoError(t, <-done)
				require.NoError(t, ps.Close())
				closed := time.Now()
				left := groups.Describe(t, group, topic)
				if !static {
					require.Empty(t, left.Members, "the member left the group as it closed")
					require.Equal(t, "Empty", left.State)
					return
				}
				require.Equal(t, want, left.InstanceIDs(), "a static member is still in the group after Close")
				require.Equal(t, joined.Members[0].Partitions, left.Members[0].Partitions, "and keeps its partitions")
				require.Eventually(t, func() bool {
					g, err := groups.Group(group, topic)
					return err == nil && len(g.Members) == 0
				},
					kafka.DefaultSessionTimeout+5*time.Second, 50*time.Millisecond, "until its session expires")
				gone := time.Since(closed)
				require.Greater(t, gone, kafka.DefaultSessionTimeout-2*time.Second, "the member stayed for its session timeout")
				t.Logf("%s: static member dropped %s after Close (session timeout %s)", mode.name, gone.Round(10*time.Millisecond), kafka.DefaultSessionTimeout)
			})
		}
	}
}

// TestKafkaRestartDuplicateInstanceID: two subscribers given one
// instance_id, in both subscriber modes, do not fail silently: each join
// of one fences the other, whose heartbeat or join fails with
// FENCED_INSTANCE_ID, logged as an error that names group.instance.id.
func TestKafkaRestartDuplicateInstanceID(t *testing.T) {
	t.Parallel()
	cluster, err := embedded.Start(embedded.Config{DefaultPartitions: restartPartitions})
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, cluster.Close()) })
	for _, mode := range []struct{ name, params string }{
		{"one_at_a_time", "&max_in_flight=1"},
		{"key_parallel", ""},
	} {
		t.Run(mode.name, func(t *testing.T) {
			t.Parallel()
			id := pgtest.Name(t)
			topic, group := "payments_"+id, "ledger_"+id
			url := "kafka://" + strings.Join(cluster.Addrs(), ",") + "?group=" + group + mode.params + "&instance_id=ledger-0"
			logs := &restartErrorLog{}
			for range 2 {
				ps, err := adapters.Open(context.Background(), url, adapters.Options{Logger: logs})
				require.NoError(t, err)
				r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
				require.NoError(t, err)
				r.AddNoPublisherHandler("ledger", topic, ps.Subscriber, func(*message.Message) error { return nil })
				done := make(chan error, 1)
				go func() { done <- r.Run(context.Background()) }()
				<-r.Running()
				t.Cleanup(func() {
					require.NoError(t, r.Close())
					require.NoError(t, <-done)
					require.NoError(t, ps.Close())
				})
			}
			require.Eventually(t, func() bool { return logs.contains("group.instance.id") }, 30*time.Second, 20*time.Millisecond,
				"a fenced subscriber logs why; errors logged: %v", logs)
		})
	}
}

// restartErrorLog is a watermill logger that keeps the errors logged.
type restartErrorLog struct {
	mu     sync.Mutex
	errors []string
}

func (l *restartErrorLog) Error(msg string, err error, _ watermill.LogFields) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.errors = append(l.errors, fmt.Sprintf("%s: %v", msg, err))
}

func (*restartErrorLog) Info(string, watermill.LogFields)  {}
func (*restartErrorLog) Debug(string, watermill.LogFields) {}
func (*restartErrorLog) Trace(string, watermill.LogFields) {}

func (l *restartErrorLog) With(watermill.LogFields) watermill.LoggerAdapter { return l }

func (l *restartErrorLog) contains(s string) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.ContainsFunc(l.errors, func(e string) bool { return strings.Contains(e, s) })
}

func (l *restartErrorLog) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return strings.Join(l.errors, "; ")
}
