package twotier_test

import (
	"context"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/dedup"
	"github.com/oncemill/oncemill/dedup/redis"
	"github.com/oncemill/oncemill/dedup/twotier"
	"github.com/oncemill/oncemill/internal/testing/msgtest"
	"github.com/oncemill/oncemill/internal/testing/redistest"
	"github.com/oncemill/oncemill/middleware"
)

// TestBreakerSkipsRedisWhileDown kills the lock's Redis under a running
// router. After a few deliveries wait out the client's dial cycle the
// breaker opens, and from then on only its probes reach Redis: the
// deliveries go to PostgreSQL alone at about PostgreSQL's own pace,
// measured against a store of PostgreSQL alone. Once Redis is back the
// breaker closes on a probe, and duplicates are answered by the lock
// again. Every key is applied once throughout, duplicates sent during and
// after the outage included.
func TestBreakerSkipsRedisWhileDown(t *testing.T) {
	t.Parallel()
	srv := redistest.StartServer(t)
	logs := watermill.NewCaptureLogger()
	b := setup(t, options{maxConns: 8, server: srv, logger: logs, lease: 10 * time.Second})
	calls := b.countCalls()
	const n, m, copies = 30, 500, 3
	h := newHarness(t, b, copies)
	pgStore, pb := postgresOnly(t, b)
	pg := newHarnessOn(t, pgStore, pb, copies)

	before, warm := msgtest.Keys("before", n), msgtest.Keys("warm", n)
	h.Publish(before, copies)
	acked := int64(n * copies)
	h.WaitAcked(acked)
	// The PostgreSQL-only store is warmed up alike.
	pg.Publish(before, copies)
	pg.Publish(warm, 1)
	pgAcked := int64(n*copies + n)
	pg.WaitAcked(pgAcked)
	require.Equal(t, twotier.Stats{}, withoutHits(b.store.Stats()), "Redis up: no fallback, no skip")

	srv.Stop()
	// The first deliveries wait out the client's dial cycle until
	// BreakerFailures calls in a row have failed; then the breaker opens.
	start := time.Now()
	h.Publish(warm, 1)
	acked += n
	h.WaitAcked(acked)
	t.Logf("Redis down, breaker opening: %d deliveries in %s", n, time.Since(start).Round(time.Millisecond))
	stats := b.store.Stats()
	require.True(t, stats.BreakerOpen)
	require.Equal(t, int64(1), stats.BreakerOpens)

	// With the breaker open: m keys, copies times each.
	during := msgtest.Keys("during", m)
	callsBefore, skippedBefore := calls.Calls(), stats.Skipped
	start = time.Now()
	h.Publish(during, copies)
	acked += m * copies
	h.WaitAcked(acked)
	elapsed := time.Since(start)
	deliveries := int64(m * copies)
	redisCalls := calls.Calls() - callsBefore
	skipped := b.store.Stats().Skipped - skippedBefore
	// At most one probe per interval (1 s) reaches Redis, each one
	// command; every other start and claim is skipped.
	probes := int64(elapsed/twotier.DefaultBreakerProbe) + 2
	require.LessOrEqual(t, redisCalls, probes, "only the breaker's probes reach Redis")
	require.GreaterOrEqual(t, skipped, deliveries-probes, "every delivery skipped the lock at least once")
	t.Logf("Redis down, breaker open: %d deliveries in %s, %d Redis commands, %d lock calls skipped",
		deliveries, elapsed.Round(time.Millisecond), redisCalls, skipped)

	// Duplicates of keys done before the outage, during it.
	h.Publish(before, 1)
	acked += n
	h.WaitAcked(acked)

	// The same deliveries on PostgreSQL alone, with the same handlers and
	// pool.
	start = time.Now()
	pg.Publish(during, copies)
	pg.WaitAcked(pgAcked + deliveries)
	pgElapsed := time.Since(start)
	twoTierRate := float64(deliveries) / elapsed.Seconds()
	pgRate := float64(deliveries) / pgElapsed.Seconds()
	t.Logf("throughput with Redis down: two-tier %.0f msg/s, PostgreSQL alone %.0f msg/s, ratio %.2f (target >= 0.5)",
		twoTierRate, pgRate, twoTierRate/pgRate)

	effects := b.effects(t)
	for _, k := range concat(before, warm, during) {
		require.Equal(t, 1, effects[k], "key %s while Redis was down", k)
	}

	// Redis comes back, empty. The breaker closes on the next probe,
	// within a few probe intervals.
	srv.Start()
	took := waitBreakerClosed(t, b.store, dedup.Key{Consumer: "orders", Key: before[0]}, 10*twotier.DefaultBreakerProbe)
	t.Logf("breaker closed %s after Redis restarted (%.1f probe intervals)",
		took.Round(time.Millisecond), took.Seconds()/twotier.DefaultBreakerProbe.Seconds())
	stats = b.store.Stats()
	require.False(t, stats.BreakerOpen)
	require.Equal(t, int64(1), stats.BreakerOpens)

	// Duplicates after the outage: the first copy of each key finds the
	// restarted lock empty, is answered by PostgreSQL and teaches the
	// lock; the next ones are answered by the lock alone.
	all := concat(before, warm, during)
	h.Publish(all, 1)
	acked += int64(len(all))
	h.WaitAcked(acked)
	acquires, hits, skippedNow := b.acquires(), b.store.Stats().LockHits, b.store.Stats().Skipped
	h.Publish(all, 1)
	acked += int64(len(all))
	h.WaitAcked(acked)
	require.Equal(t, acquires, b.acquires(), "duplicates are answered by the lock again")
	require.Equal(t, hits+int64(len(all)), b.store.Stats().LockHits)
	require.Equal(t, skippedNow, b.store.Stats().Skipped, "nothing skipped once closed")

	h.RequireNoOtherErrors()
	pg.RequireNoOtherErrors()
	require.Equal(t, int64(len(all)), h.runs.Load(), "the handler ran once per key, Redis or not")
	effects = b.effects(t)
	require.Len(t, effects, len(all))
	for _, k := range all {
		require.Equal(t, 1, effects[k], "key %s", k)
	}
	require.Equal(t, len(all), b.totalEffects(t), "effects in PostgreSQL equal distinct keys")
	require.Equal(t, 2*n+m, pb.totalEffects(t))
	require.Equal(t, 1, countLogs(logs, watermill.ErrorLogLevel, "circuit breaker open"))
	require.Equal(t, 1, countLogs(logs, watermill.InfoLogLevel, "circuit breaker closed"))
}

// TestStaleLeaseAfterAPartition cuts the lock off from Redis, as a network
// partition would, while a delivery holds its lease: the delivery commits
// in PostgreSQL but cannot mark the lock done, and Redis keeps the live
// lease through the partition. When Redis answers again, that lease still
// says in flight for a key that is done: the store checks such an answer
// against the record, so the key is answered done, not in flight, also to
// a claim made without a start (SkipAttemptRecord, dead-lettering).
func TestStaleLeaseAfterAPartition(t *testing.T) {
	t.Parallel()
	b := setup(t, options{})
	part := &partition{Store: b.lock}
	logs := watermill.NewCaptureLogger()
	const probe = 50 * time.Millisecond
	store, err := twotier.New(twotier.Config{Lock: part, Record: b.record, Lease: time.Minute, BreakerProbe: probe, Logger: logs})
	require.NoError(t, err)
	b.store = store
	var runs atomic.Int32
	handler := func(msg *message.Message) ([]*message.Message, error) {
		runs.Add(1)
		key := middleware.IdempotencyKey(msg.Context())
		if err := b.effect(msg.Context(), key); err != nil {
			return nil, err
		}
		if key == "o-stale" {
			part.cut.Store(true) // the partition starts while the lease is held
		}
		return []*message.Message{message.NewMessage("receipt-"+key, nil)}, nil
	}
	h := newInbox(t, store, "billing").Middleware(handler)
	ctx := context.Background()
	stale := dedup.Key{Consumer: "billing", Key: "o-stale"}

	_, err = h(delivery("o-stale"))
	require.NoError(t, err, "the commit is in PostgreSQL; only the lock missed it")
	require.Equal(t, "processing", b.lockRecord(t, stale)["status"], "the lease outlives the commit in Redis")
	callsAtCut := part.calls.Load()

	// During the partition: duplicates of the key and new keys. Once the
	// settle and two more calls failed, the breaker skips the lock.
	start := time.Now()
	const n = 20
	for i := 0; i < n; i++ {
		_, err := h(delivery("o-stale"))
		require.NoError(t, err)
		_, err = h(delivery(fmt.Sprintf("p-%d", i)))
		require.NoError(t, err)
	}
	elapsed := time.Since(start)
	stats := store.Stats()
	require.True(t, stats.BreakerOpen)
	require.Equal(t, int64(1), stats.BreakerOpens)
	cutCalls := part.calls.Load() - callsAtCut
	// A duplicate makes one lock call (its start's peek), a new key two
	// (peek and claim): each is either made, and fails, or skipped.
	const lockCalls = n + 2*n
	require.Equal(t, int64(lockCalls), stats.Skipped+cutCalls)
	require.LessOrEqual(t, cutCalls, int64(2)+int64(elapsed/probe)+1,
		"two failures after the settle's, then one probe per interval")
	require.Equal(t, 1+int(cutCalls)+1, len(logs.Captured()[watermill.ErrorLogLevel]),
		"every failed call is logged (the settle's and cutCalls), and the opening once; skipped calls are not")

	part.cut.Store(false)
	waitBreakerClosed(t, store, stale, 5*time.Second)
	require.Equal(t, "processing", b.lockRecord(t, stale)["status"], "the stale lease is still live in Redis")

	// A claim without a start: the lock says in flight, the record says
	// done, and the record's answer is given.
	checks := store.Stats().InFlightChecks
	tx, c := b.claim(t, stale)
	require.Equal(t, dedup.StateDone, c.State, "not answered in flight from the stale lease")
	require.NotEmpty(t, c.Result)
	require.NoError(t, tx.Rollback(ctx))
	require.Equal(t, checks+1, store.Stats().InFlightChecks)

	// The same through an inbox that skips the attempt record.
	skipStart, err := middleware.NewInbox(middleware.InboxConfig{
		TxStore: store, Consumer: "billing",
		Tuning: middleware.InboxTuning{InFlightDelay: 5 * time.Millisecond, SkipAttemptRecord: true},
	})
	require.NoError(t, err)
	out, err := skipStart.Middleware(handler)(delivery("o-stale"))
	require.NoError(t, err)
	require.Len(t, out, 1)
	require.Equal(t, "receipt-o-stale", out[0].UUID, "the record's stored result")
	require.Equal(t, middleware.InboxStats{Duplicates: 1}, skipStart.Stats())

	// A key really in flight is still answered in flight: the record does
	// not hold it done.
	live := dedup.Key{Consumer: "billing", Key: "o-live"}
	holder, c := b.claim(t, live)
	require.Equal(t, dedup.StateNew, c.State)
	dup, c := b.claim(t, live)
	require.Equal(t, dedup.StateInFlight, c.State)
	require.NoError(t, dup.Rollback(ctx))
	require.NoError(t, holder.Rollback(ctx))

	require.Equal(t, int32(1+n), runs.Load(), "o-stale once and each new key once")
	effects := b.effects(t)
	require.Len(t, effects, 1+n)
	for k, e := range effects {
		require.Equal(t, 1, e, "key %s", k)
	}
}

// TestBreakerConfig checks the breaker's fields are validated by name.
func TestBreakerConfig(t *testing.T) {
	t.Parallel()
	b := setup(t, options{})
	_, err := twotier.New(twotier.Config{Lock: b.lock, Record: b.record, BreakerFailures: -1})
	require.ErrorContains(t, err, "twotier: Config.BreakerFailures must not be negative")
	_, err = twotier.New(twotier.Config{Lock: b.lock, Record: b.record, BreakerProbe: -time.Second})
	require.ErrorContains(t, err, "twotier: Config.BreakerProbe must not be negative")
	require.Equal(t, 3, twotier.DefaultBreakerFailures)
	require.Equal(t, time.Second, twotier.DefaultBreakerProbe)
}

// partition is a lock that can be cut off from its Redis: while cut,
// every call fails with an unavailability error without reaching Redis,
// which keeps what it holds, as in a network partition.
type partition struct {
	*redis.Store
	cut   atomic.Bool
	calls atomic.Int64
}

func (p *partition) down() error {
	p.calls.Add(1)
	if p.cut.Load() {
		return fmt.Errorf("redis: dial tcp: i/o timeout: %w", redis.ErrUnavailable)
	}
	return nil
}

func (p *partition) InboxPeek(ctx context.Context, key dedup.Key) (dedup.Claim, error) {
	if err := p.down(); err != nil {
		return dedup.Claim{}, err
	}
	return p.Store.InboxPeek(ctx, key)
}

func (p *partition) LeaseClaim(ctx context.Context, key dedup.Key, lease, window time.Duration) (dedup.Claim, error) {
	if err := p.down(); err != nil {
		return dedup.Claim{}, err
	}
	return p.Store.LeaseClaim(ctx, key, lease, window)
}

func (p *partition) LeaseComplete(ctx context.Context, key dedup.Key, token int64, result []byte) error {
	if err := p.down(); err != nil {
		return err
	}
	return p.Store.LeaseComplete(ctx, key, token, result)
}

func (p *partition) LeaseRelease(ctx context.Context, key dedup.Key, token int64, f dedup.Failure) error {
	if err := p.down(); err != nil {
		return err
	}
	return p.Store.LeaseRelease(ctx, key, token, f)
}

// withoutHits clears the lock hits, which depend on how the copies of a
// key raced.
func withoutHits(s twotier.Stats) twotier.Stats {
	s.LockHits = 0
	return s
}

func concat(lists ...[]string) []string {
	var out []string
	for _, l := range lists {
		out = append(out, l...)
	}
	return out
}

// countLogs counts the captured lines of level whose message contains msg.
func countLogs(logs *watermill.CaptureLoggerAdapter, level watermill.LogLevel, msg string) int {
	n := 0
	for _, l := range logs.Captured()[level] {
		if strings.Contains(l.Msg, msg) {
			n++
		}
	}
	return n
}
