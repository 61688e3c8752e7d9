package main

import (
	"bytes"
	"context"
	"encoding/csv"
	"errors"
	"fmt"
	"net"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/oncemill/oncemill/dedup"
	"github.com/oncemill/oncemill/dedup/redis"
	"github.com/oncemill/oncemill/internal/testing/redistest"
)

// RedisBenchResult is redis-benchmark's rate for EVALSHA of the claim
// script on new keys at one concurrency, next to the store's own
// LeaseClaim rate through go-redis at the same concurrency.
type RedisBenchResult struct {
	Concurrency int
	Requests    int
	// RPS, P50 and P99 are redis-benchmark's figures (latencies in ms).
	RPS, P50, P99 float64
	// Command is the exact command run (a password would be masked).
	Command string
	// StoreClaimsPerSec is redis.Store.LeaseClaim on Requests new keys
	// from Concurrency goroutines: the same script through go-redis.
	StoreClaimsPerSec float64
}

// lease and window of the claims measured here, as the inbox's defaults.
const (
	benchLease  = 30 * time.Second
	benchWindow = dedup.DefaultWindow
)

// redisBenchmark runs redis-benchmark for EVALSHA of the claim script with
// c clients on random new keys under the run's prefix, deleted afterwards.
func (e *env) redisBenchmark(ctx context.Context, bin string, c int) (r RedisBenchResult, err error) {
	r = RedisBenchResult{Concurrency: c, Requests: e.cfg.RedisBenchN}
	prefix := fmt.Sprintf("bench-dedup:%s_rb%d:", e.runID, c)
	defer func() {
		if derr := redistest.DeleteKeys(context.WithoutCancel(ctx), e.rdb, prefix); derr != nil {
			err = errors.Join(err, fmt.Errorf("delete redis-benchmark keys: %w", derr))
		}
	}()
	sha, err := e.rdb.ScriptLoad(ctx, redis.ClaimScript()).Result()
	if err != nil {
		return r, fmt.Errorf("SCRIPT LOAD: %w", err)
	}
	opts := e.rdb.Options()
	host, port, err := net.SplitHostPort(opts.Addr)
	if err != nil {
		return r, fmt.Errorf("redis address %q: %w", opts.Addr, err)
	}
	args := []string{"-h", host, "-p", port}
	shown := append([]string(nil), args...)
	if opts.Password != "" {
		args = append(args, "-a", opts.Password)
		shown = append(shown, "-a", "***")
		if opts.Username != "" {
			args = append(args, "--user", opts.Username)
			shown = append(shown, "--user", opts.Username)
		}
	}
	if opts.DB != 0 {
		args = append(args, "--dbnum", strconv.Itoa(opts.DB))
		shown = append(shown, "--dbnum", strconv.Itoa(opts.DB))
	}
	rest := []string{"-c", strconv.Itoa(c), "-n", strconv.Itoa(r.Requests), "-r", "1000000000", "--csv",
		"EVALSHA", sha, "1", prefix + "__rand_int__",
		strconv.FormatInt(benchLease.Milliseconds(), 10), strconv.FormatInt(benchWindow.Milliseconds(), 10)}
	args, shown = append(args, rest...), append(shown, rest...)
	r.Command = bin + " " + strings.Join(shown, " ")

	var stderr bytes.Buffer
	cmd := exec.CommandContext(ctx, bin, args...)
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return r, fmt.Errorf("%s: %w: %s", r.Command, err, strings.TrimSpace(stderr.String()))
	}
	if r.RPS, r.P50, r.P99, err = parseRedisBenchmark(out); err != nil {
		return r, fmt.Errorf("%s: %w", r.Command, err)
	}
	return r, nil
}

// parseRedisBenchmark reads the rate and the p50 and p99 latencies from
// redis-benchmark's --csv output.
func parseRedisBenchmark(out []byte) (rps, p50, p99 float64, err error) {
	rows, err := csv.NewReader(bytes.NewReader(out)).ReadAll()
	if err != nil {
		return 0, 0, 0, fmt.Errorf("read CSV output: %w", err)
	}
	if len(rows) < 2 {
		return 0, 0, 0, fmt.Errorf("unexpected output %q", out)
	}
	col := map[string]int{}
	for i, h := range rows[0] {
		col[h] = i
	}
	row := rows[len(rows)-1]
	get := func(name string) (float64, error) {
		i, ok := col[name]
		if !ok || i >= len(row) {
			return 0, fmt.Errorf("no %q column in %q", name, out)
		}
		return strconv.ParseFloat(row[i], 64)
	}
	if rps, err = get("rps"); err == nil {
		if p50, err = get("p50_latency_ms"); err == nil {
			p99, err = get("p99_latency_ms")
		}
	}
	return rps, p50, p99, err
}

// storeClaims measures redis.Store.LeaseClaim alone on n new keys from c
// goroutines: the claim script through go-redis, with no effect and no
// completion.
func (e *env) storeClaims(ctx context.Context, c, n int) (perSec float64, err error) {
	fx, err := e.newFixture(ctx, strategyDef{Name: "redis-claims", Redis: true})
	if err != nil {
		return 0, err
	}
	defer func() { err = errors.Join(err, fx.close()) }()
	if err := e.warmConnections(ctx, c, nil, true); err != nil {
		return 0, err
	}
	var (
		next atomic.Int64
		wg   sync.WaitGroup
		errs = make([]error, c)
	)
	start := time.Now()
	for w := range c {
		wg.Go(func() {
			for {
				i := next.Add(1)
				if i > int64(n) {
					return
				}
				key := dedup.Key{Consumer: consumer, Key: "claim-" + strconv.FormatInt(i, 10)}
				if _, err := fx.redis.LeaseClaim(ctx, key, benchLease, benchWindow); err != nil {
					errs[w] = err
					return
				}
			}
		})
	}
	wg.Wait()
	took := time.Since(start)
	if err := errors.Join(errs...); err != nil {
		return 0, fmt.Errorf("lease claim: %w", err)
	}
	return float64(n) / took.Seconds(), nil
}
