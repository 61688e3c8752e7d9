//go:build chaos

package chaos_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"
	goredis "github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/adapters"
	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/internal/testing/amqptest"
	"github.com/oncemill/oncemill/internal/testing/brokertest"
	"github.com/oncemill/oncemill/internal/testing/pgtest"
	"github.com/oncemill/oncemill/internal/testing/proctest"
	"github.com/oncemill/oncemill/internal/testing/redistest"
	"github.com/oncemill/oncemill/sqlschema"
)

func TestMain(m *testing.M) {
	// go-redis logs every failed dial; the Redis outage is on purpose.
	goredis.SetLogger(quietRedis{})
	proctest.Main(consumerRole)
	os.Exit(m.Run())
}

// quietRedis drops go-redis's own log lines.
type quietRedis struct{}

func (quietRedis) Printf(context.Context, string, ...any) {}

const (
	schema = "chaos"
	// produceRate is each lane's steady publish rate; one publish in
	// copyEvery re-sends an earlier key (as a producer that retries
	// does), one new key in poisonEvery is a poison message.
	produceRate = 80
	copyEvery   = 5
	poisonEvery = 50

	// The faults a lane can see, as the report names them.
	faultNone     = "none"
	faultKill     = "consumer SIGKILL"
	faultPostgres = "PostgreSQL restart"
	faultRabbit   = "RabbitMQ restart"
	faultRedis    = "Redis outage"
)

// step is one fault of the schedule, at an offset from the start of the
// stream.
type step struct {
	at    time.Duration
	fault string
}

// window is a span of the stream during which a fault affected a lane: it
// lasts until the next fault that affects the lane, so that the
// consequences of a fault (a Kafka rebalance after a kill, say) count as
// that fault's.
type window struct {
	fault    string
	lane     string
	from, to time.Time
}

// timeline records the fault windows; it tells which fault a lane was
// under at an instant.
type timeline struct {
	mu      sync.Mutex
	windows []window
}

// add opens a window of fault for each of lanes, closing the lanes' open
// windows.
func (tl *timeline) add(fault string, from time.Time, lanes ...string) {
	tl.mu.Lock()
	defer tl.mu.Unlock()
	for _, lane := range lanes {
		for i := range tl.windows {
			if tl.windows[i].lane == lane && tl.windows[i].to.IsZero() {
				tl.windows[i].to = from
			}
		}
		tl.windows = append(tl.windows, window{fault: fault, lane: lane, from: from})
	}
}

// close ends the open windows at t.
func (tl *timeline) close(t time.Time) {
	tl.mu.Lock()
	defer tl.mu.Unlock()
	for i := range tl.windows {
		if tl.windows[i].to.IsZero() {
			tl.windows[i].to = t
		}
	}
}

func (tl *timeline) faultAt(lane string, t time.Time) string {
	tl.mu.Lock()
	defer tl.mu.Unlock()
	for _, w := range tl.windows {
		if w.lane == lane && !t.Before(w.from) && (w.to.IsZero() || t.Before(w.to)) {
			return w.fault
		}
	}
	return faultNone
}

func (tl *timeline) of(lane, fault string) []window {
	tl.mu.Lock()
	defer tl.mu.Unlock()
	var ws []window
	for _, w := range tl.windows {
		if w.fault == fault && w.lane == lane {
			ws = append(ws, w)
		}
	}
	return ws
}

// sentKey is what the producer knows of a key it published.
type sentKey struct {
	fault  string // the lane's fault when the key was first published
	poison bool
	flaky  bool // applied only once parked (flakyKey)
}

// lane is one broker with its consumers and its producer.
type lane struct {
	name string
	url  string
	// ordered says that the lane's setup orders each account's messages
	// across its consumer processes (Kafka's partitions): its report's
	// out-of-order count must be 0. Elsewhere it is shown, not asserted.
	ordered  bool
	topic    string
	group    string
	consumer string
	slots    []*slot
	pending  func(t *testing.T) int

	mu        sync.Mutex
	keys      map[string]sentKey
	order     []string
	publishes int
	failures  int // publishes that failed and were sent again
}

func (l *lane) record(key string, k sentKey, first bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.publishes++
	if first {
		l.keys[key] = k
		l.order = append(l.order, key)
	}
}

// TestChaos is the chaos suite on Kafka, RabbitMQ and SQS (see the
// package doc).
func TestChaos(t *testing.T) {
	seed, random := seeded(t)
	pg := pgtest.StartServer(t)
	rabbit := amqptest.StartServer(t)
	rds := redistest.StartServer(t)
	kafkaAddrs := proctest.StartKafka(t)
	pool := chaosDB(t, pg.URL())

	run := strconv.FormatInt(time.Now().UnixNano()%1e9, 36)
	sqsQueues := brokertest.NewSQS(t, sqsEndpoint())
	sqsURL := "sqs://test:test@us-east-1?create=true&visibility_timeout=5s&endpoint=" + sqsEndpoint()
	lanes := []*lane{
		newLane("kafka", "kafka://"+strings.Join(kafkaAddrs, ",")+"?session_timeout=3s&rebalance_timeout=10s", run),
		// One process of the group consumes at a time, the other stands
		// by: an account's order holds across the kills.
		newLane("amqp", rabbit.URL()+"?single_active_consumer=true", run),
		newLane("sqs", sqsURL, run),
	}
	for _, l := range lanes {
		switch topic, group := l.topic, l.group; l.name {
		case "kafka":
			l.ordered = true
			l.pending = func(t *testing.T) int { return brokertest.KafkaLag(t, kafkaAddrs, topic, group) }
		case "amqp":
			l.ordered = true
			l.pending = func(t *testing.T) int { return brokertest.AMQPReady(t, rabbit.URL(), topic, group) }
		case "sqs":
			l.pending = func(t *testing.T) int { return sqsQueues.Backlog(t, topic) }
			t.Cleanup(func() { sqsQueues.DeleteQueue(t, topic) })
		}
		l.addSlots(pg.URL(), rds.Addr(), "postgres", "twotier")
	}
	runChaos(t, chaosRun{
		seed: seed, random: random, pool: pool, lanes: lanes,
		// 12 SIGKILLs of a random consumer of each lane in turn, and one
		// outage of each service, spaced so that each fault's window
		// shows its own stall.
		schedule: []step{
			{4 * time.Second, faultKill}, {8 * time.Second, faultKill}, {12 * time.Second, faultKill},
			{16 * time.Second, faultPostgres},
			{26 * time.Second, faultKill}, {30 * time.Second, faultKill}, {34 * time.Second, faultKill},
			{38 * time.Second, faultRabbit},
			{48 * time.Second, faultKill}, {52 * time.Second, faultKill}, {56 * time.Second, faultKill},
			{60 * time.Second, faultRedis},
			{72 * time.Second, faultKill}, {76 * time.Second, faultKill}, {80 * time.Second, faultKill},
		},
		outages: []outage{
			{name: faultPostgres, do: downFor(3*time.Second, pg.Stop, pg.Start)},
			{name: faultRabbit, lanes: []string{"amqp"}, do: downFor(3*time.Second, rabbit.StopApp, rabbit.StartApp)},
			{name: faultRedis, do: downFor(5*time.Second, rds.Stop, rds.Start)},
		},
		// Past the last fault's window.
		produceFor: 86 * time.Second,
		minKills:   10,
		summary: func(kills int) string {
			return fmt.Sprintf("%d SIGKILLs, PostgreSQL restarted once (3 s down), RabbitMQ's app restarted once (3 s down), Redis stopped once (5 s)", kills)
		},
	})

	t.Run("redis down throughput", func(t *testing.T) {
		redisDownThroughput(t, pg.URL(), rds)
	})
}

// seeded returns the run's seed, ONCEMILL_CHAOS_SEED or the clock, and a
// random source on it that is safe for concurrent use.
func seeded(t *testing.T) (uint64, func(n int) int) {
	seed := uint64(time.Now().UnixNano())
	if s := os.Getenv("ONCEMILL_CHAOS_SEED"); s != "" {
		var err error
		seed, err = strconv.ParseUint(s, 10, 64)
		require.NoError(t, err)
	}
	t.Logf("seed %d (ONCEMILL_CHAOS_SEED to repeat the schedule's choices)", seed)
	rnd := rand.New(rand.NewPCG(seed, seed>>1))
	var mu sync.Mutex
	return seed, func(n int) int {
		mu.Lock()
		defer mu.Unlock()
		return rnd.IntN(n)
	}
}

// chaosDB connects to the database at url, migrates oncemill's tables
// into the suite's schema and creates the effects table beside them; an
// effect row records the transaction that wrote it.
func chaosDB(t *testing.T, url string) *pgxpool.Pool {
	t.Helper()
	ctx := context.Background()
	pool := connect(t, url, 4)
	require.NoError(t, sqlschema.Migrate(ctx, pool, sqlschema.Config{Schema: schema}))
	_, err := pool.Exec(ctx, `CREATE TABLE `+schema+`.effects (
    broker text NOT NULL, key text NOT NULL, pid integer NOT NULL,
    at timestamptz NOT NULL DEFAULT clock_timestamp(),
    tx xid8 NOT NULL DEFAULT pg_current_xact_id())`)
	require.NoError(t, err)
	return pool
}

// newLane is the lane name on the broker at url, with a topic and group
// of the run's own; its consumers' inbox name is chaos_<name>.
func newLane(name, url, run string) *lane {
	return &lane{
		name: name, url: url,
		topic: "chaos_" + run, group: "chaos_" + name + "_" + run, consumer: "chaos_" + name,
		keys: map[string]sentKey{},
	}
}

// addSlots gives l a consumer slot per store ("postgres" or "twotier",
// the latter on the Redis at redisAddr), on the database at dbURL.
func (l *lane) addSlots(dbURL, redisAddr string, stores ...string) {
	for _, store := range stores {
		l.slots = append(l.slots, &slot{cfg: consumerConfig{
			Stack: proctest.Stack{
				BrokerURL: l.url, Group: l.group, Topic: l.topic,
				DatabaseURL: dbURL, Schema: schema, Consumer: l.consumer,
			},
			Broker: l.name, Store: store, RedisAddr: redisAddr,
		}})
	}
}

// chaosRun is one run of the suite: its lanes, the faults of its schedule
// and how to cause them.
type chaosRun struct {
	seed   uint64
	random func(n int) int
	// pool is the database the consumers write their effects to.
	pool     *pgxpool.Pool
	lanes    []*lane
	schedule []step
	// outages are the faults of the schedule besides faultKill, in the
	// report's order.
	outages    []outage
	produceFor time.Duration
	// minKills is how many consumer SIGKILLs the schedule must have made.
	minKills int
	// summary is the report's first line, given the SIGKILLs made.
	summary func(kills int) string
}

// outage is a fault of a service that runs from the test's goroutine.
type outage struct {
	name string
	// lanes are the lanes it affects; nil for every lane.
	lanes []string
	// do causes the fault and ends it.
	do func()
}

// downFor is an outage's do: stop, then start again d later.
func downFor(d time.Duration, stop, start func()) func() {
	return func() {
		stop()
		time.Sleep(d)
		start()
	}
}

// runChaos runs r: it starts every lane's consumers under their
// supervisors and its producer, causes the faults of the schedule, waits
// until every key is applied or dead-lettered and every broker holds
// nothing, prints the report and checks the invariant.
func runChaos(t *testing.T, r chaosRun) {
	ctx := context.Background()
	var all []*slot
	for _, l := range r.lanes {
		all = append(all, l.slots...)
	}
	restartDelay := func() time.Duration { return time.Duration(r.random(1000)) * time.Millisecond }
	for _, s := range all {
		s.supervise(restartDelay)
	}
	t.Cleanup(func() {
		for _, s := range all {
			_ = s.stop(20 * time.Second)
		}
	})
	require.Eventually(t, func() bool {
		for _, s := range all {
			if !s.running() {
				return false
			}
		}
		return true
	}, 2*time.Minute, 50*time.Millisecond, "the consumers start")

	// The producers: a steady stream per lane, with copies of earlier keys
	// and poison keys; a failed publish is sent again until it is taken.
	tl := &timeline{}
	start := time.Now()
	prodCtx, stopProducers := context.WithTimeout(ctx, r.produceFor)
	defer stopProducers()
	var producers sync.WaitGroup
	for _, l := range r.lanes {
		ps, err := adapters.Open(ctx, l.url, adapters.Options{ConsumerGroup: "producer_" + l.group})
		require.NoError(t, err)
		t.Cleanup(func() { _ = ps.Close() })
		producers.Add(1)
		go func() {
			defer producers.Done()
			produce(prodCtx, l, ps.Publisher, tl, r.random)
		}()
	}

	var laneNames []string
	for _, l := range r.lanes {
		laneNames = append(laneNames, l.name)
	}
	faults := []string{faultNone, faultKill}
	for _, o := range r.outages {
		faults = append(faults, o.name)
	}
	// The faults, in the test's goroutine.
	kills := 0
	for _, st := range r.schedule {
		time.Sleep(time.Until(start.Add(st.at)))
		now := time.Now()
		if st.fault == faultKill {
			// A random running consumer of each lane in turn.
			l := r.lanes[kills%len(r.lanes)]
			for try := 0; try < 100; try++ {
				if l.slots[r.random(len(l.slots))].kill() {
					tl.add(faultKill, now, l.name)
					kills++
					break
				}
				time.Sleep(20 * time.Millisecond)
			}
			continue
		}
		i := slices.IndexFunc(r.outages, func(o outage) bool { return o.name == st.fault })
		require.GreaterOrEqual(t, i, 0, "the schedule's fault %q has no outage", st.fault)
		o := r.outages[i]
		lanes := o.lanes
		if lanes == nil {
			lanes = laneNames
		}
		tl.add(o.name, now, lanes...)
		o.do()
	}
	producers.Wait()
	end := time.Now()
	tl.close(end)
	require.GreaterOrEqual(t, kills, r.minKills, "consumers SIGKILLed")

	// Drain: every key applied or dead-lettered, then nothing pending on
	// any broker while the consumers still run.
	outcome := func() map[string]map[string]keyOutcome { return outcomes(t, r.pool) }
	missing := func() map[string][]string {
		out := outcome()
		miss := map[string][]string{}
		for _, l := range r.lanes {
			l.mu.Lock()
			for key, k := range l.keys {
				o := out[l.name][key]
				if (k.poison && o.dead == 0) || (!k.poison && o.effects == 0) {
					miss[l.name] = append(miss[l.name], key)
				}
			}
			l.mu.Unlock()
		}
		return miss
	}
	if !assert.Eventually(t, func() bool { return len(missing()) == 0 }, 4*time.Minute, 200*time.Millisecond, "every key applied or dead-lettered") {
		for lane, keys := range missing() {
			slices.Sort(keys)
			t.Errorf("%s: %d keys neither applied nor dead-lettered, first %v", lane, len(keys), keys[:min(len(keys), 5)])
		}
		t.FailNow()
	}
	for _, l := range r.lanes {
		require.Eventually(t, func() bool { return l.pending(t) == 0 }, 2*time.Minute, 200*time.Millisecond,
			"%s: messages left on the broker", l.name)
	}
	for _, s := range all {
		require.NoError(t, s.stop(20*time.Second), "%s consumer on %s", s.cfg.Store, s.cfg.Broker)
	}
	// With the consumers gone, what they held unacked is back on the
	// broker (RabbitMQ's count leaves it out while they run).
	for _, l := range r.lanes {
		require.Equal(t, 0, l.pending(t), "%s: messages left on the broker once the consumers stopped", l.name)
	}

	// The report, then the invariant.
	out := outcome()
	stalls := effectTimes(t, r.pool)
	var report strings.Builder
	fmt.Fprintf(&report, "\nchaos: %s; %s of stream, seed %d\n\n", r.summary(kills), r.produceFor, r.seed)
	fmt.Fprintln(&report, "Per broker, the keys first published while the broker was under each fault (none: under no fault), what became of them, and the longest time")
	fmt.Fprintf(&report, "between two effects on that broker during that fault, while its producer published %d messages a second.\n", produceRate)
	fmt.Fprintln(&report)
	fmt.Fprintln(&report, "Out of order: keys applied after a later key of their account (the partition key) was; 0 asserted where the setup orders an account")
	fmt.Fprintln(&report, "across processes (marked *).")
	fmt.Fprintln(&report)
	fmt.Fprintln(&report, "| broker | fault | sent | applied | doubled | lost | dead-lettered (poison) | healthy dead-lettered | parked, then applied | out of order | longest stall |")
	fmt.Fprintln(&report, "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
	late := outOfOrder(t, r.pool)
	var problems []string
	for _, l := range r.lanes {
		total := tally{}
		var spans []window
		for _, f := range faults {
			spans = append(spans, l.windowsOf(tl, f, faults[1:], start, end)...)
		}
		for _, f := range faults {
			var tly tally
			for key, k := range l.keys {
				if k.fault == f {
					tly.add(k, out[l.name][key])
					if late[l.name][key] {
						tly.outOfOrder++
					}
				}
			}
			total.merge(tly)
			if tly.sent == 0 && f != faultNone {
				continue
			}
			stall := longestStall(stalls[l.name], spans, f)
			fmt.Fprintf(&report, "| %s | %s | %d | %d | %d | %d | %d | %d | %d of %d | %d | %s |\n",
				l.label(), f, tly.sent, tly.applied, tly.doubled, tly.lost, tly.poisonDead, tly.healthyDead, tly.parkedApplied, tly.parked,
				tly.outOfOrder, stall.Round(time.Millisecond))
		}
		fmt.Fprintf(&report, "| %s | all | %d | %d | %d | %d | %d | %d | %d of %d | %d | |\n",
			l.label(), total.sent, total.applied, total.doubled, total.lost, total.poisonDead, total.healthyDead, total.parkedApplied, total.parked,
			total.outOfOrder)
		if total.doubled+total.lost+total.healthyDead+total.both+total.poisonApplied+total.deadTwice > 0 {
			problems = append(problems, fmt.Sprintf("%s: %+v", l.name, total))
		}
		if l.ordered && total.outOfOrder > 0 {
			problems = append(problems, fmt.Sprintf("%s: %d keys applied after a later key of their account", l.name, total.outOfOrder))
		}
		// Effects of keys nobody sent would be a bug in the suite itself.
		for key := range out[l.name] {
			if _, ok := l.keys[key]; !ok {
				problems = append(problems, fmt.Sprintf("%s: key %q applied or dead-lettered but never sent", l.name, key))
			}
		}
	}
	fmt.Fprintf(&report, "\n")
	for _, l := range r.lanes {
		fmt.Fprintf(&report, "%s: %d publishes (%d of them copies of earlier keys, %d publish failures sent again);", l.name, l.publishes, l.publishes-len(l.keys), l.failures)
		for _, s := range l.slots {
			fmt.Fprintf(&report, " %s consumer killed %d times, died by itself %d times, failed to start %d times;",
				s.cfg.Store, s.kills, len(s.exits), s.startErrors)
		}
		fmt.Fprintln(&report)
	}
	fmt.Print(report.String())
	for _, s := range all {
		for _, e := range s.exits {
			t.Logf("%s consumer on %s died by itself: %s", s.cfg.Store, s.cfg.Broker, tail(e, 3000))
		}
	}
	require.Empty(t, problems, "the invariant: every key applied exactly once or dead-lettered, never both, never neither")

	var healthyNotDone int
	require.NoError(t, r.pool.QueryRow(ctx, `SELECT count(*) FROM `+schema+`.inbox WHERE key NOT LIKE '`+poisonPrefix+`%' AND status <> 'done'`).Scan(&healthyNotDone))
	require.Zero(t, healthyNotDone, "every healthy key is recorded done")
	var poisonNotDead int
	require.NoError(t, r.pool.QueryRow(ctx, `SELECT count(*) FROM `+schema+`.inbox WHERE key LIKE '`+poisonPrefix+`%' AND status <> 'dead'`).Scan(&poisonNotDead))
	require.Zero(t, poisonNotDead, "every poison key is recorded dead")
	var stillParked int
	require.NoError(t, r.pool.QueryRow(ctx, `SELECT count(*) FROM `+schema+`.retries`).Scan(&stillParked))
	require.Zero(t, stillParked, "nothing left parked")
}

// produce publishes l's stream until ctx ends.
func produce(ctx context.Context, l *lane, pub message.Publisher, tl *timeline, random func(int) int) {
	tick := time.NewTicker(time.Second / produceRate)
	defer tick.Stop()
	n := 0
	for i := 0; ; i++ {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		var key string
		first := true
		l.mu.Lock()
		if i%copyEvery == copyEvery-1 && len(l.order) > 0 {
			key, first = l.order[random(len(l.order))], false
		}
		l.mu.Unlock()
		if first {
			key = fmt.Sprintf("%s-%05d", l.name, n)
			if n%poisonEvery == poisonEvery-1 {
				key = poisonPrefix + key
			}
			n++
		}
		uuid := watermill.NewUUID()
		for {
			msg := message.NewMessage(uuid, []byte(`{"account":"`+key+`"}`))
			msg.Metadata.Set(delivery.IdempotencyKey, key)
			// The key's account, the same for its copies.
			msg.Metadata.Set(delivery.PartitionKey, accountOf(key))
			err := pub.Publish(l.topic, msg)
			if err == nil {
				break
			}
			l.mu.Lock()
			l.failures++
			l.mu.Unlock()
			// The producer does not give up on a key: it sends it again,
			// past the end of the stream if it must.
			time.Sleep(200 * time.Millisecond)
		}
		l.record(key, sentKey{fault: tl.faultAt(l.name, time.Now()), poison: strings.HasPrefix(key, poisonPrefix), flaky: flakyKey(key)}, first)
	}
}

// keyOutcome is what the database says of one key.
type keyOutcome struct {
	effects int // effect rows
	dead    int // dead-letter rows
}

// outcomes reads every key's effects and dead letters, per lane.
func outcomes(t *testing.T, pool *pgxpool.Pool) map[string]map[string]keyOutcome {
	ctx := context.Background()
	out := map[string]map[string]keyOutcome{}
	at := func(lane, key string) keyOutcome {
		if out[lane] == nil {
			out[lane] = map[string]keyOutcome{}
		}
		return out[lane][key]
	}
	rows, err := pool.Query(ctx, `SELECT broker, key, count(*) FROM `+schema+`.effects GROUP BY broker, key`)
	require.NoError(t, err)
	for rows.Next() {
		var lane, key string
		var n int
		require.NoError(t, rows.Scan(&lane, &key, &n))
		o := at(lane, key)
		o.effects = n
		out[lane][key] = o
	}
	require.NoError(t, rows.Err())
	rows, err = pool.Query(ctx, `SELECT consumer, key, count(*) FROM `+schema+`.dlq GROUP BY consumer, key`)
	require.NoError(t, err)
	for rows.Next() {
		var consumer, key string
		var n int
		require.NoError(t, rows.Scan(&consumer, &key, &n))
		lane := strings.TrimPrefix(consumer, "chaos_")
		o := at(lane, key)
		o.dead = n
		out[lane][key] = o
	}
	require.NoError(t, rows.Err())
	return out
}

// tally counts the outcomes of a set of keys.
type tally struct {
	sent, applied, doubled, lost, poisonDead, healthyDead int
	both, poisonApplied, deadTwice                        int
	// parked counts the flaky keys, parked before they applied, and
	// parkedApplied those of them applied.
	parked, parkedApplied int
	// outOfOrder counts the keys applied after a later key of their
	// account.
	outOfOrder int
}

func (t *tally) add(k sentKey, o keyOutcome) {
	t.sent++
	if k.flaky {
		t.parked++
		if o.effects > 0 {
			t.parkedApplied++
		}
	}
	if o.effects > 0 {
		t.applied++
	}
	if o.effects > 1 {
		t.doubled++
	}
	if o.effects > 0 && o.dead > 0 {
		t.both++
	}
	if o.dead > 1 {
		t.deadTwice++
	}
	switch {
	case k.poison:
		if o.dead > 0 {
			t.poisonDead++
		}
		if o.effects > 0 {
			t.poisonApplied++
		}
		if o.dead == 0 && o.effects == 0 {
			t.lost++
		}
	default:
		if o.dead > 0 {
			t.healthyDead++
		}
		if o.effects == 0 && o.dead == 0 {
			t.lost++
		}
	}
}

func (t *tally) merge(o tally) {
	t.sent += o.sent
	t.applied += o.applied
	t.doubled += o.doubled
	t.lost += o.lost
	t.poisonDead += o.poisonDead
	t.healthyDead += o.healthyDead
	t.both += o.both
	t.poisonApplied += o.poisonApplied
	t.deadTwice += o.deadTwice
	t.parked += o.parked
	t.parkedApplied += o.parkedApplied
	t.outOfOrder += o.outOfOrder
}

// windowsOf returns the spans of the stream during which the lane was
// under fault, one of faults; for faultNone, the spans under none of them.
func (l *lane) windowsOf(tl *timeline, fault string, faults []string, start, end time.Time) []window {
	if fault != faultNone {
		return tl.of(l.name, fault)
	}
	var busy []window
	for _, f := range faults {
		busy = append(busy, tl.of(l.name, f)...)
	}
	sort.Slice(busy, func(i, j int) bool { return busy[i].from.Before(busy[j].from) })
	var free []window
	at := start
	for _, w := range busy {
		if w.from.After(at) {
			free = append(free, window{fault: faultNone, from: at, to: w.from})
		}
		if w.to.After(at) {
			at = w.to
		}
	}
	if end.After(at) {
		free = append(free, window{fault: faultNone, from: at, to: end})
	}
	return free
}

// accounts is how many accounts a lane's keys belong to.
const accounts = 16

// accountOf is the account of a key the producer made: its number's
// remainder by accounts. A key's number orders it among its account's.
func accountOf(key string) string {
	return "acct-" + strconv.Itoa(keyNumber(key)%accounts)
}

// keyNumber is the number at the end of a key the producer made.
func keyNumber(key string) int {
	i := strings.LastIndexByte(key, '-')
	n, err := strconv.Atoi(key[i+1:])
	if err != nil {
		panic(fmt.Sprintf("chaos: key %q has no number", key))
	}
	return n
}

// label is the lane's name in the report, marked * when its setup
// orders an account's messages across processes.
func (l *lane) label() string {
	if l.ordered {
		return l.name + " *"
	}
	return l.name
}

// outOfOrder returns, per lane, the keys applied after a key of their
// account published later: the effects in the order they were written
// (each account's are written one after the other where the setup orders
// them, a transaction's own rows in the order its statement wrote them).
func outOfOrder(t *testing.T, pool *pgxpool.Pool) map[string]map[string]bool {
	rows, err := pool.Query(context.Background(), `SELECT broker, key FROM `+schema+`.effects ORDER BY at, tx`)
	require.NoError(t, err)
	type laneAccount struct{ lane, account string }
	latest := map[laneAccount]int{}
	late := map[string]map[string]bool{}
	for rows.Next() {
		var lane, key string
		require.NoError(t, rows.Scan(&lane, &key))
		n := keyNumber(key)
		la := laneAccount{lane, accountOf(key)}
		if last, ok := latest[la]; ok && n < last {
			if late[lane] == nil {
				late[lane] = map[string]bool{}
			}
			late[lane][key] = true
			continue
		}
		latest[la] = n
	}
	require.NoError(t, rows.Err())
	return late
}

// effectTimes returns each lane's effect commit times, in order.
func effectTimes(t *testing.T, pool *pgxpool.Pool) map[string][]time.Time {
	rows, err := pool.Query(context.Background(), `SELECT broker, at FROM `+schema+`.effects ORDER BY at`)
	require.NoError(t, err)
	times := map[string][]time.Time{}
	for rows.Next() {
		var lane string
		var at time.Time
		require.NoError(t, rows.Scan(&lane, &at))
		times[lane] = append(times[lane], at)
	}
	require.NoError(t, rows.Err())
	return times
}

// longestStall is the longest time between two effects of a lane among
// the gaps that belong to fault: a gap belongs to the window (of any fault,
// or of none) it overlaps most, so that the gap that begins just before an
// outage and ends after it is the outage's.
func longestStall(times []time.Time, ws []window, fault string) time.Duration {
	var longest time.Duration
	for i := 0; i+1 < len(times); i++ {
		a, b := times[i], times[i+1]
		best, owner := time.Duration(0), ""
		for _, w := range ws {
			from, to := later(a, w.from), earlier(b, w.to)
			if d := to.Sub(from); d > best {
				best, owner = d, w.fault
			}
		}
		if owner == fault {
			longest = max(longest, b.Sub(a))
		}
	}
	return longest
}

func later(a, b time.Time) time.Time {
	if a.After(b) {
		return a
	}
	return b
}

func earlier(a, b time.Time) time.Time {
	if a.Before(b) {
		return a
	}
	return b
}

func connect(t *testing.T, url string, maxConns int32) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(url)
	require.NoError(t, err)
	cfg.MaxConns = maxConns
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	return pool
}

func sqsEndpoint() string {
	if e := os.Getenv("ONCEMILL_SQS_ENDPOINT"); e != "" {
		return e
	}
	return "http://127.0.0.1:4566"
}

func tail(s string, n int) string {
	if len(s) > n {
		return s[len(s)-n:]
	}
	return s
}
