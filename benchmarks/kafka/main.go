// Command kafka measures oncemill's exactly-once consumption end to end:
// Kafka (the embedded broker of adapters/kafka/embedded, in process, or
// the cluster that ONCEMILL_KAFKA_BROKERS names) →
// a Watermill router → the PostgreSQL inbox (middleware.NewInbox on
// dedup/postgres) → one INSERT into an effects table in the inbox's
// transaction.
//
// A stream of payment events (JSON: payment id, order id, per-order
// sequence number, amount) over 1,000 orders, 10% of them duplicates (an
// earlier payment published again with a new message UUID), is published
// beforehand with kafka.NewPublisher: the idempotency key is the payment
// id, the partition key, and so the record key, the order id. Then each
// subscriber consumes the whole topic, and the clock runs from the
// router's start (which subscribes and joins a fresh consumer group) until
// every message has been handled. Compared, on topics of 1 and 8
// partitions:
//
//   - watermill-kafka's own subscriber (its default Sarama config, oldest
//     offset), one message per partition at a time;
//   - oncemill's subscriber with MaxInFlightPerPartition 1 (the same loop
//     with oncemill's config);
//   - oncemill's key-parallel subscriber (MaxInFlightPerPartition 64, the
//     default): different order ids of a partition concurrently, one
//     order's payments in order; and the same with the inbox's
//     PipelineAlways, with its group commit (Batch), and with the group
//     commit and a middleware.BatchHandler that inserts a batch's
//     payments with one multi-row INSERT;
//   - the key-parallel subscriber with the same handler and no inbox: the
//     effect autocommitted, INSERT … ON CONFLICT (idem_key) DO NOTHING on a
//     unique index, the baseline of what the inbox costs.
//
// After each run the effects table is checked: payments with more than one
// effect row (doubled), with none (lost), and effect rows whose sequence
// number is lower than one applied before them for the same order (order
// violations). Any of them makes the command fail. Every run has its own
// schema, topic and consumer group, dropped afterwards.
//
//	cd benchmarks && go run ./kafka          # full run, writes the "Kafka end to end" section of benchmarks/README.md and benchmarks/kafka/throughput.png
//	cd benchmarks && go run ./kafka -quick   # under a minute, writes nothing
//
// (or make bench-kafka from the repository root); the results files are
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
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"time"

	"github.com/oncemill/oncemill/adapters/kafka"
	"github.com/oncemill/oncemill/benchmarks/internal/benchutil"
)

func main() {
	var (
		quick       = flag.Bool("quick", false, "a short run (under a minute): fewer messages, one repetition; writes nothing unless -readme or -chart is given")
		dsn         = flag.String("dsn", benchutil.EnvOr("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"), "PostgreSQL URL (default $DATABASE_URL)")
		readme      = flag.String("readme", benchutil.Path("README.md"), "file whose \"Kafka end to end\" section receives the results; empty writes none")
		chart       = flag.String("chart", benchutil.Path("kafka", "throughput.png"), "throughput chart to write; empty writes none")
		n           = flag.Int("n", 0, "messages per run (default 8000, -quick 1500)")
		keys        = flag.Int("keys", 1000, "distinct orders (record keys)")
		dups        = flag.Int("dups", 10, "duplicate percentage")
		partitions  = flag.String("partitions", "1,8", "comma-separated partition counts")
		reps        = flag.Int("reps", 0, "repetitions of every row; the table shows medians (default 3, -quick 1)")
		maxConns    = flag.Int("max-conns", 64, "most PostgreSQL connections in the pool (it is also kept below what the server has left)")
		maxInFlight = flag.Int("max-in-flight", kafka.DefaultMaxInFlightPerPartition, "MaxInFlightPerPartition of the key-parallel rows")
		seed        = flag.Uint64("seed", 1, "seed of the generated stream")
		only        = flag.String("systems", "", "comma-separated subscribers to run (default all): "+strings.Join(systems(), ","))
		timeout     = flag.Duration("run-timeout", 2*time.Minute, "longest a single run may take")
	)
	flag.Parse()

	cfg := Config{
		DSN:         *dsn,
		N:           8000,
		Keys:        *keys,
		DupRatio:    float64(*dups) / 100,
		Reps:        3,
		MaxConns:    *maxConns,
		MaxInFlight: *maxInFlight,
		Seed:        *seed,
		RunTimeout:  *timeout,
		Brokers:     kafka.BrokersFromEnv(),
		Out:         os.Stderr,
	}
	if *quick {
		cfg.N, cfg.Reps = 1500, 1
	}
	if *n > 0 {
		cfg.N = *n
	}
	if *reps > 0 {
		cfg.Reps = *reps
	}
	var err error
	cfg.Partitions, err = benchutil.ParseInts(*partitions)
	if *only != "" {
		cfg.Systems = strings.Split(*only, ",")
	}
	if err == nil {
		err = cfg.Validate()
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "kafka benchmark:", err)
		os.Exit(2)
	}
	writeReadme, writeChart := *readme != "", *chart != ""
	if *quick {
		writeReadme, writeChart = *readme != "" && benchutil.FlagSet("readme"), *chart != "" && benchutil.FlagSet("chart")
	}

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()

	started := time.Now()
	res, err := Run(ctx, cfg)
	if err != nil {
		if res != nil && len(res.Rows) > 0 {
			fmt.Println(Markdown(res, cfg))
		}
		fmt.Fprintln(os.Stderr, "kafka benchmark:", err)
		os.Exit(1)
	}
	took := time.Since(started).Round(time.Second)
	table := Markdown(res, cfg)
	fmt.Println()
	fmt.Print(table)
	fmt.Printf("\ntotal run time %s\n", took)

	if writeReadme || writeChart {
		cmd := command
		if len(os.Args) > 1 {
			cmd += " " + strings.Join(os.Args[1:], " ")
		}
		note := fmt.Sprintf("Command: `%s` (or `make bench-kafka`), run %s on %d cores (nproc; GOMAXPROCS %d, %s/%s, %s), a shared and noisy machine; total run time %s.",
			cmd, started.UTC().Format("2006-01-02 15:04 MST"), runtime.NumCPU(), runtime.GOMAXPROCS(0),
			runtime.GOOS, runtime.GOARCH, runtime.Version(), took)
		readmePath, chartPath := pathIf(writeReadme, *readme), pathIf(writeChart, *chart)
		if err := writeOutputs(res, cfg, note, table, readmePath, chartPath); err != nil {
			fmt.Fprintln(os.Stderr, "kafka benchmark:", err)
			os.Exit(1)
		}
		fmt.Println("wrote", strings.TrimSpace(readmePath+" "+chartPath))
	}
	if failed := Failures(res, cfg); len(failed) > 0 {
		fmt.Fprintln(os.Stderr)
		fmt.Fprintln(os.Stderr, "!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!")
		fmt.Fprintln(os.Stderr, "!!! FAILURE: effects not exactly once, in order:")
		for _, f := range failed {
			fmt.Fprintln(os.Stderr, "!!!   "+f)
		}
		fmt.Fprintln(os.Stderr, "!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!")
		os.Exit(1)
	}
}

// pathIf returns path when write is set, else "".
func pathIf(write bool, path string) string {
	if write {
		return path
	}
	return ""
}

// writeOutputs writes the README section to readme and the chart to png;
// an empty path writes nothing.
func writeOutputs(res *Results, cfg Config, note, table, readme, png string) error {
	if readme != "" {
		if err := UpdateReadme(readme, Section(note, table, res, cfg, chartLink(readme, png))); err != nil {
			return fmt.Errorf("write %s: %w", readme, err)
		}
	}
	if png != "" {
		if err := os.MkdirAll(filepath.Dir(png), 0o755); err != nil {
			return fmt.Errorf("create %s: %w", filepath.Dir(png), err)
		}
		if err := Chart(png, res.Rows, cfg); err != nil {
			return fmt.Errorf("write %s: %w", png, err)
		}
	}
	return nil
}

// chartLink is png relative to the README's directory, for the image
// link; "" when either is not written.
func chartLink(readme, png string) string {
	if readme == "" || png == "" {
		return ""
	}
	rel, err := filepath.Rel(filepath.Dir(readme), png)
	if err != nil {
		return ""
	}
	return filepath.ToSlash(rel)
}

// Config sizes a run.
type Config struct {
	// DSN is the PostgreSQL URL.
	DSN string
	// N is the messages of the stream, Keys its distinct orders (record
	// keys), DupRatio its share of duplicates, Seed its seed.
	N        int
	Keys     int
	DupRatio float64
	Seed     uint64
	// Partitions are the topic sizes measured; Reps the repetitions of
	// every row.
	Partitions []int
	Reps       int
	// Systems selects subscribers by name; empty runs all.
	Systems []string
	// MaxConns caps the pool; MaxInFlight is the key-parallel rows'
	// MaxInFlightPerPartition (0: the default).
	MaxConns    int
	MaxInFlight int
	// RunTimeout bounds a single run.
	RunTimeout time.Duration
	// Brokers, when set, are the seed brokers of a real cluster to run
	// on instead of the embedded broker.
	Brokers []string
	// Out receives progress lines.
	Out io.Writer
}

// Validate reports the first field out of range.
func (c Config) Validate() error {
	switch {
	case c.N < 1:
		return fmt.Errorf("messages per run must be positive, got %d", c.N)
	case c.Keys < 1:
		return fmt.Errorf("keys must be positive, got %d", c.Keys)
	case c.DupRatio < 0 || c.DupRatio >= 1:
		return fmt.Errorf("duplicate ratio %.2f out of [0, 1)", c.DupRatio)
	case len(c.Partitions) == 0:
		return errors.New("need at least one partition count")
	case c.Reps < 1:
		return fmt.Errorf("repetitions must be positive, got %d", c.Reps)
	case c.MaxConns < 4:
		return fmt.Errorf("max-conns must be at least 4, got %d", c.MaxConns)
	case c.MaxInFlight < 0 || c.MaxInFlight == 1:
		return fmt.Errorf("max-in-flight must be at least 2 (1 is the one-in-flight row), or 0 for the default, got %d", c.MaxInFlight)
	case c.RunTimeout <= 0:
		return errors.New("run timeout must be positive")
	}
	for _, p := range c.Partitions {
		if p < 1 {
			return fmt.Errorf("partition counts must be positive, got %d", p)
		}
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

// maxInFlight is the key-parallel rows' MaxInFlightPerPartition.
func (c Config) maxInFlight() int {
	if c.MaxInFlight == 0 {
		return kafka.DefaultMaxInFlightPerPartition
	}
	return c.MaxInFlight
}
