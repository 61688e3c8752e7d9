// Command dedup runs every deduplication strategy on one generated stream
// of messages and measures speed and correctness: oncemill's inbox on
// PostgreSQL (alone and behind the Bloom prefilter), on SQLite, on Redis
// (lease mode) and on Redis in front of PostgreSQL (two-tier), next to
// three baselines that do not promise exactly-once effects — no
// deduplication, Watermill's own Deduplicator, and the inbox on the
// in-memory store — and to the raw SQL of one claim+effect transaction.
// The inbox on database/sql (dedup/sqlstore) runs on the same PostgreSQL
// through pgx's stdlib driver and on MySQL/MariaDB (-mysql), each next to
// the same raw SQL on its own database and driver.
//
// Messages are handed to the wrapped handler directly by worker goroutines
// (no broker): what is measured is the cost of deduplicating. The handler's
// effect is one INSERT into an effects table, inside the inbox's
// transaction for the transactional strategies and autocommitted otherwise.
//
//   - Speed: a stream of N messages with 0, 10, 50 and 90% duplicates at
//     1, 8 and 32 workers: msgs/s, p50/p99 handling latency, round trips
//     per message (pgx QueryTracer, go-redis hook), allocated bytes per
//     message, heap in use, and the ratio to the raw-SQL baseline.
//   - Correctness: a smaller stream with a fault injected on every 7th
//     message — a crash after the claim, after the effect, after the
//     commit, or a handler error — and every unacked message redelivered
//     until all are acked; a crash loses the process's in-memory state.
//     Counted: keys with more than one effect, keys with none.
//
// Every measurement has its own PostgreSQL schema, Redis key prefix and
// SQLite file, removed afterwards.
//
//	cd benchmarks && go run ./dedup          # full run, writes benchmarks/RESULTS.md, benchmarks/dedup/results.csv and throughput.png
//	cd benchmarks && go run ./dedup -quick   # under a minute, writes nothing unless -out is given
//
// (or make bench-dedup from the repository root); the results files are
// found from the working directory, wherever in the repository it is.
package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"path/filepath"
	"runtime"
	"runtime/pprof"
	"strings"
	"time"

	"github.com/oncemill/oncemill/benchmarks/internal/benchutil"
)

func main() {
	var (
		quick        = flag.Bool("quick", false, "a short run (under a minute) with small streams; writes nothing unless -out is given")
		dsn          = flag.String("dsn", benchutil.EnvOr("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"), "PostgreSQL URL (default $DATABASE_URL)")
		mysqlDSN     = flag.String("mysql", benchutil.EnvOr("MYSQL_URL", benchutil.EnvOr("ONCEMILL_TEST_MYSQL_DSN", defaultMySQLDSN)), "MySQL/MariaDB DSN (go-sql-driver/mysql) of sqlstore-mysql and raw-sql-mysql (default $MYSQL_URL, else $ONCEMILL_TEST_MYSQL_DSN)")
		redisURL     = flag.String("redis", benchutil.EnvOr("REDIS_URL", "redis://127.0.0.1:6379/0"), "Redis URL (default $REDIS_URL)")
		out          = flag.String("out", benchutil.Path(), "directory receiving RESULTS.md (its \"Deduplication\" section) and dedup/results.csv and dedup/throughput.png; empty writes nothing")
		n            = flag.Int("n", 0, "messages in each speed run (default 8000, -quick 300)")
		crashN       = flag.Int("crash-n", 0, "messages in each correctness run (default 2000, -quick 200)")
		crashEvery   = flag.Int("crash-every", 7, "inject the fault on the first delivery of every k-th message")
		crashWorkers = flag.Int("crash-workers", 8, "workers in the correctness runs")
		crashLease   = flag.Duration("crash-lease", 200*time.Millisecond, "lease of the lease strategies and the two-tier lock in the correctness runs")
		seed         = flag.Uint64("seed", 1, "seed of the generated streams")
		strategies   = flag.String("strategies", "", "comma-separated strategies to run (default all)")
		conc         = flag.String("concurrency", "1,8,32", "comma-separated worker counts of the speed runs")
		dups         = flag.String("dups", "0,10,50,90", "comma-separated duplicate percentages of the speed runs (-quick: 0,50)")
		redisBench   = flag.String("redis-benchmark", "redis-benchmark", "redis-benchmark binary; empty skips it")
		skipSpeed    = flag.Bool("skip-speed", false, "run the correctness runs only")
		skipCrash    = flag.Bool("skip-correctness", false, "run the speed runs only")
		pacedRate    = flag.Float64("paced-rate", 1000, "offered msgs/s of the paced latency runs")
		cpuProfile   = flag.String("cpuprofile", "", "write a CPU profile of the whole run to this file")
		minFill      = flag.Int("batch-min-fill", 0, "Batch.MinFill of the batched inboxes (0: the library's default)")
		pacedN       = flag.Int("paced-n", 0, "messages in each paced latency run (default 5000, -quick 500; 0 with -paced-rate 0 skips them)")
	)
	flag.Parse()
	if *cpuProfile != "" {
		f, err := os.Create(*cpuProfile)
		if err != nil {
			fmt.Fprintln(os.Stderr, "cpuprofile:", err)
			os.Exit(2)
		}
		if err := pprof.StartCPUProfile(f); err != nil {
			fmt.Fprintln(os.Stderr, "cpuprofile:", err)
			os.Exit(2)
		}
		defer pprof.StopCPUProfile()
	}

	cfg := Config{
		DSN:             *dsn,
		MySQLDSN:        *mysqlDSN,
		RedisURL:        *redisURL,
		N:               8000,
		Seed:            *seed,
		CrashN:          2000,
		CrashDupRatio:   0.10,
		CrashEvery:      *crashEvery,
		CrashWorkers:    *crashWorkers,
		CrashLease:      *crashLease,
		RedisBenchmark:  *redisBench,
		RedisBenchN:     20000,
		RunTimeout:      3 * time.Minute,
		PacedN:          5000,
		PacedRate:       *pacedRate,
		PacedWorkers:    32,
		SkipSpeed:       *skipSpeed,
		BatchMinFill:    *minFill,
		SkipCorrectness: *skipCrash,
		Out:             os.Stderr,
	}
	if *quick {
		cfg.N, cfg.CrashN, cfg.RedisBenchN, cfg.RunTimeout, cfg.PacedN = 300, 200, 2000, time.Minute, 500
		if !benchutil.FlagSet("dups") {
			*dups = "0,50"
		}
	}
	if *n > 0 {
		cfg.N = *n
	}
	if *crashN > 0 {
		cfg.CrashN = *crashN
	}
	if *pacedN > 0 {
		cfg.PacedN = *pacedN
	}
	if *pacedRate == 0 {
		cfg.PacedN = 0
	}
	var err error
	if cfg.Concurrency, err = benchutil.ParseInts(*conc); err == nil {
		var ps []int
		if ps, err = benchutil.ParseInts(*dups); err == nil {
			for _, p := range ps {
				if p < 0 || p >= 100 {
					err = fmt.Errorf("duplicate percentage %d out of [0, 100)", p)
				}
				cfg.DupRatios = append(cfg.DupRatios, float64(p)/100)
			}
		}
	}
	if *strategies != "" {
		cfg.Strategies = strings.Split(*strategies, ",")
	}
	if err == nil {
		err = cfg.Validate()
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "dedup benchmark:", err)
		os.Exit(2)
	}
	write := *out != "" && (!*quick || benchutil.FlagSet("out"))

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()

	started := time.Now()
	results, err := Run(ctx, cfg)
	if err != nil {
		fmt.Fprintln(os.Stderr, "dedup benchmark:", err)
		os.Exit(1)
	}
	cmd := "cd benchmarks && go run ./dedup"
	if len(os.Args) > 1 {
		cmd += " " + strings.Join(os.Args[1:], " ")
	}
	took := time.Since(started).Round(time.Second)
	note := fmt.Sprintf("Command: `%s` (or `make bench-dedup`), run %s on %d cores (nproc; GOMAXPROCS %d, %s/%s, %s), a shared and noisy machine; total run time %s.",
		cmd, started.UTC().Format("2006-01-02 15:04 MST"), runtime.NumCPU(), runtime.GOMAXPROCS(0),
		runtime.GOOS, runtime.GOARCH, runtime.Version(), took)
	tables := Markdown(results, cfg)
	fmt.Println(tables)
	fmt.Printf("total run time %s\n", took)

	if write {
		report := filepath.Join(*out, "RESULTS.md")
		csvPath := filepath.Join(*out, "dedup", "results.csv")
		png := filepath.Join(*out, "dedup", "throughput.png")
		if err := writeOutputs(results, cfg, Section(note, tables, cfg), report, csvPath, png); err != nil {
			fmt.Fprintln(os.Stderr, "dedup benchmark:", err)
			os.Exit(1)
		}
		fmt.Println("wrote", report, csvPath, png)
	}
}

// writeOutputs writes the report section, the CSV and the chart.
func writeOutputs(res *Results, cfg Config, section, report, csvPath, png string) error {
	for _, p := range []string{report, csvPath, png} {
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			return fmt.Errorf("create %s: %w", filepath.Dir(p), err)
		}
	}
	if err := UpdateReport(report, section); err != nil {
		return fmt.Errorf("write %s: %w", report, err)
	}
	if err := WriteCSV(csvPath, res); err != nil {
		return fmt.Errorf("write %s: %w", csvPath, err)
	}
	if len(res.Speed) > 0 {
		if err := Chart(png, res.Speed, chartConcurrency(cfg)); err != nil {
			return fmt.Errorf("write %s: %w", png, err)
		}
	}
	return nil
}

// Config sizes a run.
type Config struct {
	// DSN is the PostgreSQL URL; RedisURL the Redis URL.
	DSN, RedisURL string
	// MySQLDSN is the MySQL or MariaDB server of the MySQL strategies, a
	// go-sql-driver/mysql DSN; each measurement gets a database of its
	// own on it. Defaults to defaultMySQLDSN.
	MySQLDSN string
	// N is the stream length of the speed runs, DupRatios their duplicate
	// ratios and Concurrency their worker counts.
	N           int
	DupRatios   []float64
	Concurrency []int
	// Strategies selects strategies by name; empty runs all.
	Strategies []string
	// Seed makes the streams.
	Seed uint64
	// CrashN is the stream length of the correctness runs, CrashDupRatio
	// its duplicate ratio; the fault hits the first delivery of every
	// CrashEvery-th message; CrashWorkers deliver; lease strategies and
	// the two-tier lock use CrashLease.
	CrashN        int
	CrashDupRatio float64
	CrashEvery    int
	CrashWorkers  int
	CrashLease    time.Duration
	// RedisBenchmark is the redis-benchmark binary (empty skips it);
	// RedisBenchN its number of requests per concurrency.
	RedisBenchmark string
	RedisBenchN    int
	// RunTimeout bounds one measurement.
	RunTimeout time.Duration
	// PacedN messages arrive at PacedRate msgs/s in each paced latency
	// run, delivered by PacedWorkers workers; PacedN 0 skips them.
	PacedN       int
	PacedRate    float64
	PacedWorkers int
	// SkipSpeed and SkipCorrectness leave out one half.
	SkipSpeed, SkipCorrectness bool
	// BatchMinFill is the batched inboxes' Batch.MinFill; 0 keeps the
	// library's default.
	BatchMinFill int
	// Out receives progress lines.
	Out io.Writer
}

// defaultMySQLDSN is the local MariaDB. interpolateParams saves the
// statement preparation's round trip per statement, as sqlstore's doc
// advises; the store and its raw baseline share the pool and the setting.
const defaultMySQLDSN = "root@tcp(127.0.0.1:3306)/test?interpolateParams=true"

// Validate reports the first field out of range.
func (c Config) Validate() error {
	switch {
	case c.N < 1 || c.CrashN < 1:
		return fmt.Errorf("stream lengths must be positive, got %d and %d", c.N, c.CrashN)
	case len(c.Concurrency) == 0 || len(c.DupRatios) == 0:
		return fmt.Errorf("need at least one concurrency and one duplicate ratio")
	case c.CrashEvery < 2:
		return fmt.Errorf("crash-every must be at least 2, got %d", c.CrashEvery)
	case c.PacedN < 0 || (c.PacedN > 0 && (c.PacedRate <= 0 || c.PacedWorkers < 1)):
		return fmt.Errorf("paced runs need a positive rate and workers, got %d messages at %v msgs/s with %d workers", c.PacedN, c.PacedRate, c.PacedWorkers)
	case c.CrashWorkers < 1:
		return fmt.Errorf("crash-workers must be positive, got %d", c.CrashWorkers)
	case c.CrashLease < 10*time.Millisecond:
		return fmt.Errorf("crash-lease must be at least 10ms, got %s", c.CrashLease)
	case c.RunTimeout <= 0:
		return fmt.Errorf("run timeout must be positive")
	}
	for _, w := range c.Concurrency {
		if w < 1 {
			return fmt.Errorf("concurrency must be positive, got %d", w)
		}
	}
	return nil
}

// chartConcurrency is the concurrency the chart shows: 8, or the nearest
// one measured.
func chartConcurrency(cfg Config) int {
	best := cfg.Concurrency[0]
	for _, c := range cfg.Concurrency {
		if abs(c-8) < abs(best-8) {
			best = c
		}
	}
	return best
}

func abs(x int) int {
	if x < 0 {
		return -x
	}
	return x
}
