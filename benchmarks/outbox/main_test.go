package main

import (
	"context"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"go.uber.org/goleak"

	"github.com/oncemill/oncemill/benchmarks/internal/benchutil"
	"github.com/oncemill/oncemill/internal/testing/pgtest"
)

// TestSmoke runs a tiny benchmark, GoChannel only, against the PostgreSQL
// of DATABASE_URL (or the default), and checks that every event arrived
// and that nothing keeps running.
func TestSmoke(t *testing.T) {
	if testing.Short() {
		t.Skip("needs PostgreSQL")
	}
	dsn := benchutil.EnvOr("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/test?sslmode=disable")
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	conn, err := pgx.Connect(ctx, dsn)
	if err != nil {
		pgtest.Unavailable(t, "PostgreSQL", err)
	}
	_ = conn.Close(ctx)
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent())

	var out strings.Builder
	cfg := Config{
		DSN: dsn, NOurs: 200, NStock: 200, Rate: 200,
		Duration: 500 * time.Millisecond, Drain: 5 * time.Second, Timeout: 20 * time.Second,
		Instances: []int{1}, Brokers: []string{brokerGo}, Out: &out,
		WriterCounts: []int{2}, WriterRelays: []int{0, 1}, WriterRound: 200 * time.Millisecond, WriterRepeats: 1,
		Idle: 500 * time.Millisecond, Ahead: 300 * time.Millisecond,
	}
	rep, err := Run(ctx, cfg)
	t.Log(out.String())
	if err != nil {
		t.Fatal(err)
	}
	if len(rep.Relay) != 2 {
		t.Fatalf("got %d results, want 2", len(rep.Relay))
	}
	for _, r := range rep.Relay {
		if r.Delivered != r.N || r.TimedOut {
			t.Errorf("%s: throughput run delivered %d of %d", r.Scenario, r.Delivered, r.N)
		}
		if r.Sent == 0 || r.LatArrived != r.Sent {
			t.Errorf("%s: latency run: %d of %d arrived", r.Scenario, r.LatArrived, r.Sent)
		}
	}
	if len(rep.Floor) != 1 {
		t.Fatalf("got %d floor results, want 1", len(rep.Floor))
	}
	for _, r := range []Result{rep.Floor[0].Raw, rep.Floor[0].Relay} {
		if r.Delivered != r.N || r.TimedOut {
			t.Errorf("floor %s: delivered %d of %d", r.Scenario, r.Delivered, r.N)
		}
	}
	if len(rep.Writers) != 3 {
		t.Fatalf("got %d writer results, want 3", len(rep.Writers))
	}
	for i, want := range []string{drainNone, drainRelay, drainRaw} {
		if got := rep.Writers[i].Drain; got != want {
			t.Errorf("writer cell %d: drain %q, want %q", i, got, want)
		}
	}
	for _, w := range rep.Writers {
		if w.BaselineTPS <= 0 || w.OutboxTPS <= 0 {
			t.Errorf("writers %d, %s: baseline %.0f tx/s, outbox %.0f tx/s", w.Writers, w.drainers(), w.BaselineTPS, w.OutboxTPS)
		}
		if w.Relays > 0 && w.RelayQPS <= 0 {
			t.Errorf("writers %d, %s: no drainer statements counted", w.Writers, w.drainers())
		}
	}
	if rep.Idle == nil || rep.Idle.Statements == 0 {
		t.Errorf("idle relay: %+v, want some statements", rep.Idle)
	}
	if s := rep.Scheduled; s == nil || s.Due == 0 || s.Arrived != s.Due || s.Early != 0 || s.Dups != 0 || s.Immediate == 0 || s.ImmArrived != s.Immediate {
		t.Errorf("scheduled messages: %+v, want every due and immediate message once, none early", s)
	}
	table := Markdown(rep, cfg.withDefaults())
	for _, want := range []string{"| oncemill relay | 1 | GoChannel |", "| GoChannel | 1 | 200 |", "| 2 | 1 |", "| 2 | 1 (SKIP LOCKED floor) |", "with 1 raw SKIP LOCKED workers", "### Idle relay", "### Scheduled messages", "| 200 | 500ms |"} {
		if !strings.Contains(table, want) {
			t.Errorf("table lacks %q:\n%s", want, table)
		}
	}

	readme := t.TempDir() + "/README.md"
	if err := os.WriteFile(readme, []byte("# Benchmarks\n\n## Outbox relay\n\nold\n\n## Other\n\nkept\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := UpdateReadme(readme, Section("note", table, rep, Config{})); err != nil {
		t.Fatal(err)
	}
	b, _ := os.ReadFile(readme)
	if s := string(b); strings.Contains(s, "\nold\n") || !strings.Contains(s, "## Other\n\nkept\n") || !strings.Contains(s, "note") {
		t.Errorf("README not updated as expected:\n%s", s)
	}
}
