package main

import (
	"context"
	"fmt"
	"image/png"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"go.uber.org/goleak"

	"github.com/oncemill/oncemill/internal/testing/pgtest"
)

// saramaMetrics is the process-wide goroutine that Sarama's metrics start
// and nothing stops.
const saramaMetrics = "github.com/rcrowley/go-metrics.(*meterArbiter).tick"

// TestSmoke runs every subscriber once on a tiny stream over the embedded
// broker and the real PostgreSQL, checks that every run applied each
// payment exactly once and in order, renders the report and the chart,
// and checks that nothing keeps running.
func TestSmoke(t *testing.T) {
	// Fails the test under CI=true when PostgreSQL is unreachable.
	pgtest.Pool(t, 1)
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent(), goleak.IgnoreTopFunction(saramaMetrics))

	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	var out strings.Builder
	cfg := Config{
		DSN: pgtest.URL(), N: 200, Keys: 20, DupRatio: 0.1, Seed: 3,
		Partitions: []int{1, 2}, Reps: 1, MaxConns: 8, RunTimeout: 30 * time.Second, Out: &out,
	}
	res, err := Run(ctx, cfg)
	t.Log(out.String())
	if err != nil {
		t.Fatal(err)
	}

	if want := len(cfg.Partitions) * len(systems()); len(res.Samples) != want || len(res.Rows) != want {
		t.Fatalf("got %d samples and %d rows, want %d", len(res.Samples), len(res.Rows), want)
	}
	if res.Stream.Keys+res.Stream.Dups != cfg.N || res.Stream.Dups != 20 {
		t.Errorf("stream: %+v", res.Stream)
	}
	for _, smp := range res.Samples {
		name := fmt.Sprintf("%s p=%d", chartName(smp.System, cfg), smp.Partitions)
		c := smp.Effects
		if !c.ok() || c.Rows != res.Stream.Keys || c.Keys != res.Stream.Keys {
			t.Errorf("%s: effects %+v, want %d rows, one per payment", name, c, res.Stream.Keys)
		}
		if smp.MsgsPerSec <= 0 || smp.Deliveries < int64(cfg.N) || smp.FirstMsg <= 0 || smp.FirstMsg > smp.Elapsed {
			t.Errorf("%s: %.0f msgs/s, %d deliveries, first message after %s of %s", name, smp.MsgsPerSec, smp.Deliveries, smp.FirstMsg, smp.Elapsed)
		}
		if usesInbox(smp.System) && (smp.Inbox.Applied != int64(res.Stream.Keys) || smp.Inbox.Duplicates < int64(res.Stream.Dups)) {
			t.Errorf("%s: inbox applied %d and dropped %d, want %d and at least %d", name, smp.Inbox.Applied, smp.Inbox.Duplicates, res.Stream.Keys, res.Stream.Dups)
		}
		switch smp.System {
		case sysStock, sysSerial:
			if smp.PeakInFlight > int64(smp.Partitions) {
				t.Errorf("%s: %d messages at once, more than one per partition", name, smp.PeakInFlight)
			}
		}
	}
	for _, r := range res.Rows {
		if r.RatioStock <= 0 || r.RatioNoInbox <= 0 {
			t.Errorf("%s p=%d: ratios %.2f and %.2f", r.System, r.Partitions, r.RatioStock, r.RatioNoInbox)
		}
	}
	if f := Failures(res, cfg); len(f) != 0 {
		t.Errorf("failures: %v", f)
	}

	table := Markdown(res, cfg)
	for _, want := range []string{"| watermill-kafka `NewSubscriber` (stock) | 1 |", "| oncemill key-parallel (64), **no inbox** | 2 |", "| oncemill key-parallel (64), `Batch` (32), `BatchHandler` | 1 |",
		"`BatchHandler` with the inbox ≥ 1.0× the same handler with no inbox, 1 partition",
		"key-parallel ≥ 5× watermill-kafka at 1 partition", fmt.Sprintf("0 order violations — **PASS** (%d runs)", len(cfg.Partitions)*len(systems()))} {
		if !strings.Contains(table, want) {
			t.Errorf("table lacks %q:\n%s", want, table)
		}
	}
	dir := t.TempDir()
	readme, chart := filepath.Join(dir, "README.md"), filepath.Join(dir, "kafka", "throughput.png")
	if err := os.WriteFile(readme, []byte("# Benchmarks\n\n## Outbox relay\n\nkept\n\n## Kafka end to end\n\nold\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := writeOutputs(res, cfg, "note", table, readme, chart); err != nil {
		t.Fatal(err)
	}
	b, _ := os.ReadFile(readme)
	if s := string(b); strings.Contains(s, "\nold\n") || !strings.Contains(s, "## Outbox relay\n\nkept\n") ||
		!strings.Contains(s, "note") || !strings.Contains(s, "](kafka/throughput.png)") {
		t.Errorf("README not updated as expected:\n%s", s)
	}
	f, err := os.Open(chart)
	if err != nil {
		t.Fatal(err)
	}
	img, err := png.Decode(f)
	_ = f.Close()
	if err != nil || img.Bounds().Dx() < 500 {
		t.Errorf("chart: %v, %v", err, img)
	}
}

// TestCountEffects checks the counting on hand-written effect rows: a
// doubled payment, a lost one and two order violations; and that the
// no-inbox baseline's effect statement deduplicates by itself.
func TestCountEffects(t *testing.T) {
	pgtest.Pool(t, 1)
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent(), goleak.IgnoreTopFunction(saramaMetrics))
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	e, closeEnv, err := newEnv(ctx, Config{DSN: pgtest.URL(), Partitions: []int{1}, MaxConns: 4, Out: &strings.Builder{}})
	if err != nil {
		t.Fatal(err)
	}
	defer closeEnv()

	f, err := e.newFixture(ctx, sysParallel, 1)
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		if err := f.close(context.Background()); err != nil {
			t.Error(err)
		}
	}()
	// Applied in this order: order o1 gets seq 1, 3, 2 and 1 again (pay-1
	// doubled); o2 is in order; pay-5 of the stream's five is lost.
	for _, r := range []struct {
		key, order string
		seq        int
	}{{"pay-1", "o1", 1}, {"pay-3", "o1", 3}, {"pay-2", "o1", 2}, {"pay-1", "o1", 1}, {"pay-4", "o2", 1}} {
		if _, err := e.pool.Exec(ctx, f.insert, r.key, r.order, r.seq, 100); err != nil {
			t.Fatal(err)
		}
	}
	got, err := f.countEffects(ctx, &stream{Keys: 5})
	if err != nil {
		t.Fatal(err)
	}
	if want := (effectCounts{Rows: 5, Keys: 4, Doubled: 1, Lost: 1, OrderViolations: 2}); got != want {
		t.Errorf("got %+v, want %+v", got, want)
	}
	if got.ok() {
		t.Error("ok() for wrong effects")
	}

	b, err := e.newFixture(ctx, sysNoInbox, 1)
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		if err := b.close(context.Background()); err != nil {
			t.Error(err)
		}
	}()
	for range 2 {
		if _, err := e.pool.Exec(ctx, b.insert, "pay-1", "o1", 1, 100); err != nil {
			t.Fatal(err)
		}
	}
	if got, err := b.countEffects(ctx, &stream{Keys: 1}); err != nil || got != (effectCounts{Rows: 1, Keys: 1}) || !got.ok() {
		t.Errorf("baseline: got %+v, %v; want one row", got, err)
	}

	var n int
	if err := e.pool.QueryRow(ctx, `SELECT count(*) FROM `+pgx.Identifier{f.schema, "inbox"}.Sanitize()).Scan(&n); err != nil || n != 0 {
		t.Errorf("inbox table of the fixture: %d rows, %v", n, err)
	}
}

// TestStream checks that a stream is reproducible and shaped as asked:
// the duplicates, each a copy of an earlier payment; the per-order
// sequence numbers; unique UUIDs.
func TestStream(t *testing.T) {
	a, b := newStream(2000, 50, 0.1, 5), newStream(2000, 50, 0.1, 5)
	if a.Dups != 200 || a.Keys != 1800 || a.Orders != 50 {
		t.Fatalf("got %d payments, %d dups, %d orders; want 1800, 200, 50", a.Keys, a.Dups, a.Orders)
	}
	seen := map[string]event{}
	next := map[string]int{}
	uuids := map[string]bool{}
	for i, ev := range a.Events {
		if b.Events[i].UUID != ev.UUID || string(b.Events[i].Payload) != string(ev.Payload) {
			t.Fatalf("event %d differs between two streams of the same seed", i)
		}
		if uuids[ev.UUID] {
			t.Fatalf("event %d: UUID %s repeated", i, ev.UUID)
		}
		uuids[ev.UUID] = true
		orig, dup := seen[ev.Key]
		if dup != ev.Dup {
			t.Fatalf("event %d: Dup %v, but key seen before: %v", i, ev.Dup, dup)
		}
		if dup {
			if orig.Order != ev.Order || orig.Seq != ev.Seq || string(orig.Payload) != string(ev.Payload) {
				t.Fatalf("event %d: duplicate %+v differs from its original %+v", i, ev, orig)
			}
			continue
		}
		next[ev.Order]++
		if ev.Seq != next[ev.Order] {
			t.Fatalf("event %d: order %s seq %d, want %d", i, ev.Order, ev.Seq, next[ev.Order])
		}
		if m := ev.message(); m.Metadata.Get("idempotency_key") != ev.Key || m.Metadata.Get("partition_key") != ev.Order {
			t.Fatalf("event %d: message metadata %v", i, m.Metadata)
		}
		seen[ev.Key] = ev
	}
	if c := newStream(2000, 50, 0.1, 6); c.Events[500].UUID == a.Events[500].UUID {
		t.Error("another seed gave the same stream")
	}
	if s := newStream(1, 10, 0.5, 1); s.Keys != 1 || s.Dups != 0 {
		t.Errorf("one event: %d payments, %d dups", s.Keys, s.Dups)
	}
}

// TestFailures checks that wrong effects surface in the failures and the
// targets.
func TestFailures(t *testing.T) {
	cfg := Config{Partitions: []int{1}, Reps: 1}
	res := &Results{Rows: []Row{
		{System: sysStock, Partitions: 1, Reps: 1, MsgsPerSec: 100},
		{System: sysParallel, Partitions: 1, Reps: 1, MsgsPerSec: 600, RatioStock: 6, Lost: 2},
	}}
	f := Failures(res, cfg)
	if len(f) != 1 || !strings.Contains(f[0], "2 lost") {
		t.Errorf("failures: %v", f)
	}
	table := Markdown(res, cfg)
	if !strings.Contains(table, "**FAIL**") || !strings.Contains(table, "6.00× — **PASS**") {
		t.Errorf("table:\n%s", table)
	}
}
