package main

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/oncemill/oncemill/internal/testing/pgtest"
)

// TestSmoke runs every subscriber once in each kind of run, small, on an
// embedded NATS server and the real PostgreSQL; checks that every run
// applied each payment exactly once, that oncemill's subscribers
// delivered each slow message once, renders the report and writes the
// README section, and checks that nothing keeps running.
func TestSmoke(t *testing.T) {
	// Fails the test under CI=true when PostgreSQL is unreachable.
	pgtest.Pool(t, 1)
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent())

	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var out strings.Builder
	cfg := Config{
		DSN: pgtest.URL(), Server: "embedded", N: 200, DupRatio: 0.1, Seed: 3,
		Rate: 100, PacedFor: time.Second, Slow: 2, SlowAckWait: time.Second, SlowWork: 2 * time.Second,
		MaxInFlight: 4, Reps: 1, RunTimeout: time.Minute, Out: &out,
	}
	res, err := Run(ctx, cfg)
	t.Log(out.String())
	if err != nil {
		t.Fatal(err)
	}
	if want := len(kinds()) * len(systems()); len(res.Samples) != want || len(res.Rows) != want {
		t.Fatalf("got %d samples and %d rows, want %d", len(res.Samples), len(res.Rows), want)
	}
	for _, s := range res.Samples {
		if !s.Effects.ok() || s.Effects.Keys != s.Effects.Rows {
			t.Errorf("%s, %s run: effects %+v", s.System, s.Kind, s.Effects)
		}
		if s.Deliveries < int64(s.N) || s.MsgsPerSec <= 0 {
			t.Errorf("%s, %s run: %d deliveries of %d messages, %.0f msgs/s", s.System, s.Kind, s.Deliveries, s.N, s.MsgsPerSec)
		}
		if s.Kind == kindLatency && (s.P50 <= 0 || s.P99 < s.P50 || s.Max < s.P99) {
			t.Errorf("%s: latencies p50 %s p99 %s max %s", s.System, s.P50, s.P99, s.Max)
		}
		if s.Kind == kindInProgress && !stock(s.System) && (s.InProgress != 0 || s.Deliveries != int64(s.N)) {
			t.Errorf("%s: %d deliveries of %d slow messages, %d while in progress; want each delivered once", s.System, s.Deliveries, s.N, s.InProgress)
		}
	}
	if f := Failures(res); len(f) != 0 {
		t.Errorf("failures: %v", f)
	}

	table := Markdown(res, cfg)
	for _, want := range []string{"| watermill-nats `pkg/nats`, JetStream (stock) | ", "| oncemill `adapters/nats`, 4 in flight | ",
		"is not redelivered while it runs", "0 doubled, 0 lost — **PASS** (12 runs)"} {
		if !strings.Contains(table, want) {
			t.Errorf("table lacks %q:\n%s", want, table)
		}
	}
	readme := filepath.Join(t.TempDir(), "README.md")
	if err := os.WriteFile(readme, []byte("# Benchmarks\n\n## Kafka end to end\n\nkept\n\n## NATS end to end\n\nold\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := UpdateReadme(readme, Section("note", table, res, cfg)); err != nil {
		t.Fatal(err)
	}
	b, _ := os.ReadFile(readme)
	if s := string(b); strings.Contains(s, "\nold\n") || !strings.Contains(s, "## Kafka end to end\n\nkept\n") || !strings.Contains(s, "note") {
		t.Errorf("README not updated as expected:\n%s", s)
	}
}

// TestEvents checks that the stream is reproducible and has its
// duplicates, each a copy of an earlier payment with a UUID of its own.
func TestEvents(t *testing.T) {
	a, keys := events(1000, 0.1, 5)
	b, _ := events(1000, 0.1, 5)
	if keys != 900 {
		t.Fatalf("%d payments, want 900", keys)
	}
	seen := map[string]event{}
	uuids := map[string]bool{}
	for i, ev := range a {
		if b[i].UUID != ev.UUID || string(b[i].Payload) != string(ev.Payload) {
			t.Fatalf("event %d differs between two streams of the same seed", i)
		}
		if uuids[ev.UUID] {
			t.Fatalf("event %d: UUID %s repeated", i, ev.UUID)
		}
		uuids[ev.UUID] = true
		orig, dup := seen[ev.Key]
		if dup != ev.Dup || (dup && string(orig.Payload) != string(ev.Payload)) {
			t.Fatalf("event %d: Dup %v, seen before %v", i, ev.Dup, dup)
		}
		if !dup {
			seen[ev.Key] = ev
		}
		m := ev.natsMsg("s")
		if m.Header.Get("idempotency_key") != ev.Key || m.Header.Get("Nats-Msg-Id") != ev.UUID {
			t.Fatalf("event %d: headers %v", i, m.Header)
		}
	}
}
