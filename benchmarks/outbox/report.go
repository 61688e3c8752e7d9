package main

import (
	"fmt"
	"strings"
	"time"

	"github.com/oncemill/oncemill/benchmarks/internal/mdsection"
)

const (
	targetRatio       = 10.0
	targetP50         = 10 * time.Millisecond
	targetP99         = 50 * time.Millisecond
	targetWriterRatio = 0.9
	targetIdleQPS     = 5.0
	targetFloorRatio  = 0.5
	targetLateP99     = 50 * time.Millisecond
	sectionHead       = "## Outbox relay"
	command           = "cd benchmarks && go run ./outbox"
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

// fmtThroughput renders a throughput run's msgs/s, and how far it got if it
// timed out.
func fmtThroughput(r Result) string {
	tp := fmt.Sprintf("%.0f", r.Throughput)
	if r.TimedOut {
		tp = fmt.Sprintf("%s (only %d/%d in %s)", tp, r.Delivered, r.N, r.Elapsed)
	}
	return tp
}

// fmtInts joins ns with sep.
func fmtInts(ns []int, sep string) string {
	parts := make([]string, len(ns))
	for i, n := range ns {
		parts[i] = fmt.Sprint(n)
	}
	return strings.Join(parts, sep)
}

// stageCommand is the command that reruns one stage alone.
func stageCommand(stage string) string {
	return "`" + command + " -stages " + stage + "`"
}

// Markdown renders the tables of the stages that ran, each with a line on
// how it was measured, and the targets.
func Markdown(rep Report, cfg Config) string {
	var b strings.Builder
	if len(rep.Relay) > 0 {
		relayTables(&b, rep.Relay)
	}
	if len(rep.Floor) > 0 {
		floorTable(&b, rep.Floor, cfg)
	}
	if len(rep.Writers) > 0 {
		writerTable(&b, rep.Writers, rep.Triggers, cfg)
	}
	if rep.Idle != nil {
		idleTable(&b, *rep.Idle)
	}
	if rep.Scheduled != nil {
		scheduledTable(&b, *rep.Scheduled)
	}
	targets(&b, rep)
	return b.String()
}

func relayTables(b *strings.Builder, results []Result) {
	fmt.Fprintf(b, "### Throughput: oncemill relay vs Watermill forwarder\n\nA backlog of N events, then the relays/forwarders start; msgs/s until the N-th arrives (%s).\n\n", stageCommand(StageRelay))
	b.WriteString("| System | Instances | Broker | Throughput N | Throughput (msgs/s) | Ours / stock |\n")
	b.WriteString("|---|---:|---|---:|---:|---:|\n")
	for _, r := range results {
		ratio := ""
		if r.System == systemOurs {
			if s, ok := find(results, systemStock, r.Instances, r.Broker); ok && s.Throughput > 0 {
				ratio = fmt.Sprintf("%.1f×", r.Throughput/s.Throughput)
			}
		}
		fmt.Fprintf(b, "| %s | %d | %s | %d | %s | %s |\n", r.System, r.Instances, r.Broker, r.N, fmtThroughput(r), ratio)
	}
	fmt.Fprintf(b, "\n### Commit → publish latency\n\nOne event per transaction at a steady rate, relays/forwarders running; latency = arrival − the return of `Commit`; p50 and p99 over every event written, the ones that never arrived counting as infinitely late (%s).\n\n", stageCommand(StageRelay))
	b.WriteString("| System | Instances | Broker | Events arrived / written | Written rate (/s) | **p50** | **p99** | Duplicates |\n")
	b.WriteString("|---|---:|---|---:|---:|---:|---:|---:|\n")
	for _, r := range results {
		fmt.Fprintf(b, "| %s | %d | %s | %d/%d | %.0f | %s | %s | %d |\n",
			r.System, r.Instances, r.Broker, r.LatArrived, r.Sent, r.SentRate,
			fmtLat(r.P50, r.P50Missing), fmtLat(r.P99, r.P99Missing), r.Dups)
	}
}

func floorTable(b *strings.Builder, results []FloorResult, cfg Config) {
	fmt.Fprintf(b, "\n### Raw floor: oncemill relay vs a hand-written relay\n\nThe same throughput run (a backlog of %d events written through `TxPublisher`, msgs/s until the last arrives), first for the raw relay — per batch one transaction: `DELETE … WHERE id IN (SELECT id … ORDER BY id FOR UPDATE SKIP LOCKED LIMIT %d) RETURNING …`, publish, commit — then for oncemill's relay with its defaults, on a fresh backlog of the same size and the same broker (%s).\n\n",
		cfg.NOurs, rawBatch, stageCommand(StageFloor))
	b.WriteString("| Broker | Instances | Backlog N | Raw relay (msgs/s) | oncemill relay (msgs/s) | Relay / raw |\n")
	b.WriteString("|---|---:|---:|---:|---:|---:|\n")
	for _, f := range results {
		fmt.Fprintf(b, "| %s | %d | %d | %s | %s | %.2f |\n",
			f.Broker, f.Instances, f.Raw.N, fmtThroughput(f.Raw), fmtThroughput(f.Relay), f.Ratio)
	}
}

func writerTable(b *strings.Builder, results []WriterResult, triggers string, cfg Config) {
	trig := "its triggers: none"
	if triggers != "" {
		trig = "its triggers: " + triggers
	}
	fmt.Fprintf(b, "\n### Writer throughput: outbox vs baseline\n\nEach writer loops on BEGIN, one event, COMMIT for %s per round: into the outbox through `forwarder.NewTxPublisher(…).Publish` (%s), or the same INSERT into a baseline table of the outbox's shape with no trigger; %d baseline/outbox pairs per cell, alternating which goes first, medians of the rounds. The relays, when any, drain the outbox (to GoChannel) during the outbox rounds; in the \"SKIP LOCKED floor\" rows the raw floor's workers do instead, as many, on the same pool and to the same GoChannel — per batch `DELETE … WHERE id IN (SELECT id … ORDER BY id FOR UPDATE SKIP LOCKED LIMIT %d) RETURNING …`, publish, commit, none of the relay's ordering — their statements counted the same way (%s).\n\n",
		cfg.WriterRound, trig, cfg.WriterRepeats, rawBatch, stageCommand(StageWriters))
	b.WriteString("| Writers | Relays | Baseline (tx/s) | Outbox (tx/s) | Outbox / baseline | Per pair (min–max) | Outbox rows at round end | Relay statements (/s) |\n")
	b.WriteString("|---:|---:|---:|---:|---:|---|---:|---:|\n")
	for _, r := range results {
		qps := "—"
		if r.Relays > 0 {
			qps = fmt.Sprintf("%.0f", r.RelayQPS)
		}
		relays := fmt.Sprint(r.Relays)
		if r.Drain == drainRaw {
			relays += " (SKIP LOCKED floor)"
		}
		fmt.Fprintf(b, "| %d | %s | %.0f | %.0f | %.2f | %.2f–%.2f | %d | %s |\n",
			r.Writers, relays, r.BaselineTPS, r.OutboxTPS, r.Ratio, r.PairMin, r.PairMax, r.Backlog, qps)
	}
}

// findWriter returns the writer cell of writers writers with relays
// drainers of kind drain.
func findWriter(results []WriterResult, writers, relays int, drain string) (WriterResult, bool) {
	for _, r := range results {
		if r.Writers == writers && r.Relays == relays && r.Drain == drain {
			return r, true
		}
	}
	return WriterResult{}, false
}

func idleTable(b *strings.Builder, r IdleResult) {
	fmt.Fprintf(b, "\n### Idle relay\n\nOne relay with its defaults on an empty outbox; every statement on its pool (each Exec and Query, BEGIN and COMMIT included) counted by a pgx `QueryTracer` from the start of `Run` (%s).\n\n", stageCommand(StageIdle))
	b.WriteString("| Window | Statements | Statements/s | Last half (/s) | By statement (first two words) | Pool pings (not traced) |\n")
	b.WriteString("|---:|---:|---:|---:|---|---:|\n")
	fmt.Fprintf(b, "| %s | %d | %.2f | %.2f | %s | %d |\n",
		r.Window.Round(100*time.Millisecond), r.Statements, r.PerSecond, r.LastHalf, fmtKinds(r.ByKind), r.Pings)
}

func scheduledTable(b *strings.Builder, r ScheduledResult) {
	fmt.Fprintf(b, "\n### Scheduled messages\n\nOne relay with its defaults; messages written through `forwarder.PublishAt` come due at a steady rate, each written %s before its due time (a transaction every 10 ms); lateness = arrival at a GoChannel subscriber − due time, the ones that never arrived counting as infinitely late. In the same run, immediate messages at a tenth of the rate, one per transaction: latency = arrival − the return of `Commit`. Relay statements: every statement on the relay's pool, per second, while the messages came due (%s).\n\n",
		r.Ahead, stageCommand(StageScheduled))
	b.WriteString("| Due rate (/s) | Window | Due arrived / written | Early | **Lateness p50** | **Lateness p99** | Lateness max | Immediate arrived / written | Immediate p50 | Immediate p99 | Relay statements (/s) |\n")
	b.WriteString("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n")
	fmt.Fprintf(b, "| %d | %s | %d/%d | %d | %s | %s | %s | %d/%d | %s | %s | %.0f |\n",
		r.Rate, r.Window, r.Arrived, r.Due, r.Early, fmtLat(r.P50, r.P50Missing), fmtLat(r.P99, r.P99Missing), fmtLat(r.Max, false),
		r.ImmArrived, r.Immediate, fmtLat(r.ImmP50, r.ImmP50Missing), fmtLat(r.ImmP99, r.ImmP99Missing), r.Statements)
}

// targets renders every target the results can be checked against.
func targets(b *strings.Builder, rep Report) {
	b.WriteString("\nTargets (checked, not asserted):\n\n")
	for _, r := range rep.Relay {
		if r.System != systemOurs {
			continue
		}
		if s, ok := find(rep.Relay, systemStock, r.Instances, r.Broker); ok {
			ratio := 0.0
			if s.Throughput > 0 {
				ratio = r.Throughput / s.Throughput
			}
			fmt.Fprintf(b, "- %s ×%d → %s: throughput ≥ %.0f× stock: %.1f× — **%s**\n",
				r.System, r.Instances, r.Broker, targetRatio, ratio, passFail(ratio >= targetRatio))
		}
		fmt.Fprintf(b, "- %s ×%d → %s: p50 < %s: %s — **%s**\n",
			r.System, r.Instances, r.Broker, targetP50, fmtLat(r.P50, r.P50Missing), passFail(!r.P50Missing && r.P50 < targetP50))
		fmt.Fprintf(b, "- %s ×%d → %s: p99 < %s: %s — **%s**\n",
			r.System, r.Instances, r.Broker, targetP99, fmtLat(r.P99, r.P99Missing), passFail(!r.P99Missing && r.P99 < targetP99))
	}
	for _, f := range rep.Floor {
		fmt.Fprintf(b, "- relay ×%d → %s: throughput ≥ %.1f× raw: %.3f× — **%s**\n",
			f.Instances, f.Broker, targetFloorRatio, f.Ratio, passFail(f.Ratio >= targetFloorRatio))
	}
	for _, w := range rep.Writers {
		if w.Drain == drainRaw {
			continue
		}
		fmt.Fprintf(b, "- %d writers, %d relays: outbox / baseline ≥ %.1f: %.3f — **%s**\n",
			w.Writers, w.Relays, targetWriterRatio, w.Ratio, passFail(w.Ratio >= targetWriterRatio))
	}
	for _, f := range rep.Writers {
		if f.Drain != drainRaw {
			continue
		}
		w, ok := findWriter(rep.Writers, f.Writers, f.Relays, drainRelay)
		if !ok {
			continue
		}
		ratio := 0.0
		if f.OutboxTPS > 0 {
			ratio = w.OutboxTPS / f.OutboxTPS
		}
		fmt.Fprintf(b, "- %d writers: outbox tx/s with %d relays / with %d raw SKIP LOCKED workers: %.0f / %.0f = %.3f (outbox / baseline %.3f vs %.3f) — information, not a target\n",
			f.Writers, w.Relays, f.Relays, w.OutboxTPS, f.OutboxTPS, ratio, w.Ratio, f.Ratio)
	}
	if r := rep.Idle; r != nil {
		fmt.Fprintf(b, "- idle relay: ≤ %.0f statements/s: %.2f/s — **%s**\n",
			targetIdleQPS, r.PerSecond, passFail(r.PerSecond <= targetIdleQPS))
	}
	if r := rep.Scheduled; r != nil {
		fmt.Fprintf(b, "- scheduled messages at %d/s: lateness p99 ≤ %s: %s — **%s**\n",
			r.Rate, targetLateP99, fmtLat(r.P99, r.P99Missing), passFail(!r.P99Missing && r.P99 <= targetLateP99))
		fmt.Fprintf(b, "- scheduled messages: none before its due time: %d early — **%s**\n", r.Early, passFail(r.Early == 0))
	}
}

// Section renders the README section.
func Section(note, table string, rep Report, cfg Config) string {
	var b strings.Builder
	b.WriteString(sectionHead + "\n\n")
	b.WriteString(`Compares oncemill's transactional outbox (` + "`forwarder.NewTxPublisher`" + ` + ` + "`forwarder.Relay`" + `)
with Watermill's own forwarder (` + "`components/forwarder`" + ` over watermill-sql v4's PostgreSQL
publisher and subscriber) on the same PostgreSQL, each with 1 and 4 instances, publishing to a
Watermill GoChannel and to the embedded Kafka broker (` + "`adapters/kafka/embedded`" + `, 4 partitions,
through ` + "`kafka.NewPublisher`" + `); then measures the relay against a hand-written floor, the cost
the outbox puts on the writers' commits, and what an idle relay sends. Every run uses a fresh
schema / fresh tables and topics, dropped afterwards.

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
- **Settings**: oncemill's relay runs with its defaults (only ` + "`Pool`, `Publisher`, `Schema`" + ` and
  ` + "`Logger`" + ` of ` + "`forwarder.RelayConfig`" + ` set). Watermill's forwarder runs with its **defaults on
  purpose** — that is the point of the comparison: the watermill-sql subscriber polls every
  **1 s** when it finds nothing, reads 100 rows per query and acks (one UPDATE of the offsets
  row) message by message; its 4 instances share one consumer group, so they serialize on the
  offsets row.
`)
	if rep.Triggers != "" {
		b.WriteString(`- **Written rate**: the latency column shows the rate the writers actually reached. The
  outbox table, as migrated for this run, has a trigger (` + rep.Triggers + `); a NOTIFY trigger makes
  PostgreSQL serialize the commits of notifying transactions (one lock on the notification queue,
  held through the commit's WAL flush). On 2 cores the writers may then fall short of the
  target, mostly with 4 relays; the latency figures are at the rate reached.
`)
	} else {
		b.WriteString(`- **Written rate**: the latency column shows the rate the writers actually reached; the
  outbox table, as migrated for this run, has no trigger.
`)
	}
	b.WriteString(`- **Raw floor**: a hand-written relay with none of the relay's ordering: each worker loops on
  one transaction per batch — ` + "`DELETE FROM outbox WHERE id IN (SELECT id FROM outbox ORDER BY id FOR UPDATE SKIP LOCKED LIMIT " + fmt.Sprint(rawBatch) + ") RETURNING …`" + `
  (the relay's default batch size), publish the rows, commit. Its throughput run and then the
  relay's, on backlogs of the same size written the same way, to the same broker; the relay's
  figures here come from their own runs, next to the raw ones, not from the first table.
- **Writer throughput**: ` + fmtInts(cfg.WriterCounts, " and ") + ` writer goroutines each loop for ` + cfg.WriterRound.String() + ` on BEGIN, one
  event, COMMIT, from one pool in the benchmark's process: into the outbox through
  ` + "`forwarder.NewTxPublisher(ctx, tx, cfg).Publish(topic, msg)`" + `, or — the baseline — the INSERT
  ` + "`TxPublisher`" + ` sends (same columns and values) into a table created
  ` + "`LIKE outbox INCLUDING ALL`" + ` (columns, defaults, the generated lane column, indexes; never
  triggers) with a sequence of its own. Both tables are emptied before every round. Each cell
  runs a short warm-up of each kind, then ` + fmt.Sprint(cfg.WriterRepeats) + ` baseline/outbox pairs, alternating which goes
  first; the table shows the medians, their ratio and the ratio's range over the pairs. With
  relays, that many ` + "`forwarder.Relay`" + `s on a pool of their own drain the outbox to GoChannel
  during the outbox rounds only; "outbox rows at round end" is what they had not caught up
  with (without relays: every row the round wrote), "relay statements" what all of them sent
  per second (counted by a pgx ` + "`QueryTracer`" + ` on their pool). Medians over the outbox rounds.
  Then, for each writer count, one more cell with as many workers of the raw floor (above) in
  place of the relays, on the same pool, publishing to the same GoChannel, their statements
  counted the same way: the "SKIP LOCKED floor" rows. The targets set the relays' outbox tx/s
  against the raw workers', as information: what any drainer deleting rows as fast as they
  are written costs the writers on the same cores, apart from the relay's ordering.
- **Idle relay**: one relay on an empty outbox for ` + cfg.Idle.String() + `, on a pool of its own whose pgx
  ` + "`QueryTracer`" + ` counts every statement (each Exec and Query, BEGIN and COMMIT included) from the
  start of ` + "`Run`" + `; "last half" is the rate over the second half of the window. The pool's
  liveness pings (a connection idle over 1 s is pinged on acquire) bypass the tracer and are
  counted apart.
- **Scheduled messages**: one relay with its defaults; messages written through
  ` + "`forwarder.PublishAt`" + ` come due at the latency runs' rate for ` + cfg.Duration.String() + `, each written ` + cfg.Ahead.String() + ` before its
  due time, in a transaction every 10 ms; their lateness is arrival − due time. Immediate
  messages at a tenth of the rate, one per transaction, in the same run, give the
  commit → arrival latency beside it.
- Targets, checked but not asserted: ours ≥ 10× stock throughput; ours p50 < 10 ms and p99 <
  50 ms; relay ≥ 0.5× raw; outbox / baseline ≥ 0.9 in every writer cell with oncemill's
  relays or none (not the SKIP LOCKED floor's); idle relay ≤ 5 statements/s; scheduled
  messages' lateness p99 ≤ 50 ms, none early.

`)
	b.WriteString(note + "\n\n")
	b.WriteString(table)
	return b.String()
}

// UpdateReadme replaces (or appends) the "Outbox relay" section of path.
func UpdateReadme(path, section string) error {
	return mdsection.Replace(path, "# Benchmarks", sectionHead, section)
}
