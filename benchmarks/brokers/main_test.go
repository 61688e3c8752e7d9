package main

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/oncemill/oncemill/internal/testing/amqptest"
	"github.com/oncemill/oncemill/internal/testing/pgtest"
)

// TestSmoke runs every row once on RabbitMQ and NATS, small, with the real
// PostgreSQL: each run applies every message once and each account's
// versions in order, the batch row commits several messages a call, the
// report names every row and the targets, and its section replaces the
// README's.
func TestSmoke(t *testing.T) {
	// Fail under CI=true when PostgreSQL is unreachable.
	pgtest.Pool(t, 1)
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var out strings.Builder
	cfg := Config{
		DSN: pgtest.URL(), AMQP: amqptest.URL(), NATS: natsURL(), Brokers: []string{"amqp", "nats"}, Rows: rows(),
		Accounts: 20, Versions: 4, InFlight: 16, BatchSize: 8, PoolSize: 8, Reps: 1, RunTimeout: time.Minute, Out: &out,
	}
	res, err := Run(ctx, cfg)
	t.Log(out.String())
	if err != nil {
		t.Fatal(err)
	}
	if want := len(cfg.Brokers) * len(rows()); len(res.Samples) != want {
		t.Fatalf("%d samples, want %d", len(res.Samples), want)
	}
	for _, s := range res.Samples {
		if !s.ok() || s.N != 80 || s.MsgsPerSec <= 0 {
			t.Errorf("%s %s: %+v", s.Broker, s.Row, s)
		}
		if s.Row == rowBatch && s.Calls >= int64(s.N) {
			t.Errorf("%s: %d batch calls for %d messages", s.Broker, s.Calls, s.N)
		}
		if s.Row != rowBatch && s.Calls != int64(s.N) {
			t.Errorf("%s %s: %d handler calls for %d messages", s.Broker, s.Row, s.Calls, s.N)
		}
	}
	if f := Failures(res); len(f) != 0 {
		t.Errorf("failures: %v", f)
	}
	table := Markdown(res, cfg)
	for _, want := range []string{"**RabbitMQ (watermill-amqp v3)**", "**NATS JetStream", "| stock Watermill subscriber, inbox, a transaction per message | ",
		"oncemill-batch over stock", "0 doubled, 0 lost, 0 accounts out of order in 8 runs."} {
		if !strings.Contains(table, want) {
			t.Errorf("table lacks %q:\n%s", want, table)
		}
	}
	readme := filepath.Join(t.TempDir(), "README.md")
	if err := os.WriteFile(readme, []byte("# Benchmarks\n\n"+sectionHead+"\n\nold\n\n## Next\n\nkept\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := UpdateReadme(readme, table); err != nil {
		t.Fatal(err)
	}
	b, _ := os.ReadFile(readme)
	if s := string(b); strings.Contains(s, "\nold\n") || !strings.Contains(s, "## Next\n\nkept\n") || !strings.Contains(s, "oncemill-batch over stock") {
		t.Errorf("README not updated as expected:\n%s", s)
	}
}

// natsURL is the NATS server with JetStream the tests use.
func natsURL() string {
	if u := os.Getenv("ONCEMILL_NATS_URL"); u != "" {
		return u
	}
	return "nats://127.0.0.1:4222"
}
