package redis_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	goredis "github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/dedup"
	"github.com/oncemill/oncemill/dedup/redis"
	"github.com/oncemill/oncemill/internal/testing/msgtest"
	"github.com/oncemill/oncemill/internal/testing/redistest"
)

// privateStore is a store on a redis-server owned by the test, which the
// test stops and restarts. The server starts empty on every restart.
func privateStore(t *testing.T, policy redis.Policy, logger watermill.LoggerAdapter) (*redistest.Server, *goredis.Client, *redis.Store) {
	t.Helper()
	srv := redistest.StartServer(t)
	client := srv.Client(t)
	store, err := redis.New(redis.Config{Client: client, Policy: policy, Logger: logger})
	require.NoError(t, err)
	return srv, client, store
}

// restart starts srv again and waits until client reaches it: after a run
// of dial errors the client's pool answers with the last one until its
// background probe reconnects.
func restart(t *testing.T, srv *redistest.Server, client *goredis.Client) {
	t.Helper()
	srv.Start()
	msgtest.WaitFor(t, "the client to reconnect", func() bool {
		return client.Ping(context.Background()).Err() == nil
	})
}

// restartBetweenDeliveries brings Redis back while no delivery runs. A
// delivery caught in the transition can claim its key on the restarted
// server and then fail to complete it, on a connection the client was still
// dialling while Redis was down: its effect is applied, the message is
// nacked, and the lease holds the key until it expires, when the effect is
// applied again. That is lease mode's risk whenever completing fails, not
// Redis's alone; these tests look at what the policies do while Redis is
// down, so they keep it out.
func restartBetweenDeliveries(t *testing.T, h *harness, srv *redistest.Server, client *goredis.Client) {
	t.Helper()
	h.Pause()
	defer h.Resume()
	restart(t, srv, client)
}

// TestRedisStoppedMidRunFailClosed stops Redis under a running router.
// While it is down every delivery is nacked with ErrUnavailable and no
// effect is applied; once it is back, every message is applied exactly
// once.
func TestRedisStoppedMidRunFailClosed(t *testing.T) {
	t.Parallel()
	srv, client, store := privateStore(t, redis.FailClosed, nil)
	const n, copies = 20, 3
	h := newHarness(t, store, copies)

	before := msgtest.Keys("before", n)
	h.Publish(before, copies)
	h.WaitAcked(n * copies)
	require.Equal(t, n, h.totalEffects())

	srv.Stop()
	during := msgtest.Keys("during", n)
	h.Publish(during, copies)
	// Every handler has had deliveries refused, several times over.
	msgtest.WaitFor(t, "deliveries nacked as unavailable", func() bool { return h.Count(redis.ErrUnavailable) >= 10*copies })
	require.Equal(t, int64(n*copies), h.Acked(), "nothing is acked while Redis is down")
	require.Equal(t, n, h.totalEffects(), "nothing is applied while Redis is down")
	for _, k := range during {
		require.Zero(t, h.effectsOf(k))
	}

	restartBetweenDeliveries(t, h, srv, client)
	h.WaitAcked(2 * n * copies)
	h.RequireNoOtherErrors()
	for _, k := range before {
		require.Equal(t, 1, h.effectsOf(k), "key %s", k)
	}
	for _, k := range during {
		require.Equal(t, 1, h.effectsOf(k), "key %s was applied more or less than once", k)
	}
	require.Equal(t, 2*n, h.totalEffects())
	require.Equal(t, redis.Stats{}, store.Stats(), "fail-closed never fails open")

	// Directly: the error wraps ErrUnavailable, for the caller to tell it
	// from a real one.
	srv.Stop()
	_, err := store.LeaseClaim(context.Background(), dedup.Key{Consumer: "c", Key: "k"}, time.Minute, time.Hour)
	require.ErrorIs(t, err, redis.ErrUnavailable)
	require.ErrorContains(t, err, "redis: lease claim")
	_, err = store.InboxPeek(context.Background(), dedup.Key{Consumer: "c", Key: "k"})
	require.ErrorIs(t, err, redis.ErrUnavailable)
	err = store.InboxDoneKeys(context.Background(), "c", time.Time{}, func(string) error { return nil })
	require.ErrorIs(t, err, redis.ErrUnavailable)
	_, err = store.LeaseExtend(context.Background(), dedup.Key{Consumer: "c", Key: "k"}, 1, time.Minute)
	require.ErrorIs(t, err, redis.ErrUnavailable)
	require.ErrorIs(t, store.LeaseBury(context.Background(), dedup.Key{Consumer: "c", Key: "k"}, 1, dedup.Failure{}), redis.ErrUnavailable)
	_, err = store.InboxReopen(context.Background(), dedup.Key{Consumer: "c", Key: "k"}, "grant")
	require.ErrorIs(t, err, redis.ErrUnavailable)
	_, err = store.InboxGrantReplay(context.Background(), dedup.Key{Consumer: "c", Key: "k"}, "grant")
	require.ErrorIs(t, err, redis.ErrUnavailable)
	_, err = store.InboxReplayGranted(context.Background(), dedup.Key{Consumer: "c", Key: "k"}, "grant")
	require.ErrorIs(t, err, redis.ErrUnavailable)
	require.ErrorIs(t, store.InboxDeadCopy(context.Background(), dedup.Key{Consumer: "c", Key: "k"}), redis.ErrUnavailable)
	restart(t, srv, client) // let the pool's reconnect probe end before the leak check
}

// TestRedisStoppedMidRunFailOpenCanDoubleApply stops Redis under a running
// router with FailOpen. While Redis is down every delivery is processed
// without dedup: each is counted and logged, and every copy of a key
// applies its effect, duplicates included. This is the documented risk of
// FailOpen; once Redis is back, dedup resumes.
func TestRedisStoppedMidRunFailOpenCanDoubleApply(t *testing.T) {
	t.Parallel()
	logs := watermill.NewCaptureLogger()
	srv, client, store := privateStore(t, redis.FailOpen, logs)
	const n, copies = 20, 3
	h := newHarness(t, store, copies)

	before := msgtest.Keys("before", n)
	h.Publish(before, copies)
	h.WaitAcked(n * copies)
	require.Equal(t, n, h.totalEffects())
	require.Equal(t, redis.Stats{}, store.Stats())

	srv.Stop()
	during := msgtest.Keys("during", n)
	h.Publish(during, copies)
	h.WaitAcked(2 * n * copies)
	require.Equal(t, int64(n*copies), store.Stats().FailedOpen, "every delivery while down failed open, once")
	for _, k := range during {
		require.Equal(t, copies, h.effectsOf(k), "key %s: every copy was applied, duplicates included", k)
	}
	failOpenLogs := 0
	for _, l := range logs.Captured()[watermill.ErrorLogLevel] {
		require.Error(t, l.Err, "the log line carries the cause")
		if !strings.Contains(l.Msg, "failing open") {
			continue // the breaker's opening
		}
		require.Equal(t, "payments", l.Fields["consumer"])
		failOpenLogs++
	}
	require.Equal(t, n*copies, failOpenLogs)

	restartBetweenDeliveries(t, h, srv, client)
	// The breaker, open since the stop, closes on its next probe.
	waitBreakerClosed(t, store, 10*redis.DefaultBreakerProbe)
	failedOpen := store.Stats().FailedOpen
	after := msgtest.Keys("after", n)
	h.Publish(after, copies)
	h.WaitAcked(3 * n * copies)
	h.RequireNoOtherErrors()
	for _, k := range after {
		require.Equal(t, 1, h.effectsOf(k), "key %s: dedup resumed with Redis", k)
	}
	require.Equal(t, failedOpen, store.Stats().FailedOpen)
	require.Zero(t, h.Count(redis.ErrUnavailable), "fail-open nacks nothing")

	// A restart without persistence forgot the keys done before it: the
	// reason this store is not a source of truth.
	c, err := store.LeaseClaim(context.Background(), dedup.Key{Consumer: "payments", Key: before[0]}, time.Minute, time.Hour)
	require.NoError(t, err)
	require.Equal(t, dedup.StateNew, c.State)
}

// TestServerRefusalsAreUnavailability makes a healthy server refuse work
// the way a full or demoted one does: OOM under noeviction, and READONLY
// on a replica. Both are unavailability, not script errors.
func TestServerRefusalsAreUnavailability(t *testing.T) {
	t.Parallel()
	_, client, closed := privateStore(t, redis.FailClosed, nil)
	open, err := redis.New(redis.Config{Client: client, Policy: redis.FailOpen})
	require.NoError(t, err)
	ctx := context.Background()
	key := dedup.Key{Consumer: "c", Key: "k"}
	buried := dedup.Key{Consumer: "c", Key: "buried"}
	c, err := closed.LeaseClaim(ctx, buried, time.Minute, time.Hour)
	require.NoError(t, err)
	require.NoError(t, closed.LeaseBury(ctx, buried, c.Token, dedup.Failure{Err: "x"}))
	granted, err := closed.InboxGrantReplay(ctx, buried, "grant")
	require.NoError(t, err)
	require.True(t, granted)

	require.NoError(t, client.ConfigSet(ctx, "maxmemory", "1").Err())
	_, err = closed.LeaseClaim(ctx, key, time.Minute, time.Hour)
	require.ErrorIs(t, err, redis.ErrUnavailable)
	require.ErrorContains(t, err, "OOM")
	require.Equal(t, redis.Stats{}, closed.Stats())
	c, err = open.LeaseClaim(ctx, key, time.Minute, time.Hour)
	require.NoError(t, err)
	require.Equal(t, dedup.Claim{State: dedup.StateNew}, c, "fail-open: new, with token 0")
	require.NoError(t, open.LeaseComplete(ctx, key, c.Token, nil), "completing token 0 is a no-op")
	require.NoError(t, open.LeaseRelease(ctx, key, c.Token, dedup.Failure{}), "releasing token 0 is a no-op")
	require.NoError(t, open.LeaseBury(ctx, key, c.Token, dedup.Failure{}), "burying token 0 is a no-op")
	until, err := open.LeaseExtend(ctx, key, c.Token, time.Minute)
	require.NoError(t, err, "extending token 0 is a no-op")
	require.WithinDuration(t, time.Now().Add(time.Minute), until, time.Minute)
	require.NoError(t, client.ConfigSet(ctx, "maxmemory", "0").Err())

	// A replica of a master that does not exist: reads work, writes are
	// refused.
	require.NoError(t, client.ReplicaOf(ctx, "127.0.0.1", "1").Err())
	_, err = closed.LeaseClaim(ctx, key, time.Minute, time.Hour)
	require.ErrorIs(t, err, redis.ErrUnavailable)
	require.ErrorContains(t, err, "READONLY")
	c, err = open.LeaseClaim(ctx, key, time.Minute, time.Hour)
	require.NoError(t, err)
	require.Equal(t, dedup.StateNew, c.State)
	require.Zero(t, c.Token)
	// Reopening and counting a dead copy never fail open.
	_, err = open.InboxReopen(ctx, buried, "grant")
	require.ErrorIs(t, err, redis.ErrUnavailable)
	require.ErrorContains(t, err, "READONLY")
	require.ErrorIs(t, open.InboxDeadCopy(ctx, buried), redis.ErrUnavailable)
	require.Equal(t, redis.Stats{FailedOpen: 2}, open.Stats())
	_, err = open.InboxGrantReplay(ctx, buried, "other")
	require.ErrorIs(t, err, redis.ErrUnavailable, "writing a grant never fails open")
	require.ErrorContains(t, err, "READONLY")
	require.NoError(t, client.ReplicaOf(ctx, "NO", "ONE").Err())
	reopened, err := open.InboxReopen(ctx, buried, "grant")
	require.NoError(t, err)
	require.True(t, reopened, "the refused reopen changed nothing")

	c, err = closed.LeaseClaim(ctx, key, time.Minute, time.Hour)
	require.NoError(t, err)
	require.Equal(t, dedup.StateNew, c.State)
	require.NotZero(t, c.Token)
}

// TestTokensOutliveARestart restarts Redis without persistence: the key's
// record is gone, and the token of the next claim is still higher than the
// one issued before, so the old holder cannot complete the new lease.
func TestTokensOutliveARestart(t *testing.T) {
	t.Parallel()
	srv, client, store := privateStore(t, redis.FailClosed, nil)
	ctx := context.Background()
	key := dedup.Key{Consumer: "payments", Key: "charge-1"}
	old, err := store.LeaseClaim(ctx, key, time.Hour, time.Hour)
	require.NoError(t, err)

	srv.Stop()
	restart(t, srv, client)
	fresh, err := store.LeaseClaim(ctx, key, time.Hour, time.Hour)
	require.NoError(t, err)
	require.Equal(t, dedup.StateNew, fresh.State)
	require.Equal(t, 1, fresh.Attempts, "the restart forgot the record")
	require.Greater(t, fresh.Token, old.Token)
	require.ErrorIs(t, store.LeaseComplete(ctx, key, old.Token, []byte("zombie")), dedup.ErrLeaseLost)
	require.NoError(t, store.LeaseComplete(ctx, key, fresh.Token, []byte("ok")))
}
