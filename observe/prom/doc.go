// Package prom exports what oncemill's parts report through package
// observe as Prometheus metrics.
//
// # Hooks
//
// [New] registers the metrics on a prometheus.Registerer and returns a
// [*Metrics], which is a hook: it implements [observe.InboxHook],
// [observe.DeadLetterHook], [observe.BloomHook], [observe.RelayHook] and
// [observe.OutboxLagHook]. Give the same value to every component, in its
// config's Hooks list:
//
//	reg := prometheus.NewRegistry()
//	metrics, err := prom.New(prom.Config{Registerer: reg})
//	...
//	inbox, err := middleware.NewInbox(middleware.InboxConfig{TxStore: store, Hooks: []observe.Hook{metrics}})
//	poison, err := middleware.NewPoison(middleware.PoisonConfig{..., Hooks: []observe.Hook{metrics}})
//	relay, err := forwarder.NewRelay(forwarder.RelayConfig{..., Hooks: []observe.Hook{metrics}})
//	http.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
//
// One Metrics serves any number of consumers, topics and outboxes: they
// are labels. A second Metrics on the same registerer needs a
// [Config.Namespace] of its own, or [New] fails naming the clash.
//
// # Metrics
//
// With the default namespace "oncemill":
//
//   - oncemill_inbox_messages_total{consumer,topic,outcome}: deliveries
//     through the inbox, by [observe.Outcome].
//   - oncemill_inbox_handler_duration_seconds{consumer,topic}: how long the
//     handler ran, for deliveries that ran it.
//   - oncemill_inbox_store_duration_seconds{consumer,topic}: time spent in
//     the inbox outside the handler (the store's statements and, for
//     in_flight, the wait for the other delivery), for deliveries that
//     spent any.
//   - oncemill_dlq_messages_total{consumer,topic,reason}: messages
//     dead-lettered, by [observe.Reason].
//   - oncemill_bloom_checks_total{consumer,topic,result}: messages through
//     the Bloom prefilter, result "surely_new" or "maybe".
//   - oncemill_bloom_false_positives_total{consumer,topic}: "maybe" answers
//     whose key the store then found new.
//   - oncemill_outbox_batches_total{outbox,result}: relay batches that took
//     rows or failed, result "ok" or "error".
//   - oncemill_outbox_published_total{outbox}: rows the relay published.
//   - oncemill_outbox_batch_duration_seconds{outbox}: how long a batch took,
//     publish included.
//   - oncemill_outbox_lag_rows{outbox}, oncemill_outbox_waiting_rows{outbox},
//     oncemill_outbox_oldest_age_seconds{outbox}: the relay's backlog, as
//     last measured.
//
// Labels come from the events and have bounded cardinality: consumer and
// topic names, outcomes, reasons, outbox tables (as schema.table, unquoted:
// outbox="oncemill.outbox"); never keys or UUIDs. A
// series is created the first time its consumer and topic (or outbox) is
// seen, together with its siblings at zero (every known outcome, every
// reason, both Bloom results, both batch results), so that rate() and
// alerts see a zero before the first event instead of no series.
//
// The metrics do not clash with Watermill's own components/metrics, even
// under the same namespace: both can be registered on one registry.
//
// # Dead-letter table
//
// [NewDLQCollector] returns a prometheus.Collector that reads the
// dead-letter table at scrape time ([dlq.Store.Counts], bounded by
// [DLQCollectorConfig.Timeout]) and exports
// oncemill_dlq_entries{consumer,topic} and
// oncemill_dlq_oldest_age_seconds{consumer,topic}. A read that fails or
// times out exports neither, counts oncemill_dlq_scrape_errors_total and
// leaves the rest of the scrape intact. Register it next to the hooks'
// metrics:
//
//	collector, err := prom.NewDLQCollector(store, prom.DLQCollectorConfig{})
//	...
//	reg.MustRegister(collector)
//
// # Parked messages
//
// [NewRetryCollector] does the same for the table of parked messages,
// where the poison middleware parks a message for a delayed retry
// ([retry.Store.Counts], bounded by [RetryCollectorConfig.Timeout]):
// oncemill_retries_parked{consumer,topic}, oncemill_retries_due and
// oncemill_retries_overdue, the messages due more than
// [RetryCollectorConfig.Overdue] ago (a minute by default) that no retry
// subscriber took. Alert on oncemill_retries_overdue > 0: the consumer's
// retry subscriber does not run. A failed read counts
// oncemill_retries_scrape_errors_total.
//
//	collector, err := prom.NewRetryCollector(retries, prom.RetryCollectorConfig{})
//
// # Consumer backlog
//
// [NewBacklogCollector] returns a prometheus.Collector that asks the
// brokers at scrape time what they still hold for each consumer it is
// given (an [adapters.Backlogger]: the subscribers of adapters/kafka,
// adapters/amqp, adapters/nats and adapters/sqs, or an
// [*adapters.PubSub]), each read bounded by
// [BacklogCollectorConfig.Timeout], and exports
// oncemill_consumer_backlog_messages{consumer,topic},
// oncemill_consumer_partition_lag{consumer,topic,partition} for Kafka,
// and oncemill_consumer_backlog_scrape_errors_total{consumer,topic}:
//
//	collector, err := prom.NewBacklogCollector(prom.BacklogCollectorConfig{},
//		prom.BacklogSource{Consumer: "charge", Topic: "orders", Backlogger: ps})
//	...
//	reg.MustRegister(collector)
//
// # Cost
//
// Hooks run on the message's path. The series of a consumer and topic (or
// outbox) are resolved once, on first sight, and kept in a copy-on-write
// map keyed by the label values: after that an event is one lock-free map
// look-up and the counter and histogram updates, without allocating.
package prom
