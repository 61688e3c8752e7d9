package prom

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/oncemill/oncemill/retry"
)

// DefaultRetryTimeout is [RetryCollectorConfig.Timeout] when it is zero.
const DefaultRetryTimeout = 5 * time.Second

// RetryCollectorConfig configures a [RetryCollector].
type RetryCollectorConfig struct {
	// Namespace is the first part of the metric names; keep it the same
	// as the hooks' [Config.Namespace]. Defaults to [DefaultNamespace],
	// "oncemill".
	Namespace string
	// Timeout bounds the query a scrape runs. Keep it below Prometheus'
	// scrape_timeout (10 s by default), so that a slow database costs
	// these series and not the whole scrape. Defaults to
	// [DefaultRetryTimeout], 5 seconds.
	Timeout time.Duration
	// Overdue is how long after its due time a message that was not
	// handed back counts as overdue. Keep it above the retry subscribers'
	// PollInterval (1 s by default), with room for a backlog. Defaults to
	// [retry.DefaultOverdue], 1 minute.
	Overdue time.Duration
	// Logger receives a line for every scrape whose query failed.
	// Defaults to watermill.NopLogger.
	Logger watermill.LoggerAdapter
}

func (c *RetryCollectorConfig) setDefaults() {
	if c.Namespace == "" {
		c.Namespace = DefaultNamespace
	}
	if c.Timeout == 0 {
		c.Timeout = DefaultRetryTimeout
	}
	if c.Overdue == 0 {
		c.Overdue = retry.DefaultOverdue
	}
	if c.Logger == nil {
		c.Logger = watermill.NopLogger{}
	}
}

// Validate reports the first field that is out of range; the error names
// it. Empty fields that have a default are valid.
func (c RetryCollectorConfig) Validate() error {
	c.setDefaults()
	if err := validateNamespace("RetryCollectorConfig", c.Namespace); err != nil {
		return err
	}
	if c.Timeout < 0 {
		return fmt.Errorf("prom: RetryCollectorConfig.Timeout must not be negative, got %s", c.Timeout)
	}
	if c.Overdue < 0 {
		return fmt.Errorf("prom: RetryCollectorConfig.Overdue must not be negative, got %s", c.Overdue)
	}
	return nil
}

// RetryCollector is a prometheus.Collector over the table of parked
// messages (package retry). At every scrape it reads what waits per
// consumer and topic ([retry.Store.Counts]) and exports:
//
//   - oncemill_retries_parked{consumer,topic}: messages parked for a
//     delayed retry, or behind one of their ordering key;
//   - oncemill_retries_due{consumer,topic}: those that may go out now
//     (due, first of their ordering key, not out to their consumer);
//   - oncemill_retries_overdue{consumer,topic}: those of due whose due
//     time passed more than Overdue ago: no retry subscriber of the
//     consumer and topic hands them back (retry.Merge left out, or the
//     consumer down), or it is far behind;
//   - oncemill_retries_scrape_errors_total: scrapes whose read failed or
//     timed out.
//
// A pair with nothing parked has no series. Alert on
// oncemill_retries_overdue > 0; a read that fails exports none of the
// gauges for that scrape, counts the error and logs it, and the other
// collectors of the registry are scraped as usual. Every scrape runs one
// aggregate query on the table; it starts no goroutines.
type RetryCollector struct {
	store   *retry.Store
	timeout time.Duration
	overdue time.Duration
	logger  watermill.LoggerAdapter
	parked  *prometheus.Desc
	due     *prometheus.Desc
	late    *prometheus.Desc
	errors  prometheus.Counter
}

var _ prometheus.Collector = (*RetryCollector)(nil)

// NewRetryCollector returns a collector over the table store reads.
// Register it on the registry the hooks' metrics are on.
func NewRetryCollector(store *retry.Store, cfg RetryCollectorConfig) (*RetryCollector, error) {
	if store == nil {
		return nil, errors.New("prom: NewRetryCollector: store is nil")
	}
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	labels := []string{"consumer", "topic"}
	return &RetryCollector{
		store:   store,
		timeout: cfg.Timeout,
		overdue: cfg.Overdue,
		logger:  cfg.Logger,
		parked: prometheus.NewDesc(prometheus.BuildFQName(cfg.Namespace, "retries", "parked"),
			"Messages parked for a delayed retry, read at scrape time.", labels, nil),
		due: prometheus.NewDesc(prometheus.BuildFQName(cfg.Namespace, "retries", "due"),
			"Parked messages that may go out now and wait for their retry subscriber, read at scrape time.", labels, nil),
		late: prometheus.NewDesc(prometheus.BuildFQName(cfg.Namespace, "retries", "overdue"),
			fmt.Sprintf("Parked messages due more than %s ago and not handed back: no retry subscriber runs for the consumer and topic, read at scrape time.", cfg.Overdue),
			labels, nil),
		errors: prometheus.NewCounter(prometheus.CounterOpts{Namespace: cfg.Namespace, Subsystem: "retries", Name: "scrape_errors_total",
			Help: "Scrapes whose read of the table of parked messages failed or timed out."}),
	}, nil
}

// Describe sends the descriptors of the collector's metrics.
func (c *RetryCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- c.parked
	ch <- c.due
	ch <- c.late
	c.errors.Describe(ch)
}

// Collect reads the table, within the configured timeout, and sends its
// counts and the error counter.
func (c *RetryCollector) Collect(ch chan<- prometheus.Metric) {
	defer c.errors.Collect(ch)
	ctx, cancel := context.WithTimeout(context.Background(), c.timeout)
	defer cancel()
	counts, err := c.store.Counts(ctx, c.overdue)
	if err != nil {
		c.errors.Inc()
		c.logger.Error("Cannot read the table of parked messages for metrics", err, watermill.LogFields{"timeout": c.timeout.String()})
		return
	}
	for _, n := range counts {
		// MustNewConstMetric cannot panic here: two label values for two
		// labels, made valid UTF-8.
		consumer, topic := label(n.Consumer), label(n.Topic)
		ch <- prometheus.MustNewConstMetric(c.parked, prometheus.GaugeValue, float64(n.Parked), consumer, topic)
		ch <- prometheus.MustNewConstMetric(c.due, prometheus.GaugeValue, float64(n.Due), consumer, topic)
		ch <- prometheus.MustNewConstMetric(c.late, prometheus.GaugeValue, float64(n.Overdue), consumer, topic)
	}
}
