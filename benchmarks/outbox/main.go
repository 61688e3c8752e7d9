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
// Then, for oncemill's relay alone:
//
//   - raw floor: the throughput run of a hand-written relay (one
//     DELETE … FOR UPDATE SKIP LOCKED … RETURNING, publish, commit per
//     batch) and, right after it, the relay's, on the same backlog and
//     broker;
//   - writer throughput: writers commit one-event transactions in a loop,
//     into the outbox through forwarder.TxPublisher or, in interleaved
//     rounds, the same INSERT into a baseline table of the outbox's shape
//     without its triggers; with no relay and with 4 relays draining the
//     outbox, and with 4 of the raw floor's SKIP LOCKED workers in place of
//     the relays;
//   - idle cost: the statements one relay sends per second on an empty
//     outbox, counted by a pgx QueryTracer on its pool;
//   - scheduled messages: messages written through forwarder.PublishAt
//     come due at a steady rate (the latency runs' rate and length), each
//     written a second ahead, and their lateness is arrival − due time;
//     in the same run, immediate messages at a tenth of the rate give the
//     commit-to-arrival latency beside it.
//
// Arrival is the time a GoChannel subscriber receives the message, or, for
// Kafka, the time the Kafka publisher's Publish of that message returned
// (the broker acknowledged it with acks=all).
//
// Watermill's forwarder runs with its defaults, on purpose: the
// watermill-sql subscriber polls every 1s when it finds nothing, reads 100
// rows per query and acks one message at a time.
//
//	cd benchmarks && go run ./outbox          # full run, writes benchmarks/README.md
//	cd benchmarks && go run ./outbox -quick   # under a minute, writes nothing
//
// (or make bench-outbox from the repository root); the results file is
// found from the working directory, wherever in the repository it is.
package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"runtime"
	"slices"
	"strings"
	"time"

	"github.com/oncemill/oncemill/benchmarks/internal/benchutil"
)

func main() {
	var (
		quick    = flag.Bool("quick", false, "a short run (under a minute) with small N and 2s latency runs; does not write the README unless -readme is given")
		dsn      = flag.String("dsn", benchutil.EnvOr("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"), "PostgreSQL URL (default $DATABASE_URL)")
		readme   = flag.String("readme", benchutil.Path("README.md"), "file whose \"Outbox relay\" section receives the results; empty writes nothing")
		nOurs    = flag.Int("n", 0, "events for oncemill's throughput runs (default 20000, -quick 2000)")
		nStock   = flag.Int("n-stock", 0, "events for Watermill forwarder's throughput runs (default 20000, -quick 2000)")
		rate     = flag.Int("rate", 1000, "events per second in the latency runs")
		duration = flag.Duration("duration", 0, "length of each latency run (default 10s, -quick 2s)")
		stages   = flag.String("stages", strings.Join(allStages(), ","), "comma-separated stages to run: "+strings.Join(allStages(), ", "))
		round    = flag.Duration("writer-round", 0, "length of each writer-throughput round (default 800ms, -quick 500ms)")
		repeats  = flag.Int("writer-repeats", 0, "baseline/outbox round pairs per writer-throughput cell (default 5, -quick 3)")
		idle     = flag.Duration("idle", 0, "how long the idle relay runs (default 10s, -quick 3s)")
		ahead    = flag.Duration("ahead", 0, "how long before its due time each scheduled message is written (default 1s)")
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

		WriterRound:   800 * time.Millisecond,
		WriterRepeats: 5,
		Idle:          10 * time.Second,
	}
	if *quick {
		cfg.NOurs, cfg.NStock, cfg.Duration, cfg.Drain, cfg.Timeout = 2000, 2000, 2*time.Second, 4*time.Second, 20*time.Second
		cfg.WriterRound, cfg.WriterRepeats, cfg.Idle = 500*time.Millisecond, 3, 3*time.Second
	}
	for _, st := range strings.Split(*stages, ",") {
		st = strings.TrimSpace(st)
		if st == "" {
			continue
		}
		if !slices.Contains(allStages(), st) {
			fmt.Fprintf(os.Stderr, "outbox benchmark: unknown stage %q (want %s)\n", st, strings.Join(allStages(), ", "))
			os.Exit(2)
		}
		cfg.Stages = append(cfg.Stages, st)
	}
	if *round > 0 {
		cfg.WriterRound = *round
	}
	if *repeats > 0 {
		cfg.WriterRepeats = *repeats
	}
	if *idle > 0 {
		cfg.Idle = *idle
	}
	if *ahead > 0 {
		cfg.Ahead = *ahead
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
	rep, err := Run(ctx, cfg)
	if err != nil {
		fmt.Fprintln(os.Stderr, "outbox benchmark:", err)
		os.Exit(1)
	}
	cfg = cfg.withDefaults()
	table := Markdown(rep, cfg)
	fmt.Println()
	fmt.Print(table)
	fmt.Printf("\ntotal run time %s\n", time.Since(started).Round(time.Second))

	if writeReadme {
		cmd := command
		if len(os.Args) > 1 {
			cmd += " " + strings.Join(os.Args[1:], " ")
		}
		note := fmt.Sprintf("Command: `%s` (or `make bench-outbox`), run %s on %d cores (nproc; GOMAXPROCS %d, %s/%s, %s), a shared and noisy machine; total run time %s.",
			cmd, time.Now().UTC().Format("2006-01-02 15:04 MST"), runtime.NumCPU(), runtime.GOMAXPROCS(0),
			runtime.GOOS, runtime.GOARCH, runtime.Version(), time.Since(started).Round(time.Second))
		if err := UpdateReadme(*readme, Section(note, table, rep, cfg)); err != nil {
			fmt.Fprintln(os.Stderr, "outbox benchmark:", err)
			os.Exit(1)
		}
		fmt.Println("wrote", *readme)
	}
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
	// The raw floor runs on Instances and Brokers too.
	Systems   []string
	Instances []int
	Brokers   []string
	// Stages selects what runs (Stage…); empty means all.
	Stages []string
	// WriterCounts and WriterRelays are the cells of the writer-throughput
	// stage (default 8 and 32 writers, 0 and 4 relays), plus, for each
	// writer count, a cell with as many raw SKIP LOCKED workers as the
	// largest relay count in place of the relays; WriterRound is the
	// length of one round, WriterRepeats the baseline/outbox pairs per
	// cell.
	WriterCounts  []int
	WriterRelays  []int
	WriterRound   time.Duration
	WriterRepeats int
	// Idle is how long the idle relay runs.
	Idle time.Duration
	// Ahead is how long before its due time the scheduled stage writes
	// each message; the stage's messages come due at Rate for Duration.
	Ahead time.Duration
	// Out receives progress lines.
	Out io.Writer
}

// The stages of a run, in the order they run.
const (
	// StageRelay compares the relay with Watermill's forwarder.
	StageRelay = "relay"
	// StageFloor compares the relay with the raw relay.
	StageFloor = "floor"
	// StageWriters measures the writers' commit rate.
	StageWriters = "writers"
	// StageIdle counts an idle relay's statements.
	StageIdle = "idle"
	// StageScheduled measures how late scheduled messages arrive.
	StageScheduled = "scheduled"
)

// allStages lists every stage, in the order they run.
func allStages() []string {
	return []string{StageRelay, StageFloor, StageWriters, StageIdle, StageScheduled}
}

// withDefaults fills in what c leaves empty.
func (c Config) withDefaults() Config {
	if c.Out == nil {
		c.Out = io.Discard
	}
	// The relays' loggers print from their goroutines.
	c.Out = benchutil.SyncWriter(c.Out)
	if len(c.Systems) == 0 {
		c.Systems = []string{systemOurs, systemStock}
	}
	if len(c.Instances) == 0 {
		c.Instances = []int{1, 4}
	}
	if len(c.Brokers) == 0 {
		c.Brokers = []string{brokerGo, brokerKafka}
	}
	if len(c.Stages) == 0 {
		c.Stages = allStages()
	}
	if len(c.WriterCounts) == 0 {
		c.WriterCounts = []int{8, 32}
	}
	if len(c.WriterRelays) == 0 {
		c.WriterRelays = []int{0, 4}
	}
	if c.WriterRound <= 0 {
		c.WriterRound = 800 * time.Millisecond
	}
	if c.WriterRepeats <= 0 {
		c.WriterRepeats = 5
	}
	if c.Idle <= 0 {
		c.Idle = 10 * time.Second
	}
	if c.Ahead <= 0 {
		c.Ahead = time.Second
	}
	if c.Rate <= 0 {
		c.Rate = 1000
	}
	return c
}

// runs reports whether stage is selected.
func (c Config) runs(stage string) bool {
	return len(c.Stages) == 0 || slices.Contains(c.Stages, stage)
}
