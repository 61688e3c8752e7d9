// Command brokers measures, on RabbitMQ and on NATS JetStream, what the
// subscriber costs a consumer that applies each message exactly once:
// the broker's stock Watermill subscriber (watermill-amqp, watermill-nats)
// and oncemill's, under the same PostgreSQL inbox and handler, in the same
// run. Rows, for each broker:
//
//   - stock: the broker's Watermill subscriber → a router → the inbox
//     (middleware.NewInbox on dedup/postgres) → one INSERT of the effect in
//     the inbox's transaction, a transaction per message;
//   - oncemill: oncemill's subscriber with -in-flight messages in flight
//     (prefetch, max_in_flight), the same inbox and handler;
//   - oncemill-batch: oncemill's subscriber, the inbox's group commit
//     (Batch.MaxMessages -batch) and a middleware.BatchHandler that writes
//     a batch's effects with one multi-row INSERT;
//   - oncemill-no-inbox: oncemill's subscriber and the INSERT alone,
//     committed on its own, with no inbox: what the broker and the router
//     cost without the exactly-once path.
//
// Each run has a fresh queue or stream and schema; -accounts × -versions
// messages, versions interleaved, the account the partition key, are
// published beforehand; msgs/s runs from the router's start until every
// effect is in the table. After each run the table is checked: doubled,
// lost, and accounts whose versions were applied out of the order
// published. Any of them makes the command fail. The targets, with their
// ratio in the same run: the batch row ≥ 5× stock and ≥ 1.0× no-inbox,
// oncemill ≥ 2× stock; a miss is reported as a miss.
//
//	cd benchmarks && go run ./brokers          # writes the "RabbitMQ and NATS: the subscribers" section of benchmarks/README.md
//	cd benchmarks && go run ./brokers -quick   # under a minute, writes nothing
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

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/oncemill/oncemill/benchmarks/internal/benchutil"
	"github.com/oncemill/oncemill/benchmarks/internal/mdsection"
)

// runID names this run's schemas, queues and streams.
var runID = benchutil.RandomID()

// Config is one run of the command.
type Config struct {
	DSN, AMQP, NATS string
	Brokers         []string
	Rows            []string
	// Accounts × Versions messages a run.
	Accounts, Versions int
	// InFlight is oncemill's messages in flight (and the stock AMQP
	// subscriber's prefetch); BatchSize the batch row's Batch.MaxMessages.
	InFlight, BatchSize int
	// PoolSize is the PostgreSQL pool's connections, shared by the rows.
	PoolSize   int
	Reps       int
	RunTimeout time.Duration
	Out        io.Writer
}

// Result is every sample of a run.
type Result struct {
	Samples []Sample
	Env     string
}

func main() {
	var (
		quick    = flag.Bool("quick", false, "a short run (under a minute): fewer messages, one repetition; writes nothing unless -readme is given")
		dsn      = flag.String("dsn", benchutil.EnvOr("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"), "PostgreSQL URL (default $DATABASE_URL)")
		amqpURL  = flag.String("amqp", benchutil.EnvOr("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/"), "RabbitMQ (default $AMQP_URL)")
		natsURL  = flag.String("nats", benchutil.EnvOr("NATS_URL", "nats://127.0.0.1:4222"), "NATS server with JetStream (default $NATS_URL)")
		readme   = flag.String("readme", benchutil.Path("README.md"), "file whose section receives the results; empty writes none")
		brokers  = flag.String("brokers", "amqp,nats", "comma-separated brokers")
		only     = flag.String("rows", "", "comma-separated rows to run (default all): "+strings.Join(rows(), ","))
		accounts = flag.Int("accounts", 0, "accounts of a run (default 500, -quick 100)")
		versions = flag.Int("versions", 8, "versions of each account")
		inFlight = flag.Int("in-flight", 64, "oncemill's prefetch / max_in_flight (and the stock AMQP subscriber's prefetch)")
		batch    = flag.Int("batch", 32, "the batch row's Batch.MaxMessages")
		poolSize = flag.Int("pool", 16, "PostgreSQL connections")
		reps     = flag.Int("reps", 0, "repetitions of every row; the table shows medians (default 5, -quick 1)")
		timeout  = flag.Duration("run-timeout", 3*time.Minute, "longest a single run may take")
	)
	flag.Parse()
	cfg := Config{DSN: *dsn, AMQP: *amqpURL, NATS: *natsURL, Brokers: strings.Split(*brokers, ","), Rows: rows(),
		Accounts: *accounts, Versions: *versions, InFlight: *inFlight, BatchSize: *batch, PoolSize: *poolSize, Reps: *reps, RunTimeout: *timeout, Out: os.Stdout}
	if *only != "" {
		cfg.Rows = strings.Split(*only, ",")
	}
	if cfg.Accounts == 0 {
		cfg.Accounts = map[bool]int{true: 100, false: 500}[*quick]
	}
	if cfg.Reps == 0 {
		cfg.Reps = map[bool]int{true: 1, false: 5}[*quick]
	}
	if *quick && !benchutil.FlagSet("readme") {
		*readme = ""
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	res, err := Run(ctx, cfg)
	if err != nil {
		fmt.Fprintln(os.Stderr, "brokers:", err)
		os.Exit(1)
	}
	table := Markdown(res, cfg)
	fmt.Println(table)
	if *readme != "" {
		if err := UpdateReadme(*readme, table); err != nil {
			fmt.Fprintln(os.Stderr, "brokers:", err)
			os.Exit(1)
		}
	}
	if f := Failures(res); len(f) > 0 {
		fmt.Fprintln(os.Stderr, "brokers: FAIL:", strings.Join(f, "; "))
		os.Exit(1)
	}
}

const sectionHead = "## RabbitMQ and NATS: the subscribers"

// UpdateReadme puts section in place of path's section of these results.
func UpdateReadme(path, section string) error {
	return mdsection.Replace(path, "# Benchmarks", sectionHead, section)
}

// Run runs every row of every broker cfg.Reps times, the repetitions
// interleaved so that a drift of the machine reaches every row alike.
func Run(ctx context.Context, cfg Config) (Result, error) {
	pcfg, err := pgxpool.ParseConfig(cfg.DSN)
	if err != nil {
		return Result{}, fmt.Errorf("parse PostgreSQL URL: %w", err)
	}
	pcfg.MaxConns = int32(cfg.PoolSize)
	pool, err := pgxpool.NewWithConfig(ctx, pcfg)
	if err != nil {
		return Result{}, err
	}
	defer pool.Close()
	var version string
	if err := pool.QueryRow(ctx, `SHOW server_version`).Scan(&version); err != nil {
		return Result{}, fmt.Errorf("PostgreSQL: %w", err)
	}
	res := Result{Env: fmt.Sprintf("%s/%s, %d CPUs, %s, PostgreSQL %s", runtime.GOOS, runtime.GOARCH, runtime.NumCPU(), runtime.Version(), version)}
	seq := 0
	for _, name := range cfg.Brokers {
		var b broker
		switch name {
		case "amqp":
			b = amqpBroker(cfg.AMQP)
		case "nats":
			b = natsBroker(cfg.NATS)
		default:
			return res, fmt.Errorf("unknown broker %q: amqp or nats", name)
		}
		for rep := 1; rep <= cfg.Reps; rep++ {
			for _, row := range cfg.Rows {
				if !slices.Contains(rows(), row) {
					return res, fmt.Errorf("unknown row %q: %s", row, strings.Join(rows(), ", "))
				}
				seq++
				s, err := run(ctx, cfg, pool, b, row, rep, seq)
				if err != nil {
					return res, err
				}
				fmt.Fprintf(cfg.Out, "%s %-18s rep %d: %7.0f msgs/s (%d messages in %s, %d handler calls; doubled %d, lost %d, out of order %d)\n",
					b.name, row, rep, s.MsgsPerSec, s.N, s.Elapsed.Round(time.Millisecond), s.Calls, s.Doubled, s.Lost, s.OutOfOrder)
				res.Samples = append(res.Samples, s)
			}
		}
	}
	return res, nil
}

// of returns the samples of broker and row.
func (r Result) of(broker, row string) []Sample {
	var out []Sample
	for _, s := range r.Samples {
		if s.Broker == broker && s.Row == row {
			out = append(out, s)
		}
	}
	return out
}

// target is a ratio the issue sets: row's throughput over base's, at
// least min.
type target struct {
	row, base string
	min       float64
}

var targets = []target{{rowBatch, rowStock, 5}, {rowBatch, rowBare, 1.0}, {rowOurs, rowStock, 2}}

// Failures lists the samples that doubled, lost or reordered anything.
func Failures(r Result) []string {
	var f []string
	for _, s := range r.Samples {
		if !s.ok() {
			f = append(f, fmt.Sprintf("%s %s rep %d: doubled %d, lost %d, out of order %d", s.Broker, s.Row, s.Rep, s.Doubled, s.Lost, s.OutOfOrder))
		}
	}
	return f
}

// Markdown renders the results: a table per broker and the targets.
func Markdown(r Result, cfg Config) string {
	var b strings.Builder
	fmt.Fprintf(&b, "%s\n\n", sectionHead)
	fmt.Fprintf(&b, "`cd benchmarks && go run ./brokers` (`make bench-brokers`): %d accounts × %d versions a run, published beforehand, "+
		"the account the partition key; oncemill with %d in flight (prefetch / `max_in_flight`), batches of up to %d; "+
		"%d PostgreSQL connections; median of %d runs. %s.\n\n",
		cfg.Accounts, cfg.Versions, cfg.InFlight, cfg.BatchSize, cfg.PoolSize, cfg.Reps, r.Env)
	names := map[string]string{
		rowStock: "stock Watermill subscriber, inbox, a transaction per message",
		rowOurs:  "oncemill, inbox, a transaction per message",
		rowBatch: "oncemill, inbox's group commit + `BatchHandler`",
		rowBare:  "oncemill, no inbox (the INSERT alone)",
	}
	for _, broker := range cfg.Brokers {
		fmt.Fprintf(&b, "**%s**\n\n| row | msgs/s | × stock | handler calls | doubled / lost / out of order |\n|---|---|---|---|---|\n", map[string]string{"amqp": "RabbitMQ (watermill-amqp v3)", "nats": "NATS JetStream (watermill-nats v2 `pkg/nats`)"}[broker])
		stock := median(r.of(broker, rowStock))
		for _, row := range cfg.Rows {
			ss := r.of(broker, row)
			if len(ss) == 0 {
				continue
			}
			m := median(ss)
			ratio := "—"
			if stock > 0 {
				ratio = fmt.Sprintf("%.1f×", m/stock)
			}
			var d, l, o int
			for _, s := range ss {
				d, l, o = d+s.Doubled, l+s.Lost, o+s.OutOfOrder
			}
			fmt.Fprintf(&b, "| %s | %.0f | %s | %d | %d / %d / %d |\n", names[row], m, ratio, ss[len(ss)-1].Calls, d, l, o)
		}
		b.WriteString("\n")
		for _, t := range targets {
			num, den := median(r.of(broker, t.row)), median(r.of(broker, t.base))
			if num == 0 || den == 0 {
				continue
			}
			verdict := "met"
			if num/den < t.min {
				verdict = "**missed**"
			}
			fmt.Fprintf(&b, "- %s over %s: %.2f× (target ≥ %.1f×): %s\n", t.row, t.base, num/den, t.min, verdict)
		}
		b.WriteString("\n")
	}
	if f := Failures(r); len(f) > 0 {
		fmt.Fprintf(&b, "**FAIL**: %s\n", strings.Join(f, "; "))
	} else {
		fmt.Fprintf(&b, "0 doubled, 0 lost, 0 accounts out of order in %d runs.\n", len(r.Samples))
	}
	return b.String()
}
