package main

import (
	"fmt"
	"strings"
	"time"

	"github.com/oncemill/oncemill/benchmarks/internal/mdsection"
)

const (
	// targetSerial is the share of watermill-nats's (pkg/nats) throughput
	// that oncemill's subscriber keeps with one message in flight, as
	// watermill-nats has.
	targetSerial = 0.8
	// targetParallel is how many times watermill-nats's throughput
	// oncemill's subscriber reaches with Config.MaxInFlight in flight.
	targetParallel = 2.0
	// targetP99 is how many times watermill-nats's p99 latency at the
	// steady rate oncemill's subscriber may take, with one message in
	// flight.
	targetP99   = 1.5
	sectionHead = "## NATS end to end"
	command     = "cd benchmarks && go run ./nats"
)

// label is a subscriber's name in the table.
func label(sys string, cfg Config) string {
	switch sys {
	case sysStock:
		return "watermill-nats `pkg/nats`, JetStream (stock)"
	case sysStockJS:
		return "watermill-nats `pkg/jetstream` (stock, beta)"
	case sysSerial:
		return "oncemill `adapters/nats`, 1 in flight"
	case sysParallel:
		return fmt.Sprintf("oncemill `adapters/nats`, %d in flight", cfg.MaxInFlight)
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
	switch {
	case d == 0:
		return "—"
	case d < 10*time.Millisecond:
		return fmt.Sprintf("%.1f ms", float64(d)/float64(time.Millisecond))
	case d < time.Second:
		return fmt.Sprintf("%.0f ms", float64(d)/float64(time.Millisecond))
	}
	return fmt.Sprintf("%.2f s", d.Seconds())
}

// Markdown renders the results tables and the targets.
func Markdown(res *Results, cfg Config) string {
	var b strings.Builder
	fmt.Fprintf(&b, "### Throughput: JetStream → inbox → PostgreSQL\n\n")
	fmt.Fprintf(&b, "%d messages per run (%.0f%% duplicates), published beforehand; msgs/s from the router's start to the last message handled, median of %d; PostgreSQL pool of %d connections.\n\n",
		cfg.N, cfg.DupRatio*100, cfg.Reps, res.Conns)
	b.WriteString("| Subscriber | msgs/s (median) | min–max | × watermill-nats | Deliveries / messages | Doubled | Lost |\n")
	b.WriteString("|---|---:|---|---:|---:|---:|---:|\n")
	for _, r := range rowsOf(res, kindThroughput) {
		fmt.Fprintf(&b, "| %s | %.0f | %.0f–%.0f | %s | %d/%d | %d | %d |\n",
			label(r.System, cfg), r.MsgsPerSec, r.Min, r.Max, fmtRatio(r.RatioStock), r.Deliveries, r.N, r.Doubled, r.Lost)
	}
	fmt.Fprintf(&b, "\n### Latency at a steady %d msgs/s\n\n", cfg.Rate)
	fmt.Fprintf(&b, "%d messages published at %d msgs/s while the subscriber runs; each message from its publish to its handler chain's return (the effect committed, or the duplicate dropped).\n\n",
		int(float64(cfg.Rate)*cfg.PacedFor.Seconds()), cfg.Rate)
	b.WriteString("| Subscriber | p50 | p99 | max | Deliveries / messages | Doubled | Lost |\n")
	b.WriteString("|---|---:|---:|---:|---:|---:|---:|\n")
	for _, r := range rowsOf(res, kindLatency) {
		fmt.Fprintf(&b, "| %s | %s | %s | %s | %d/%d | %d | %d |\n",
			label(r.System, cfg), fmtDur(r.P50), fmtDur(r.P99), fmtDur(r.MaxLatency), r.Deliveries, r.N, r.Doubled, r.Lost)
	}
	fmt.Fprintf(&b, "\n### A handler slower than AckWait\n\n")
	fmt.Fprintf(&b, "%d messages, each handler working %s under the inbox, the consumer's AckWait (and watermill-nats's ack timeout) %s; until the consumer has every message acked.\n\n",
		cfg.Slow, cfg.SlowWork, cfg.SlowAckWait)
	b.WriteString("| Subscriber | Deliveries / messages | Redelivered while in progress | Doubled | Lost |\n")
	b.WriteString("|---|---:|---:|---:|---:|\n")
	for _, r := range rowsOf(res, kindInProgress) {
		fmt.Fprintf(&b, "| %s | %d/%d | %d | %d | %d |\n", label(r.System, cfg), r.Deliveries, r.N, r.InProgress, r.Doubled, r.Lost)
	}
	targets(&b, res, cfg)
	return b.String()
}

// rowsOf returns the rows of kind, in report order.
func rowsOf(res *Results, kind string) []Row {
	var out []Row
	for _, r := range res.Rows {
		if r.Kind == kind {
			out = append(out, r)
		}
	}
	return out
}

// targets renders the targets with the figures they are checked against.
func targets(b *strings.Builder, res *Results, cfg Config) {
	b.WriteString("\nTargets:\n\n")
	s, ok := findRow(res.Rows, sysStock, kindThroughput)
	if ok {
		if r, ok := findRow(res.Rows, sysSerial, kindThroughput); ok {
			fmt.Fprintf(b, "- oncemill with 1 in flight ≥ %.1f× watermill-nats (`pkg/nats`): %.0f / %.0f msgs/s = %.2f× — **%s**\n",
				targetSerial, r.MsgsPerSec, s.MsgsPerSec, r.RatioStock, passMiss(r.RatioStock >= targetSerial))
		}
		if r, ok := findRow(res.Rows, sysParallel, kindThroughput); ok {
			fmt.Fprintf(b, "- oncemill with %d in flight ≥ %.0f× watermill-nats (`pkg/nats`): %.0f / %.0f msgs/s = %.2f× — **%s**\n",
				cfg.MaxInFlight, targetParallel, r.MsgsPerSec, s.MsgsPerSec, r.RatioStock, passMiss(r.RatioStock >= targetParallel))
		}
	}
	if s, ok := findRow(res.Rows, sysStock, kindLatency); ok {
		if r, ok := findRow(res.Rows, sysSerial, kindLatency); ok {
			limit := time.Duration(float64(s.P99) * targetP99)
			fmt.Fprintf(b, "- oncemill's p99 at %d msgs/s, 1 in flight, ≤ %.1f× watermill-nats's: %s vs %s (limit %s) — **%s**\n",
				cfg.Rate, targetP99, fmtDur(r.P99), fmtDur(s.P99), fmtDur(limit), passMiss(r.P99 <= limit))
		}
	}
	var ours, theirs []string
	oursOK := true
	for _, r := range rowsOf(res, kindInProgress) {
		part := fmt.Sprintf("%s %d", label(r.System, cfg), r.InProgress)
		if stock(r.System) {
			theirs = append(theirs, part)
			continue
		}
		ours = append(ours, part)
		oursOK = oursOK && r.InProgress == 0
	}
	if len(ours) > 0 {
		fmt.Fprintf(b, "- a handler slower than AckWait is not redelivered while it runs: %s — **%s**", strings.Join(ours, ", "), passMiss(oursOK))
		if len(theirs) > 0 {
			fmt.Fprintf(b, " (watermill-nats, for comparison: %s)", strings.Join(theirs, ", "))
		}
		b.WriteString("\n")
	}
	if failed := Failures(res); len(failed) == 0 {
		fmt.Fprintf(b, "- every run: 0 doubled, 0 lost — **PASS** (%d runs)\n", len(res.Samples))
	} else {
		fmt.Fprintf(b, "- every run: 0 doubled, 0 lost — **FAIL**: %s\n", strings.Join(failed, "; "))
	}
}

// Failures lists the rows whose effects were not exactly once; empty when
// all were.
func Failures(res *Results) []string {
	var out []string
	for _, r := range res.Rows {
		if !r.ok() {
			out = append(out, fmt.Sprintf("%s, %s run: %d doubled, %d lost over %d runs", r.System, r.Kind, r.Doubled, r.Lost, r.Reps))
		}
	}
	return out
}

// Section renders the README section: what is measured and how, the note
// (command, machine) and the tables.
func Section(note, table string, res *Results, cfg Config) string {
	var b strings.Builder
	b.WriteString(sectionHead + "\n\n")
	fmt.Fprintf(&b, `Consumes a JetStream stream with a Watermill router and applies every message exactly once
through the PostgreSQL inbox, with watermill-nats's subscribers and oncemill's in the same run:
JetStream → subscriber → router → `+"`middleware.NewInbox`"+` (`+"`TxStore`"+`: `+"`dedup/postgres`"+`, defaults) → one
INSERT into an effects table through `+"`postgres.Tx(ctx)`"+`, the inbox's transaction. Source: [nats](nats/).

- **Server**: %s, the benchmark's client, the consumer and PostgreSQL on one machine.
- **Stream**: payment events, JSON, the payment id as idempotency key (header `+"`idempotency_key`"+`),
  %.0f%% of them duplicates: an earlier payment again with a new UUID and a new `+"`Nats-Msg-Id`"+`, as a
  retry after JetStream's duplicate window, so that they reach the consumer and the inbox drops
  them. Published with nats.go in the format both libraries read (the UUID in
  `+"`_watermill_message_uuid`"+`), to a fresh stream per run (file storage).
- **Subscribers**, each on a durable consumer of its own, AckWait %s: watermill-nats `+"`pkg/nats`"+`
  with JetStream, the subscriber its documentation recommends for production (a push consumer in a
  queue group; the options of its own JetStream tests: `+"`DeliverAll`"+`, `+"`AckExplicit`"+`; synchronous
  acks; `+"`AckWaitTimeout`"+` the same as AckWait); watermill-nats `+"`pkg/jetstream`"+` (beta, a pull consumer
  through nats.go's `+"`Consume`"+`, which prefetches); oncemill's `+"`adapters/nats`"+` with 1 message in flight
  (its default) and with %d.
- **Throughput**: %d messages published beforehand; the clock runs from the router's `+"`Run`"+` until
  every message has been handled (the handler chain, inbox included, returned without error);
  median of %d, the subscribers taking turns.
- **Latency**: %d messages published at %d msgs/s while the subscriber runs, each timed from its
  publish to its handler chain's return; one run each.
- **A handler slower than AckWait**: %d messages whose handler works %s, the consumer's AckWait %s;
  counted are the deliveries of a message while an earlier delivery of it is still in the handler
  chain, until the consumer has every message acked. JetStream redelivers a message whose ack
  wait passes; watermill-nats neither stops that nor tells JetStream the handler is in progress,
  and lets the next message out when its ack timeout passes; oncemill's subscriber sends a
  progress heartbeat every AckWait/3. The inbox keeps the effect once either way: the copy waits
  on the first delivery's row lock, then finds the key done.
- **Checks**, from the effects table after each run: keys with more than one effect row
  (doubled) and keys of the run with none (lost). Either fails the run, and the command exits
  non-zero.
- **Machine**: 2 shared cores; compare ratios within one run.
- Targets: oncemill with 1 in flight ≥ %.1f× watermill-nats's throughput, with %d in flight
  ≥ %.0f×; oncemill's p99 at the steady rate ≤ %.1f× watermill-nats's; oncemill's subscribers redeliver
  nothing while a handler runs; 0 doubled, 0 lost.

`, res.ServerVersion, cfg.DupRatio*100, throughputAckWait, cfg.MaxInFlight, cfg.N, cfg.Reps,
		int(float64(cfg.Rate)*cfg.PacedFor.Seconds()), cfg.Rate, cfg.Slow, cfg.SlowWork, cfg.SlowAckWait,
		targetSerial, cfg.MaxInFlight, targetParallel, targetP99)
	b.WriteString(note + "\n\n")
	b.WriteString(table)
	return b.String()
}

// UpdateReadme replaces (or appends) the "NATS end to end" section of
// path.
func UpdateReadme(path, section string) error {
	return mdsection.Replace(path, "# Benchmarks", sectionHead, section)
}
