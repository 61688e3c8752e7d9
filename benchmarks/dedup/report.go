package main

import (
	"encoding/csv"
	"errors"
	"fmt"
	"math"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/oncemill/oncemill/benchmarks/internal/mdsection"
)

// Targets, checked in the report and never asserted.
const (
	targetPGvsRaw       = 0.85 // postgres-inbox throughput over raw SQL, at 8 and 32 workers
	targetBloomSpeedup  = 1.5  // postgres+bloom over postgres-inbox at 50% duplicates
	targetStartCost     = 0.95 // postgres-inbox over postgres-inbox-no-start, new keys: the attempt-start record costs at most 5%
	targetPromCost      = 0.97 // postgres-inbox+prom over postgres-inbox: the Prometheus hooks cost at most 3%
	targetBloomDupPct   = 50
	targetRedisVsBench  = 0.70 // redis.Store.LeaseClaim/s over redis-benchmark's EVALSHA/s
	targetBloomReadsDup = 1.0  // round trips per duplicate behind the Bloom filter
	targetPipeVsRaw     = 1.0  // the pipelined inboxes over raw SQL, new keys, at 8 and 32 workers
	targetRTDup         = 2.0  // round trips per duplicate of every postgres inbox, without Bloom
	targetDefaultVsRaw  = 1.0  // postgres-inbox and postgres-inbox-batched (crash-loop count on) over raw SQL, new keys, at 8 and 32 workers
	targetFastestVsRaw  = 1.5  // the fastest exactly-once inbox mode over raw SQL, new keys, at 8 and 32 workers
	targetRTDupDefault  = 1.0  // round trips per duplicate of the default postgres inbox
	targetSQLStoreVsRaw = 1.0  // sqlstore-postgres and sqlstore-mysql over the raw SQL on their database and driver
	targetBulkVsRaw     = 2.5  // postgres-inbox-batched-bulk-x32 over raw SQL, new keys, at 8 and 32 workers
	targetBulkVsBatched = 0.9  // postgres-inbox-batched-bulk-x32 over raw-sql-batched, new keys, at 8 and 32 workers
	targetCountedVsRaw  = 0.95 // postgres-inbox-broker-counted over raw SQL, new keys, at 8 workers
	sectionHead         = "## Deduplication strategies"
)

// Target is one checked target, or, with Info, a figure reported next
// to the targets without a goal.
type Target struct {
	Text string
	Pass bool
	Info bool
}

func passFail(ok bool) string {
	if ok {
		return "PASS"
	}
	return "MISS"
}

// verdict is how a target's line ends in the report.
func (t Target) verdict() string {
	if t.Info {
		return "information, not a target"
	}
	return "**" + passFail(t.Pass) + "**"
}

// reportOrder is the strategies in report order, the raw baseline first
// and each database/sql strategy's own raw baseline just before it.
func reportOrder(rs []SpeedResult) []string {
	names := []string{stRaw, stRawBatched}
	for _, d := range strategies() {
		if d.Raw != "" {
			names = append(names, d.Raw)
		}
		names = append(names, d.Name)
	}
	return slices.DeleteFunc(names, func(n string) bool {
		return !slices.ContainsFunc(rs, func(r SpeedResult) bool { return r.Strategy == n })
	})
}

func distinctInts(xs []int) []int {
	out := slices.Clone(xs)
	slices.Sort(out)
	return slices.Compact(out)
}

// Markdown renders the tables and the targets.
func Markdown(res *Results, cfg Config) string {
	var b strings.Builder
	if len(res.Speed) > 0 {
		writeSpeed(&b, res)
		writePaced(&b, res, cfg)
		writeRedisBench(&b, res)
	}
	if len(res.Crash) > 0 {
		writeCrash(&b, res, cfg)
	}
	b.WriteString("### Targets (checked, not asserted)\n\n")
	for _, t := range Targets(res, cfg) {
		fmt.Fprintf(&b, "- %s — %s\n", t.Text, t.verdict())
	}
	b.WriteString(readingNotes)
	return b.String()
}

// readingNotes explains mechanisms that shape the numbers; they hold for
// every run, whatever its figures.
const readingNotes = `
### Reading the numbers

- **Lease mode and concurrent duplicates.** A delivery whose key another delivery holds (in-flight
  nacks column) waits the inbox's InFlightDelay (1 s) before its nack; the wait ends early only when
  the lease expires (30 s), not when the holder completes a millisecond later. With 8 or 32 workers
  every lease-mode run with duplicates (memory-lease, redis-lease, and redis+postgres, whose Redis
  lock answers in flight the same way) has such waits, mostly at the start of the stream where the
  first keys' copies arrive together: its N messages take at least about 1 s, so its msgs/s is at
  most about N. The transactional stores make a concurrent duplicate wait on the row lock for the
  length of one transaction instead.
- **Duplicates on PostgreSQL.** The inbox's claim is INSERT … ON CONFLICT DO UPDATE … WHERE status <>
  'done'; PostgreSQL locks the conflicting row even when the WHERE is false, so concurrent duplicates
  of one key wait for each other's transaction (BEGIN … ROLLBACK). The raw baseline's ON CONFLICT DO
  NOTHING does not lock.
- **Bloom.** A key enters the filter when its effect is done; a duplicate delivered while its
  original is still in flight passes the filter as new and is caught by the inbox's claim (3–4
  round trips instead of 1), so RT/dup exceeds 1 with more than one worker. A new key costs one
  extra read only when the filter answers a false positive.
- **redis-lease** claims and completes in Redis (2 round trips) but writes its effect to PostgreSQL
  in a transaction of its own, which waits for the disk: its msgs/s is bounded by that commit (the
  none row is the effect alone), not by Redis.
- **Group commit and the worker count.** The harness hands each worker one delivery at a time, so
  c workers give the batched inbox at most c deliveries to group, and its Parallel batches (4) split
  them: msgs/COMMIT stays far below MaxMessages at 8 and 32 workers, while raw-sql-batched takes 32
  messages per worker off the queue and commits about 32 at a time, with 32 times the messages in
  flight. postgres-inbox-batched-bulk-x32 gives each worker 32 deliveries at once, as a subscriber
  with a prefetch of 32 does: the same messages in flight as raw-sql-batched, which is the row the
  batch handler's targets compare. In the batched inbox with the crash-loop count, the batch's
  attempt record is a statement of its own before the batch's transaction, and every delivery of
  the batch waits for it.
- **Latency at a steady rate.** The speed runs offer every message at once, so their latencies are
  those of a saturated consumer. The paced runs offer 1,000 msgs/s, below what every strategy there
  sustains, and time each message from its arrival: a batched delivery waits for the batch it
  joins (at most Linger, only while every batch slot is busy) and for its mates' handlers, and
  gains a shorter queue behind one COMMIT. The p99 of every row is mostly the disk's flush stalls,
  which a queue of unbatched commits feels more than a batch.
- **Crashes kill everything in flight.** With 8 workers a crash also kills the other deliveries
  where they are; in the strategies whose effect is outside a transaction, a delivery that had
  written its effect but was not yet completed or acked is applied again after the restart. The
  none row under "handler error" shows the doubles the stream's own duplicates cause (no crash).

### Which inbox mode to choose

- **The default** (transactional, attempt record on, no batching, PipelineAuto): at a handful of
  handlers in flight, and wherever duplicates are common. While duplicates are rare a new key costs
  three round trips (the attempt record, BEGIN and the claim in one); once more than 1 in 20
  deliveries is a duplicate the record goes alone and answers each duplicate in one round trip and
  no transaction; a message that kills the process is dead-lettered after MaxAttempts on every
  broker. Behind a broker that counts deliveries (RabbitMQ quorum, SQS, JetStream) a first
  delivery has no record: BEGIN and the claim in one round trip.
- **Batch{MaxMessages: 32}** (group commit) and a **BatchHandler**: when many deliveries of
  different keys are in flight at once — Kafka's key-parallel subscriber, RabbitMQ or SQS with a
  prefetch of 32 or more — and new keys dominate. It wins with batches of about ten or more (the
  32-worker rows, and every -x32 row); with few in flight its batches stay small and the shared
  attempt record and COMMIT make each delivery wait, so it is slower than the default there. A
  BatchHandler writes the batch's effects in one statement: the -x32 row. Its latency cost at a
  steady rate is in the paced table; a Linger only pays when the rate fills the batches it waits for.
- **SkipAttemptRecord**: only where the broker caps redeliveries itself (RabbitMQ's delivery_limit,
  an SQS redrive policy, JetStream's MaxDeliver), on new-key-heavy streams: it saves the record's
  round trip and write, but a message that kills the process is no longer counted.
- **PipelineAlways** / **PipelineNever**: pin the default's choice: always three round trips per new
  key and two per duplicate, or five and one.
- **Bloom** and **redis+postgres**: duplicates in bursts, when the database is the shared bottleneck;
  they keep duplicates off the claim's write path rather than making new keys cheaper.
`

func writeSpeed(b *strings.Builder, res *Results) {
	var dupPcts, concs []int
	for _, r := range res.Speed {
		dupPcts, concs = append(dupPcts, r.DupPct), append(concs, r.Concurrency)
	}
	dupPcts, concs = distinctInts(dupPcts), distinctInts(concs)
	names := reportOrder(res.Speed)

	b.WriteString("### Throughput at a glance\n\n")
	b.WriteString("msgs/s, and in brackets the ratio to the raw-SQL baseline at the same duplicate ratio and worker count.\n\n")
	if slices.ContainsFunc(names, func(n string) bool { return rawOf(n) != stRaw }) {
		b.WriteString("The database/sql rows compare with the raw SQL on their own database and driver: sqlstore-postgres with raw-sql-stdlib, sqlstore-mysql with raw-sql-mysql.\n\n")
	}
	for _, c := range concs {
		fmt.Fprintf(b, "**%s**\n\n| Strategy |", workers(c))
		for _, d := range dupPcts {
			fmt.Fprintf(b, " %d%% dups |", d)
		}
		b.WriteString("\n|---|")
		b.WriteString(strings.Repeat("---:|", len(dupPcts)))
		b.WriteString("\n")
		for _, n := range names {
			fmt.Fprintf(b, "| %s |", n)
			for _, d := range dupPcts {
				r, ok := findSpeed(res.Speed, n, d, c)
				switch {
				case !ok:
					b.WriteString("  |")
				case isRawRef(n):
					fmt.Fprintf(b, " %.0f |", r.MsgsPerSec)
				default:
					fmt.Fprintf(b, " %.0f (%.2f×) |", r.MsgsPerSec, r.RatioRaw)
				}
			}
			b.WriteString("\n")
		}
		b.WriteString("\n")
	}
	b.WriteString("![Throughput by strategy and duplicate ratio](dedup/throughput.png)\n\n")

	b.WriteString("### Speed, every row\n\n")
	b.WriteString("| Dups | Workers | Strategy | msgs/s | × raw | p50 | p99 | RT/msg (pg + redis) | RT/new key | RT/dup | msgs/COMMIT | alloc/msg | heap Δ | deliveries | in-flight nacks | double / lost keys |\n")
	b.WriteString("|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n")
	for _, d := range dupPcts {
		for _, c := range concs {
			for _, n := range names {
				r, ok := findSpeed(res.Speed, n, d, c)
				if !ok {
					continue
				}
				ratio := "—"
				if !isRawRef(n) {
					ratio = fmt.Sprintf("%.2f", r.RatioRaw)
				}
				rt := fmt.Sprintf("%.2f", r.PGRT)
				if r.RedisRT > 0 {
					rt = fmt.Sprintf("%.2f + %.2f", r.PGRT, r.RedisRT)
				}
				if n == stSQLite {
					rt = "in-process"
				}
				rtNew, rtDup := fmt.Sprintf("%.2f", r.RTNew), "—"
				if r.Dups > 0 {
					rtDup = fmt.Sprintf("%.2f", r.RTDup)
				}
				if n == stSQLite {
					rtNew, rtDup = "—", "—"
				}
				if n == stSQLStoreMy || n == stRawMySQL {
					rt, rtNew, rtDup = "not counted", "—", "—"
				}
				fmt.Fprintf(b, "| %d%% | %d | %s | %.0f | %s | %s | %s | %s | %s | %s | %s | %s | %s | %d | %d | %d / %d |\n",
					d, c, n, r.MsgsPerSec, ratio, fmtMs(r.P50), fmtMs(r.P99), rt, rtNew, rtDup, msgsPerCommit(r),
					fmtBytes(r.AllocPerMsg), fmtSignedBytes(r.HeapGrowth), r.Deliveries, r.InFlight,
					r.Effects.Doubles, r.Keys-r.Effects.Keys)
			}
		}
	}
	b.WriteString("\n")
	var notes []string
	for _, r := range res.Speed {
		if r.Errors > 0 || r.LoggedErrors > 0 {
			notes = append(notes, fmt.Sprintf("- %s, %d%% dups, %d workers: %d failed deliveries (redelivered), %d errors logged; first: %s",
				r.Strategy, r.DupPct, r.Concurrency, r.Errors, r.LoggedErrors, r.FirstError))
		}
	}
	if len(notes) > 0 {
		b.WriteString("Errors during the speed runs:\n\n" + strings.Join(notes, "\n") + "\n\n")
	}
}

// msgsPerCommit says how many messages one COMMIT carried on average:
// about 1 for the single-message inboxes and raw-sql (less with
// duplicates, which the inboxes answer without a transaction), the batch
// size for the batched ones; "—" for a strategy that sent no COMMIT.
func msgsPerCommit(r SpeedResult) string {
	if r.Commits == 0 || r.Strategy == stSQLite {
		return "—"
	}
	return fmt.Sprintf("%.1f", float64(r.N)/float64(r.Commits))
}

func writeRedisBench(b *strings.Builder, res *Results) {
	b.WriteString("### redis-benchmark: EVALSHA of the claim script\n\n")
	if len(res.RedisBench) == 0 {
		fmt.Fprintf(b, "Not run: %s.\n\n", res.RedisBenchSkipped)
		return
	}
	b.WriteString("| Clients | redis-benchmark EVALSHA/s | p50 | p99 | redis.Store.LeaseClaim alone (go-redis), claims/s | redis-lease, 0% dups, msgs/s | redis-lease / redis-benchmark |\n")
	b.WriteString("|---:|---:|---:|---:|---:|---:|---:|\n")
	for _, r := range res.RedisBench {
		lease, ok := findSpeed(res.Speed, stRedis, 0, r.Concurrency)
		leaseRate, ratio := "—", "—"
		if ok && r.RPS > 0 {
			leaseRate, ratio = fmt.Sprintf("%.0f", lease.MsgsPerSec), fmt.Sprintf("%.2f", lease.MsgsPerSec/r.RPS)
		}
		fmt.Fprintf(b, "| %d | %.0f | %.3f ms | %.3f ms | %.0f | %s | %s |\n",
			r.Concurrency, r.RPS, r.P50, r.P99, r.StoreClaimsPerSec, leaseRate, ratio)
	}
	b.WriteString("\nCommands, exactly as run:\n\n```sh\n")
	for _, r := range res.RedisBench {
		b.WriteString(r.Command + "\n")
	}
	b.WriteString("```\n\n")
}

func writeCrash(b *strings.Builder, res *Results, cfg Config) {
	var names []string
	for _, r := range res.Crash {
		if !slices.Contains(names, r.Strategy) {
			names = append(names, r.Strategy)
		}
	}
	fts := faults()
	b.WriteString("### Correctness under faults\n\n")
	fmt.Fprintf(b, "%d messages (%d keys, %d duplicates), %s; the fault hits the first delivery of every %s message. "+
		"Each cell: keys with more than one effect / keys with no effect (%d keys in all).\n\n",
		cfg.CrashN, res.CrashKeys, res.CrashDups, workers(cfg.CrashWorkers), ordinal(cfg.CrashEvery), res.CrashKeys)
	b.WriteString("| Strategy |")
	for _, f := range fts {
		fmt.Fprintf(b, " %s |", f)
	}
	b.WriteString("\n|---|" + strings.Repeat("---:|", len(fts)) + "\n")
	for _, n := range names {
		fmt.Fprintf(b, "| %s |", n)
		for _, f := range fts {
			if r, ok := findCrash(res.Crash, n, f); ok {
				fmt.Fprintf(b, " %d / %d |", r.Effects.Doubles, r.Lost)
			} else {
				b.WriteString("  |")
			}
		}
		b.WriteString("\n")
	}
	b.WriteString("\n| Strategy | Fault | faults injected | processes | deliveries | in-flight nacks | other errors | effect rows | keys once | keys double | keys lost | time |\n")
	b.WriteString("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n")
	for _, r := range res.Crash {
		fmt.Fprintf(b, "| %s | %s | %d | %d | %d | %d | %d | %d | %d | %d | %d | %s |\n",
			r.Strategy, r.Fault, r.Faults, r.Processes, r.Deliveries, r.InFlight, r.Errors,
			r.Effects.Rows, r.Effects.Exactly, r.Effects.Doubles, r.Lost, r.Elapsed.Round(10*time.Millisecond))
	}
	b.WriteString("\n")
}

func findCrash(rs []CrashResult, strategy string, f fault) (CrashResult, bool) {
	for _, r := range rs {
		if r.Strategy == strategy && r.Fault == f {
			return r, true
		}
	}
	return CrashResult{}, false
}

// Targets checks the targets against the results; a target whose inputs
// were not measured is left out.
func Targets(res *Results, cfg Config) []Target {
	var ts []Target
	var dupPcts, concs []int
	for _, r := range res.Speed {
		dupPcts, concs = append(dupPcts, r.DupPct), append(concs, r.Concurrency)
	}
	dupPcts, concs = distinctInts(dupPcts), distinctInts(concs)

	ts = append(ts, costTargets(res.Speed, dupPcts, concs)...)
	ts = append(ts, pacedTargets(res.Paced)...)
	for _, c := range concs {
		if c != 8 && c != 32 {
			continue
		}
		for _, d := range dupPcts {
			if r, ok := findSpeed(res.Speed, stPostgres, d, c); ok && r.RatioRaw > 0 {
				ts = append(ts, Target{
					Text: fmt.Sprintf("postgres-inbox ≥ %.0f%% of raw SQL, %d%% dups, %s: %.0f of %.0f msgs/s = %.0f%%",
						targetPGvsRaw*100, d, workers(c), r.MsgsPerSec, r.MsgsPerSec/r.RatioRaw, r.RatioRaw*100),
					Pass: r.RatioRaw >= targetPGvsRaw,
				})
			}
		}
	}
	for _, c := range concs {
		if c != 8 && c != 32 {
			continue
		}
		for _, name := range []string{stPGPipe, stPGPipeNoStart} {
			if r, ok := findSpeed(res.Speed, name, 0, c); ok && r.RatioRaw > 0 {
				ts = append(ts, Target{
					Text: fmt.Sprintf("%s ≥ %.1f× raw SQL, new keys, %s: %.0f of %.0f msgs/s = %.2f×",
						name, targetPipeVsRaw, workers(c), r.MsgsPerSec, r.MsgsPerSec/r.RatioRaw, r.RatioRaw),
					Pass: r.RatioRaw >= targetPipeVsRaw,
				})
			}
		}
	}
	for _, name := range []string{stPostgres, stPGPipe, stPGPipeNoStart} {
		for _, d := range dupPcts {
			if d == 0 {
				continue
			}
			for _, c := range concs {
				if r, ok := findSpeed(res.Speed, name, d, c); ok && r.RTDup > 0 {
					ts = append(ts, Target{
						Text: fmt.Sprintf("%s: a duplicate costs ≤ %.0f round trips, %d%% dups, %s: %.2f",
							name, targetRTDup, d, workers(c), r.RTDup),
						Pass: r.RTDup <= targetRTDup+0.005,
					})
				}
			}
		}
	}
	for _, d := range dupPcts {
		for _, c := range concs {
			pg, ok1 := findSpeed(res.Speed, stPostgres, d, c)
			ns, ok2 := findSpeed(res.Speed, stPGNoStart, d, c)
			if !ok1 || !ok2 || ns.MsgsPerSec == 0 {
				continue
			}
			x := pg.MsgsPerSec / ns.MsgsPerSec
			t := Target{
				Text: fmt.Sprintf("the attempt-start record (crash-loop count) costs ≤ %.0f%%, %d%% dups, %s: postgres-inbox %.0f vs %.0f msgs/s without it = %.2f×",
					(1-targetStartCost)*100, d, workers(c), pg.MsgsPerSec, ns.MsgsPerSec, x),
				Pass: x >= targetStartCost,
			}
			ts = append(ts, t)
		}
	}
	for _, d := range dupPcts {
		for _, c := range concs {
			pg, ok1 := findSpeed(res.Speed, stPostgres, d, c)
			pm, ok2 := findSpeed(res.Speed, stPGProm, d, c)
			if !ok1 || !ok2 || pg.MsgsPerSec == 0 {
				continue
			}
			x := pm.MsgsPerSec / pg.MsgsPerSec
			ts = append(ts, Target{
				Text: fmt.Sprintf("the Prometheus hooks cost ≤ %.0f%%, %d%% dups, %s: postgres-inbox+prom %.0f vs %.0f msgs/s without = %.3f×",
					(1-targetPromCost)*100, d, workers(c), pm.MsgsPerSec, pg.MsgsPerSec, x),
				Pass: x >= targetPromCost,
			})
		}
	}
	for _, c := range concs {
		bl, ok1 := findSpeed(res.Speed, stBloom, 0, c)
		pg, ok2 := findSpeed(res.Speed, stPostgres, 0, c)
		if !ok1 || !ok2 {
			continue
		}
		extra := int(math.Round((bl.PGRT - pg.PGRT) * float64(bl.N)))
		ts = append(ts, Target{
			Text: fmt.Sprintf("postgres+bloom adds no round trip for new keys, 0%% dups, %s: %.3f RT/msg vs postgres-inbox's %.3f, "+
				"%+d statements in all, for %d false positives of the filter (one read each, %.2f%% of keys); surely-new keys: %+d",
				workers(c), bl.PGRT, pg.PGRT, extra, bl.BloomFalsePositives, 100*float64(bl.BloomFalsePositives)/float64(bl.Keys), extra-int(bl.BloomFalsePositives)),
			Pass: int64(extra) == bl.BloomFalsePositives,
		})
	}
	for _, d := range dupPcts {
		if d == 0 {
			continue
		}
		for _, c := range concs {
			bl, ok := findSpeed(res.Speed, stBloom, d, c)
			if !ok || bl.Dups == 0 {
				continue
			}
			ts = append(ts, Target{
				Text: fmt.Sprintf("postgres+bloom costs %.0f read per duplicate, %d%% dups, %s: %.3f RT per duplicate",
					targetBloomReadsDup, d, workers(c), bl.RTDup),
				Pass: bl.RTDup <= targetBloomReadsDup+0.005,
			})
		}
	}
	for _, c := range concs {
		bl, ok1 := findSpeed(res.Speed, stBloom, targetBloomDupPct, c)
		pg, ok2 := findSpeed(res.Speed, stPostgres, targetBloomDupPct, c)
		if !ok1 || !ok2 || pg.MsgsPerSec == 0 {
			continue
		}
		x := bl.MsgsPerSec / pg.MsgsPerSec
		ts = append(ts, Target{
			Text: fmt.Sprintf("postgres+bloom ≥ %.1f× postgres-inbox at %d%% dups, %s: %.0f vs %.0f msgs/s = %.2f×",
				targetBloomSpeedup, targetBloomDupPct, workers(c), bl.MsgsPerSec, pg.MsgsPerSec, x),
			Pass: x >= targetBloomSpeedup,
		})
	}
	for _, rb := range res.RedisBench {
		lease, ok := findSpeed(res.Speed, stRedis, 0, rb.Concurrency)
		if !ok || rb.RPS == 0 {
			continue
		}
		x := rb.StoreClaimsPerSec / rb.RPS
		ts = append(ts, Target{
			Text: fmt.Sprintf("Redis lease store's claim ≥ %.0f%% of redis-benchmark's EVALSHA rate of the same script, %s: redis.Store.LeaseClaim %.0f/s vs %.0f/s = %.0f%% "+
				"(the whole redis-lease message, claim + PostgreSQL effect + complete: %.0f msgs/s)",
				targetRedisVsBench*100, countOf(rb.Concurrency, "client"), rb.StoreClaimsPerSec, rb.RPS, 100*x, lease.MsgsPerSec),
			Pass: x >= targetRedisVsBench,
		})
	}
	ts = append(ts, sqlStoreTargets(res.Speed, dupPcts, concs)...)
	for _, d := range strategies() {
		if !d.ExactlyOnce {
			continue
		}
		var parts []string
		doubles, lost, n := 0, 0, 0
		for _, f := range faults() {
			if r, ok := findCrash(res.Crash, d.Name, f); ok {
				doubles, lost, n = doubles+r.Effects.Doubles, lost+r.Lost, n+1
				parts = append(parts, fmt.Sprintf("%s %d/%d", f.short(), r.Effects.Doubles, r.Lost))
			}
		}
		if n == 0 {
			continue
		}
		ts = append(ts, Target{
			Text: fmt.Sprintf("%s: 0 double / 0 lost under every fault: %d double / %d lost (%s)", d.Name, doubles, lost, strings.Join(parts, ", ")),
			Pass: doubles == 0 && lost == 0,
		})
	}
	return ts
}

// sqlStoreTargets checks the database/sql stores against the raw SQL on
// their database and driver, at every worker count, on new keys and at
// 50% duplicates.
func sqlStoreTargets(rs []SpeedResult, dupPcts, concs []int) []Target {
	var ts []Target
	for _, name := range []string{stSQLStorePG, stSQLStoreMy} {
		for _, d := range dupPcts {
			if d != 0 && d != 50 {
				continue
			}
			for _, c := range concs {
				r, ok := findSpeed(rs, name, d, c)
				if !ok || r.RatioRaw == 0 {
					continue
				}
				ts = append(ts, Target{
					Text: fmt.Sprintf("%s ≥ %.1f× %s (the same database and driver), %d%% dups, %s: %.0f of %.0f msgs/s = %.2f×",
						name, targetSQLStoreVsRaw, rawOf(name), d, workers(c), r.MsgsPerSec, r.MsgsPerSec/r.RatioRaw, r.RatioRaw),
					Pass: r.RatioRaw >= targetSQLStoreVsRaw,
				})
			}
		}
	}
	return ts
}

// costTargets checks the cost of the inbox against the raw SQL it
// replaces: the default inbox and the batched one (both with the
// crash-loop count) and the fastest exactly-once mode over raw-sql on new
// keys, what the crash-loop count costs the batched inbox, the round
// trips of a duplicate in the default mode, and, as information, the
// inboxes over the batched raw floor.
func costTargets(rs []SpeedResult, dupPcts, concs []int) []Target {
	var ts []Target
	for _, c := range concs {
		if c != 8 && c != 32 {
			continue
		}
		raw, ok := findSpeed(rs, stRaw, 0, c)
		if !ok || raw.MsgsPerSec == 0 {
			continue
		}
		for _, name := range []string{stPostgres, stPGBatch} {
			r, ok := findSpeed(rs, name, 0, c)
			if !ok {
				continue
			}
			what := name + " (the default: batching off)"
			if name == stPGBatch {
				what = fmt.Sprintf("%s (Batch{MaxMessages: %d})", name, batchMax)
			}
			x := r.MsgsPerSec / raw.MsgsPerSec
			ts = append(ts, Target{
				Text: fmt.Sprintf("%s, crash-loop count on, ≥ %.1f× raw SQL, new keys, %s: %.0f of %.0f msgs/s = %.2f×",
					what, targetDefaultVsRaw, workers(c), r.MsgsPerSec, raw.MsgsPerSec, x),
				Pass: x >= targetDefaultVsRaw,
			})
		}
		var best SpeedResult
		var bestDef strategyDef
		for _, d := range strategies() {
			if r, ok := findSpeed(rs, d.Name, 0, c); ok && d.ExactlyOnce && d.Raw == "" && r.MsgsPerSec > best.MsgsPerSec {
				best, bestDef = r, d
			}
		}
		if best.MsgsPerSec > 0 {
			protection := "crash-loop count on"
			if bestDef.NoStart {
				protection = "no crash-loop count"
			}
			x := best.MsgsPerSec / raw.MsgsPerSec
			ts = append(ts, Target{
				Text: fmt.Sprintf("fastest exactly-once inbox mode ≥ %.1f× raw SQL, new keys, %s: %s (%s), %.0f of %.0f msgs/s = %.2f×",
					targetFastestVsRaw, workers(c), best.Strategy, protection, best.MsgsPerSec, raw.MsgsPerSec, x),
				Pass: x >= targetFastestVsRaw,
			})
		}
	}
	for _, d := range dupPcts {
		for _, c := range concs {
			bt, ok1 := findSpeed(rs, stPGBatch, d, c)
			ns, ok2 := findSpeed(rs, stPGBatchNoStart, d, c)
			if !ok1 || !ok2 || ns.MsgsPerSec == 0 {
				continue
			}
			x := bt.MsgsPerSec / ns.MsgsPerSec
			ts = append(ts, Target{
				Text: fmt.Sprintf("the attempt-start record (crash-loop count) costs the batched inbox ≤ %.0f%%, %d%% dups, %s: postgres-inbox-batched %.0f vs %.0f msgs/s without it = %.2f×",
					(1-targetStartCost)*100, d, workers(c), bt.MsgsPerSec, ns.MsgsPerSec, x),
				Pass: x >= targetStartCost,
			})
		}
	}
	for _, d := range dupPcts {
		if d == 0 {
			continue
		}
		for _, c := range concs {
			if r, ok := findSpeed(rs, stPostgres, d, c); ok && r.Dups > 0 {
				ts = append(ts, Target{
					Text: fmt.Sprintf("postgres-inbox (the default): a duplicate costs ≤ %.0f round trip, %d%% dups, %s: %.2f",
						targetRTDupDefault, d, workers(c), r.RTDup),
					Pass: r.RTDup <= targetRTDupDefault+0.005,
				})
			}
		}
	}
	for _, c := range concs {
		if c != 8 && c != 32 {
			continue
		}
		floor, ok := findSpeed(rs, stRawBatched, 0, c)
		if !ok || floor.MsgsPerSec == 0 {
			continue
		}
		// The batch handler's targets compare the row whose workers hold as
		// many deliveries as raw-sql-batched's take per transaction; the row
		// with one delivery per worker is shown beside them.
		for _, name := range []string{stPGBatchBulkX, stPGBatchBulk} {
			r, ok := findSpeed(rs, name, 0, c)
			if !ok {
				continue
			}
			info := name != stPGBatchBulkX
			x := r.MsgsPerSec / floor.MsgsPerSec
			ts = append(ts, Target{
				Text: fmt.Sprintf("%s ≥ %.1f× raw-sql-batched (%d messages per transaction, an INSERT each), new keys, %s: %.0f of %.0f msgs/s = %.2f× (%s vs %s messages per COMMIT)",
					name, targetBulkVsBatched, rawBatchSize, workers(c), r.MsgsPerSec, floor.MsgsPerSec, x, msgsPerCommit(r), msgsPerCommit(floor)),
				Pass: x >= targetBulkVsBatched,
				Info: info,
			})
			if raw, ok := findSpeed(rs, stRaw, 0, c); ok && raw.MsgsPerSec > 0 {
				x := r.MsgsPerSec / raw.MsgsPerSec
				ts = append(ts, Target{
					Text: fmt.Sprintf("%s ≥ %.1f× raw SQL, new keys, %s: %.0f of %.0f msgs/s = %.2f×",
						name, targetBulkVsRaw, workers(c), r.MsgsPerSec, raw.MsgsPerSec, x),
					Pass: x >= targetBulkVsRaw,
					Info: info,
				})
			}
		}
		if r, ok := findSpeed(rs, stPGBrokerCount, 0, c); ok && c == 8 {
			if raw, ok := findSpeed(rs, stRaw, 0, c); ok && raw.MsgsPerSec > 0 {
				x := r.MsgsPerSec / raw.MsgsPerSec
				ts = append(ts, Target{
					Text: fmt.Sprintf("%s (the default inbox on a broker's first deliveries) ≥ %.2f× raw SQL, new keys, %s: %.0f of %.0f msgs/s = %.2f×",
						stPGBrokerCount, targetCountedVsRaw, workers(c), r.MsgsPerSec, raw.MsgsPerSec, x),
					Pass: x >= targetCountedVsRaw,
				})
			}
		}
		for _, name := range []string{stPostgres, stPGBatch, stPGBatchNoStart} {
			r, ok := findSpeed(rs, name, 0, c)
			if !ok {
				continue
			}
			ts = append(ts, Target{
				Text: fmt.Sprintf("%s / raw-sql-batched (the group-commit floor, %d messages per transaction), new keys, %s: %.0f of %.0f msgs/s = %.2f× (%s vs %s messages per COMMIT)",
					name, rawBatchSize, workers(c), r.MsgsPerSec, floor.MsgsPerSec, r.MsgsPerSec/floor.MsgsPerSec, msgsPerCommit(r), msgsPerCommit(floor)),
				Info: true,
			})
		}
	}
	return ts
}

// Section renders the report section: what was measured and how, the run's
// note, and the tables.
func Section(note, tables string, cfg Config) string {
	var b strings.Builder
	b.WriteString(sectionHead + "\n\n")
	fmt.Fprintf(&b, `Runs every deduplication strategy on the same generated streams and measures speed and correctness.
Source: [benchmarks/dedup](dedup/); every measured row is in [dedup/results.csv](dedup/results.csv).

| Strategy | What it is |
|---|---|
`)
	for _, d := range append(append(baselineDefs(), strategies()...), sqlBaselineDefs()...) {
		fmt.Fprintf(&b, "| %s | %s |\n", d.Name, d.What)
	}
	fmt.Fprintf(&b, `
- **Stream**: N messages (speed: %d; correctness: %d at %.0f%% duplicates), seeded (seed %d), the same for every
  strategy at a given duplicate ratio. A duplicate is a later copy of an earlier key: a new UUID, the
  same idempotency_key metadata and payload as a key drawn uniformly from the distinct keys before it.
- **Delivery**: no broker. Worker goroutines take positions from an in-process queue, build a fresh
  message for every delivery and call the wrapped handler; a nacked delivery (an error, or a key
  in flight in another delivery) goes to the back of the queue and is delivered again. The clock
  runs until all N messages are acked; msgs/s is N over that time.
- **Effect**: one INSERT of (key, payload) into an effects table with no unique constraint, so that
  a double effect is a second row. In the inbox's transaction (postgres.Tx / sqlite.Tx) for the
  transactional strategies (every postgres-inbox, postgres+bloom, redis+postgres, sqlite-inbox, raw-sql,
  raw-sql-batched),
  autocommitted through the pool for the others: lease mode is for effects outside the claim.
  sqlite-inbox writes its effect into the SQLite database, every other strategy into PostgreSQL.
- **Settings**: the library's defaults (Window 72 h, Lease 30 s, InFlightDelay 1 s; Bloom at 1%%
  false positives, ExpectedKeys = N, warmed from the store before the clock starts). Watermill's
  Deduplicator uses NewMapExpiringKeyRepository with a 72 h window and the message's idempotency_key
  as its key (NewMessageHasherFromMetadataField), like the inbox; its default key, an Adler-32 of
  the payload, would deduplicate by content. The PostgreSQL pool and the Redis client's pool have
  %d connections, more than the most workers, so no worker queues for one; they are opened before
  the clock starts. Every measurement gets a fresh schema (sqlschema.Migrate), Redis key prefix and
  SQLite file (WAL, synchronous=FULL: a commit waits for the disk), removed afterwards.
- **Raw SQL baseline**: per message, through pgx on the same pool: BEGIN; INSERT INTO raw_keys (key)
  … ON CONFLICT DO NOTHING RETURNING key; if a row came back, INSERT the effect; COMMIT. Each
  strategy's "× raw" is its msgs/s over the baseline's at the same duplicate ratio and worker count.
- **database/sql and MySQL** (sqlstore-postgres, sqlstore-mysql): the inbox on dedup/sqlstore, the
  effect written through sqlstore.Tx, each next to the raw SQL on its own database and driver, in
  the same speed cell: raw-sql-stdlib runs raw-sql's transaction through database/sql on pgx's
  stdlib driver (a pool of its own on the same PostgreSQL), raw-sql-mysql the same on MySQL/MariaDB
  (-mysql) with INSERT IGNORE as the claim, a new key told by the row it inserted. The MySQL
  strategies get a database of their own per measurement (sqlschema.MigrateSQL), dropped afterwards;
  the effects and keys tables there have VARBINARY keys. The PostgreSQL rows count round trips with
  the same QueryTracer (database/sql on pgx's stdlib driver passes the delivery's context through);
  the MySQL rows count none (RT "not counted", msgs/COMMIT "—").
- **Batched raw floor** (raw-sql-batched): the same statements for up to %d messages in one
  transaction. Each worker takes up to %d messages off the queue at once (as many as are queued),
  sorts them by key (so that two transactions holding copies of the same keys take the row locks in
  one order and wait instead of deadlocking), runs BEGIN, the claim and, if new, the effect of each,
  COMMIT, and acks all of them (their latency is the transaction's). It holds up to %d messages per
  worker in flight; the inboxes get one delivery per worker, so with c workers an inbox batch holds
  at most c messages, about c/Parallel when its Parallel batches (4, the default) run at once:
  msgs/COMMIT in the speed table shows the sizes each actually committed.
- **Batched inbox** (postgres-inbox-batched, -no-start): InboxConfig.Tuning.Batch{MaxMessages: %d}, Parallel
  (4) and Linger (0) at their defaults, the fastest of Parallel 1, 2 and 4 in short runs on new keys
  at 8 and 32 workers (figures in strategies.go); crashes and handler errors go through the same faults as every
  exactly-once strategy (a crash ends the whole batch: nothing of it is acked).
- **Latency** is one call of the wrapped handler (a nacked attempt is a call of its own).
- **Round trips** are counted per delivery through its context: every statement pgx sends through
  the pool (a pgx QueryTracer; BEGIN, COMMIT and ROLLBACK count; the statement preparation pgx does
  once per connection and statement is not counted) plus every Redis command (a go-redis hook; a
  pipeline counts once). RT/new key is the round trips of all deliveries of first copies over the
  number of keys; RT/dup of all deliveries of copies over the number of duplicates. A batch's own
  statements (the batched attempt record, BEGIN + claim, COMMIT) are counted against the first
  message of the batch, each handler's effect against its own: for the batched inboxes and the
  batched floor RT/msg is exact, the split between RT/new key and RT/dup is not. msgs/COMMIT is N
  over the COMMIT statements sent. SQLite's statements are calls into the embedded library, not
  round trips, and are not counted.
- **Memory**: alloc/msg is the growth of runtime.MemStats.TotalAlloc over the run divided by N; it
  includes the harness's own per-delivery allocations (message, context, counters), the same for
  every strategy (the none row is the floor). Heap Δ is the growth of HeapInuse over the run, both
  read after a GC, with the strategy's state (maps, filters) still alive at the end; it also holds
  the connections' caches of the run's prepared statements. The absolute value is in the CSV.
- **Correctness**: %s; on the first delivery of every %s message a fault is injected —
  a crash in the handler before the effect (after the claim), a crash after the effect and before
  the commit or lease completion, a crash after the handler chain returned (committed) and before
  the ack, or a handler error while the process lives. A crash kills the whole process: every
  delivery in flight dies where it is (its context is cancelled, its open transaction is rolled
  back, it reaches no store and acks nothing any more), the in-memory state is lost (a new memory
  store, a new Watermill repository, a new Bloom filter warmed from PostgreSQL again), Redis and
  the databases keep theirs. Every unacked or nacked message is delivered again, to the next
  process, until all are acked. Lease strategies and the two-tier lock use a %s lease so that a
  dead process's lease ends soon; a key in flight is nacked after the inbox's InFlightDelay (cut
  short at the lease's end) and delivered again later. Counted at the end from the effects
  table: keys with more than one effect row (double) and keys with none (lost).
- **redis-benchmark** runs EVALSHA of the store's claim script (SCRIPT LOAD of
  redis.ClaimScript()) on random new
  keys, lease 30 s and window 72 h as the inbox passes them, %d requests per client count. Next to
  it, redis.Store.LeaseClaim alone through go-redis at the same concurrency: the store's cost, which
  the target compares; redis-lease's msgs/s also include the effect (a PostgreSQL INSERT) and the
  completion of every message.

`, cfg.N, cfg.CrashN, cfg.CrashDupRatio*100, cfg.Seed, maxOf(cfg.Concurrency, cfg.CrashWorkers, cfg.PacedWorkers)+8,
		rawBatchSize, rawBatchSize, rawBatchSize, batchMax,
		workers(cfg.CrashWorkers), ordinal(cfg.CrashEvery), cfg.CrashLease, cfg.RedisBenchN)
	b.WriteString(note + "\n\n")
	b.WriteString(tables)
	return b.String()
}

// UpdateReport replaces (or appends) the report's section in path,
// keeping every other section.
func UpdateReport(path, section string) error {
	return mdsection.Replace(path, "# Benchmark results", sectionHead, section)
}

// csvHeader names the CSV's columns; a cell that does not apply is empty.
func csvHeader() []string {
	return []string{
		"kind", "strategy", "dup_pct", "concurrency", "fault", "n", "keys", "dups",
		"elapsed_s", "msgs_per_s", "ratio_raw", "p50_ms", "p99_ms",
		"pg_rt_per_msg", "redis_rt_per_msg", "rt_per_new_key", "rt_per_dup", "commits",
		"alloc_bytes_per_msg", "heap_inuse_bytes", "heap_growth_bytes", "deliveries", "in_flight_nacks", "errors",
		"effect_rows", "keys_once", "keys_double", "keys_lost",
		"faults", "processes", "bloom_maybe_seen", "bloom_false_positives", "lock_hits",
		"rps", "store_claims_per_s", "command",
	}
}

// WriteCSV writes every measured row to path.
func WriteCSV(path string, res *Results) error {
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	w := csv.NewWriter(f)
	header := csvHeader()
	rows := [][]string{header}
	row := func(kv map[string]string) []string {
		out := make([]string, len(header))
		for i, h := range header {
			out[i] = kv[h]
		}
		return out
	}
	fl := func(v float64, prec int) string { return strconv.FormatFloat(v, 'f', prec, 64) }
	it := strconv.Itoa
	ms := func(d time.Duration) string { return fl(float64(d)/float64(time.Millisecond), 3) }
	for _, r := range res.Speed {
		rows = append(rows, row(map[string]string{
			"kind":                  "speed",
			"strategy":              r.Strategy,
			"dup_pct":               it(r.DupPct),
			"concurrency":           it(r.Concurrency),
			"n":                     it(r.N),
			"keys":                  it(r.Keys),
			"dups":                  it(r.Dups),
			"elapsed_s":             fl(r.Elapsed.Seconds(), 3),
			"msgs_per_s":            fl(r.MsgsPerSec, 1),
			"ratio_raw":             fl(r.RatioRaw, 3),
			"p50_ms":                ms(r.P50),
			"p99_ms":                ms(r.P99),
			"pg_rt_per_msg":         fl(r.PGRT, 4),
			"redis_rt_per_msg":      fl(r.RedisRT, 4),
			"rt_per_new_key":        fl(r.RTNew, 4),
			"rt_per_dup":            fl(r.RTDup, 4),
			"commits":               strconv.FormatInt(r.Commits, 10),
			"alloc_bytes_per_msg":   fl(r.AllocPerMsg, 0),
			"heap_inuse_bytes":      strconv.FormatUint(r.HeapInuse, 10),
			"heap_growth_bytes":     strconv.FormatInt(r.HeapGrowth, 10),
			"deliveries":            it(r.Deliveries),
			"in_flight_nacks":       it(r.InFlight),
			"errors":                it(r.Errors),
			"effect_rows":           it(r.Effects.Rows),
			"keys_once":             it(r.Effects.Exactly),
			"keys_double":           it(r.Effects.Doubles),
			"keys_lost":             it(r.Keys - r.Effects.Keys),
			"bloom_maybe_seen":      strconv.FormatInt(r.BloomMaybeSeen, 10),
			"bloom_false_positives": strconv.FormatInt(r.BloomFalsePositives, 10),
			"lock_hits":             strconv.FormatInt(r.LockHits, 10),
		}))
	}
	for _, r := range res.RedisBench {
		rows = append(rows, row(map[string]string{
			"kind": "redis-benchmark", "strategy": "EVALSHA claim script", "concurrency": it(r.Concurrency), "n": it(r.Requests),
			"p50_ms": fl(r.P50, 3), "p99_ms": fl(r.P99, 3), "rps": fl(r.RPS, 1),
			"store_claims_per_s": fl(r.StoreClaimsPerSec, 1), "command": r.Command,
		}))
	}
	for _, r := range res.Crash {
		rows = append(rows, row(map[string]string{
			"kind": "correctness", "strategy": r.Strategy, "fault": r.Fault.short(), "n": it(r.N), "keys": it(r.Keys),
			"dups": it(r.N - r.Keys), "elapsed_s": fl(r.Elapsed.Seconds(), 3),
			"deliveries": it(r.Deliveries), "in_flight_nacks": it(r.InFlight), "errors": it(r.Errors),
			"effect_rows": it(r.Effects.Rows), "keys_once": it(r.Effects.Exactly), "keys_double": it(r.Effects.Doubles),
			"keys_lost": it(r.Lost), "faults": it(r.Faults), "processes": it(r.Processes),
		}))
	}
	werr := w.WriteAll(rows)
	return errors.Join(werr, f.Close())
}

// workers says "1 worker", "8 workers".
func workers(n int) string { return countOf(n, "worker") }

// countOf says "1 client", "8 clients".
func countOf(n int, noun string) string {
	if n == 1 {
		return "1 " + noun
	}
	return strconv.Itoa(n) + " " + noun + "s"
}

// ordinal says "7th", "2nd".
func ordinal(n int) string {
	suffix := "th"
	switch {
	case n%100 >= 11 && n%100 <= 13:
	case n%10 == 1:
		suffix = "st"
	case n%10 == 2:
		suffix = "nd"
	case n%10 == 3:
		suffix = "rd"
	}
	return strconv.Itoa(n) + suffix
}

func fmtSignedBytes(b int64) string {
	if b < 0 {
		return "−" + fmtBytes(float64(-b))
	}
	return "+" + fmtBytes(float64(b))
}

func fmtBytes(b float64) string {
	switch {
	case b >= 1<<20:
		return fmt.Sprintf("%.1f MiB", b/(1<<20))
	case b >= 10<<10:
		return fmt.Sprintf("%.0f KiB", b/(1<<10))
	case b >= 1<<10:
		return fmt.Sprintf("%.1f KiB", b/(1<<10))
	}
	return fmt.Sprintf("%.0f B", b)
}
