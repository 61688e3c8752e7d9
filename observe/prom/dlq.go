package prom

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/oncemill/oncemill/dlq"
)

// DefaultDLQTimeout is [DLQCollectorConfig.Timeout] when it is zero.
const DefaultDLQTimeout = 5 * time.Second

// DLQCollectorConfig configures a [DLQCollector].
type DLQCollectorConfig struct {
	// Namespace is the first part of the metric names; keep it the same
	// as the hooks' [Config.Namespace]. Defaults to [DefaultNamespace],
	// "oncemill".
	Namespace string
	// Timeout bounds the query a scrape runs. Keep it below Prometheus'
	// scrape_timeout (10 s by default), so that a slow database costs
	// these series and not the whole scrape. Defaults to
	// [DefaultDLQTimeout], 5 seconds.
	Timeout time.Duration
	// Logger receives a line for every scrape whose query failed.
	// Defaults to watermill.NopLogger.
	Logger watermill.LoggerAdapter
}

func (c *DLQCollectorConfig) setDefaults() {
	if c.Namespace == "" {
		c.Namespace = DefaultNamespace
	}
	if c.Timeout == 0 {
		c.Timeout = DefaultDLQTimeout
	}
	if c.Logger == nil {
		c.Logger = watermill.NopLogger{}
	}
}

// Validate reports the first field that is out of range; the error names
// it. Empty fields that have a default are valid.
func (c DLQCollectorConfig) Validate() error {
	c.setDefaults()
	if err := validateNamespace("DLQCollectorConfig", c.Namespace); err != nil {
		return err
	}
	if c.Timeout < 0 {
		return fmt.Errorf("prom: DLQCollectorConfig.Timeout must not be negative, got %s", c.Timeout)
	}
	return nil
}

// DLQCollector is a prometheus.Collector over the dead-letter table. At
// every scrape it reads the number of entries per consumer and original
// topic ([dlq.Store.Counts]) and exports:
//
//   - oncemill_dlq_entries{consumer,topic}: entries in the table;
//   - oncemill_dlq_oldest_age_seconds{consumer,topic}: age of the oldest
//     of them;
//   - oncemill_dlq_scrape_errors_total: scrapes whose read failed or timed
//     out.
//
// A pair with no entry left (replayed or purged) has no series. A read
// that fails exports neither gauge for that scrape, counts the error and
// logs it; the other collectors of the registry are scraped as usual, so
// alert on increase(oncemill_dlq_scrape_errors_total[10m]) > 0 beside
// oncemill_dlq_entries > 0. Every scrape runs one aggregate query on the
// table; it starts no goroutines.
type DLQCollector struct {
	store   *dlq.Store
	timeout time.Duration
	logger  watermill.LoggerAdapter
	entries *prometheus.Desc
	oldest  *prometheus.Desc
	errors  prometheus.Counter
}

var _ prometheus.Collector = (*DLQCollector)(nil)

// NewDLQCollector returns a collector over the table store reads. Register
// it on the registry the hooks' metrics are on.
func NewDLQCollector(store *dlq.Store, cfg DLQCollectorConfig) (*DLQCollector, error) {
	if store == nil {
		return nil, errors.New("prom: NewDLQCollector: store is nil")
	}
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	labels := []string{"consumer", "topic"}
	return &DLQCollector{
		store:   store,
		timeout: cfg.Timeout,
		logger:  cfg.Logger,
		entries: prometheus.NewDesc(prometheus.BuildFQName(cfg.Namespace, "dlq", "entries"),
			"Entries in the dead-letter table, read at scrape time.", labels, nil),
		oldest: prometheus.NewDesc(prometheus.BuildFQName(cfg.Namespace, "dlq", "oldest_age_seconds"),
			"Age of the oldest entry in the dead-letter table, read at scrape time.", labels, nil),
		errors: prometheus.NewCounter(prometheus.CounterOpts{Namespace: cfg.Namespace, Subsystem: "dlq", Name: "scrape_errors_total",
			Help: "Scrapes whose read of the dead-letter table failed or timed out."}),
	}, nil
}

// Describe sends the descriptors of the collector's metrics.
func (c *DLQCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- c.entries
	ch <- c.oldest
	c.errors.Describe(ch)
}

// Collect reads the table, within the configured timeout, and sends its
// counts and the error counter.
func (c *DLQCollector) Collect(ch chan<- prometheus.Metric) {
	defer c.errors.Collect(ch)
	ctx, cancel := context.WithTimeout(context.Background(), c.timeout)
	defer cancel()
	counts, err := c.store.Counts(ctx)
	if err != nil {
		c.fail(err)
		return
	}
	now := time.Now()
	for _, n := range counts {
		// MustNewConstMetric cannot panic here: two label values for two
		// labels, made valid UTF-8.
		consumer, topic := label(n.Consumer), label(n.Topic)
		ch <- prometheus.MustNewConstMetric(c.entries, prometheus.GaugeValue, float64(n.Entries), consumer, topic)
		ch <- prometheus.MustNewConstMetric(c.oldest, prometheus.GaugeValue, max(now.Sub(n.Oldest), 0).Seconds(), consumer, topic)
	}
}

func (c *DLQCollector) fail(err error) {
	c.errors.Inc()
	c.logger.Error("Cannot read the dead-letter table for metrics", err, watermill.LogFields{"timeout": c.timeout.String()})
}
