package prom

import (
	"context"
	"errors"
	"fmt"
	"math"
	"strings"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/oncemill/oncemill/observe"
)

// DefaultNamespace is [Config.Namespace] and [DLQCollectorConfig.Namespace]
// when they are empty: metric names start with "oncemill_".
const DefaultNamespace = "oncemill"

// The values of the result labels.
const (
	// ResultSurelyNew is oncemill_bloom_checks_total's result when the
	// filter proved the key new.
	ResultSurelyNew = "surely_new"
	// ResultMaybe is oncemill_bloom_checks_total's result when the filter
	// said the key may be known, and the store was asked.
	ResultMaybe = "maybe"
	// ResultOK is oncemill_outbox_batches_total's result for a batch that
	// published its rows.
	ResultOK = "ok"
	// ResultError is oncemill_outbox_batches_total's result for a batch
	// that failed.
	ResultError = "error"
)

// Config configures the metrics [New] registers.
type Config struct {
	// Registerer receives the metrics: a *prometheus.Registry, or
	// prometheus.DefaultRegisterer, or one wrapped with
	// prometheus.WrapRegistererWith to add constant labels. Required.
	Registerer prometheus.Registerer
	// Namespace is the first part of every metric name. It must be a
	// valid metric name of its own (letters, digits, '_' and ':', not
	// starting with a digit). Defaults to [DefaultNamespace], "oncemill".
	Namespace string
	// HandlerBuckets are the upper bounds, in seconds and increasing, of
	// oncemill_inbox_handler_duration_seconds. Defaults to
	// prometheus.ExponentialBuckets(0.0005, 2, 16): 0.5 ms to about 16 s.
	HandlerBuckets []float64
	// StoreBuckets are the upper bounds, in seconds and increasing, of
	// oncemill_inbox_store_duration_seconds. Defaults to
	// prometheus.ExponentialBuckets(0.0001, 2, 16): 0.1 ms to about 3.3 s.
	StoreBuckets []float64
	// BatchBuckets are the upper bounds, in seconds and increasing, of
	// oncemill_outbox_batch_duration_seconds. Defaults to
	// prometheus.ExponentialBuckets(0.0005, 2, 16): 0.5 ms to about 16 s.
	BatchBuckets []float64
}

func (c *Config) setDefaults() {
	if c.Namespace == "" {
		c.Namespace = DefaultNamespace
	}
	if len(c.HandlerBuckets) == 0 {
		c.HandlerBuckets = prometheus.ExponentialBuckets(0.0005, 2, 16)
	}
	if len(c.StoreBuckets) == 0 {
		c.StoreBuckets = prometheus.ExponentialBuckets(0.0001, 2, 16)
	}
	if len(c.BatchBuckets) == 0 {
		c.BatchBuckets = prometheus.ExponentialBuckets(0.0005, 2, 16)
	}
}

// Validate reports the first field that is missing or out of range; the
// error names it. Empty fields that have a default are valid.
func (c Config) Validate() error {
	c.setDefaults()
	if c.Registerer == nil {
		return errors.New("prom: Config.Registerer is required: a *prometheus.Registry or prometheus.DefaultRegisterer")
	}
	if err := validateNamespace("Config", c.Namespace); err != nil {
		return err
	}
	for _, b := range []struct {
		field   string
		buckets []float64
	}{
		{"HandlerBuckets", c.HandlerBuckets},
		{"StoreBuckets", c.StoreBuckets},
		{"BatchBuckets", c.BatchBuckets},
	} {
		if err := validateBuckets("Config."+b.field, b.buckets); err != nil {
			return err
		}
	}
	return nil
}

// validateNamespace checks that ns ("" allowed: it has a default) is a
// valid metric name in Prometheus' classic character set.
func validateNamespace(config, ns string) error {
	for i, r := range ns {
		if r == '_' || r == ':' || r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || i > 0 && r >= '0' && r <= '9' {
			continue
		}
		return fmt.Errorf("prom: %s.Namespace must be letters, digits, '_' and ':', not starting with a digit, got %q", config, ns)
	}
	return nil
}

// validateBuckets checks what client_golang would otherwise panic on when
// it creates the first series: bounds that do not increase.
func validateBuckets(field string, b []float64) error {
	for i, v := range b {
		switch {
		case math.IsNaN(v):
			return fmt.Errorf("prom: %s[%d] is NaN", field, i)
		case i > 0 && v <= b[i-1]:
			return fmt.Errorf("prom: %s must increase: [%d] = %g is not above [%d] = %g", field, i, v, i-1, b[i-1])
		}
	}
	return nil
}

// Metrics turns oncemill's hook events into Prometheus metrics. It
// implements [observe.InboxHook], [observe.DeadLetterHook],
// [observe.RetryHook], [observe.BloomHook], [observe.RelayHook] and
// [observe.OutboxLagHook]:
// pass it in the Hooks of every component's config. It is safe for
// concurrent use and starts no goroutines.
type Metrics struct {
	inboxMessages   *prometheus.CounterVec
	inboxHandler    *prometheus.HistogramVec
	inboxStore      *prometheus.HistogramVec
	dlqMessages     *prometheus.CounterVec
	bloomChecks     *prometheus.CounterVec
	bloomFalse      *prometheus.CounterVec
	outboxBatches   *prometheus.CounterVec
	outboxPublished *prometheus.CounterVec
	outboxDuration  *prometheus.HistogramVec
	outboxLag       *prometheus.GaugeVec
	outboxWaiting   *prometheus.GaugeVec
	outboxOldest    *prometheus.GaugeVec
	outboxScheduled *prometheus.GaugeVec
	retriesParked   *prometheus.CounterVec

	inbox   cache[inboxKey, inboxSeries]
	dead    cache[deadKey, prometheus.Counter]
	retries cache[retryKey, prometheus.Counter]
	bloom   cache[pairKey, bloomSeries]
	relay   cache[string, relaySeries]
	lag     cache[string, lagSeries]
}

var (
	_ observe.InboxHook      = (*Metrics)(nil)
	_ observe.DeadLetterHook = (*Metrics)(nil)
	_ observe.RetryHook      = (*Metrics)(nil)
	_ observe.BloomHook      = (*Metrics)(nil)
	_ observe.RelayHook      = (*Metrics)(nil)
	_ observe.OutboxLagHook  = (*Metrics)(nil)
)

// The cache keys: label values, as structs so that a look-up builds no
// string.
type (
	pairKey  struct{ consumer, topic string }
	inboxKey struct {
		consumer, topic string
		outcome         observe.Outcome
	}
	deadKey struct {
		consumer, topic string
		reason          observe.Reason
	}
)

type inboxSeries struct {
	messages       prometheus.Counter
	handler, store prometheus.Observer
}

type bloomSeries struct{ surelyNew, maybe, falsePositives prometheus.Counter }

type relaySeries struct {
	ok, failed, published prometheus.Counter
	duration              prometheus.Observer
}

type lagSeries struct{ pending, waiting, oldest, scheduled prometheus.Gauge }

type retryKey struct {
	consumer, topic string
	behind          bool
}

// New registers oncemill's metrics on cfg.Registerer and returns the hook
// that feeds them. When one of them cannot be registered (a collector of
// the same name is there already: another Metrics with the same
// Namespace, say), New unregisters those it registered and returns an
// error naming the metric and wrapping the registerer's, such as a
// prometheus.AlreadyRegisteredError.
func New(cfg Config) (*Metrics, error) {
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	ns := cfg.Namespace
	counter := func(subsystem, name, help string, labels ...string) *prometheus.CounterVec {
		return prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: ns, Subsystem: subsystem, Name: name, Help: help}, labels)
	}
	gauge := func(subsystem, name, help string, labels ...string) *prometheus.GaugeVec {
		return prometheus.NewGaugeVec(prometheus.GaugeOpts{Namespace: ns, Subsystem: subsystem, Name: name, Help: help}, labels)
	}
	histogram := func(subsystem, name, help string, buckets []float64, labels ...string) *prometheus.HistogramVec {
		return prometheus.NewHistogramVec(prometheus.HistogramOpts{Namespace: ns, Subsystem: subsystem, Name: name, Help: help,
			Buckets: append([]float64(nil), buckets...)}, labels)
	}
	m := &Metrics{
		inboxMessages: counter("inbox", "messages_total",
			"Deliveries through the inbox, by outcome.", "consumer", "topic", "outcome"),
		inboxHandler: histogram("inbox", "handler_duration_seconds",
			"How long the handler ran, for deliveries through the inbox that ran it.", cfg.HandlerBuckets, "consumer", "topic"),
		inboxStore: histogram("inbox", "store_duration_seconds",
			"Time a delivery through the inbox spent outside the handler: the store's statements and, for in_flight, the wait for the other delivery.", cfg.StoreBuckets, "consumer", "topic"),
		dlqMessages: counter("dlq", "messages_total",
			"Messages dead-lettered, by reason, once the dead-letter publish succeeded.", "consumer", "topic", "reason"),
		retriesParked: counter("retries", "parked_total",
			`Messages parked for a delayed retry, by kind: "failed" (its attempt failed) or "behind" (it waits behind a parked message of its ordering key).`, "consumer", "topic", "kind"),
		bloomChecks: counter("bloom", "checks_total",
			`Messages through the Bloom prefilter, by result: "surely_new" (pre-check skipped) or "maybe" (store asked).`, "consumer", "topic", "result"),
		bloomFalse: counter("bloom", "false_positives_total",
			"Bloom prefilter answers of maybe whose key the store found new.", "consumer", "topic"),
		outboxBatches: counter("outbox", "batches_total",
			`Outbox relay batches that took rows or failed, by result: "ok" or "error".`, "outbox", "result"),
		outboxPublished: counter("outbox", "published_total",
			"Outbox rows the relay published and deleted.", "outbox"),
		outboxDuration: histogram("outbox", "batch_duration_seconds",
			"How long an outbox relay batch took, publish included.", cfg.BatchBuckets, "outbox"),
		outboxLag: gauge("outbox", "lag_rows",
			"Outbox rows pending, as last measured by the relay.", "outbox"),
		outboxWaiting: gauge("outbox", "waiting_rows",
			"Pending outbox rows that wait on an open transaction, as last measured by the relay.", "outbox"),
		outboxOldest: gauge("outbox", "oldest_age_seconds",
			"Age of the oldest pending outbox row, as last measured by the relay.", "outbox"),
		outboxScheduled: gauge("outbox", "scheduled_rows",
			"Outbox rows written with a due time still ahead, as last measured by the relay.", "outbox"),
	}
	collectors := []struct {
		name string
		c    prometheus.Collector
	}{
		{"inbox_messages_total", m.inboxMessages},
		{"inbox_handler_duration_seconds", m.inboxHandler},
		{"inbox_store_duration_seconds", m.inboxStore},
		{"dlq_messages_total", m.dlqMessages},
		{"retries_parked_total", m.retriesParked},
		{"bloom_checks_total", m.bloomChecks},
		{"bloom_false_positives_total", m.bloomFalse},
		{"outbox_batches_total", m.outboxBatches},
		{"outbox_published_total", m.outboxPublished},
		{"outbox_batch_duration_seconds", m.outboxDuration},
		{"outbox_lag_rows", m.outboxLag},
		{"outbox_waiting_rows", m.outboxWaiting},
		{"outbox_oldest_age_seconds", m.outboxOldest},
		{"outbox_scheduled_rows", m.outboxScheduled},
	}
	for i, c := range collectors {
		if err := cfg.Registerer.Register(c.c); err != nil {
			for _, done := range collectors[:i] {
				cfg.Registerer.Unregister(done.c)
			}
			return nil, fmt.Errorf("prom: register %s_%s (one Metrics serves every component: pass the same one to each, "+
				"or give another a Config.Namespace of its own): %w", ns, c.name, err)
		}
	}
	return m, nil
}

// outcomes are the inbox outcomes whose series are created at zero with
// the first delivery of a consumer and topic.
func outcomes() []observe.Outcome {
	return []observe.Outcome{
		observe.Applied, observe.Duplicate, observe.InFlight, observe.Failed, observe.Panicked,
		observe.Dead, observe.CrashLoop, observe.Abandoned, observe.Unavailable, observe.Rejected,
		observe.OtherConsumer,
	}
}

// reasons are the dead-letter reasons whose series are created at zero
// with the first dead letter of a consumer and topic.
func reasons() []observe.Reason {
	return []observe.Reason{
		observe.ReasonError, observe.ReasonPanic, observe.ReasonDeadline,
		observe.ReasonCrashLoop, observe.ReasonPermanent, observe.ReasonUndecodable,
	}
}

// OnInboxAttempt counts the delivery in oncemill_inbox_messages_total and
// observes its handler time (when the handler ran) and its store time
// (when it spent any, which a rejected message does not).
func (m *Metrics) OnInboxAttempt(_ context.Context, a observe.InboxAttempt) {
	k := inboxKey{consumer: a.Consumer, topic: a.Topic, outcome: a.Outcome}
	s, ok := m.inbox.load(k)
	if !ok {
		s = m.inbox.add(k, m.resolveInbox)
	}
	s.messages.Inc()
	if a.Handler > 0 {
		s.handler.Observe(a.Handler.Seconds())
	}
	if a.Store > 0 {
		s.store.Observe(a.Store.Seconds())
	}
}

// resolveInbox creates the series of k's consumer and topic, for k's
// outcome and every known one.
func (m *Metrics) resolveInbox(k inboxKey, set func(inboxKey, inboxSeries)) {
	consumer, topic := label(k.consumer), label(k.topic)
	handler := m.inboxHandler.WithLabelValues(consumer, topic)
	store := m.inboxStore.WithLabelValues(consumer, topic)
	for _, o := range append(outcomes(), k.outcome) {
		set(inboxKey{consumer: k.consumer, topic: k.topic, outcome: o}, inboxSeries{
			messages: m.inboxMessages.WithLabelValues(consumer, topic, label(string(o))),
			handler:  handler,
			store:    store,
		})
	}
}

// OnDeadLetter counts the message in oncemill_dlq_messages_total.
func (m *Metrics) OnDeadLetter(_ context.Context, d observe.DeadLetter) {
	k := deadKey{consumer: d.Consumer, topic: d.Topic, reason: d.Reason}
	c, ok := m.dead.load(k)
	if !ok {
		c = m.dead.add(k, m.resolveDead)
	}
	c.Inc()
}

// OnRetry counts the message in oncemill_retries_parked_total.
func (m *Metrics) OnRetry(_ context.Context, r observe.Retry) {
	k := retryKey{consumer: r.Consumer, topic: r.Topic, behind: r.Behind}
	c, ok := m.retries.load(k)
	if !ok {
		c = m.retries.add(k, m.resolveRetry)
	}
	c.Inc()
}

func (m *Metrics) resolveRetry(k retryKey, set func(retryKey, prometheus.Counter)) {
	consumer, topic := label(k.consumer), label(k.topic)
	set(retryKey{consumer: k.consumer, topic: k.topic}, m.retriesParked.WithLabelValues(consumer, topic, "failed"))
	set(retryKey{consumer: k.consumer, topic: k.topic, behind: true}, m.retriesParked.WithLabelValues(consumer, topic, "behind"))
}

func (m *Metrics) resolveDead(k deadKey, set func(deadKey, prometheus.Counter)) {
	consumer, topic := label(k.consumer), label(k.topic)
	for _, r := range append(reasons(), k.reason) {
		set(deadKey{consumer: k.consumer, topic: k.topic, reason: r}, m.dlqMessages.WithLabelValues(consumer, topic, label(string(r))))
	}
}

// OnBloomCheck counts the message in oncemill_bloom_checks_total under
// its result, and in oncemill_bloom_false_positives_total when the filter
// was wrong.
func (m *Metrics) OnBloomCheck(_ context.Context, c observe.BloomCheck) {
	k := pairKey{consumer: c.Consumer, topic: c.Topic}
	s, ok := m.bloom.load(k)
	if !ok {
		s = m.bloom.add(k, m.resolveBloom)
	}
	if c.SurelyNew {
		s.surelyNew.Inc()
	} else {
		s.maybe.Inc()
	}
	if c.FalsePositive {
		s.falsePositives.Inc()
	}
}

func (m *Metrics) resolveBloom(k pairKey, set func(pairKey, bloomSeries)) {
	consumer, topic := label(k.consumer), label(k.topic)
	set(k, bloomSeries{
		surelyNew:      m.bloomChecks.WithLabelValues(consumer, topic, ResultSurelyNew),
		maybe:          m.bloomChecks.WithLabelValues(consumer, topic, ResultMaybe),
		falsePositives: m.bloomFalse.WithLabelValues(consumer, topic),
	})
}

// OnRelayBatch counts the batch in oncemill_outbox_batches_total under
// "ok" or "error", adds its rows to oncemill_outbox_published_total and
// observes its duration.
func (m *Metrics) OnRelayBatch(_ context.Context, b observe.RelayBatch) {
	s, ok := m.relay.load(b.Outbox)
	if !ok {
		s = m.relay.add(b.Outbox, m.resolveRelay)
	}
	if b.Err != nil {
		s.failed.Inc()
	} else {
		s.ok.Inc()
	}
	if b.Rows > 0 {
		s.published.Add(float64(b.Rows))
	}
	s.duration.Observe(b.Duration.Seconds())
}

func (m *Metrics) resolveRelay(key string, set func(string, relaySeries)) {
	outbox := label(key)
	set(key, relaySeries{
		ok:        m.outboxBatches.WithLabelValues(outbox, ResultOK),
		failed:    m.outboxBatches.WithLabelValues(outbox, ResultError),
		published: m.outboxPublished.WithLabelValues(outbox),
		duration:  m.outboxDuration.WithLabelValues(outbox),
	})
}

// OnOutboxLag sets oncemill_outbox_lag_rows, oncemill_outbox_waiting_rows,
// oncemill_outbox_oldest_age_seconds and oncemill_outbox_scheduled_rows.
func (m *Metrics) OnOutboxLag(_ context.Context, l observe.OutboxLag) {
	s, ok := m.lag.load(l.Outbox)
	if !ok {
		s = m.lag.add(l.Outbox, m.resolveLag)
	}
	s.pending.Set(float64(l.Pending))
	s.waiting.Set(float64(l.Waiting))
	s.oldest.Set(l.OldestAge.Seconds())
	s.scheduled.Set(float64(l.Scheduled))
}

func (m *Metrics) resolveLag(key string, set func(string, lagSeries)) {
	outbox := label(key)
	set(key, lagSeries{
		pending:   m.outboxLag.WithLabelValues(outbox),
		waiting:   m.outboxWaiting.WithLabelValues(outbox),
		oldest:    m.outboxOldest.WithLabelValues(outbox),
		scheduled: m.outboxScheduled.WithLabelValues(outbox),
	})
}

// label makes s a valid label value: client_golang panics on invalid
// UTF-8, which a hook must never do on the message's path.
func label(s string) string { return strings.ToValidUTF8(s, "\uFFFD") }
