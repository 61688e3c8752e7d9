package main

import (
	"context"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"go.uber.org/goleak"

	"github.com/oncemill/oncemill/internal/pgtest"
)

// TestSmoke runs a tiny benchmark, GoChannel only, against the PostgreSQL
// of DATABASE_URL (or the default), and checks that every event arrived
// and that nothing keeps running.
func TestSmoke(t *testing.T) {
	if testing.Short() {
		t.Skip("needs PostgreSQL")
	}
	dsn := envOr("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/test?sslmode=disable")
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	conn, err := pgx.Connect(ctx, dsn)
	if err != nil {
		pgtest.Unavailable(t, "PostgreSQL", err)
	}
	_ = conn.Close(ctx)
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent())

	var out strings.Builder
	results, err := Run(ctx, Config{
		DSN: dsn, NOurs: 200, NStock: 200, Rate: 200,
		Duration: 500 * time.Millisecond, Drain: 5 * time.Second, Timeout: 20 * time.Second,
		Instances: []int{1}, Brokers: []string{brokerGo}, Out: &out,
	})
	t.Log(out.String())
	if err != nil {
		t.Fatal(err)
	}
	if len(results) != 2 {
		t.Fatalf("got %d results, want 2", len(results))
	}
	for _, r := range results {
		if r.Delivered != r.N || r.TimedOut {
			t.Errorf("%s: throughput run delivered %d of %d", r.Scenario, r.Delivered, r.N)
		}
		if r.Sent == 0 || r.LatArrived != r.Sent {
			t.Errorf("%s: latency run: %d of %d arrived", r.Scenario, r.LatArrived, r.Sent)
		}
	}
	table := Markdown(results, Config{})
	if !strings.Contains(table, "| oncemill relay | 1 | GoChannel |") {
		t.Errorf("table lacks oncemill's row:\n%s", table)
	}

	readme := t.TempDir() + "/README.md"
	if err := os.WriteFile(readme, []byte("# Benchmarks\n\n## Outbox relay\n\nold\n\n## Other\n\nkept\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := UpdateReadme(readme, Section("note", table, Config{})); err != nil {
		t.Fatal(err)
	}
	b, _ := os.ReadFile(readme)
	if s := string(b); strings.Contains(s, "\nold\n") || !strings.Contains(s, "## Other\n\nkept\n") || !strings.Contains(s, "note") {
		t.Errorf("README not updated as expected:\n%s", s)
	}
}
