package adapters_test

import (
	"context"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/adapters"
	"github.com/oncemill/oncemill/adapters/kafka"
	"github.com/oncemill/oncemill/adapters/kafka/embedded"
	"github.com/oncemill/oncemill/dedup/postgres"
	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/internal/testing/brokertest"
	"github.com/oncemill/oncemill/internal/testing/pgtest"
	"github.com/oncemill/oncemill/internal/testing/proctest"
	"github.com/oncemill/oncemill/middleware"
)

const (
	// restartPublishEvery is the producer's pace: 50 messages a second,
	// over 4 partitions.
	restartPublishEvery = 20 * time.Millisecond
	// restartPartitions is the partition count of the broker's topics.
	restartPartitions = proctest.KafkaPartitions
	// restartStallSlack is what the longest stall may exceed the
	// session timeout by: the rebalance's JoinGroup and SyncGroup, and
	// the first fetch of a moved partition.
	restartStallSlack = 2 * time.Second
	// restartShutdownBound is how long a consumer may take to exit after
	// SIGTERM: the router's CloseTimeout, and then some.
	restartShutdownBound = 20 * time.Second
)

// restartConsumer is a consumer process of the restart tests: the
// standard stack on the Kafka adapter, around a handler that inserts one
// effect row per key in the inbox's transaction, with the partition and
// the member that applied it.
type restartConsumer struct {
	proctest.Stack
	Member string // "a" or "b", whatever process runs it
}

var restartRole = proctest.NewRole("restart", func(cfg restartConsumer, term <-chan os.Signal) error {
	// Info logs go to the parent, which shows them when a check fails and
	// looks in them for read timeouts.
	c := &proctest.Consumer{Stack: cfg.Stack, Verbose: true, StrictClose: true, Poison: &middleware.PoisonConfig{
		Topic: "dlq", MaxAttempts: 5,
		InitialBackoff: 20 * time.Millisecond, MaxBackoff: 200 * time.Millisecond,
	}}
	effects := cfg.Table("effects")
	pid := os.Getpid()
	return c.Run(term, func(msg *message.Message) error {
		ctx := msg.Context()
		part, err := strconv.Atoi(msg.Metadata.Get(delivery.Partition))
		if err != nil {
			return fmt.Errorf("partition metadata: %w", err)
		}
		_, err = postgres.Tx(ctx).Exec(ctx, `INSERT INTO `+effects+` (key, part, member, pid) VALUES ($1, $2, $3, $4)`,
			middleware.IdempotencyKey(ctx), part, cfg.Member, pid)
		return err
	})
})

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
	m.cur = restartRole.Start(t, m.cfg)
	m.outs = append(m.outs, m.cur.Out)
}

// terminate sends SIGTERM and waits for a clean exit.
func (m *restartMember) terminate(t *testing.T) {
	t.Helper()
	m.cur.Stop(t, restartShutdownBound)
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
	brokers := proctest.KafkaCluster(t)
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
	id := pgtest.Name(t)
	topic, group := "payments_"+id, "ledger_"+id
	db := proctest.NewDB(t, `CREATE TABLE {S}.effects (key text NOT NULL, part integer NOT NULL, member text NOT NULL, pid integer NOT NULL, at timestamptz NOT NULL DEFAULT clock_timestamp());
CREATE TABLE {S}.published (key text PRIMARY KEY, at timestamptz NOT NULL DEFAULT clock_timestamp())`)

	base := "kafka://" + strings.Join(brokers, ",") + "?group=" + group
	if sc.params != "" {
		base += "&" + sc.params
	}
	members := map[string]*restartMember{}
	for _, name := range []string{"a", "b"} {
		cfg := restartConsumer{Stack: db.Stack(base, group, topic, "ledger"), Member: name}
		if sc.static {
			cfg.BrokerURL += "&instance_id=ledger-" + name
		}
		members[name] = &restartMember{name: name, cfg: cfg}
	}
	brokertest.CreateKafkaTopic(t, brokers, topic, restartPartitions)
	a, b := members["a"], members["b"]
	a.start(t)
	b.start(t)
	groups := brokertest.NewKafkaGroups(t, brokers)

	// The producer: one message a tick, each its own key, recorded once
	// the broker has it.
	stopProducer := db.Stream(t, "kafka://"+strings.Join(brokers, ","), topic, restartPublishEvery)

	// Steady: both members apply messages.
	started := db.Now(t)
	require.Eventually(t, func() bool {
		return db.Count(t, `SELECT count(DISTINCT member) FROM {S}.effects WHERE at > $1`, started) == 2
	}, time.Minute, 50*time.Millisecond, "both members apply messages")
	steady := db.Now(t)
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
		statesMu   sync.Mutex
		rebalances []string
	)
	stopWatching := func() {}
	if sc.static {
		stopWatching = groups.Watch(t, group, topic, 20*time.Millisecond, func(g brokertest.KafkaGroup, err error) {
			if err == nil && g.State == "Stable" {
				return
			}
			what := g.State
			if err != nil {
				what = err.Error()
			}
			statesMu.Lock()
			rebalances = append(rebalances, fmt.Sprintf("%s at %s", what, time.Now().Format("15:04:05.000")))
			statesMu.Unlock()
		})
	}

	events := []restartEvent{{what: "steady", at: steady}}
	last := time.Now()
	for i, gap := range sc.kills {
		time.Sleep(time.Until(last.Add(gap)))
		last = time.Now()
		events = append(events, restartEvent{what: fmt.Sprintf("kill %d of b", i+1), at: db.Now(t)})
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
	events = append(events, restartEvent{what: "SIGTERM of " + term.name, at: db.Now(t)})
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

	published := stopAndCatchUp(t, db, stopProducer, brokers, topic, group)
	other.terminate(t)

	require.Equal(t, published, db.Count(t, `SELECT count(*) FROM {S}.effects`), "exactly one effect per published message")
	require.Equal(t, published, db.Count(t, `SELECT count(DISTINCT key) FROM {S}.effects`))
	require.Equal(t, restartPartitions, db.Count(t, `SELECT count(DISTINCT part) FROM {S}.effects`))
	require.Zero(t, db.Count(t, `SELECT count(*) FROM {S}.dlq`), "nothing dead-lettered")
	require.Zero(t, brokertest.KafkaLag(t, brokers, topic, group), "nothing left on the broker")
	for _, m := range members {
		require.NotContains(t, m.output(), "i/o timeout", "no request of member %s timed out", m.name)
	}

	// The stalls, from the effects and publish times.
	rows, err := db.Pool.Query(context.Background(), db.Q(`SELECT e.part, p.at, e.at FROM {S}.effects e JOIN {S}.published p USING (key)`))
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
		// groupSince and partitionSince count a stall only from this
		// event on: a kill that comes while the previous kill's
		// rebalance is still under way (kills 3 s apart, a 2 s session
		// and a slow restart) starts the wait again, and the stall that
		// spans both is the later kill's to end in time.
		groupSince, partitionSince time.Duration
	}
	var report strings.Builder
	fmt.Fprintf(&report, "%s (session timeout %s, %d messages):", sc.name, sc.session, published)
	var measured []eventStalls
	for i, ev := range events {
		end := time.Now().Add(time.Hour)
		if i+1 < len(events) {
			end = events[i+1].at
		}
		es := eventStalls{restartEvent: ev, group: restartLongestOverlapping(whole, ev.at, end),
			groupSince: restartLongestSince(whole, ev.at, end)}
		for _, ps := range parts {
			es.partition = max(es.partition, restartLongestOverlapping(ps, ev.at, end))
			es.partitionSince = max(es.partitionSince, restartLongestSince(ps, ev.at, end))
		}
		measured = append(measured, es)
		fmt.Fprintf(&report, "\n  %-13s +%5.1fs: whole group stalled %5.2fs at most, a partition %5.2fs (%5.2fs of it after this event)",
			ev.what, ev.at.Sub(steady).Seconds(), es.group.Seconds(), es.partition.Seconds(), es.partitionSince.Seconds())
	}
	t.Log(report.String())

	bound := sc.session + restartStallSlack
	for _, es := range measured {
		// The spec: whatever the kills, the group re-forms within the
		// session timeout and a little.
		require.LessOrEqual(t, es.groupSince, bound, "%s: the group's longest stall is within the session timeout plus %s", es.what, restartStallSlack)
		switch {
		case !strings.HasPrefix(es.what, "SIGTERM"):
			require.LessOrEqual(t, es.partitionSince, bound, "%s: a killed member's partitions move, or come back, within the session timeout plus %s", es.what, restartStallSlack)
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

// stopAndCatchUp stops the producer and waits until every message it
// published is applied and group's offsets reach the end of every
// partition; it returns how many messages were published.
func stopAndCatchUp(t *testing.T, db *proctest.DB, stopProducer func(), brokers []string, topic, group string) int {
	t.Helper()
	stopProducer()
	published := db.Count(t, `SELECT count(*) FROM {S}.published`)
	require.Eventually(t, func() bool {
		return db.Count(t, `SELECT count(*) FROM {S}.published p WHERE NOT EXISTS (SELECT 1 FROM {S}.effects e WHERE e.key = p.key)`) == 0
	}, time.Minute, 50*time.Millisecond, "every published message is applied")
	require.Eventually(t, func() bool { return brokertest.KafkaLag(t, brokers, topic, group) == 0 }, 30*time.Second, 100*time.Millisecond,
		"the group's offsets reach the end of every partition")
	return published
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

// restartLongestSince is the longest part after from of the stalls
// that end between from and to.
func restartLongestSince(stalls []restartStall, from, to time.Time) time.Duration {
	var longest time.Duration
	for _, s := range stalls {
		end := s.start.Add(s.d)
		if end.After(from) && !end.After(to) {
			start := s.start
			if start.Before(from) {
				start = from
			}
			longest = max(longest, end.Sub(start))
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
				stop := ackAll(t, url, topic, adapters.Options{})

				var joined brokertest.KafkaGroup
				require.Eventually(t, func() bool {
					g, err := groups.Group(group, topic) // GROUP_ID_NOT_FOUND until the first join
					joined = g
					return err == nil && g.State == "Stable" && len(g.Members) == 1 && len(g.Members[0].Partitions) == restartPartitions
				}, 30*time.Second, 20*time.Millisecond, "the subscriber joins and is assigned every partition")
				require.Equal(t, want, joined.InstanceIDs(), "the subscriber joined with the URL's instance_id")

				stop()
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
				t.Cleanup(ackAll(t, url, topic, adapters.Options{Logger: logs}))
			}
			require.Eventually(t, func() bool { return logs.contains("group.instance.id") }, 30*time.Second, 20*time.Millisecond,
				"a fenced subscriber logs why; errors logged: %v", logs)
		})
	}
}

// ackAll opens the broker at url and runs a router whose handler acks
// every message of topic, until the returned stop closes the router, then
// the broker.
func ackAll(t *testing.T, url, topic string, opts adapters.Options) (stop func()) {
	t.Helper()
	ps, err := adapters.Open(context.Background(), url, opts)
	require.NoError(t, err)
	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
	require.NoError(t, err)
	r.AddNoPublisherHandler("ledger", topic, ps.Subscriber, func(*message.Message) error { return nil })
	done := make(chan error, 1)
	go func() { done <- r.Run(context.Background()) }()
	<-r.Running()
	return func() {
		require.NoError(t, r.Close())
		require.NoError(t, <-done)
		require.NoError(t, ps.Close())
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
