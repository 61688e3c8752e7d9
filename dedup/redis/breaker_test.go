package redis_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/dedup"
	"github.com/oncemill/oncemill/dedup/redis"
	"github.com/oncemill/oncemill/internal/testing/msgtest"
	"github.com/oncemill/oncemill/internal/testing/redistest"
)

// TestFailOpenBreakerSkipsADownRedis kills Redis under a running router
// with FailOpen. The caller's own cancellations do not open the breaker;
// after a few claims wait out the client's dial cycle it opens, and from
// then on claims fail open without calling Redis but for one probe per
// interval, each counted and logged as fail-open answers are. Once Redis
// is back the breaker closes on a probe and dedup resumes.
func TestFailOpenBreakerSkipsADownRedis(t *testing.T) {
	t.Parallel()
	logs := watermill.NewCaptureLogger()
	srv := redistest.StartServer(t)
	client := srv.Client(t)
	calls := &redistest.CallCounter{}
	client.AddHook(calls)
	store, err := redis.New(redis.Config{Client: client, Policy: redis.FailOpen, Logger: logs})
	require.NoError(t, err)
	const n, m, copies = 20, 200, 3
	h := newHarness(t, store, copies)

	before := msgtest.Keys("before", n)
	h.Publish(before, copies)
	acked := int64(n * copies)
	h.WaitAcked(acked)
	require.Equal(t, redis.Stats{}, store.Stats())

	srv.Stop()
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	for i := 0; i < 2*redis.DefaultBreakerFailures; i++ {
		_, err := store.LeaseClaim(ctx, dedup.Key{Consumer: "payments", Key: "cancelled"}, time.Minute, time.Hour)
		require.ErrorIs(t, err, context.Canceled)
	}
	require.Equal(t, redis.Stats{}, store.Stats(), "the caller's cancellation neither fails open nor opens the breaker")

	// The first claims wait out the client's dial cycle, until
	// BreakerFailures in a row have failed; then the breaker opens.
	warm := msgtest.Keys("warm", n)
	h.Publish(warm, 1)
	acked += n
	h.WaitAcked(acked)
	stats := store.Stats()
	require.True(t, stats.BreakerOpen)
	require.Equal(t, int64(1), stats.BreakerOpens)
	require.Equal(t, int64(n), stats.FailedOpen)

	during := msgtest.Keys("during", m)
	callsBefore := calls.Calls()
	start := time.Now()
	h.Publish(during, copies)
	acked += m * copies
	h.WaitAcked(acked)
	elapsed := time.Since(start)
	deliveries := int64(m * copies)
	redisCalls := calls.Calls() - callsBefore
	after := store.Stats()
	// One claim per delivery: a probe, which fails, or a skip; both fail
	// open.
	require.Equal(t, deliveries, after.FailedOpen-stats.FailedOpen, "every delivery failed open once")
	require.Equal(t, deliveries, after.Skipped-stats.Skipped+redisCalls, "each claim was skipped or probed")
	require.LessOrEqual(t, redisCalls, int64(elapsed/redis.DefaultBreakerProbe)+2, "one probe per interval reaches Redis")
	t.Logf("Redis down, breaker open: %d deliveries in %s (%.0f msg/s), %d Redis commands, %d claims skipped",
		deliveries, elapsed.Round(time.Millisecond), float64(deliveries)/elapsed.Seconds(), redisCalls, after.Skipped-stats.Skipped)
	for _, k := range during {
		require.Equal(t, copies, h.effectsOf(k), "key %s: fail-open applies every copy", k)
	}
	failOpenLogs, openLogs := 0, 0
	for _, l := range logs.Captured()[watermill.ErrorLogLevel] {
		switch {
		case strings.Contains(l.Msg, "failing open"):
			require.Error(t, l.Err, "the cause is logged")
			if l.Fields["breaker"] == "open" {
				require.ErrorIs(t, l.Err, redis.ErrUnavailable)
				require.ErrorContains(t, l.Err, "circuit breaker open")
			}
			failOpenLogs++
		case strings.Contains(l.Msg, "circuit breaker open"):
			openLogs++
		}
	}
	require.Equal(t, int(after.FailedOpen), failOpenLogs, "every fail-open answer is logged, skipped or not")
	require.Equal(t, 1, openLogs)

	srv.Start()
	took := waitBreakerClosed(t, store, 10*redis.DefaultBreakerProbe)
	t.Logf("breaker closed %s after Redis restarted (%.1f probe intervals)",
		took.Round(time.Millisecond), took.Seconds()/redis.DefaultBreakerProbe.Seconds())
	failedOpen := store.Stats().FailedOpen

	again := msgtest.Keys("again", n)
	h.Publish(again, copies)
	acked += n * copies
	h.WaitAcked(acked)
	h.RequireNoOtherErrors()
	for _, k := range again {
		require.Equal(t, 1, h.effectsOf(k), "key %s: dedup resumed with Redis", k)
	}
	stats = store.Stats()
	require.Equal(t, failedOpen, stats.FailedOpen)
	require.False(t, stats.BreakerOpen)
	require.Equal(t, int64(1), stats.BreakerOpens)
}

// TestBreakerConfig checks the breaker's fields are validated by name.
func TestBreakerConfig(t *testing.T) {
	t.Parallel()
	client := redistest.Client(t)
	_, err := redis.New(redis.Config{Client: client, BreakerFailures: -1})
	require.ErrorContains(t, err, "redis: Config.BreakerFailures must not be negative")
	_, err = redis.New(redis.Config{Client: client, BreakerProbe: -time.Second})
	require.ErrorContains(t, err, "redis: Config.BreakerProbe must not be negative")
	require.Equal(t, 3, redis.DefaultBreakerFailures)
	require.Equal(t, time.Second, redis.DefaultBreakerProbe)
}
