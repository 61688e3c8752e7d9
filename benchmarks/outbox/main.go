// Command outbox compares oncemill's outbox relay (package forwarder) with
// Watermill's own forwarder (components/forwarder over watermill-sql v4) on
// one PostgreSQL, publishing to a Watermill GoChannel and to the embedded
// Kafka broker.
//
// For each system, instance count (1 and 4) and broker it measures
//
//   - throughput: N events are written first, in transactions of 50, then
//     the relays (or forwarders) start, and the clock runs until all N have
//     arrived;
//   - commit-to-publish latency: a writer commits one event per transaction
//     at a steady rate, records the time Commit returned, and the latency
//     of each event is its arrival time minus that commit time.
//
// Arrival is the time a GoChannel subscriber receives the message, or, for
// Kafka, the time the Kafka publisher's Publish of that message returned
// (the broker acknowledged it with acks=all).
//
// Watermill's forwarder runs with its defaults, on purpose: the
// watermill-sql subscriber polls every 1s when it finds nothing, reads 100
// rows per query and acks one message at a time.
//
//	go run ./benchmarks/outbox          # full run, writes benchmarks/README.md
//	go run ./benchmarks/outbox -quick   # under a minute, writes nothing
package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"runtime"
	"strings"
	"time"
)

func main() {
	var (
		quick    = flag.Bool("quick", false, "a short run (under a minute) with small N and 2s latency runs; does not write the README unless -readme is given")
		dsn      = flag.String("dsn", envOr("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"), "PostgreSQL URL (default $DATABASE_URL)")
		readme   = flag.String("readme", "benchmarks/README.md", "file whose \"Outbox relay\" section receives the results; empty writes nothing")
		nOurs    = flag.Int("n", 0, "events for oncemill's throughput runs (default 20000, -quick 2000)")
		nStock   = flag.Int("n-stock", 0, "events for Watermill forwarder's throughput runs (default 20000, -quick 2000)")
		rate     = flag.Int("rate", 1000, "events per second in the latency runs")
		duration = flag.Duration("duration", 0, "length of each latency run (default 10s, -quick 2s)")
	)
	flag.Parse()

	cfg := Config{
		DSN:      *dsn,
		NOurs:    20000,
		NStock:   20000,
		Rate:     *rate,
		Duration: 10 * time.Second,
		Drain:    15 * time.Second,
		Timeout:  90 * time.Second,
		Out:      os.Stdout,
	}
	if *quick {
		cfg.NOurs, cfg.NStock, cfg.Duration, cfg.Drain, cfg.Timeout = 2000, 2000, 2*time.Second, 4*time.Second, 20*time.Second
	}
	if *nOurs > 0 {
		cfg.NOurs = *nOurs
	}
	if *nStock > 0 {
		cfg.NStock = *nStock
	}
	if *duration > 0 {
		cfg.Duration = *duration
	}
	writeReadme := *readme != ""
	if *quick {
		writeReadme = false
		flag.Visit(func(f *flag.Flag) {
			if f.Name == "readme" && *readme != "" {
				writeReadme = true
			}
		})
	}

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()

	started := time.Now()
	results, err := Run(ctx, cfg)
	if err != nil {
		fmt.Fprintln(os.Stderr, "outbox benchmark:", err)
		os.Exit(1)
	}
	table := Markdown(results, cfg)
	fmt.Println()
	fmt.Print(table)
	fmt.Printf("\ntotal run time %s\n", time.Since(started).Round(time.Second))

	if writeReadme {
		cmd := "go run ./benchmarks/outbox"
		if len(os.Args) > 1 {
			cmd += " " + strings.Join(os.Args[1:], " ")
		}
		note := fmt.Sprintf("Command: `%s` (or `make bench-outbox`), run %s on %d cores (nproc; GOMAXPROCS %d, %s/%s, %s), a shared and noisy machine; total run time %s.",
			cmd, time.Now().UTC().Format("2006-01-02 15:04 MST"), runtime.NumCPU(), runtime.GOMAXPROCS(0),
			runtime.GOOS, runtime.GOARCH, runtime.Version(), time.Since(started).Round(time.Second))
		if err := UpdateReadme(*readme, Section(note, table, cfg)); err != nil {
			fmt.Fprintln(os.Stderr, "outbox benchmark:", err)
			os.Exit(1)
		}
		fmt.Println("wrote", *readme)
	}
}

func envOr(key, def string) string {
	if v := os.Getenv(key); v != "" {
		return v
	}
	return def
}

// Config sizes a run.
type Config struct {
	DSN string
	// NOurs and NStock are the events of the throughput runs.
	NOurs, NStock int
	// Rate (events/s) and Duration shape the latency runs; Drain is how
	// long to wait afterwards for the last events.
	Rate     int
	Duration time.Duration
	Drain    time.Duration
	// Timeout bounds one throughput run's wait for its events.
	Timeout time.Duration
	// Systems, Instances and Brokers select scenarios; empty means all.
	Systems   []string
	Instances []int
	Brokers   []string
	// Out receives progress lines.
	Out io.Writer
}
