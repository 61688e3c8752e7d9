package prom_test

import (
	"context"
	"errors"
	"math"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wmetrics "github.com/ThreeDotsLabs/watermill/components/metrics"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/prometheus/client_golang/prometheus/testutil"
	dto "github.com/prometheus/client_model/go"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/oncemill/oncemill/dedup/memory"
	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/dlq"
	"github.com/oncemill/oncemill/internal/testing/msgtest"
	"github.com/oncemill/oncemill/internal/testing/pgtest"
	"github.com/oncemill/oncemill/middleware"
	"github.com/oncemill/oncemill/observe"
	"github.com/oncemill/oncemill/observe/prom"
	"github.com/oncemill/oncemill/sqlschema"
)

func TestMain(m *testing.M) {
	// Sarama, in the backlog collector's Kafka test, starts go-metrics's
	// process-wide meter goroutine, which never stops.
	goleak.VerifyTestMain(m, goleak.IgnoreTopFunction("github.com/rcrowley/go-metrics.(*meterArbiter).tick"))
}

// setup returns a fresh registry and the metrics registered on it.
func setup(t testing.TB) (*prometheus.Registry, *prom.Metrics) {
	t.Helper()
	reg := prometheus.NewPedanticRegistry()
	m, err := prom.New(prom.Config{Registerer: reg})
	require.NoError(t, err)
	return reg, m
}

// histogram returns the sample count and sum of the series of family name
// whose labels include want.
func histogram(t *testing.T, g prometheus.Gatherer, name string, want map[string]string) (uint64, float64) {
	t.Helper()
	m := series(t, g, name, want)
	require.NotNil(t, m.GetHistogram(), "%s is not a histogram", name)
	return m.GetHistogram().GetSampleCount(), m.GetHistogram().GetSampleSum()
}

// series returns the one series of family name whose labels include want.
func series(t *testing.T, g prometheus.Gatherer, name string, want map[string]string) *dto.Metric {
	t.Helper()
	families, err := g.Gather()
	require.NoError(t, err)
	var found []*dto.Metric
	for _, f := range families {
		if f.GetName() != name {
			continue
		}
	metrics:
		for _, m := range f.GetMetric() {
			labels := map[string]string{}
			for _, l := range m.GetLabel() {
				labels[l.GetName()] = l.GetValue()
			}
			for k, v := range want {
				if labels[k] != v {
					continue metrics
				}
			}
			found = append(found, m)
		}
	}
	require.Len(t, found, 1, "series of %s with %v", name, want)
	return found[0]
}

func TestConfigValidate(t *testing.T) {
	t.Parallel()
	reg := prometheus.NewRegistry()
	require.NoError(t, prom.Config{Registerer: reg}.Validate(), "defaults are valid")
	for _, tc := range []struct {
		cfg  prom.Config
		want string
	}{
		{prom.Config{}, "prom: Config.Registerer is required"},
		{prom.Config{Registerer: reg, Namespace: "my-app"}, `prom: Config.Namespace must be letters, digits, '_' and ':', not starting with a digit, got "my-app"`},
		{prom.Config{Registerer: reg, Namespace: "9lives"}, "prom: Config.Namespace"},
		{prom.Config{Registerer: reg, Namespace: "ünï"}, "prom: Config.Namespace"},
		{prom.Config{Registerer: reg, HandlerBuckets: []float64{0.1, 0.2, 0.2}}, "prom: Config.HandlerBuckets must increase: [2] = 0.2 is not above [1] = 0.2"},
		{prom.Config{Registerer: reg, StoreBuckets: []float64{1, 0.5}}, "prom: Config.StoreBuckets must increase: [1] = 0.5 is not above [0] = 1"},
		{prom.Config{Registerer: reg, BatchBuckets: []float64{0.1, math.NaN()}}, "prom: Config.BatchBuckets[1] is NaN"},
	} {
		require.ErrorContains(t, tc.cfg.Validate(), tc.want)
		_, err := prom.New(tc.cfg)
		require.ErrorContains(t, err, tc.want, "New validates")
	}

	ok := prom.Config{Registerer: reg, Namespace: "shop:orders_2", HandlerBuckets: []float64{0.1, 1, math.Inf(1)}}
	require.NoError(t, ok.Validate())
	_, err := prom.New(ok)
	require.NoError(t, err)

	require.NoError(t, prom.DLQCollectorConfig{}.Validate())
	require.EqualError(t, prom.DLQCollectorConfig{Timeout: -time.Second}.Validate(),
		"prom: DLQCollectorConfig.Timeout must not be negative, got -1s")
	require.ErrorContains(t, prom.DLQCollectorConfig{Namespace: "a b"}.Validate(), "prom: DLQCollectorConfig.Namespace")
	_, err = prom.NewDLQCollector(nil, prom.DLQCollectorConfig{})
	require.EqualError(t, err, "prom: NewDLQCollector: store is nil")
}

// TestConfigNotChanged: New works on its own copy of the config.
func TestConfigNotChanged(t *testing.T) {
	t.Parallel()
	buckets := []float64{0.1, 1}
	cfg := prom.Config{Registerer: prometheus.NewRegistry(), StoreBuckets: buckets}
	_, err := prom.New(cfg)
	require.NoError(t, err)
	require.Empty(t, cfg.Namespace)
	require.Nil(t, cfg.HandlerBuckets)
	require.Equal(t, []float64{0.1, 1}, buckets)
}

func TestRegisterClash(t *testing.T) {
	t.Parallel()
	reg, _ := setup(t)
	_, err := prom.New(prom.Config{Registerer: reg})
	var are prometheus.AlreadyRegisteredError
	require.ErrorAs(t, err, &are, "the registry's own error is wrapped")
	require.ErrorContains(t, err, "prom: register oncemill_inbox_messages_total")
	require.ErrorContains(t, err, "Config.Namespace")

	other, err := prom.New(prom.Config{Registerer: reg, Namespace: "billing"})
	require.NoError(t, err, "another namespace does not clash")
	other.OnInboxAttempt(context.Background(), observe.InboxAttempt{Consumer: "c", Outcome: observe.Applied})
	require.Equal(t, 1.0, series(t, reg, "billing_inbox_messages_total", map[string]string{"outcome": "applied"}).GetCounter().GetValue())

	// A clash in the middle of the list: the metrics registered before it
	// are unregistered again, so that a second try clashes at the same
	// place and not on the first metric.
	reg2 := prometheus.NewRegistry()
	squatter := prometheus.NewGauge(prometheus.GaugeOpts{Name: "oncemill_bloom_checks_total", Help: "not ours"})
	require.NoError(t, reg2.Register(squatter))
	for range 2 {
		_, err = prom.New(prom.Config{Registerer: reg2})
		require.ErrorContains(t, err, "prom: register oncemill_bloom_checks_total")
		require.NotErrorAs(t, err, &are)
	}
	families, err := reg2.Gather()
	require.NoError(t, err)
	require.Len(t, families, 1, "only the squatter is left")
}

func TestInboxAttempt(t *testing.T) {
	t.Parallel()
	reg, m := setup(t)
	ctx := context.Background()
	m.OnInboxAttempt(ctx, observe.InboxAttempt{Consumer: "charge", Topic: "orders", Outcome: observe.Applied,
		Handler: 20 * time.Millisecond, Store: 2 * time.Millisecond})
	m.OnInboxAttempt(ctx, observe.InboxAttempt{Consumer: "charge", Topic: "orders", Outcome: observe.Applied,
		Handler: 30 * time.Millisecond, Store: 3 * time.Millisecond})
	m.OnInboxAttempt(ctx, observe.InboxAttempt{Consumer: "charge", Topic: "orders", Outcome: observe.Duplicate,
		Store: time.Millisecond}) // the handler did not run
	m.OnInboxAttempt(ctx, observe.InboxAttempt{Consumer: "charge", Topic: "orders", Outcome: observe.Failed,
		Handler: 10 * time.Millisecond, Store: time.Millisecond, Err: errors.New("declined")})
	m.OnInboxAttempt(ctx, observe.InboxAttempt{Consumer: "ship", Topic: "", Outcome: observe.Rejected}) // no store, no handler
	m.OnInboxAttempt(ctx, observe.InboxAttempt{Consumer: "ship", Topic: "", Outcome: "from_the_future"})

	require.NoError(t, testutil.GatherAndCompare(reg, strings.NewReader(`
# HELP oncemill_inbox_messages_total Deliveries through the inbox, by outcome.
# TYPE oncemill_inbox_messages_total counter
oncemill_inbox_messages_total{consumer="charge",outcome="abandoned",topic="orders"} 0
oncemill_inbox_messages_total{consumer="charge",outcome="applied",topic="orders"} 2
oncemill_inbox_messages_total{consumer="charge",outcome="crash_loop",topic="orders"} 0
oncemill_inbox_messages_total{consumer="charge",outcome="dead",topic="orders"} 0
oncemill_inbox_messages_total{consumer="charge",outcome="duplicate",topic="orders"} 1
oncemill_inbox_messages_total{consumer="charge",outcome="failed",topic="orders"} 1
oncemill_inbox_messages_total{consumer="charge",outcome="in_flight",topic="orders"} 0
oncemill_inbox_messages_total{consumer="charge",outcome="other_consumer",topic="orders"} 0
oncemill_inbox_messages_total{consumer="charge",outcome="panicked",topic="orders"} 0
oncemill_inbox_messages_total{consumer="charge",outcome="rejected",topic="orders"} 0
oncemill_inbox_messages_total{consumer="charge",outcome="unavailable",topic="orders"} 0
oncemill_inbox_messages_total{consumer="ship",outcome="abandoned",topic=""} 0
oncemill_inbox_messages_total{consumer="ship",outcome="applied",topic=""} 0
oncemill_inbox_messages_total{consumer="ship",outcome="crash_loop",topic=""} 0
oncemill_inbox_messages_total{consumer="ship",outcome="dead",topic=""} 0
oncemill_inbox_messages_total{consumer="ship",outcome="duplicate",topic=""} 0
oncemill_inbox_messages_total{consumer="ship",outcome="failed",topic=""} 0
oncemill_inbox_messages_total{consumer="ship",outcome="from_the_future",topic=""} 1
oncemill_inbox_messages_total{consumer="ship",outcome="in_flight",topic=""} 0
oncemill_inbox_messages_total{consumer="ship",outcome="other_consumer",topic=""} 0
oncemill_inbox_messages_total{consumer="ship",outcome="panicked",topic=""} 0
oncemill_inbox_messages_total{consumer="ship",outcome="rejected",topic=""} 1
oncemill_inbox_messages_total{consumer="ship",outcome="unavailable",topic=""} 0
`), "oncemill_inbox_messages_total"))

	n, sum := histogram(t, reg, "oncemill_inbox_handler_duration_seconds", map[string]string{"consumer": "charge", "topic": "orders"})
	require.Equal(t, uint64(3), n, "only the deliveries that ran the handler")
	require.InDelta(t, 0.060, sum, 1e-9)
	n, sum = histogram(t, reg, "oncemill_inbox_store_duration_seconds", map[string]string{"consumer": "charge", "topic": "orders"})
	require.Equal(t, uint64(4), n)
	require.InDelta(t, 0.007, sum, 1e-9)
	n, _ = histogram(t, reg, "oncemill_inbox_store_duration_seconds", map[string]string{"consumer": "ship"})
	require.Zero(t, n, "a delivery that spent nothing in the store is not observed")

	// Every label is a bounded name: no key, UUID or error text.
	families, err := reg.Gather()
	require.NoError(t, err)
	for _, f := range families {
		for _, s := range f.GetMetric() {
			for _, l := range s.GetLabel() {
				require.Contains(t, []string{"consumer", "topic", "outcome", "le"}, l.GetName(), f.GetName())
			}
		}
	}
}

func TestInvalidUTF8Labels(t *testing.T) {
	t.Parallel()
	reg, m := setup(t)
	require.NotPanics(t, func() {
		m.OnInboxAttempt(context.Background(), observe.InboxAttempt{Consumer: "c\xff", Topic: "t\xc3(", Outcome: observe.Applied})
		m.OnBloomCheck(context.Background(), observe.BloomCheck{Consumer: "c\xff", Topic: "t"})
		m.OnDeadLetter(context.Background(), observe.DeadLetter{Consumer: "c\xff", Topic: "t", Reason: observe.ReasonError})
		m.OnRelayBatch(context.Background(), observe.RelayBatch{Outbox: "o\xff"})
		m.OnOutboxLag(context.Background(), observe.OutboxLag{Outbox: "o\xff"})
	})
	s := series(t, reg, "oncemill_inbox_messages_total", map[string]string{"consumer": "c\uFFFD", "topic": "t\uFFFD(", "outcome": "applied"})
	require.Equal(t, 1.0, s.GetCounter().GetValue())
}

func TestDeadLetter(t *testing.T) {
	t.Parallel()
	reg, m := setup(t)
	ctx := context.Background()
	m.OnDeadLetter(ctx, observe.DeadLetter{Consumer: "charge", Topic: "orders", Reason: observe.ReasonPanic, Attempts: 5})
	m.OnDeadLetter(ctx, observe.DeadLetter{Consumer: "charge", Topic: "orders", Reason: observe.ReasonPanic, Attempts: 5})
	m.OnDeadLetter(ctx, observe.DeadLetter{Consumer: "charge", Topic: "orders", Reason: observe.ReasonPermanent, Attempts: 1})
	require.NoError(t, testutil.GatherAndCompare(reg, strings.NewReader(`
# HELP oncemill_dlq_messages_total Messages dead-lettered, by reason, once the dead-letter publish succeeded.
# TYPE oncemill_dlq_messages_total counter
oncemill_dlq_messages_total{consumer="charge",reason="crash_loop",topic="orders"} 0
oncemill_dlq_messages_total{consumer="charge",reason="deadline",topic="orders"} 0
oncemill_dlq_messages_total{consumer="charge",reason="error",topic="orders"} 0
oncemill_dlq_messages_total{consumer="charge",reason="panic",topic="orders"} 2
oncemill_dlq_messages_total{consumer="charge",reason="permanent",topic="orders"} 1
oncemill_dlq_messages_total{consumer="charge",reason="undecodable",topic="orders"} 0
`), "oncemill_dlq_messages_total"))
}

func TestRetry(t *testing.T) {
	t.Parallel()
	reg, m := setup(t)
	ctx := context.Background()
	m.OnRetry(ctx, observe.Retry{Consumer: "charge", Topic: "orders", Attempts: 5, Delay: 5 * time.Second})
	m.OnRetry(ctx, observe.Retry{Consumer: "charge", Topic: "orders", Behind: true})
	m.OnRetry(ctx, observe.Retry{Consumer: "charge", Topic: "orders", Behind: true})
	require.NoError(t, testutil.GatherAndCompare(reg, strings.NewReader(`
# HELP oncemill_retries_parked_total Messages parked for a delayed retry, by kind: "failed" (its attempt failed) or "behind" (it waits behind a parked message of its ordering key).
# TYPE oncemill_retries_parked_total counter
oncemill_retries_parked_total{consumer="charge",kind="behind",topic="orders"} 2
oncemill_retries_parked_total{consumer="charge",kind="failed",topic="orders"} 1
`), "oncemill_retries_parked_total"))
}

func TestBloomCheck(t *testing.T) {
	t.Parallel()
	reg, m := setup(t)
	ctx := context.Background()
	for range 3 {
		m.OnBloomCheck(ctx, observe.BloomCheck{Consumer: "charge", Topic: "orders", SurelyNew: true})
	}
	m.OnBloomCheck(ctx, observe.BloomCheck{Consumer: "charge", Topic: "orders"})
	m.OnBloomCheck(ctx, observe.BloomCheck{Consumer: "charge", Topic: "orders", FalsePositive: true})
	m.OnBloomCheck(ctx, observe.BloomCheck{Consumer: "ship", Topic: "orders", SurelyNew: true})
	require.NoError(t, testutil.GatherAndCompare(reg, strings.NewReader(`
# HELP oncemill_bloom_checks_total Messages through the Bloom prefilter, by result: "surely_new" (pre-check skipped) or "maybe" (store asked).
# TYPE oncemill_bloom_checks_total counter
oncemill_bloom_checks_total{consumer="charge",result="maybe",topic="orders"} 2
oncemill_bloom_checks_total{consumer="charge",result="surely_new",topic="orders"} 3
oncemill_bloom_checks_total{consumer="ship",result="maybe",topic="orders"} 0
oncemill_bloom_checks_total{consumer="ship",result="surely_new",topic="orders"} 1
# HELP oncemill_bloom_false_positives_total Bloom prefilter answers of maybe whose key the store found new.
# TYPE oncemill_bloom_false_positives_total counter
oncemill_bloom_false_positives_total{consumer="charge",topic="orders"} 1
oncemill_bloom_false_positives_total{consumer="ship",topic="orders"} 0
`), "oncemill_bloom_checks_total", "oncemill_bloom_false_positives_total"))
}

func TestRelayAndLag(t *testing.T) {
	t.Parallel()
	reg, m := setup(t)
	ctx := context.Background()
	const outbox = "oncemill.outbox"
	m.OnRelayBatch(ctx, observe.RelayBatch{Outbox: outbox, Rows: 500, Duration: 40 * time.Millisecond})
	m.OnRelayBatch(ctx, observe.RelayBatch{Outbox: outbox, Rows: 20, Duration: 10 * time.Millisecond})
	m.OnRelayBatch(ctx, observe.RelayBatch{Outbox: outbox, Duration: 5 * time.Second, Err: errors.New("broker down")})
	m.OnOutboxLag(ctx, observe.OutboxLag{Outbox: outbox, Pending: 1200, Waiting: 7, OldestAge: 1500 * time.Millisecond})
	require.NoError(t, testutil.GatherAndCompare(reg, strings.NewReader(`
# HELP oncemill_outbox_batches_total Outbox relay batches that took rows or failed, by result: "ok" or "error".
# TYPE oncemill_outbox_batches_total counter
oncemill_outbox_batches_total{outbox="oncemill.outbox",result="error"} 1
oncemill_outbox_batches_total{outbox="oncemill.outbox",result="ok"} 2
# HELP oncemill_outbox_published_total Outbox rows the relay published and deleted.
# TYPE oncemill_outbox_published_total counter
oncemill_outbox_published_total{outbox="oncemill.outbox"} 520
# HELP oncemill_outbox_lag_rows Outbox rows pending, as last measured by the relay.
# TYPE oncemill_outbox_lag_rows gauge
oncemill_outbox_lag_rows{outbox="oncemill.outbox"} 1200
# HELP oncemill_outbox_waiting_rows Pending outbox rows that wait on an open transaction, as last measured by the relay.
# TYPE oncemill_outbox_waiting_rows gauge
oncemill_outbox_waiting_rows{outbox="oncemill.outbox"} 7
# HELP oncemill_outbox_oldest_age_seconds Age of the oldest pending outbox row, as last measured by the relay.
# TYPE oncemill_outbox_oldest_age_seconds gauge
oncemill_outbox_oldest_age_seconds{outbox="oncemill.outbox"} 1.5
`), "oncemill_outbox_batches_total", "oncemill_outbox_published_total",
		"oncemill_outbox_lag_rows", "oncemill_outbox_waiting_rows", "oncemill_outbox_oldest_age_seconds"))
	n, sum := histogram(t, reg, "oncemill_outbox_batch_duration_seconds", map[string]string{"outbox": outbox})
	require.Equal(t, uint64(3), n)
	require.InDelta(t, 5.05, sum, 1e-9)

	m.OnOutboxLag(ctx, observe.OutboxLag{Outbox: outbox})
	require.Zero(t, series(t, reg, "oncemill_outbox_lag_rows", nil).GetGauge().GetValue(), "a gauge follows the last measure")
}

// TestThroughObserveHooks: the components reach the metrics through
// observe.Hooks, which sorts them by interface.
func TestThroughObserveHooks(t *testing.T) {
	t.Parallel()
	reg, m := setup(t)
	hooks := observe.New(m)
	require.True(t, hooks.ObservesInbox())
	require.True(t, hooks.ObservesLag())
	ctx := context.Background()
	hooks.InboxAttempt(ctx, observe.InboxAttempt{Consumer: "c", Topic: "t", Outcome: observe.Applied})
	hooks.DeadLetter(ctx, observe.DeadLetter{Consumer: "c", Topic: "t", Reason: observe.ReasonError})
	hooks.BloomCheck(ctx, observe.BloomCheck{Consumer: "c", Topic: "t", SurelyNew: true})
	hooks.RelayBatch(ctx, observe.RelayBatch{Outbox: "o", Rows: 1})
	hooks.OutboxLag(ctx, observe.OutboxLag{Outbox: "o", Pending: 3})
	for name, labels := range map[string]map[string]string{
		"oncemill_inbox_messages_total":   {"outcome": "applied"},
		"oncemill_dlq_messages_total":     {"reason": "error"},
		"oncemill_bloom_checks_total":     {"result": "surely_new"},
		"oncemill_outbox_published_total": nil,
	} {
		require.Equal(t, 1.0, series(t, reg, name, labels).GetCounter().GetValue(), name)
	}
	require.Equal(t, 3.0, series(t, reg, "oncemill_outbox_lag_rows", nil).GetGauge().GetValue())

	problems, err := testutil.GatherAndLint(reg)
	require.NoError(t, err)
	require.Empty(t, problems, "every metric follows Prometheus' naming rules")
}

// TestConcurrentHooks runs every hook from many goroutines over new and
// known label values at once; run with -race.
func TestConcurrentHooks(t *testing.T) {
	t.Parallel()
	reg, m := setup(t)
	ctx := context.Background()
	const goroutines, rounds = 16, 200
	consumers := []string{"a", "b", "c", "d"}
	var wg sync.WaitGroup
	for g := range goroutines {
		wg.Go(func() {
			for i := range rounds {
				c := consumers[(g+i)%len(consumers)]
				m.OnInboxAttempt(ctx, observe.InboxAttempt{Consumer: c, Topic: "t", Outcome: observe.Applied, Handler: time.Millisecond, Store: time.Millisecond})
				m.OnBloomCheck(ctx, observe.BloomCheck{Consumer: c, Topic: "t", SurelyNew: true})
				m.OnDeadLetter(ctx, observe.DeadLetter{Consumer: c, Topic: "t", Reason: observe.ReasonError})
				m.OnRelayBatch(ctx, observe.RelayBatch{Outbox: c, Rows: 1})
				m.OnOutboxLag(ctx, observe.OutboxLag{Outbox: c, Pending: i})
			}
		})
	}
	wg.Wait()
	var total float64
	for _, c := range consumers {
		total += series(t, reg, "oncemill_inbox_messages_total", map[string]string{"consumer": c, "outcome": "applied"}).GetCounter().GetValue()
		n, _ := histogram(t, reg, "oncemill_inbox_handler_duration_seconds", map[string]string{"consumer": c})
		require.Equal(t, uint64(goroutines*rounds/len(consumers)), n)
	}
	require.Equal(t, float64(goroutines*rounds), total)
	require.Equal(t, float64(goroutines*rounds/len(consumers)),
		series(t, reg, "oncemill_outbox_published_total", map[string]string{"outbox": "a"}).GetCounter().GetValue())
}

// TestHotPathDoesNotAllocate: once a consumer and topic have been seen,
// an event allocates nothing.
func TestHotPathDoesNotAllocate(t *testing.T) {
	_, m := setup(t)
	ctx := context.Background()
	attempt := observe.InboxAttempt{Consumer: "charge", Topic: "orders", Outcome: observe.Applied,
		Handler: 3 * time.Millisecond, Store: time.Millisecond}
	check := observe.BloomCheck{Consumer: "charge", Topic: "orders", FalsePositive: true}
	dead := observe.DeadLetter{Consumer: "charge", Topic: "orders", Reason: observe.ReasonError}
	batch := observe.RelayBatch{Outbox: "outbox", Rows: 10, Duration: time.Millisecond}
	lag := observe.OutboxLag{Outbox: "outbox", Pending: 10}
	m.OnInboxAttempt(ctx, attempt)
	m.OnBloomCheck(ctx, check)
	m.OnDeadLetter(ctx, dead)
	m.OnRelayBatch(ctx, batch)
	m.OnOutboxLag(ctx, lag)

	require.Zero(t, testing.AllocsPerRun(1000, func() { m.OnInboxAttempt(ctx, attempt) }), "OnInboxAttempt")
	// Other values of the same pair: other strings with equal contents,
	// and an outcome created at zero with the first attempt.
	other := observe.InboxAttempt{Consumer: strings.Clone("charge"), Topic: strings.Clone("orders"), Outcome: observe.InFlight, Store: time.Second}
	require.Zero(t, testing.AllocsPerRun(1000, func() { m.OnInboxAttempt(ctx, other) }), "OnInboxAttempt, a sibling outcome")
	require.Zero(t, testing.AllocsPerRun(1000, func() { m.OnBloomCheck(ctx, check) }), "OnBloomCheck")
	require.Zero(t, testing.AllocsPerRun(1000, func() { m.OnDeadLetter(ctx, dead) }), "OnDeadLetter")
	require.Zero(t, testing.AllocsPerRun(1000, func() { m.OnRelayBatch(ctx, batch) }), "OnRelayBatch")
	require.Zero(t, testing.AllocsPerRun(1000, func() { m.OnOutboxLag(ctx, lag) }), "OnOutboxLag")
}

func BenchmarkOnInboxAttempt(b *testing.B) {
	_, m := setup(b)
	ctx := context.Background()
	attempt := observe.InboxAttempt{Consumer: "charge", Topic: "orders", Outcome: observe.Applied,
		Handler: 3 * time.Millisecond, Store: time.Millisecond}
	m.OnInboxAttempt(ctx, attempt)
	b.Run("serial", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			m.OnInboxAttempt(ctx, attempt)
		}
	})
	b.Run("parallel", func(b *testing.B) {
		b.ReportAllocs()
		b.RunParallel(func(pb *testing.PB) {
			for pb.Next() {
				m.OnInboxAttempt(ctx, attempt)
			}
		})
	})
}

func BenchmarkOnBloomCheck(b *testing.B) {
	_, m := setup(b)
	ctx := context.Background()
	check := observe.BloomCheck{Consumer: "charge", Topic: "orders", SurelyNew: true}
	m.OnBloomCheck(ctx, check)
	b.ReportAllocs()
	for b.Loop() {
		m.OnBloomCheck(ctx, check)
	}
}

// TestWatermillMetricsCoexist registers Watermill's router metrics and
// ours on one registry, under Watermill's default (empty) namespace and
// under ours, runs a message through a router that has both (the inbox
// reporting to ours), and gathers.
func TestWatermillMetricsCoexist(t *testing.T) {
	t.Parallel()
	for _, namespace := range []string{"", "oncemill"} {
		t.Run("namespace="+namespace, func(t *testing.T) {
			t.Parallel()
			reg, m := setup(t)
			pubSub := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})
			router, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
			require.NoError(t, err)
			wmetrics.NewPrometheusMetricsBuilder(reg, namespace, "").AddPrometheusRouterMetrics(router)
			inbox, err := middleware.NewInbox(middleware.InboxConfig{LeaseStore: memory.New(), Hooks: []observe.Hook{m}})
			require.NoError(t, err)
			router.AddMiddleware(inbox.Middleware)
			router.AddHandler("echo", "in", pubSub, "out", pubSub, func(msg *message.Message) ([]*message.Message, error) {
				return []*message.Message{message.NewMessage(watermill.NewUUID(), msg.Payload)}, nil
			})
			out, err := pubSub.Subscribe(context.Background(), "out")
			require.NoError(t, err)
			stopped := make(chan struct{})
			go func() {
				defer close(stopped)
				if err := router.Run(context.Background()); err != nil {
					t.Errorf("router: %v", err)
				}
			}()
			t.Cleanup(func() {
				require.NoError(t, router.Close())
				<-stopped
				require.NoError(t, pubSub.Close())
			})
			<-router.Running()
			require.NoError(t, pubSub.Publish("in", message.NewMessage(watermill.NewUUID(), []byte("x"))))
			msgtest.Receive(t, out, 10*time.Second).Ack()

			prefix := ""
			if namespace != "" {
				prefix = namespace + "_"
			}
			want := []string{
				prefix + "handler_execution_time_seconds", prefix + "publish_time_seconds", prefix + "subscriber_messages_received_total",
				"oncemill_inbox_messages_total", "oncemill_inbox_handler_duration_seconds", "oncemill_inbox_store_duration_seconds",
			}
			// Watermill counts a received message once it is acked, which
			// happens after the handler's output was published.
			msgtest.WaitFor(t, "both libraries' metrics", func() bool {
				families, err := reg.Gather()
				require.NoError(t, err, "one registry gathers both")
				names := map[string]bool{}
				for _, f := range families {
					names[f.GetName()] = true
				}
				for _, name := range want {
					if !names[name] {
						return false
					}
				}
				return true
			})
			require.Equal(t, 1.0, series(t, reg, "oncemill_inbox_messages_total",
				map[string]string{"consumer": "echo", "topic": "in", "outcome": "applied"}).GetCounter().GetValue())
			problems, err := testutil.GatherAndLint(reg, want[3:]...)
			require.NoError(t, err)
			require.Empty(t, problems, "our metrics follow Prometheus' naming rules")
		})
	}
}

// dlqEnv is a migrated schema with a dead-letter publisher and store.
type dlqEnv struct {
	pub   *dlq.Publisher
	store *dlq.Store
}

func setupDLQ(t *testing.T) dlqEnv {
	t.Helper()
	pool := pgtest.Pool(t, 4)
	cfg := sqlschema.Config{Schema: pgtest.Schema(t, pool)}
	pub, err := dlq.NewPublisher(pool, cfg)
	require.NoError(t, err)
	store, err := dlq.NewStore(pool, cfg)
	require.NoError(t, err)
	return dlqEnv{pub: pub, store: store}
}

// deadLetter is a message as the poison middleware dead-letters it.
func deadLetter(topic, consumer string) *message.Message {
	m := message.NewMessage(watermill.NewUUID(), []byte(`{}`))
	m.Metadata.Set(delivery.DeadTopic, topic)
	m.Metadata.Set(delivery.DeadConsumer, consumer)
	m.Metadata.Set(delivery.DeadKey, "key-"+m.UUID)
	m.Metadata.Set(delivery.DeadError, "boom")
	return m
}

func TestDLQCollector(t *testing.T) {
	t.Parallel()
	e := setupDLQ(t)
	collector, err := prom.NewDLQCollector(e.store, prom.DLQCollectorConfig{})
	require.NoError(t, err)
	reg, _ := setup(t)
	require.NoError(t, reg.Register(collector))

	require.NoError(t, testutil.GatherAndCompare(reg, strings.NewReader(`
# HELP oncemill_dlq_scrape_errors_total Scrapes whose read of the dead-letter table failed or timed out.
# TYPE oncemill_dlq_scrape_errors_total counter
oncemill_dlq_scrape_errors_total 0
`), "oncemill_dlq_entries", "oncemill_dlq_oldest_age_seconds", "oncemill_dlq_scrape_errors_total"), "an empty table has no series")

	require.NoError(t, e.pub.Publish("orders.dlq",
		deadLetter("orders", "charge"), deadLetter("orders", "charge"), deadLetter("orders", "ship"), deadLetter("refunds", "charge")))
	require.NoError(t, testutil.GatherAndCompare(reg, strings.NewReader(`
# HELP oncemill_dlq_entries Entries in the dead-letter table, read at scrape time.
# TYPE oncemill_dlq_entries gauge
oncemill_dlq_entries{consumer="charge",topic="orders"} 2
oncemill_dlq_entries{consumer="charge",topic="refunds"} 1
oncemill_dlq_entries{consumer="ship",topic="orders"} 1
# HELP oncemill_dlq_scrape_errors_total Scrapes whose read of the dead-letter table failed or timed out.
# TYPE oncemill_dlq_scrape_errors_total counter
oncemill_dlq_scrape_errors_total 0
`), "oncemill_dlq_entries", "oncemill_dlq_scrape_errors_total"))
	require.Equal(t, 3, testutil.CollectAndCount(collector, "oncemill_dlq_oldest_age_seconds"))
	age := series(t, reg, "oncemill_dlq_oldest_age_seconds", map[string]string{"consumer": "charge", "topic": "orders"}).GetGauge().GetValue()
	require.GreaterOrEqual(t, age, 0.0)
	require.Less(t, age, 60.0)
	problems, err := testutil.CollectAndLint(collector)
	require.NoError(t, err)
	require.Empty(t, problems)

	n, err := e.store.Purge(context.Background(), dlq.Filter{Consumer: "ship"})
	require.NoError(t, err)
	require.Equal(t, 1, n)
	require.Equal(t, 2, testutil.CollectAndCount(collector, "oncemill_dlq_entries"), "a pair with no entry left has no series")
}

// TestDLQCollectorFailure: a read that fails costs the dead-letter series
// of that scrape, and nothing else: the registry gathers, promhttp
// answers 200 with the other metrics.
func TestDLQCollectorFailure(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t, 2)
	store, err := dlq.NewStore(pool, sqlschema.Config{Schema: pgtest.Name(t)}) // never migrated
	require.NoError(t, err)
	logger := watermill.NewCaptureLogger()
	collector, err := prom.NewDLQCollector(store, prom.DLQCollectorConfig{Logger: logger})
	require.NoError(t, err)
	reg, m := setup(t)
	require.NoError(t, reg.Register(collector))
	m.OnInboxAttempt(context.Background(), observe.InboxAttempt{Consumer: "charge", Topic: "orders", Outcome: observe.Applied})

	require.NoError(t, testutil.GatherAndCompare(reg, strings.NewReader(`
# HELP oncemill_dlq_scrape_errors_total Scrapes whose read of the dead-letter table failed or timed out.
# TYPE oncemill_dlq_scrape_errors_total counter
oncemill_dlq_scrape_errors_total 1
`), "oncemill_dlq_entries", "oncemill_dlq_oldest_age_seconds", "oncemill_dlq_scrape_errors_total"))
	requireLogged(t, logger, dlq.ErrNotMigrated)

	rec := httptest.NewRecorder()
	promhttp.HandlerFor(reg, promhttp.HandlerOpts{}).ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/metrics", nil))
	require.Equal(t, http.StatusOK, rec.Code, rec.Body.String())
	require.Contains(t, rec.Body.String(), `oncemill_inbox_messages_total{consumer="charge",outcome="applied",topic="orders"} 1`)
	require.Contains(t, rec.Body.String(), "oncemill_dlq_scrape_errors_total 2")
}

// TestDLQCollectorTimeout: the read is bounded by the configured timeout.
func TestDLQCollectorTimeout(t *testing.T) {
	t.Parallel()
	e := setupDLQ(t)
	require.NoError(t, e.pub.Publish("orders.dlq", deadLetter("orders", "charge")))
	logger := watermill.NewCaptureLogger()
	collector, err := prom.NewDLQCollector(e.store, prom.DLQCollectorConfig{Timeout: time.Nanosecond, Namespace: "shop", Logger: logger})
	require.NoError(t, err)
	reg := prometheus.NewPedanticRegistry()
	require.NoError(t, reg.Register(collector))
	for want := range 3 {
		require.NoError(t, testutil.GatherAndCompare(reg, strings.NewReader(`
# HELP shop_dlq_scrape_errors_total Scrapes whose read of the dead-letter table failed or timed out.
# TYPE shop_dlq_scrape_errors_total counter
shop_dlq_scrape_errors_total `+strconv.Itoa(want+1)+`
`)), "each failed scrape counts once, and exports no entries")
	}
	requireLogged(t, logger, context.DeadlineExceeded)
}

// requireLogged checks that an error wrapping target was logged.
func requireLogged(t *testing.T, logger *watermill.CaptureLoggerAdapter, target error) {
	t.Helper()
	for _, m := range logger.Captured()[watermill.ErrorLogLevel] {
		if errors.Is(m.Err, target) {
			require.Equal(t, "Cannot read the dead-letter table for metrics", m.Msg)
			return
		}
	}
	t.Fatalf("no error wrapping %v logged: %v", target, logger.Captured())
}
