package main

import (
	"fmt"
	"strings"
	"time"

	"github.com/oncemill/oncemill/benchmarks/internal/mdsection"
)

const (
	targetRatio = 10.0
	targetP99   = 50 * time.Millisecond
	sectionHead = "## Outbox relay"
)

func fmtLat(d time.Duration, missing bool) string {
	if missing {
		return "not arrived"
	}
	switch {
	case d < time.Millisecond:
		return fmt.Sprintf("%.2f ms", float64(d)/float64(time.Millisecond))
	case d < 10*time.Second:
		return fmt.Sprintf("%.1f ms", float64(d)/float64(time.Millisecond))
	}
	return d.Round(100 * time.Millisecond).String()
}

func find(results []Result, sys string, n int, broker string) (Result, bool) {
	for _, r := range results {
		if r.System == sys && r.Instances == n && r.Broker == broker {
			return r, true
		}
	}
	return Result{}, false
}

func passFail(ok bool) string {
	if ok {
		return "PASS"
	}
	return "FAIL"
}

// Markdown renders the results table and the targets.
func Markdown(results []Result, cfg Config) string {
	var b strings.Builder
	b.WriteString("| System | Instances | Broker | Throughput N | Throughput (msgs/s) | Ours / stock | Latency events (arrived/written, rate) | p50 | p99 | Duplicates |\n")
	b.WriteString("|---|---:|---|---:|---:|---:|---|---:|---:|---:|\n")
	for _, r := range results {
		ratio := ""
		if r.System == systemOurs {
			if s, ok := find(results, systemStock, r.Instances, r.Broker); ok && s.Throughput > 0 {
				ratio = fmt.Sprintf("%.1f×", r.Throughput/s.Throughput)
			}
		}
		tp := fmt.Sprintf("%.0f", r.Throughput)
		if r.TimedOut {
			tp = fmt.Sprintf("%s (only %d/%d in %s)", tp, r.Delivered, r.N, r.Elapsed)
		}
		fmt.Fprintf(&b, "| %s | %d | %s | %d | %s | %s | %d/%d at %.0f/s | %s | %s | %d |\n",
			r.System, r.Instances, r.Broker, r.N, tp, ratio, r.LatArrived, r.Sent, r.SentRate,
			fmtLat(r.P50, r.P50Missing), fmtLat(r.P99, r.P99Missing), r.Dups)
	}
	b.WriteString("\nTargets (checked, not asserted):\n\n")
	for _, r := range results {
		if r.System != systemOurs {
			continue
		}
		if s, ok := find(results, systemStock, r.Instances, r.Broker); ok {
			ratio := 0.0
			if s.Throughput > 0 {
				ratio = r.Throughput / s.Throughput
			}
			fmt.Fprintf(&b, "- %s ×%d → %s: throughput ≥ %.0f× stock: %.1f× — **%s**\n",
				r.System, r.Instances, r.Broker, targetRatio, ratio, passFail(ratio >= targetRatio))
		}
		fmt.Fprintf(&b, "- %s ×%d → %s: p99 < %s: %s — **%s**\n",
			r.System, r.Instances, r.Broker, targetP99, fmtLat(r.P99, r.P99Missing), passFail(!r.P99Missing && r.P99 < targetP99))
	}
	return b.String()
}

// Section renders the README section.
func Section(note, table string, cfg Config) string {
	var b strings.Builder
	b.WriteString(sectionHead + "\n\n")
	b.WriteString(`Compares oncemill's transactional outbox (` + "`forwarder.NewTxPublisher`" + ` + ` + "`forwarder.Relay`" + `)
with Watermill's own forwarder (` + "`components/forwarder`" + ` over watermill-sql v4's PostgreSQL
publisher and subscriber) on the same PostgreSQL, each with 1 and 4 instances, publishing to a
Watermill GoChannel and to the embedded Kafka broker (` + "`adapters/kafka/embedded`" + `, 4 partitions,
through ` + "`kafka.NewPublisher`" + `). Every run uses a fresh schema / fresh tables and topics, dropped afterwards.

- **Throughput**: N events are written first, in transactions of 50 (8 writers), then the
  relays/forwarders start; the clock runs from their start until the N-th event arrives.
- **Latency**: after a warm-up, 8 writers commit one event per transaction at a steady rate
  (every 10 ms, rate/100 transactions) for ` + cfg.Duration.String() + `; each event's commit time is
  taken when ` + "`Commit`" + ` returns, its latency is arrival − commit. Events that never arrived (within
  ` + cfg.Drain.String() + ` after the writers stop) count as infinitely late.
- **Arrival**: GoChannel — the time a real subscriber receives the message. Kafka — the time
  the Kafka publisher's ` + "`Publish`" + ` of that message returned, i.e. the broker acknowledged it
  (acks=all). Both systems use oncemill's Kafka publisher, which sends the messages of one
  ` + "`Publish`" + ` call as one batch: the relay publishes a batch per topic in one call, Watermill's
  forwarder one message per call.
- **Settings**: oncemill's relay runs with its defaults (BatchSize 500, LanesPerBatch 16,
  PollInterval 5s, woken by LISTEN/NOTIFY). Watermill's forwarder runs with its **defaults on
  purpose** — that is the point of the comparison: the watermill-sql subscriber polls every
  **1 s** when it finds nothing, reads 100 rows per query and acks (one UPDATE of the offsets
  row) message by message; its 4 instances share one consumer group, so they serialize on the
  offsets row.
- **Written rate**: the latency column shows the rate the writers actually reached. The
  outbox table has a statement-level NOTIFY trigger, and PostgreSQL serializes the commits of
  notifying transactions (one lock on the notification queue, held through the commit's WAL
  flush); and each notification wakes every relay for a batch transaction (about 3 transactions
  per relay per event at this rate, since notifications are not coalesced). On 2 cores the
  writers may then fall short of the target, mostly with 4 relays; the latency figures are at
  the rate reached.
- Targets, checked but not asserted: ours ≥ 10× stock throughput; ours p99 < 50 ms.

`)
	b.WriteString(note + "\n\n")
	b.WriteString(table)
	return b.String()
}

// UpdateReadme replaces (or appends) the "Outbox relay" section of path.
func UpdateReadme(path, section string) error {
	return mdsection.Replace(path, "# Benchmarks", sectionHead, section)
}
