// Command nats measures oncemill's exactly-once consumption from NATS
// JetStream end to end, against watermill-nats's subscribers in the same
// run: JetStream (the NATS server of NATS_URL, else 127.0.0.1:4222, or an
// embedded one) → a Watermill router → the PostgreSQL inbox
// (middleware.NewInbox on dedup/postgres) → one INSERT into an effects
// table in the inbox's transaction. Every subscriber runs the same
// handler under the same inbox.
//
// The subscribers compared:
//
//   - watermill-nats's pkg/nats subscriber with JetStream, the one its
//     package documentation recommends for production: a durable push
//     consumer in a queue group, the options of watermill-nats's own
//     tests (DeliverAll, AckExplicit), synchronous acks;
//   - watermill-nats's pkg/jetstream subscriber (beta): a pull consumer
//     through nats.go's Consume, which prefetches;
//   - oncemill's adapters/nats subscriber with one message in flight (its
//     default), and with 16.
//
// Three measurements, each with a fresh stream, consumer and schema per
// run:
//
//   - throughput: a stream of payment events, 10% of them duplicates (an
//     earlier payment published again with a new UUID and a new
//     Nats-Msg-Id, as a retry after JetStream's duplicate window), is
//     published beforehand; msgs/s from the router's start until every
//     message has been handled;
//   - latency: the events are published at a steady rate while the
//     subscriber runs; each message's latency runs from its publish to its
//     handler chain's return (its effect committed); p50, p99 and max;
//   - in progress: a few messages whose handler works longer than the
//     consumer's AckWait; counted are the deliveries of a message while an
//     earlier delivery of it is still in its handler. watermill-nats's
//     subscribers let JetStream redeliver them; oncemill's must not.
//
// After each run the effects table is checked: keys with more than one
// effect row (doubled) and keys with none (lost). Either makes the command
// fail.
//
//	cd benchmarks && go run ./nats          # full run, writes the "NATS end to end" section of benchmarks/README.md
//	cd benchmarks && go run ./nats -quick   # under a minute, writes nothing
//
// (or make bench-nats from the repository root); the results file is
// found from the working directory, wherever in the repository it is.
package main

import (
	"context"
	"errors"
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
		quick    = flag.Bool("quick", false, "a short run (under a minute): fewer messages, one repetition; writes nothing unless -readme is given")
		dsn      = flag.String("dsn", benchutil.EnvOr("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"), "PostgreSQL URL (default $DATABASE_URL)")
		server   = flag.String("nats", benchutil.EnvOr("NATS_URL", "nats://127.0.0.1:4222"), `NATS server with JetStream (default $NATS_URL), or "embedded" for one in this process`)
		readme   = flag.String("readme", benchutil.Path("README.md"), "file whose \"NATS end to end\" section receives the results; empty writes none")
		n        = flag.Int("n", 0, "messages of a throughput run (default 5000, -quick 1000)")
		dups     = flag.Int("dups", 10, "duplicate percentage")
		rate     = flag.Int("rate", 100, "publish rate of a latency run, messages per second")
		paced    = flag.Duration("paced-for", 0, "how long a latency run publishes (default 10s, -quick 3s)")
		slow     = flag.Int("slow", 4, "messages of an in-progress run")
		ackWait  = flag.Duration("slow-ack-wait", 2*time.Second, "the consumers' AckWait in an in-progress run")
		work     = flag.Duration("slow-work", 5*time.Second, "how long the handler of an in-progress run works on each message (longer than -slow-ack-wait)")
		inFlight = flag.Int("max-in-flight", 16, "MaxInFlight of oncemill's parallel row")
		reps     = flag.Int("reps", 0, "repetitions of every throughput row; the table shows medians (default 3, -quick 1)")
		seed     = flag.Uint64("seed", 1, "seed of the generated stream")
		only     = flag.String("systems", "", "comma-separated subscribers to run (default all): "+strings.Join(systems(), ","))
		timeout  = flag.Duration("run-timeout", 2*time.Minute, "longest a single run may take")
	)
	flag.Parse()

	cfg := Config{
		DSN: *dsn, Server: *server, N: 5000, DupRatio: float64(*dups) / 100,
		Rate: *rate, PacedFor: 10 * time.Second,
		Slow: *slow, SlowAckWait: *ackWait, SlowWork: *work,
		MaxInFlight: *inFlight, Reps: 3, Seed: *seed, RunTimeout: *timeout, Out: os.Stderr,
	}
	if *quick {
		cfg.N, cfg.Reps, cfg.PacedFor = 1000, 1, 3*time.Second
	}
	if *n > 0 {
		cfg.N = *n
	}
	if *reps > 0 {
		cfg.Reps = *reps
	}
	if *paced > 0 {
		cfg.PacedFor = *paced
	}
	if *only != "" {
		cfg.Systems = strings.Split(*only, ",")
	}
	if err := cfg.Validate(); err != nil {
		fmt.Fprintln(os.Stderr, "nats benchmark:", err)
		os.Exit(2)
	}
	writeReadme := *readme != "" && (!*quick || benchutil.FlagSet("readme"))

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()

	started := time.Now()
	res, err := Run(ctx, cfg)
	if err != nil {
		if res != nil {
			fmt.Println(Markdown(res, cfg))
		}
		fmt.Fprintln(os.Stderr, "nats benchmark:", err)
		os.Exit(1)
	}
	took := time.Since(started).Round(time.Second)
	table := Markdown(res, cfg)
	fmt.Println()
	fmt.Print(table)
	fmt.Printf("\ntotal run time %s\n", took)

	if writeReadme {
		cmd := command
		if len(os.Args) > 1 {
			cmd += " " + strings.Join(os.Args[1:], " ")
		}
		note := fmt.Sprintf("Command: `%s` (or `make bench-nats`), run %s on %d cores (nproc; GOMAXPROCS %d, %s/%s, %s) against %s, a shared and noisy machine; total run time %s.",
			cmd, started.UTC().Format("2006-01-02 15:04 MST"), runtime.NumCPU(), runtime.GOMAXPROCS(0),
			runtime.GOOS, runtime.GOARCH, runtime.Version(), res.ServerVersion, took)
		if err := UpdateReadme(*readme, Section(note, table, res, cfg)); err != nil {
			fmt.Fprintln(os.Stderr, "nats benchmark: write", *readme+":", err)
			os.Exit(1)
		}
		fmt.Println("wrote", *readme)
	}
	if failed := Failures(res); len(failed) > 0 {
		fmt.Fprintln(os.Stderr)
		fmt.Fprintln(os.Stderr, "!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!")
		fmt.Fprintln(os.Stderr, "!!! FAILURE: effects not exactly once:")
		for _, f := range failed {
			fmt.Fprintln(os.Stderr, "!!!   "+f)
		}
		fmt.Fprintln(os.Stderr, "!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!")
		os.Exit(1)
	}
}

// Config sizes a run.
type Config struct {
	// DSN is the PostgreSQL URL; Server the NATS server's URL, or
	// "embedded".
	DSN, Server string
	// N is the messages of a throughput run, DupRatio their share of
	// duplicates, Seed the stream's seed.
	N        int
	DupRatio float64
	Seed     uint64
	// Rate is the publish rate of a latency run, in messages per second,
	// for PacedFor.
	Rate     int
	PacedFor time.Duration
	// Slow is the messages of an in-progress run, SlowWork how long its
	// handler works on each, SlowAckWait the consumer's AckWait there.
	Slow        int
	SlowAckWait time.Duration
	SlowWork    time.Duration
	// MaxInFlight is oncemill's parallel row's MaxInFlight.
	MaxInFlight int
	// Reps is the repetitions of every throughput row.
	Reps int
	// Systems selects subscribers by name; empty runs all.
	Systems []string
	// RunTimeout bounds a single run.
	RunTimeout time.Duration
	// Out receives progress lines.
	Out io.Writer
}

// Validate reports the first field out of range.
func (c Config) Validate() error {
	switch {
	case c.N < 1:
		return fmt.Errorf("messages per run must be positive, got %d", c.N)
	case c.DupRatio < 0 || c.DupRatio >= 1:
		return fmt.Errorf("duplicate ratio %.2f out of [0, 1)", c.DupRatio)
	case c.Rate < 1 || c.PacedFor <= 0:
		return errors.New("the latency run needs a positive rate and duration")
	case c.Slow < 1:
		return fmt.Errorf("slow messages must be positive, got %d", c.Slow)
	case c.SlowAckWait < time.Second:
		return fmt.Errorf("slow-ack-wait must be at least 1s, got %s", c.SlowAckWait)
	case c.SlowWork <= c.SlowAckWait:
		return fmt.Errorf("slow-work %s must be longer than slow-ack-wait %s", c.SlowWork, c.SlowAckWait)
	case c.MaxInFlight < 2:
		return fmt.Errorf("max-in-flight must be at least 2 (1 is the one-in-flight row), got %d", c.MaxInFlight)
	case c.Reps < 1:
		return fmt.Errorf("repetitions must be positive, got %d", c.Reps)
	case c.RunTimeout <= 0:
		return errors.New("run timeout must be positive")
	}
	for _, s := range c.Systems {
		if !slices.Contains(systems(), s) {
			return fmt.Errorf("unknown subscriber %q (want %s)", s, strings.Join(systems(), ", "))
		}
	}
	return nil
}

// systems returns the selected subscribers, in report order.
func (c Config) systems() []string {
	if len(c.Systems) == 0 {
		return systems()
	}
	var out []string
	for _, s := range systems() {
		if slices.Contains(c.Systems, s) {
			out = append(out, s)
		}
	}
	return out
}
