package main

import (
	"context"
	"encoding/csv"
	"image/png"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/oncemill/oncemill/internal/testing/mysqltest"
	"github.com/oncemill/oncemill/internal/testing/pgtest"
	"github.com/oncemill/oncemill/internal/testing/redistest"
)

// watermillCleanup is the goroutine Watermill v1.5.1's
// NewMapExpiringKeyRepository starts and never stops; every process of the
// watermill-deduplicator strategy leaves one behind.
const watermillCleanup = "github.com/ThreeDotsLabs/watermill/message/router/middleware.(*mapExpiringKeyRepository).cleanOutLoop"

// TestSmoke runs a tiny configuration of both halves on three strategies
// against the real PostgreSQL and Redis, checks that the counts add up and
// that the postgres inbox neither doubled nor lost an effect, renders every
// output, and checks that nothing keeps running.
func TestSmoke(t *testing.T) {
	// Both fail the test under CI=true when the service is unreachable.
	pgtest.Pool(t, 1)
	redistest.Client(t)
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent(), goleak.IgnoreTopFunction(watermillCleanup))

	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	bench := "redis-benchmark"
	if _, err := exec.LookPath(bench); err != nil {
		t.Logf("redis-benchmark not installed (%v): that part is not run", err)
		bench = ""
	}
	var out strings.Builder
	cfg := Config{
		DSN: pgtest.URL(), RedisURL: redistest.URL(),
		N: 80, DupRatios: []float64{0, 0.5}, Concurrency: []int{1, 8},
		Strategies: []string{stWatermill, stRedis, stPostgres, stPGBatch},
		Seed:       7, CrashN: 70, CrashDupRatio: 0.1, CrashEvery: 7, CrashWorkers: 4, CrashLease: 100 * time.Millisecond,
		RedisBenchmark: bench, RedisBenchN: 500, RunTimeout: time.Minute, Out: &out,
		PacedN: 60, PacedRate: 200, PacedWorkers: 8,
	}
	res, err := Run(ctx, cfg)
	t.Log(out.String())
	if err != nil {
		t.Fatal(err)
	}

	if want := len(cfg.DupRatios) * len(cfg.Concurrency) * (len(cfg.Strategies) + len(baselineDefs())); len(res.Speed) != want {
		t.Fatalf("got %d speed results, want %d", len(res.Speed), want)
	}
	for _, r := range res.Speed {
		name := r.Strategy + " " + strconv.Itoa(r.DupPct) + "% c=" + strconv.Itoa(r.Concurrency)
		if r.Keys+r.Dups != r.N || r.Deliveries < r.N || r.MsgsPerSec <= 0 {
			t.Errorf("%s: N %d, keys %d, dups %d, deliveries %d, %.0f msgs/s", name, r.N, r.Keys, r.Dups, r.Deliveries, r.MsgsPerSec)
		}
		if e := r.Effects; e.Keys != r.Keys || e.Exactly+e.Doubles != e.Keys || e.Rows < e.Exactly+2*e.Doubles {
			t.Errorf("%s: effects %+v do not add up for %d keys", name, e, r.Keys)
		}
		if r.Strategy != stRaw && r.RatioRaw <= 0 {
			t.Errorf("%s: no ratio to the raw baseline", name)
		}
		exact := r.Strategy == stPostgres || r.Strategy == stPGBatch || r.Strategy == stRaw || r.Strategy == stRawBatched
		if exact && (r.Effects.Doubles != 0 || r.Effects.Rows != r.Keys) {
			t.Errorf("%s: %d effect rows for %d keys", name, r.Effects.Rows, r.Keys)
		}
		// One worker takes the whole queue in transactions of
		// rawBatchSize.
		if want := int64((r.N + rawBatchSize - 1) / rawBatchSize); r.Strategy == stRawBatched && r.Concurrency == 1 && r.Commits != want {
			t.Errorf("%s: %d COMMITs for %d messages, want %d", name, r.Commits, r.N, want)
		}
		if r.Strategy == stRaw && r.Commits != int64(r.N) {
			t.Errorf("%s: %d COMMITs for %d messages", name, r.Commits, r.N)
		}
		// The default pipelines while duplicates are rare.
		if r.Strategy == stPostgres && r.DupPct == 0 && r.PGRT != 3 {
			t.Errorf("%s: %.3f round trips per message, want 3 (attempt start, BEGIN and claim in one; effect; COMMIT)", name, r.PGRT)
		}
	}
	// The paced runs: the raw baseline, the default inbox, the batched
	// inbox with and without a linger, each key applied once.
	if want := len(pacedRuns()); len(res.Paced) != want {
		t.Fatalf("got %d paced results, want %d", len(res.Paced), want)
	}
	for _, r := range res.Paced {
		if r.N != cfg.PacedN || r.Achieved <= 0 || r.P50 <= 0 || r.P99 < r.P50 || r.Max < r.P99 {
			t.Errorf("paced %s: %+v", r.Name(), r)
		}
		if r.Effects.Doubles != 0 || r.Lost != 0 || r.Effects.Rows != r.Effects.Keys {
			t.Errorf("paced %s: effects %+v, %d lost, want one per key", r.Name(), r.Effects, r.Lost)
		}
	}
	if bench != "" && len(res.RedisBench) != len(cfg.Concurrency) {
		t.Errorf("got %d redis-benchmark results, want %d (%s)", len(res.RedisBench), len(cfg.Concurrency), res.RedisBenchSkipped)
	}
	for _, r := range res.RedisBench {
		if r.RPS <= 0 || r.StoreClaimsPerSec <= 0 || !strings.Contains(r.Command, "EVALSHA") {
			t.Errorf("redis-benchmark c=%d: %+v", r.Concurrency, r)
		}
	}

	if want := len(cfg.Strategies) * len(faults()); len(res.Crash) != want {
		t.Fatalf("got %d correctness results, want %d", len(res.Crash), want)
	}
	for _, r := range res.Crash {
		name := r.Strategy + " / " + r.Fault.String()
		e := r.Effects
		if e.Exactly+e.Doubles+r.Lost != r.Keys || e.Keys+r.Lost != r.Keys || e.Rows < e.Exactly+2*e.Doubles {
			t.Errorf("%s: effects %+v and %d lost do not add up to %d keys", name, e, r.Lost, r.Keys)
		}
		if r.Faults != cfg.CrashN/cfg.CrashEvery || r.Deliveries < r.N {
			t.Errorf("%s: %d faults, %d deliveries for %d messages", name, r.Faults, r.Deliveries, r.N)
		}
		if r.Fault != faultHandlerError && r.Processes < 2 {
			t.Errorf("%s: %d processes: the crashes did not restart it", name, r.Processes)
		}
		if (r.Strategy == stPostgres || r.Strategy == stPGBatch) && (e.Doubles != 0 || r.Lost != 0) {
			t.Errorf("%s: %d double, %d lost, want 0 and 0", name, e.Doubles, r.Lost)
		}
		if r.Strategy == stWatermill && r.Fault == faultHandlerError && r.Lost == 0 {
			t.Errorf("%s: no key lost, although a failed delivery's key stays recorded", name)
		}
	}

	tables := Markdown(res, cfg)
	for _, want := range []string{"| postgres-inbox |", "| raw-sql-batched |", "### Correctness under faults", "### Targets",
		"postgres-inbox: 0 double / 0 lost", "postgres-inbox-batched: 0 double / 0 lost",
		"postgres-inbox (the default: batching off), crash-loop count on, ≥ 1.0× raw SQL", "postgres-inbox-batched / raw-sql-batched",
		"### Latency at a steady 200 msgs/s", "| postgres-inbox-batched, Linger 2ms |", "p99 ≤ postgres-inbox's p99 + Linger"} {
		if !strings.Contains(tables, want) {
			t.Errorf("report lacks %q:\n%s", want, tables)
		}
	}
	dir := t.TempDir()
	report := filepath.Join(dir, "RESULTS.md")
	if err := os.WriteFile(report, []byte("# Results\n\n## Deduplication strategies\n\nold\n\n## Other\n\nkept\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	csvPath, pngPath := filepath.Join(dir, "dedup", "results.csv"), filepath.Join(dir, "dedup", "throughput.png")
	if err := writeOutputs(res, cfg, Section("note", tables, cfg), report, csvPath, pngPath); err != nil {
		t.Fatal(err)
	}
	b, _ := os.ReadFile(report)
	if s := string(b); strings.Contains(s, "\nold\n") || !strings.Contains(s, "## Other\n\nkept\n") || !strings.Contains(s, "note") {
		t.Errorf("report not updated as expected:\n%s", s)
	}
	f, err := os.Open(csvPath)
	if err != nil {
		t.Fatal(err)
	}
	rows, err := csv.NewReader(f).ReadAll()
	_ = f.Close()
	if want := 1 + len(res.Speed) + len(res.Crash) + len(res.RedisBench); err != nil || len(rows) != want {
		t.Errorf("CSV: %d rows (%v), want %d", len(rows), err, want)
	}
	f, err = os.Open(pngPath)
	if err != nil {
		t.Fatal(err)
	}
	img, err := png.Decode(f)
	_ = f.Close()
	if err != nil || img.Bounds().Dx() < 500 {
		t.Errorf("chart: %v, %v", err, img)
	}
}

// TestSmokeSQL runs the database/sql strategies, on PostgreSQL through
// pgx's stdlib driver and on MySQL, each with its own raw-SQL baseline:
// every key applied once in the speed runs, 0 double and 0 lost under
// every fault, each store's ratio taken against its own baseline.
func TestSmokeSQL(t *testing.T) {
	// Both fail the test under CI=true when the server is unreachable.
	pgtest.Pool(t, 1)
	mysqltest.Open(t, mysqltest.Config(t, ""), 1)
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent())

	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	var out strings.Builder
	cfg := Config{
		DSN: pgtest.URL(), MySQLDSN: mysqltest.DSN(),
		N: 60, DupRatios: []float64{0, 0.5}, Concurrency: []int{1, 4},
		Strategies: []string{stSQLStorePG, stSQLStoreMy},
		Seed:       7, CrashN: 70, CrashDupRatio: 0.1, CrashEvery: 7, CrashWorkers: 4, CrashLease: 100 * time.Millisecond,
		RunTimeout: time.Minute, Out: &out,
	}
	res, err := Run(ctx, cfg)
	t.Log(out.String())
	if err != nil {
		t.Fatal(err)
	}
	// Each store brings its own baseline, and only that one.
	if want := len(cfg.DupRatios) * len(cfg.Concurrency) * 4; len(res.Speed) != want {
		t.Fatalf("got %d speed results, want %d", len(res.Speed), want)
	}
	for _, r := range res.Speed {
		name := r.Strategy + " " + strconv.Itoa(r.DupPct) + "% c=" + strconv.Itoa(r.Concurrency)
		if r.Effects.Doubles != 0 || r.Effects.Rows != r.Keys || r.Effects.Keys != r.Keys {
			t.Errorf("%s: effects %+v for %d keys, want one per key", name, r.Effects, r.Keys)
		}
		raw, ok := findSpeed(res.Speed, rawOf(r.Strategy), r.DupPct, r.Concurrency)
		switch {
		case r.Strategy == stRawStdlib || r.Strategy == stRawMySQL:
			if r.RatioRaw != 0 {
				t.Errorf("%s: ratio %.2f, want none for a baseline", name, r.RatioRaw)
			}
		case !ok || r.RatioRaw != r.MsgsPerSec/raw.MsgsPerSec:
			t.Errorf("%s: ratio %.3f, not to %s (found %v)", name, r.RatioRaw, rawOf(r.Strategy), ok)
		}
	}
	if want := len(cfg.Strategies) * len(faults()); len(res.Crash) != want {
		t.Fatalf("got %d correctness results, want %d", len(res.Crash), want)
	}
	for _, r := range res.Crash {
		if r.Effects.Doubles != 0 || r.Lost != 0 || r.Faults != cfg.CrashN/cfg.CrashEvery {
			t.Errorf("%s / %s: %d double, %d lost, %d faults; want 0, 0 and %d", r.Strategy, r.Fault, r.Effects.Doubles, r.Lost, r.Faults, cfg.CrashN/cfg.CrashEvery)
		}
	}
	tables := Markdown(res, cfg)
	for _, want := range []string{"| raw-sql-stdlib |", "| sqlstore-mysql |", "sqlstore-postgres ≥ 1.0× raw-sql-stdlib",
		"sqlstore-mysql ≥ 1.0× raw-sql-mysql", "sqlstore-mysql: 0 double / 0 lost"} {
		if !strings.Contains(tables, want) {
			t.Errorf("report lacks %q:\n%s", want, tables)
		}
	}
	if strings.Contains(tables, "| raw-sql |") {
		t.Errorf("report has the pgx baseline, which no strategy of this run compares with:\n%s", tables)
	}
}

// TestUnreachableMySQL checks that a run needing MySQL fails, naming the
// DSN, when the server cannot be reached.
func TestUnreachableMySQL(t *testing.T) {
	pgtest.Pool(t, 1)
	dsn := "root@tcp(127.0.0.1:1)/test"
	cfg := Config{
		DSN: pgtest.URL(), MySQLDSN: dsn,
		N: 10, DupRatios: []float64{0}, Concurrency: []int{1}, Strategies: []string{stSQLStoreMy},
		CrashN: 10, CrashEvery: 7, CrashWorkers: 1, CrashLease: time.Second, RunTimeout: time.Minute,
	}
	_, err := Run(context.Background(), cfg)
	if err == nil || !strings.Contains(err.Error(), "127.0.0.1:1") {
		t.Fatalf("got %v, want an error naming the DSN", err)
	}
}

// TestStream checks that a stream is reproducible and has the duplicates
// it was asked for, each a copy of an earlier key.
func TestStream(t *testing.T) {
	a, b := newStream(1000, 0.3, 5), newStream(1000, 0.3, 5)
	if a.Dups != 300 || a.Keys != 700 {
		t.Fatalf("got %d keys and %d dups, want 700 and 300", a.Keys, a.Dups)
	}
	seen := map[string]bool{}
	uuids := map[string]bool{}
	for i, m := range a.Msgs {
		if b.Msgs[i].UUID != m.UUID || b.Msgs[i].Key != m.Key {
			t.Fatalf("message %d differs between two streams of the same seed", i)
		}
		if m.Dup != seen[m.Key] {
			t.Fatalf("message %d: Dup %v, but key seen before: %v", i, m.Dup, seen[m.Key])
		}
		if uuids[m.UUID] {
			t.Fatalf("message %d: UUID %s repeated", i, m.UUID)
		}
		seen[m.Key], uuids[m.UUID] = true, true
	}
	if c := newStream(1000, 0.3, 6); c.Msgs[500].UUID == a.Msgs[500].UUID {
		t.Error("another seed gave the same stream")
	}
	if s := newStream(1, 0.9, 1); s.Keys != 1 || s.Dups != 0 {
		t.Errorf("one message: %d keys, %d dups", s.Keys, s.Dups)
	}
}
