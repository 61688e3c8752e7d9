package main

import (
	"context"
	"fmt"
	"io"
	"os/exec"
	"slices"
	"time"

	"github.com/oncemill/oncemill/benchmarks/internal/benchutil"
)

// Results is everything one run measured.
type Results struct {
	Speed      []SpeedResult
	Paced      []PacedResult
	Crash      []CrashResult
	RedisBench []RedisBenchResult
	// RedisBenchSkipped says why there are no redis-benchmark figures.
	RedisBenchSkipped string
	// CrashStream describes the correctness runs' stream.
	CrashKeys, CrashDups int
}

// Run runs every measurement cfg selects and returns the results measured
// so far, with the first error.
func Run(ctx context.Context, cfg Config) (*Results, error) {
	if cfg.Out == nil {
		cfg.Out = io.Discard
	}
	// Loggers print from the subscribers' and handlers' goroutines.
	cfg.Out = benchutil.SyncWriter(cfg.Out)
	baselines, defs, err := lookupStrategies(cfg.Strategies)
	if err != nil {
		return nil, err
	}
	e, closeEnv, err := newEnv(ctx, cfg, needsOf(append(slices.Clone(baselines), defs...)))
	if err != nil {
		return nil, err
	}
	defer closeEnv()

	res := &Results{}
	total := 0
	paced := pacedSelected(baselines, defs, cfg)
	if !cfg.SkipSpeed {
		total += len(cfg.DupRatios)*len(cfg.Concurrency)*(len(defs)+len(baselines)) + len(paced)
	}
	if !cfg.SkipCorrectness {
		total += len(defs) * len(faults())
	}
	p := &progress{out: cfg.Out, total: total, start: time.Now()}

	if !cfg.SkipSpeed {
		for _, ratio := range cfg.DupRatios {
			s := newStream(cfg.N, ratio, cfg.Seed)
			for _, c := range cfg.Concurrency {
				for _, d := range append(slices.Clone(baselines), defs...) {
					r, err := e.speed(ctx, d, &s, c)
					if err != nil {
						return res, fmt.Errorf("speed %s, %d%% duplicates, %d workers: %w", d.Name, pct(ratio), c, err)
					}
					res.Speed = append(res.Speed, r)
					p.line("speed %-22s dup %2d%% c=%-2d %7.0f msgs/s  p50 %s p99 %s  %.2f RT/msg  %s msgs/COMMIT  %d in-flight nacks  %d double",
						d.Name, r.DupPct, c, r.MsgsPerSec, fmtMs(r.P50), fmtMs(r.P99), r.PGRT+r.RedisRT, msgsPerCommit(r), r.InFlight, r.Effects.Doubles)
				}
			}
		}
		fillRatios(res.Speed)
		s := newStream(cfg.PacedN, cfg.CrashDupRatio, cfg.Seed)
		for _, run := range paced {
			r, err := e.paced(ctx, run, &s, cfg.PacedRate, cfg.PacedWorkers)
			if err != nil {
				return res, fmt.Errorf("paced %s at %.0f msgs/s: %w", run.Strategy, cfg.PacedRate, err)
			}
			res.Paced = append(res.Paced, r)
			p.line("paced %-34s %5.0f msgs/s offered, %5.0f acked  p50 %s p99 %s max %s  %d double",
				r.Name(), r.Rate, r.Achieved, fmtMs(r.P50), fmtMs(r.P99), fmtMs(r.Max), r.Effects.Doubles)
		}
		if err := e.redisBenchmarks(ctx, res, defs); err != nil {
			return res, err
		}
	}

	if !cfg.SkipCorrectness {
		s := newStream(cfg.CrashN, cfg.CrashDupRatio, cfg.Seed)
		res.CrashKeys, res.CrashDups = s.Keys, s.Dups
		for _, d := range defs {
			for _, f := range faults() {
				r, err := e.correctness(ctx, d, &s, f)
				if err != nil {
					return res, fmt.Errorf("correctness %s, %s: %w", d.Name, f, err)
				}
				res.Crash = append(res.Crash, r)
				p.line("correctness %-22s %-44s %3d faults %3d processes: %d double, %d lost (%s)",
					d.Name, f, r.Faults, r.Processes, r.Effects.Doubles, r.Lost, r.Elapsed.Round(10*time.Millisecond))
			}
		}
	}
	return res, nil
}

// pacedSelected returns the paced runs of the strategies cfg selects
// (the raw-SQL baseline's whenever it runs), none when cfg.PacedN is 0.
func pacedSelected(baselines, defs []strategyDef, cfg Config) []pacedRun {
	if cfg.PacedN == 0 {
		return nil
	}
	all := append(slices.Clone(baselines), defs...)
	var out []pacedRun
	for _, run := range pacedRuns() {
		if slices.ContainsFunc(all, func(d strategyDef) bool { return d.Name == run.Strategy }) {
			out = append(out, run)
		}
	}
	return out
}

// redisBenchmarks runs redis-benchmark and the store's claims at every
// concurrency, when redis-lease is among the strategies.
func (e *env) redisBenchmarks(ctx context.Context, res *Results, defs []strategyDef) error {
	want := false
	for _, d := range defs {
		want = want || d.Name == stRedis
	}
	if !want {
		res.RedisBenchSkipped = "redis-lease was not run"
		return nil
	}
	if e.cfg.RedisBenchmark == "" {
		res.RedisBenchSkipped = "disabled with -redis-benchmark ''"
		return nil
	}
	bin, err := exec.LookPath(e.cfg.RedisBenchmark)
	if err != nil {
		res.RedisBenchSkipped = fmt.Sprintf("%s not found: %v", e.cfg.RedisBenchmark, err)
		fmt.Fprintln(e.cfg.Out, "redis-benchmark skipped:", res.RedisBenchSkipped)
		return nil
	}
	for _, c := range e.cfg.Concurrency {
		r, err := e.redisBenchmark(ctx, bin, c)
		if err != nil {
			return fmt.Errorf("redis-benchmark, %d clients: %w", c, err)
		}
		if r.StoreClaimsPerSec, err = e.storeClaims(ctx, c, e.cfg.RedisBenchN); err != nil {
			return fmt.Errorf("store claims, %d workers: %w", c, err)
		}
		res.RedisBench = append(res.RedisBench, r)
		fmt.Fprintf(e.cfg.Out, "redis-benchmark EVALSHA claim c=%-2d %8.0f/s (p50 %.3f ms, p99 %.3f ms); redis.Store.LeaseClaim alone %8.0f/s\n",
			c, r.RPS, r.P50, r.P99, r.StoreClaimsPerSec)
	}
	return nil
}

// fillRatios sets every speed result's throughput ratio to its raw-SQL
// baseline (strategyDef.Raw) at the same duplicate ratio and concurrency;
// the baselines on their own database and driver have none.
func fillRatios(rs []SpeedResult) {
	for i := range rs {
		if isRawRef(rs[i].Strategy) && rs[i].Strategy != stRaw {
			continue
		}
		if raw, ok := findSpeed(rs, rawOf(rs[i].Strategy), rs[i].DupPct, rs[i].Concurrency); ok && raw.MsgsPerSec > 0 {
			rs[i].RatioRaw = rs[i].MsgsPerSec / raw.MsgsPerSec
		}
	}
}

// isRawRef says whether name is a baseline other rows' ratios compare
// with: raw-sql, raw-sql-stdlib, raw-sql-mysql.
func isRawRef(name string) bool {
	return name == stRaw || name == stRawStdlib || name == stRawMySQL
}

// rawOf is the baseline strategy name's ratio compares with.
func rawOf(name string) string {
	for _, d := range allDefs() {
		if d.Name == name {
			return d.raw()
		}
	}
	return stRaw
}

func findSpeed(rs []SpeedResult, strategy string, dupPct, c int) (SpeedResult, bool) {
	for _, r := range rs {
		if r.Strategy == strategy && r.DupPct == dupPct && r.Concurrency == c {
			return r, true
		}
	}
	return SpeedResult{}, false
}

// progress prints numbered progress lines with the time elapsed.
type progress struct {
	out   io.Writer
	total int
	n     int
	start time.Time
}

func (p *progress) line(format string, args ...any) {
	p.n++
	fmt.Fprintf(p.out, "[%3d/%d %s] %s\n", p.n, p.total, fmtElapsed(time.Since(p.start)), fmt.Sprintf(format, args...))
}

func fmtElapsed(d time.Duration) string {
	d = d.Round(time.Second)
	return fmt.Sprintf("%dm%02ds", int(d.Minutes()), int(d.Seconds())%60)
}

// fmtMs formats a latency in milliseconds.
func fmtMs(d time.Duration) string {
	ms := float64(d) / float64(time.Millisecond)
	switch {
	case ms < 0.1:
		return fmt.Sprintf("%.0f µs", ms*1000)
	case ms < 10:
		return fmt.Sprintf("%.2f ms", ms)
	case ms < 1000:
		return fmt.Sprintf("%.1f ms", ms)
	}
	return fmt.Sprintf("%.0f ms", ms)
}
