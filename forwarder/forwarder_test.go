package forwarder_test

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/forwarder"
	"github.com/oncemill/oncemill/internal/testing/pgtest"
	"github.com/oncemill/oncemill/internal/testing/proctest"
	"github.com/oncemill/oncemill/sqlschema"
)

func TestMain(m *testing.M) {
	proctest.Main(relayRole)
	goleak.VerifyTestMain(m)
}

type bundle struct {
	pool   *pgxpool.Pool
	schema sqlschema.Config
}

func setup(t *testing.T, maxConns int32) bundle {
	t.Helper()
	pool := pgtest.Pool(t, maxConns)
	schema := pgtest.Schema(t, pool)
	_, err := pool.Exec(context.Background(), `CREATE TABLE "`+schema+`".orders (id text PRIMARY KEY)`)
	require.NoError(t, err)
	return bundle{pool: pool, schema: sqlschema.Config{Schema: schema}}
}

// write commits one transaction with a business row per event and the
// events in the outbox.
func (b bundle) write(t *testing.T, topic string, events ...*message.Message) {
	t.Helper()
	ctx := context.Background()
	tx, err := b.pool.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx) //nolint:errcheck // no-op after commit
	pub, err := forwarder.NewTxPublisher(ctx, tx, b.schema)
	require.NoError(t, err)
	for _, e := range events {
		_, err := tx.Exec(ctx, `INSERT INTO "`+b.schema.Schema+`".orders (id) VALUES ($1)`, e.UUID)
		require.NoError(t, err)
	}
	require.NoError(t, pub.Publish(topic, events...))
	require.NoError(t, tx.Commit(ctx))
}

func (b bundle) count(t *testing.T, table string) int {
	t.Helper()
	var n int
	require.NoError(t, b.pool.QueryRow(context.Background(), `SELECT count(*) FROM "`+b.schema.Schema+`".`+table).Scan(&n))
	return n
}

func event(key string, seq int) *message.Message {
	m := message.NewMessage(watermill.NewUUID(), []byte(strconv.Itoa(seq)))
	m.Metadata.Set(delivery.PartitionKey, key)
	m.Metadata.Set("seq", strconv.Itoa(seq))
	return m
}

// sink is the broker side: it records what the relay published, and can be
// made to fail.
type sink struct {
	mu        sync.Mutex
	published []*message.Message
	topics    []string
	// fail, when set, decides per call whether Publish fails, and whether
	// it fails after the broker already took the messages.
	fail  func(call int) (fail, afterPublish bool)
	calls int
}

func (s *sink) Publish(topic string, msgs ...*message.Message) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.calls++
	var fail, after bool
	if s.fail != nil {
		fail, after = s.fail(s.calls)
	}
	if fail && !after {
		return errors.New("broker unavailable")
	}
	for _, m := range msgs {
		s.published = append(s.published, m)
		s.topics = append(s.topics, topic)
	}
	if fail {
		return errors.New("connection reset after the broker took the messages")
	}
	return nil
}

func (s *sink) Close() error { return nil }

func (s *sink) snapshot() []*message.Message {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]*message.Message(nil), s.published...)
}

func newRelay(t *testing.T, b bundle, pub message.Publisher, mod func(*forwarder.RelayConfig)) *forwarder.Relay {
	t.Helper()
	cfg := forwarder.RelayConfig{Pool: b.pool, Publisher: pub, Schema: b.schema, MinBackoff: 10 * time.Millisecond, MaxBackoff: 50 * time.Millisecond}
	if mod != nil {
		mod(&cfg)
	}
	r, err := forwarder.NewRelay(cfg)
	require.NoError(t, err)
	return r
}

// run starts r.Run and stops it when the test ends.
func run(t *testing.T, r *forwarder.Relay) {
	t.Helper()
	done := make(chan error, 1)
	go func() { done <- r.Run(context.Background()) }()
	t.Cleanup(func() {
		require.NoError(t, r.Close())
		require.NoError(t, <-done)
	})
}

func TestEventCommitsAndRollsBackWithBusinessRow(t *testing.T) {
	t.Parallel()
	b := setup(t, 4)
	ctx := context.Background()

	e := event("order-1", 1)
	e.Metadata.Set("tenant", "acme")
	cancelled, cancel := context.WithCancel(ctx)
	cancel()
	e.SetContext(cancelled) // a cancelled message context must not break the write
	b.write(t, "orders.confirmed", e)
	require.Equal(t, 1, b.count(t, "orders"))
	require.Equal(t, 1, b.count(t, "outbox"))
	var (
		topic, uuid, key string
		md               map[string]string
	)
	require.NoError(t, b.pool.QueryRow(ctx, `SELECT topic, uuid, partition_key, metadata FROM "`+b.schema.Schema+`".outbox`).Scan(&topic, &uuid, &key, &md))
	require.Equal(t, "orders.confirmed", topic)
	require.Equal(t, e.UUID, uuid)
	require.Equal(t, "order-1", key)
	require.Equal(t, "acme", md["tenant"])

	tx, err := b.pool.Begin(ctx)
	require.NoError(t, err)
	pub, err := forwarder.NewTxPublisher(ctx, tx, b.schema)
	require.NoError(t, err)
	_, err = tx.Exec(ctx, `INSERT INTO "`+b.schema.Schema+`".orders (id) VALUES ('rolled-back')`)
	require.NoError(t, err)
	require.NoError(t, pub.Publish("orders.confirmed", event("order-2", 1)))
	require.NoError(t, tx.Rollback(ctx))
	require.Equal(t, 1, b.count(t, "orders"), "a rollback leaves no business row")
	require.Equal(t, 1, b.count(t, "outbox"), "and no event")

	s := &sink{}
	r := newRelay(t, b, s, nil)
	relayAll(t, r, 1)
	got := s.snapshot()
	require.Len(t, got, 1)
	require.Equal(t, e.UUID, got[0].UUID, "the relay keeps the UUID")
	require.Equal(t, "acme", got[0].Metadata.Get("tenant"))
	require.Equal(t, "order-1", got[0].Metadata.Get(delivery.PartitionKey))
	require.Equal(t, []byte("1"), []byte(got[0].Payload))
	require.Equal(t, 0, b.count(t, "outbox"), "published rows are deleted")
}

func TestSeveralRelaysKeepKeyOrderAndPublishOnce(t *testing.T) {
	t.Parallel()
	for _, relays := range []int{2, 4} {
		t.Run(fmt.Sprintf("%d relays", relays), func(t *testing.T) {
			t.Parallel()
			const rowsTotal, keys, perTx = 5000, 50, 50
			b := setup(t, int32(relays*2+4))
			s := &sink{}
			for i := 0; i < relays; i++ {
				// Small batches of few lanes: the relays contend for the
				// lanes and take turns on each key's; each key's writers
				// commit one after another, so their order must hold.
				run(t, newRelay(t, b, s, func(c *forwarder.RelayConfig) { c.BatchSize = 200; c.LanesPerBatch = 8 }))
			}
			seq := 0
			for tx := 0; tx < rowsTotal/perTx; tx++ {
				events := make([]*message.Message, perTx)
				for i := range events {
					events[i] = event(fmt.Sprintf("key-%d", seq%keys), seq)
					seq++
				}
				b.write(t, "orders.confirmed", events...)
			}
			require.Eventually(t, func() bool { return len(s.snapshot()) >= rowsTotal }, 2*time.Minute, 20*time.Millisecond)
			// The last batches' rows are deleted in the transaction that
			// published them, which commits after the broker took them.
			r := newRelay(t, b, s, nil)
			require.Eventually(t, func() bool {
				lag, err := r.Lag(context.Background())
				require.NoError(t, err)
				return lag == forwarder.Lag{}
			}, 30*time.Second, 10*time.Millisecond, "every published row deleted")

			got := s.snapshot()
			require.Len(t, got, rowsTotal, "every row published, none twice")
			seen := map[string]bool{}
			last := map[string]int{}
			for _, m := range got {
				require.False(t, seen[m.UUID], "published twice: %s", m.UUID)
				seen[m.UUID] = true
				key := m.Metadata.Get(delivery.PartitionKey)
				n, err := strconv.Atoi(m.Metadata.Get("seq"))
				require.NoError(t, err)
				if prev, ok := last[key]; ok {
					require.Greater(t, n, prev, "key %s out of order", key)
				}
				last[key] = n
			}
			require.Len(t, last, keys)
		})
	}
}

func TestBrokerDownKeepsRows(t *testing.T) {
	t.Parallel()
	b := setup(t, 6)
	var down atomic.Bool
	down.Store(true)
	s := &sink{fail: func(int) (bool, bool) { return down.Load(), false }}
	r := newRelay(t, b, s, nil)
	run(t, r)
	for i := 0; i < 20; i++ {
		b.write(t, "payments", event(fmt.Sprintf("k%d", i%3), i))
	}
	// Wait until the relay has tried and failed a few times.
	require.Eventually(t, func() bool { s.mu.Lock(); defer s.mu.Unlock(); return s.calls >= 3 }, 30*time.Second, 10*time.Millisecond)
	lag, err := r.Lag(context.Background())
	require.NoError(t, err)
	require.Equal(t, 20, lag.Pending, "rows stay while the broker is down")
	require.Positive(t, lag.OldestAge)
	require.Empty(t, s.snapshot())

	down.Store(false)
	require.Eventually(t, func() bool { return len(s.snapshot()) == 20 && b.count(t, "outbox") == 0 }, 30*time.Second, 10*time.Millisecond)
	require.Len(t, s.snapshot(), 20, "each row published once")
}

func TestCrashBetweenPublishAndDeleteRepublishesSameUUIDs(t *testing.T) {
	t.Parallel()
	b := setup(t, 4)
	ctx := context.Background()
	events := make([]*message.Message, 10)
	for i := range events {
		events[i] = event("k", i)
	}
	b.write(t, "payments", events...)
	s := &sink{fail: func(call int) (bool, bool) { return call == 1, true }}
	r := newRelay(t, b, s, nil)

	require.Eventually(t, func() bool {
		_, err := r.RelayBatch(ctx)
		return err != nil
	}, 30*time.Second, 10*time.Millisecond, "the first batch dies after the broker took it")
	require.Equal(t, 10, b.count(t, "outbox"), "its rows were not deleted")
	relayAll(t, r, 10)

	counts := map[string]int{}
	for _, m := range s.snapshot() {
		counts[m.UUID]++
	}
	require.Len(t, counts, 10)
	for _, e := range events {
		require.Equal(t, 2, counts[e.UUID], "published once more, under the same UUID")
	}
	require.Equal(t, 0, b.count(t, "outbox"))
}

// TestIdleRelayFindsNewRows: a relay that has found nothing for a while
// backs off to PollInterval and still picks up each new row; the writers'
// commits send no notification (no global lock on their commit path).
func TestIdleRelayFindsNewRows(t *testing.T) {
	t.Parallel()
	b := setup(t, 4)
	ctx := context.Background()
	listener, err := b.pool.Acquire(ctx)
	require.NoError(t, err)
	defer listener.Release()
	_, err = listener.Exec(ctx, `LISTEN "`+b.schema.Schema+`.outbox"`)
	require.NoError(t, err)
	defer listener.Exec(context.WithoutCancel(ctx), `UNLISTEN *`) //nolint:errcheck // the pool's connection

	s := &sink{}
	r := newRelay(t, b, s, func(c *forwarder.RelayConfig) { c.PollInterval = 30 * time.Millisecond })
	run(t, r)
	for i := 1; i <= 3; i++ {
		time.Sleep(100 * time.Millisecond) // idle: the relay's wait has grown to PollInterval
		b.write(t, "payments", event("k", i))
		require.Eventually(t, func() bool { return len(s.snapshot()) == i }, 30*time.Second, 5*time.Millisecond)
	}
	wctx, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
	defer cancel()
	n, err := listener.Conn().WaitForNotification(wctx)
	require.ErrorIs(t, err, context.DeadlineExceeded, "a writer's commit notified %v", n)
}

// TestRelayRunsWithTheRouter: as a router plugin the relay starts with the
// router, and the router's Close stops it after the batch in flight has
// published and deleted its rows.
func TestRelayRunsWithTheRouter(t *testing.T) {
	t.Parallel()
	b := setup(t, 4)
	entered, release := make(chan struct{}), make(chan struct{})
	var once sync.Once
	s := &sink{fail: func(call int) (bool, bool) {
		if call == 2 {
			once.Do(func() { close(entered) })
			<-release // the second batch is in flight when the router closes
		}
		return false, false
	}}
	r := newRelay(t, b, s, nil)
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 20 * time.Second}, watermill.NopLogger{})
	require.NoError(t, err)
	router.AddPlugin(r.Plugin)
	done := make(chan error, 1)
	go func() { done <- router.Run(context.Background()) }()
	<-router.Running()

	b.write(t, "payments", event("k", 1))
	require.Eventually(t, func() bool { return len(s.snapshot()) == 1 }, 30*time.Second, 5*time.Millisecond)
	b.write(t, "payments", event("k", 2))
	<-entered
	closed := make(chan error, 1)
	go func() { closed <- router.Close() }()
	select {
	case err := <-closed:
		t.Fatalf("the router closed (%v) while the relay's batch was in flight", err)
	case <-time.After(200 * time.Millisecond):
	}
	close(release)
	require.NoError(t, <-closed)
	require.NoError(t, <-done)
	require.Len(t, s.snapshot(), 2)
	require.Zero(t, b.count(t, "outbox"), "the batch in flight deleted its rows")

	b.write(t, "payments", event("k", 3))
	time.Sleep(100 * time.Millisecond)
	require.Len(t, s.snapshot(), 2, "the relay stopped with the router")
	require.Equal(t, 1, b.count(t, "outbox"))
}

// relayHandlers adds the relays as plugins of one new router, runs it until
// it runs, and returns the names of its handlers.
func relayHandlers(t *testing.T, relays ...*forwarder.Relay) []string {
	t.Helper()
	router, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	require.NoError(t, err)
	for _, r := range relays {
		router.AddPlugin(r.Plugin)
	}
	done := make(chan error, 1)
	go func() { done <- router.Run(context.Background()) }()
	<-router.Running()
	var names []string
	for name := range router.Handlers() {
		names = append(names, name)
	}
	require.NoError(t, router.Close())
	require.NoError(t, <-done)
	sort.Strings(names)
	return names
}

// TestRelayHandlerName: the relay's handler in a router is named after its
// outbox table, the same on every start (Watermill's metrics label series
// with it), and relays of other tables, or of the same table, in one router
// do not collide.
func TestRelayHandlerName(t *testing.T) {
	t.Parallel()
	b, other := setup(t, 4), setup(t, 4)
	want := "oncemill_outbox_relay_" + b.schema.Schema + ".outbox"

	first := relayHandlers(t, newRelay(t, b, &sink{}, nil))
	again := relayHandlers(t, newRelay(t, b, &sink{}, nil))
	require.Equal(t, []string{want}, first)
	require.Equal(t, first, again, "a second start of the same relay has the same name")

	two := relayHandlers(t, newRelay(t, b, &sink{}, nil), newRelay(t, other, &sink{}, nil))
	require.ElementsMatch(t, []string{want, "oncemill_outbox_relay_" + other.schema.Schema + ".outbox"}, two)

	same := relayHandlers(t, newRelay(t, b, &sink{}, nil), newRelay(t, b, &sink{}, nil))
	require.Equal(t, []string{want, want + "_2"}, same, "two relays of one table share a router")
}

func TestRelayConfigValidate(t *testing.T) {
	t.Parallel()
	b := setup(t, 2)
	cases := map[string]forwarder.RelayConfig{
		"RelayConfig.Pool":            {Publisher: &sink{}},
		"RelayConfig.Publisher":       {Pool: b.pool},
		"RelayConfig.BatchSize":       {Pool: b.pool, Publisher: &sink{}, BatchSize: -1},
		"RelayConfig.LanesPerBatch":   {Pool: b.pool, Publisher: &sink{}, LanesPerBatch: 65},
		"RelayConfig.MinPollInterval": {Pool: b.pool, Publisher: &sink{}, PollInterval: time.Millisecond, MinPollInterval: time.Second},
		"RelayConfig.DrainTimeout":    {Pool: b.pool, Publisher: &sink{}, DrainTimeout: -time.Second},
		"RelayConfig.StallWarning":    {Pool: b.pool, Publisher: &sink{}, StallWarning: -time.Second},
		"OutboxTable":                 {Pool: b.pool, Publisher: &sink{}, Schema: sqlschema.Config{OutboxTable: "Out Box"}},
	}
	for want, cfg := range cases {
		_, err := forwarder.NewRelay(cfg)
		require.ErrorContains(t, err, want)
	}
	_, err := forwarder.NewTxPublisher(context.Background(), nil, sqlschema.Config{})
	require.ErrorContains(t, err, "tx is nil")
}

// relayAll runs batches until want rows have been published: rows come due
// only once every older transaction in the cluster has ended, and other
// tests keep transactions open.
func relayAll(t *testing.T, r *forwarder.Relay, want int) {
	t.Helper()
	total := 0
	require.Eventually(t, func() bool {
		n, err := r.RelayBatch(context.Background())
		require.NoError(t, err)
		total += n
		return total >= want
	}, 30*time.Second, 10*time.Millisecond)
	require.Equal(t, want, total)
}
