package main

import (
	"fmt"
	"strings"
	"time"

	"github.com/oncemill/oncemill/benchmarks/internal/mdsection"
)

const (
	// targetStock is how many times watermill-kafka's throughput the
	// key-parallel subscriber should reach at 1 partition.
	targetStock = 5.0
	// targetNoInbox is the share of the no-inbox baseline's throughput
	// the key-parallel subscriber with the inbox should keep.
	targetNoInbox = 0.8
	// targetBatchNoInbox is the share the batch handler should reach:
	// one INSERT per batch against one autocommit per message, it should
	// not be slower than no inbox at all.
	targetBatchNoInbox = 1.0
	sectionHead        = "## Kafka end to end"
	command            = "cd benchmarks && go run ./kafka"
)

// label is a subscriber's name in the table.
func label(sys string, cfg Config) string {
	switch sys {
	case sysStock:
		return "watermill-kafka `NewSubscriber` (stock)"
	case sysSerial:
		return "oncemill, `MaxInFlightPerPartition` 1"
	case sysParallel:
		return fmt.Sprintf("oncemill key-parallel (%d)", cfg.maxInFlight())
	case sysPipelined:
		return fmt.Sprintf("oncemill key-parallel (%d), `PipelineAlways`", cfg.maxInFlight())
	case sysBatched:
		return fmt.Sprintf("oncemill key-parallel (%d), `Batch` (%d)", cfg.maxInFlight(), batchConfig.MaxMessages)
	case sysBatchHandler:
		return fmt.Sprintf("oncemill key-parallel (%d), `Batch` (%d), `BatchHandler`", cfg.maxInFlight(), batchConfig.MaxMessages)
	case sysNoInbox:
		return fmt.Sprintf("oncemill key-parallel (%d), **no inbox**", cfg.maxInFlight())
	}
	return sys
}

func passMiss(ok bool) string {
	if ok {
		return "PASS"
	}
	return "MISS"
}

func fmtRatio(r float64) string {
	if r == 0 {
		return "—"
	}
	return fmt.Sprintf("%.2f×", r)
}

func fmtDur(d time.Duration) string {
	if d < time.Second {
		return fmt.Sprintf("%.0f ms", float64(d)/float64(time.Millisecond))
	}
	return fmt.Sprintf("%.2f s", d.Seconds())
}

// Markdown renders the results table and the targets.
func Markdown(res *Results, cfg Config) string {
	var b strings.Builder
	fmt.Fprintf(&b, "### Consumer throughput: Kafka → inbox → PostgreSQL\n\n")
	fmt.Fprintf(&b, "%d messages per run (%d payments, %d duplicates, %d orders as record keys), published beforehand; msgs/s from the router's start to the last message handled, median of %d; PostgreSQL pool of %d connections.\n\n",
		res.Stream.N, res.Stream.Keys, res.Stream.Dups, res.Stream.Orders, cfg.Reps, res.Conns)
	b.WriteString("| Subscriber | Partitions | Inbox | msgs/s (median) | min–max | × watermill-kafka | × no inbox | First message after | Deliveries / messages | Doubled | Lost | Order violations |\n")
	b.WriteString("|---|---:|---|---:|---|---:|---:|---:|---:|---:|---:|---:|\n")
	for _, r := range res.Rows {
		inbox := "dedup/postgres"
		if !usesInbox(r.System) {
			inbox = "none: ON CONFLICT DO NOTHING"
		}
		fmt.Fprintf(&b, "| %s | %d | %s | %.0f | %.0f–%.0f | %s | %s | %s | %d/%d | %d | %d | %d |\n",
			label(r.System, cfg), r.Partitions, inbox, r.MsgsPerSec, r.Min, r.Max,
			fmtRatio(r.RatioStock), fmtRatio(r.RatioNoInbox), fmtDur(r.FirstMsg),
			r.Deliveries, r.Reps*res.Stream.N, r.Doubled, r.Lost, r.OrderViolations)
	}
	targets(&b, res, cfg)
	return b.String()
}

// targets renders the targets with the figures they are checked against.
func targets(b *strings.Builder, res *Results, cfg Config) {
	b.WriteString("\nTargets:\n\n")
	if p, ok := findRow(res.Rows, sysParallel, 1); ok {
		if s, ok := findRow(res.Rows, sysStock, 1); ok {
			fmt.Fprintf(b, "- key-parallel ≥ %.0f× watermill-kafka at 1 partition: %.0f / %.0f msgs/s = %.2f× — **%s**\n",
				targetStock, p.MsgsPerSec, s.MsgsPerSec, p.RatioStock, passMiss(p.RatioStock >= targetStock))
		}
	}
	for _, sys := range []string{sysPipelined, sysBatched, sysBatchHandler} {
		if p, ok := findRow(res.Rows, sys, 1); ok {
			if s, ok := findRow(res.Rows, sysStock, 1); ok {
				fmt.Fprintf(b, "- %s ≥ %.0f× watermill-kafka at 1 partition: %.0f / %.0f msgs/s = %.2f× — **%s**\n",
					label(sys, cfg), targetStock, p.MsgsPerSec, s.MsgsPerSec, p.RatioStock, passMiss(p.RatioStock >= targetStock))
			}
		}
	}
	for _, parts := range cfg.Partitions {
		for _, sys := range []string{sysParallel, sysPipelined, sysBatched, sysBatchHandler} {
			p, ok1 := findRow(res.Rows, sys, parts)
			n, ok2 := findRow(res.Rows, sysNoInbox, parts)
			if ok1 && ok2 {
				target := targetNoInbox
				if sys == sysBatchHandler {
					target = targetBatchNoInbox
				}
				fmt.Fprintf(b, "- %s with the inbox ≥ %.1f× the same handler with no inbox, %d partition%s: %.0f / %.0f msgs/s = %.2f× — **%s**\n",
					label(sys, cfg), target, parts, plural(parts), p.MsgsPerSec, n.MsgsPerSec, p.RatioNoInbox, passMiss(p.RatioNoInbox >= target))
			}
		}
	}
	if failed := Failures(res, cfg); len(failed) == 0 {
		fmt.Fprintf(b, "- every run: 0 doubled, 0 lost, 0 order violations — **PASS** (%d runs)\n", len(res.Samples))
	} else {
		fmt.Fprintf(b, "- every run: 0 doubled, 0 lost, 0 order violations — **FAIL**: %s\n", strings.Join(failed, "; "))
	}
}

// Failures lists the rows whose effects were not exactly once and in
// order; empty when all were.
func Failures(res *Results, cfg Config) []string {
	var out []string
	for _, r := range res.Rows {
		if !r.ok() {
			out = append(out, fmt.Sprintf("%s, %d partition%s: %d doubled, %d lost, %d order violations over %d runs",
				chartName(r.System, cfg), r.Partitions, plural(r.Partitions), r.Doubled, r.Lost, r.OrderViolations, r.Reps))
		}
	}
	return out
}

// joinInts joins ns with sep.
func joinInts(ns []int, sep string) string {
	parts := make([]string, len(ns))
	for i, n := range ns {
		parts[i] = fmt.Sprint(n)
	}
	return strings.Join(parts, sep)
}

func plural(n int) string {
	if n == 1 {
		return ""
	}
	return "s"
}

// Section renders the README section: what is measured and how, the note
// (command, machine), the table, and the chart when chart is not empty.
func Section(note, table string, res *Results, cfg Config, chart string) string {
	var b strings.Builder
	b.WriteString(sectionHead + "\n\n")
	fmt.Fprintf(&b, `Consumes a Kafka topic with a Watermill router and applies every message exactly once
through the PostgreSQL inbox: Kafka (the embedded broker, `+"`adapters/kafka/embedded`"+`, in the
benchmark's process) → subscriber → router → `+"`middleware.NewInbox`"+` (`+"`TxStore`"+`: `+"`dedup/postgres`"+`,
defaults) → one INSERT into an effects table through `+"`postgres.Tx(ctx)`"+`, the inbox's
transaction. Source: [kafka](kafka/).

- **Stream**: %d payment events per run over %d orders, %.0f%% of them duplicates (%d): an earlier
  payment published again, a new message UUID, the same metadata and payload, drawn uniformly
  from the payments before it. JSON payload: payment id, order id, the order's sequence number
  (1, 2, … in publish order), amount. The idempotency key is the payment id (%d distinct); the
  partition key, and so the record key (the `+"`kafka.Marshaler`"+`), is the order id, so one order's
  payments are in one partition, in order. Seeded (seed %d): every run publishes the same stream.
- **Publishing**: before the consumer starts, with `+"`kafka.NewPublisher`"+` (idempotent producer,
  batches of %d) to a fresh topic of %s partitions; untimed.
- **Clock**: from the router's `+"`Run`"+` (which subscribes: a fresh consumer group joins, reads from
  the oldest offset) until every one of the N messages has been handled — the handler chain,
  inbox included, returned without error: its effect committed or its duplicate dropped.
  msgs/s = N over that time, including the group join ("first message after").
- **Subscribers**: watermill-kafka's `+"`NewSubscriber`"+` with `+"`DefaultSaramaSubscriberConfig()`"+` (Sarama
  version 1.0, below the 2.4 that the embedded broker needs) and only
  `+"`Consumer.Offsets.Initial = OffsetOldest`"+`, `+"`kafka.Marshaler`"+` as unmarshaler; oncemill's
  `+"`kafka.NewSubscriber`"+` with `+"`MaxInFlightPerPartition`"+` 1 (watermill-kafka's loop, oncemill's config);
  oncemill's key-parallel subscriber (`+"`MaxInFlightPerPartition`"+` %d: different record keys of a
  partition concurrently, one key's messages in order). Consumer group, defaults otherwise.
- **Batch handler**: the key-parallel subscriber with the inbox's group commit (`+"`Batch`"+`, %d
  deliveries per transaction) and the handler made by `+"`middleware.BatchHandler`"+`: the batch's new
  payments, duplicates dropped, decoded as the per-message handler decodes each and written by one
  multi-row `+"`INSERT … SELECT * FROM unnest(…)`"+` in the batch's transaction; one payment per
  order in a batch, as the key-parallel subscriber hands out an order's next payment only after
  the previous one was acked.
- **No inbox**: the key-parallel subscriber with the same handler and no inbox; the effect is
  autocommitted on the pool (its own one-statement transaction) as
  `+"`INSERT … ON CONFLICT (idem_key) DO NOTHING`"+` on a unique index of the effects table, so it
  deduplicates by itself and must also show 0 doubled. The inbox rows' effects table has no unique
  index: a double effect there is a second row.
- **Pool**: one pgxpool of %d connections for every run, filled before the first: the messages
  in flight (%d per partition × partitions) capped at %d and at what PostgreSQL's
  max_connections leaves beside the connections others hold, less a margin of %d. The handler
  uses only the inbox's transaction, so a message waiting for a connection holds none.
- **Checks**, from the effects table after each run: payments with more than one effect row
  (doubled), payments of the stream with none (lost), and order violations — effect rows whose
  sequence number is lower than that of a row applied earlier for the same order, application
  order being the identity column (a key's next message is handed out only after the previous
  one was acked, after its commit). Any of them fails the run, loudly, and the command exits
  non-zero.
- **Repetitions**: %d per row; within a repetition the subscribers take turns, starting one later
  each repetition. Every run has its own schema (inbox and effects tables), topic and consumer
  group, dropped afterwards. The table shows the median msgs/s and the range; ratios are of
  medians at the same partition count; deliveries, doubled, lost and order violations are summed
  over the repetitions.
- **Machine**: the broker, the consumer and PostgreSQL share the machine's cores, so the
  absolute figures are low and noisy; compare the ratios within one run.
- Targets: key-parallel ≥ %.0f× watermill-kafka at 1 partition; key-parallel with the inbox ≥ %.1f×
  the same handler with no inbox; the batch handler ≥ %.1f× the per-message handler with no inbox.

`, res.Stream.N, res.Stream.Orders, cfg.DupRatio*100, res.Stream.Dups, res.Stream.Keys, cfg.Seed, publishBatch, joinInts(cfg.Partitions, " or "),
		cfg.maxInFlight(), batchConfig.MaxMessages, res.Conns, cfg.maxInFlight(), cfg.MaxConns, connMargin, cfg.Reps, targetStock, targetNoInbox, targetBatchNoInbox)
	b.WriteString(note + "\n\n")
	b.WriteString(table)
	if chart != "" {
		fmt.Fprintf(&b, "\n![Kafka end to end: consumer throughput by subscriber and partitions](%s)\n", chart)
	}
	return b.String()
}

// UpdateReadme replaces (or appends) the "Kafka end to end" section of
// path.
func UpdateReadme(path, section string) error {
	return mdsection.Replace(path, "# Benchmarks", sectionHead, section)
}
