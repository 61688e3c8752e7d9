package prom

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/oncemill/oncemill/adapters"
)

// DefaultBacklogTimeout is [BacklogCollectorConfig.Timeout] when it is
// zero.
const DefaultBacklogTimeout = 5 * time.Second

// BacklogSource is one consumer of one topic whose backlog a
// [BacklogCollector] exports.
type BacklogSource struct {
	// Consumer is the consumer label: the name the inbox and the
	// dead-letter metrics use for this consumer (InboxConfig.Consumer).
	// Required.
	Consumer string
	// Topic is the topic the consumer subscribes to. Required.
	Topic string
	// Backlogger asks the broker: the consumer's subscriber (those of
	// adapters/kafka, adapters/amqp, adapters/nats and adapters/sqs are
	// Backloggers) or the *adapters.PubSub it belongs to. It must return
	// when its context ends, as those do. Required.
	Backlogger adapters.Backlogger
}

// BacklogCollectorConfig configures a [BacklogCollector].
type BacklogCollectorConfig struct {
	// Namespace is the first part of the metric names; keep it the same
	// as the hooks' [Config.Namespace]. Defaults to [DefaultNamespace],
	// "oncemill".
	Namespace string
	// Timeout bounds the reads of one scrape, which run concurrently, one
	// per source. Keep it below Prometheus' scrape_timeout (10 s by
	// default), so that a broker that does not answer costs its series
	// and not the whole scrape. Defaults to [DefaultBacklogTimeout], 5
	// seconds.
	Timeout time.Duration
	// OmitPartitions leaves out oncemill_consumer_partition_lag, for
	// Kafka topics with so many partitions that a series each costs more
	// than it tells. Defaults to false: a series per partition.
	OmitPartitions bool
	// Logger receives a line for every read that fails, but only the
	// first for a source that cannot tell its backlog
	// (adapters.ErrNoBacklog), which will not change. Defaults to
	// watermill.NopLogger.
	Logger watermill.LoggerAdapter
}

func (c *BacklogCollectorConfig) setDefaults() {
	if c.Namespace == "" {
		c.Namespace = DefaultNamespace
	}
	if c.Timeout == 0 {
		c.Timeout = DefaultBacklogTimeout
	}
	if c.Logger == nil {
		c.Logger = watermill.NopLogger{}
	}
}

// Validate reports the first field that is out of range; the error names
// it. Empty fields that have a default are valid.
func (c BacklogCollectorConfig) Validate() error {
	c.setDefaults()
	if err := validateNamespace("BacklogCollectorConfig", c.Namespace); err != nil {
		return err
	}
	if c.Timeout < 0 {
		return fmt.Errorf("prom: BacklogCollectorConfig.Timeout must not be negative, got %s", c.Timeout)
	}
	return nil
}

// BacklogCollector is a prometheus.Collector of what the brokers still
// hold for consumers (see adapters.Backlog). At every scrape it asks the
// broker of each of its sources, concurrently and within the configured
// timeout, and exports:
//
//   - oncemill_consumer_backlog_messages{consumer,topic}: the messages the
//     broker holds for the consumer, not yet acknowledged (Kafka: the
//     group's lag; RabbitMQ: the queue's ready messages; NATS: the durable
//     consumer's pending and ack-pending messages; SQS: the queue's
//     visible, in-flight and delayed messages);
//   - oncemill_consumer_partition_lag{consumer,topic,partition}: for
//     Kafka, each partition's high watermark minus the group's committed
//     offset;
//   - oncemill_consumer_backlog_scrape_errors_total{consumer,topic}:
//     reads that failed or timed out.
//
// The brokers are asked at scrape time rather than by a poller: the
// figures are as fresh as the scrape, nothing runs while nobody scrapes,
// and there is no goroutine to stop. A read costs the broker a request or
// a few (Kafka: metadata, the group's offsets, the partitions' offsets
// from each leader).
//
// A read that fails exports neither gauge of its source for that scrape,
// counts the error and logs it; the other sources and the other
// collectors of the registry are scraped as usual, so alert on
// increase(oncemill_consumer_backlog_scrape_errors_total[10m]) > 0 beside
// the backlog itself. The series are bounded by the sources given to
// [NewBacklogCollector] and, for Kafka, their topics' partitions.
type BacklogCollector struct {
	sources   []backlogSource
	timeout   time.Duration
	omit      bool
	logger    watermill.LoggerAdapter
	messages  *prometheus.Desc
	partition *prometheus.Desc
	errors    *prometheus.CounterVec
}

type backlogSource struct {
	BacklogSource
	errors prometheus.Counter
	// toldNoBacklog is set once ErrNoBacklog has been logged.
	toldNoBacklog atomic.Bool
}

var _ prometheus.Collector = (*BacklogCollector)(nil)

// NewBacklogCollector returns a collector of the backlogs of sources, one
// consumer and topic each, which must not repeat. Register it on the
// registry the hooks' metrics are on. It starts no goroutine of its own;
// each scrape starts one per source and waits for them.
func NewBacklogCollector(cfg BacklogCollectorConfig, sources ...BacklogSource) (*BacklogCollector, error) {
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if len(sources) == 0 {
		return nil, errors.New("prom: NewBacklogCollector: no source given: pass a BacklogSource per consumer and topic")
	}
	labels := []string{"consumer", "topic"}
	c := &BacklogCollector{
		timeout: cfg.Timeout,
		omit:    cfg.OmitPartitions,
		logger:  cfg.Logger,
		messages: prometheus.NewDesc(prometheus.BuildFQName(cfg.Namespace, "consumer", "backlog_messages"),
			"Messages the broker holds for the consumer, not yet acknowledged, read at scrape time.", labels, nil),
		partition: prometheus.NewDesc(prometheus.BuildFQName(cfg.Namespace, "consumer", "partition_lag"),
			"Kafka: records from the consumer group's committed offset to the partition's high watermark, read at scrape time.",
			append(labels, "partition"), nil),
		errors: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: cfg.Namespace, Subsystem: "consumer", Name: "backlog_scrape_errors_total",
			Help: "Scrapes whose read of the consumer's backlog failed or timed out."}, labels),
	}
	seen := map[[2]string]bool{}
	for i, s := range sources {
		switch {
		case s.Consumer == "":
			return nil, fmt.Errorf("prom: NewBacklogCollector: sources[%d].Consumer is empty", i)
		case s.Topic == "":
			return nil, fmt.Errorf("prom: NewBacklogCollector: sources[%d].Topic is empty", i)
		case s.Backlogger == nil:
			return nil, fmt.Errorf("prom: NewBacklogCollector: sources[%d].Backlogger is nil: pass the consumer's subscriber or *adapters.PubSub", i)
		}
		k := [2]string{label(s.Consumer), label(s.Topic)}
		if seen[k] {
			return nil, fmt.Errorf("prom: NewBacklogCollector: sources[%d] repeats consumer %q and topic %q", i, s.Consumer, s.Topic)
		}
		seen[k] = true
	}
	c.sources = make([]backlogSource, len(sources))
	for i, s := range sources {
		c.sources[i].BacklogSource = s
		// Created at zero, so that increase() sees the first error.
		c.sources[i].errors = c.errors.WithLabelValues(label(s.Consumer), label(s.Topic))
	}
	return c, nil
}

// Describe sends the descriptors of the collector's metrics.
func (c *BacklogCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- c.messages
	if !c.omit {
		ch <- c.partition
	}
	c.errors.Describe(ch)
}

// Collect reads every source's backlog, concurrently and within the
// configured timeout, and sends the gauges of those it read and the
// error counters.
func (c *BacklogCollector) Collect(ch chan<- prometheus.Metric) {
	ctx, cancel := context.WithTimeout(context.Background(), c.timeout)
	defer cancel()
	var wg sync.WaitGroup
	for i := range c.sources {
		wg.Add(1)
		go func() {
			defer wg.Done()
			c.collect(ctx, &c.sources[i], ch)
		}()
	}
	wg.Wait()
	c.errors.Collect(ch)
}

func (c *BacklogCollector) collect(ctx context.Context, s *backlogSource, ch chan<- prometheus.Metric) {
	b, err := s.Backlogger.Backlog(ctx, s.Topic)
	if err != nil {
		s.errors.Inc()
		if errors.Is(err, adapters.ErrNoBacklog) && s.toldNoBacklog.Swap(true) {
			return
		}
		c.logger.Error("Cannot read the consumer's backlog for metrics", err,
			watermill.LogFields{"consumer": s.Consumer, "topic": s.Topic, "timeout": c.timeout.String()})
		return
	}
	// MustNewConstMetric cannot panic here: the label values match the
	// descriptors' labels and are valid UTF-8.
	consumer, topic := label(s.Consumer), label(s.Topic)
	ch <- prometheus.MustNewConstMetric(c.messages, prometheus.GaugeValue, float64(b.Messages), consumer, topic)
	if c.omit {
		return
	}
	for _, p := range b.Partitions {
		ch <- prometheus.MustNewConstMetric(c.partition, prometheus.GaugeValue, float64(p.Lag),
			consumer, topic, strconv.FormatInt(int64(p.Partition), 10))
	}
}
