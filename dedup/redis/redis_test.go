package redis_test

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/dedup"
	"github.com/oncemill/oncemill/dedup/redis"
	"github.com/oncemill/oncemill/internal/testing/msgtest"
	"github.com/oncemill/oncemill/internal/testing/redistest"
	"github.com/oncemill/oncemill/middleware"
)

func TestConfigValidate(t *testing.T) {
	t.Parallel()
	_, err := redis.New(redis.Config{})
	require.ErrorContains(t, err, "redis: Config.Client is required")

	client := redistest.Client(t)
	_, err = redis.New(redis.Config{Client: client, Prefix: "app{x}:"})
	require.ErrorContains(t, err, "Config.Prefix")
	_, err = redis.New(redis.Config{Client: client, Policy: redis.Policy(7)})
	require.ErrorContains(t, err, "Config.Policy")

	require.Equal(t, "fail_closed", redis.FailClosed.String())
	require.Equal(t, "fail_open", redis.FailOpen.String())
	require.Equal(t, "Policy(7)", redis.Policy(7).String())
}

func TestLeaseLifecycle(t *testing.T) {
	t.Parallel()
	b := setup(t, redis.Config{})
	ctx := context.Background()
	key := dedup.Key{Consumer: "mailer", Key: "welcome-7"}

	first, err := b.store.LeaseClaim(ctx, key, time.Hour, 2*time.Hour)
	require.NoError(t, err)
	require.Equal(t, dedup.StateNew, first.State)
	require.Equal(t, 1, first.Attempts)
	require.NotZero(t, first.Token)
	require.WithinDuration(t, time.Now().Add(time.Hour), first.Until, time.Minute, "the lease ends lease after the claim, on the server's clock")

	// A duplicate while the lease is live is in flight, never new.
	dup, err := b.store.LeaseClaim(ctx, key, time.Hour, 2*time.Hour)
	require.NoError(t, err)
	require.Equal(t, dedup.StateInFlight, dup.State)
	require.Equal(t, first.Until, dup.Until)
	require.Equal(t, 1, dup.Attempts, "an in-flight answer counts no attempt")
	require.Zero(t, dup.Token)
	require.True(t, dup.FirstFailedAt.IsZero(), "no failure yet")

	// Release frees the key at once; the next claim gets a higher token.
	failedAt := time.Date(2026, 3, 1, 12, 0, 0, 0, time.UTC)
	require.NoError(t, b.store.LeaseRelease(ctx, key, first.Token, dedup.Failure{Err: "smtp down", At: failedAt}))
	rec := b.record(t, key)
	require.Equal(t, "failed", rec["status"])
	require.Equal(t, "smtp down", rec["first_error"])
	require.Equal(t, strconv.FormatInt(failedAt.UnixMilli(), 10), rec["first_failed_at"])
	require.NotContains(t, rec, "lease_until")

	second, err := b.store.LeaseClaim(ctx, key, time.Hour, 2*time.Hour)
	require.NoError(t, err)
	require.Equal(t, dedup.StateNew, second.State)
	require.Equal(t, 2, second.Attempts)
	require.Greater(t, second.Token, first.Token)
	require.True(t, failedAt.Equal(second.FirstFailedAt), "the first failure's time: %s", second.FirstFailedAt)

	// The old token can neither release nor complete.
	require.ErrorIs(t, b.store.LeaseRelease(ctx, key, first.Token, dedup.Failure{Err: "zombie"}), dedup.ErrLeaseLost)
	require.ErrorIs(t, b.store.LeaseComplete(ctx, key, first.Token, []byte("zombie")), dedup.ErrLeaseLost)

	// A second failure keeps the first one's text and time.
	require.NoError(t, b.store.LeaseRelease(ctx, key, second.Token, dedup.Failure{Err: "smtp 451", At: failedAt.Add(time.Minute)}))
	rec = b.record(t, key)
	require.Equal(t, "smtp down", rec["first_error"])
	require.Equal(t, "smtp 451", rec["last_error"])
	require.Equal(t, strconv.FormatInt(failedAt.UnixMilli(), 10), rec["first_failed_at"])
	require.Equal(t, strconv.FormatInt(failedAt.Add(time.Minute).UnixMilli(), 10), rec["last_failed_at"])
	require.Equal(t, "2", rec["attempts"], "a release counts no attempt: the claim did")

	third, err := b.store.LeaseClaim(ctx, key, time.Hour, 2*time.Hour)
	require.NoError(t, err)
	require.Equal(t, dedup.StateNew, third.State)
	require.Equal(t, 3, third.Attempts)
	require.Greater(t, third.Token, second.Token)
	require.True(t, failedAt.Equal(third.FirstFailedAt), "still the first failure's time")

	require.NoError(t, b.store.LeaseComplete(ctx, key, third.Token, []byte("sent")))
	done, err := b.store.LeaseClaim(ctx, key, time.Hour, 2*time.Hour)
	require.NoError(t, err)
	require.Equal(t, dedup.StateDone, done.State)
	require.Equal(t, []byte("sent"), done.Result)
	require.Equal(t, 3, done.Attempts)
	require.True(t, failedAt.Equal(done.FirstFailedAt))
	require.Zero(t, done.Token)
	require.True(t, done.Until.IsZero())
	require.ErrorIs(t, b.store.LeaseComplete(ctx, key, third.Token, []byte("again")), dedup.ErrLeaseLost, "a done key cannot be completed twice")
	require.ErrorIs(t, b.store.LeaseRelease(ctx, key, third.Token, dedup.Failure{Err: "late"}), dedup.ErrLeaseLost, "a done key cannot be released")

	rec = b.record(t, key)
	require.Equal(t, "done", rec["status"])
	require.Equal(t, "sent", rec["result"])
	require.NotEmpty(t, rec["done_at"])
	require.Equal(t, "smtp 451", rec["last_error"], "the failure history stays")

	// A key never claimed cannot be completed or released.
	ghost := dedup.Key{Consumer: "mailer", Key: "ghost"}
	require.ErrorIs(t, b.store.LeaseComplete(ctx, ghost, 1, nil), dedup.ErrLeaseLost)
	require.ErrorIs(t, b.store.LeaseRelease(ctx, ghost, 1, dedup.Failure{}), dedup.ErrLeaseLost)
	require.Equal(t, 1, b.keyCount(t), "fenced calls write nothing")
}

func TestLeaseExpiredIsTakenOverAndZombieIsFenced(t *testing.T) {
	t.Parallel()
	b := setup(t, redis.Config{})
	ctx := context.Background()
	key := dedup.Key{Consumer: "payments", Key: "charge-9"}

	zombie, err := b.store.LeaseClaim(ctx, key, 50*time.Millisecond, time.Hour)
	require.NoError(t, err)
	require.Equal(t, dedup.StateNew, zombie.State)

	// Claim until the server's clock has passed the lease end.
	var taker dedup.Claim
	msgtest.WaitFor(t, "the lease to expire", func() bool {
		taker, err = b.store.LeaseClaim(ctx, key, time.Hour, time.Hour)
		require.NoError(t, err)
		if taker.State == dedup.StateInFlight {
			require.Equal(t, zombie.Until, taker.Until)
		}
		return taker.State == dedup.StateNew
	})
	require.Greater(t, taker.Token, zombie.Token)
	require.Equal(t, 2, taker.Attempts)

	require.ErrorIs(t, b.store.LeaseComplete(ctx, key, zombie.Token, []byte("zombie")), dedup.ErrLeaseLost)
	require.ErrorIs(t, b.store.LeaseRelease(ctx, key, zombie.Token, dedup.Failure{Err: "zombie"}), dedup.ErrLeaseLost)
	require.Equal(t, "processing", b.record(t, key)["status"], "the zombie changed nothing")

	require.NoError(t, b.store.LeaseComplete(ctx, key, taker.Token, []byte("taker")))
	done, err := b.store.LeaseClaim(ctx, key, time.Hour, time.Hour)
	require.NoError(t, err)
	require.Equal(t, dedup.StateDone, done.State)
	require.Equal(t, []byte("taker"), done.Result)
}

func TestResultRoundTrip(t *testing.T) {
	t.Parallel()
	b := setup(t, redis.Config{})
	ctx := context.Background()
	binary := make([]byte, 256)
	for i := range binary {
		binary[i] = byte(i) // NUL and every other byte
	}
	cases := map[string][]byte{
		"nil":    nil,
		"empty":  {},
		"binary": binary,
		"json":   []byte(`[{"uuid":"u-1","payload":"eyJhIjoxfQ=="}]`),
	}
	for name, result := range cases {
		key := dedup.Key{Consumer: "c", Key: name}
		c, err := b.store.LeaseClaim(ctx, key, time.Minute, time.Hour)
		require.NoError(t, err)
		require.NoError(t, b.store.LeaseComplete(ctx, key, c.Token, result))
		done, err := b.store.LeaseClaim(ctx, key, time.Minute, time.Hour)
		require.NoError(t, err)
		require.Equal(t, dedup.StateDone, done.State, name)
		require.Equal(t, result, done.Result, name)
		if result == nil {
			require.Nil(t, done.Result, "no result stored answers nil")
		} else {
			require.NotNil(t, done.Result, "an empty result is not lost as nil")
		}
	}
}

func TestRecordExpiresAfterWindow(t *testing.T) {
	t.Parallel()
	b := setup(t, redis.Config{})
	ctx := context.Background()
	key := dedup.Key{Consumer: "c", Key: "ttl"}
	c, err := b.store.LeaseClaim(ctx, key, time.Minute, 3*time.Hour)
	require.NoError(t, err)
	ttl, err := b.client.PTTL(ctx, b.recordKey(key)).Result()
	require.NoError(t, err)
	require.LessOrEqual(t, ttl, 3*time.Hour)
	require.Greater(t, ttl, 3*time.Hour-time.Minute)

	// Completing keeps the claim's expiry; a done answer does not extend it.
	require.NoError(t, b.store.LeaseComplete(ctx, key, c.Token, nil))
	_, err = b.store.LeaseClaim(ctx, key, time.Minute, 10*time.Hour)
	require.NoError(t, err)
	ttl, err = b.client.PTTL(ctx, b.recordKey(key)).Result()
	require.NoError(t, err)
	require.LessOrEqual(t, ttl, 3*time.Hour)

	// A record never expires before its lease ends.
	long := dedup.Key{Consumer: "c", Key: "long-lease"}
	_, err = b.store.LeaseClaim(ctx, long, 5*time.Hour, time.Hour)
	require.NoError(t, err)
	ttl, err = b.client.PTTL(ctx, b.recordKey(long)).Result()
	require.NoError(t, err)
	require.Greater(t, ttl, 4*time.Hour)

	_, err = b.store.LeaseClaim(ctx, key, 0, time.Hour)
	require.ErrorContains(t, err, "must be positive")
	_, err = b.store.LeaseClaim(ctx, key, time.Second, -time.Hour)
	require.ErrorContains(t, err, "must be positive")
}

func TestConsumersAndKeysNeverCollide(t *testing.T) {
	t.Parallel()
	b := setup(t, redis.Config{})
	ctx := context.Background()
	// Pairs that a naive "<consumer>:<key>" layout, or a consumer copied
	// into the hash tag unescaped, would confuse.
	pairs := []dedup.Key{
		{Consumer: "a", Key: "b}:c"},
		{Consumer: "a}:b", Key: "c"},
		{Consumer: "a", Key: "b:c"},
		{Consumer: "a:b", Key: "c"},
		{Consumer: "a}", Key: "k"},
		{Consumer: "a%7D", Key: "k"},
		{Consumer: "{a", Key: "k"},
		{Consumer: "a*", Key: "k"},
		{Consumer: "a?", Key: "k"},
		{Consumer: "a[b]", Key: "k"},
		{Consumer: `a\`, Key: "k"},
		{Consumer: "", Key: "k"},
		{Consumer: "a", Key: "*"},
		{Consumer: "a", Key: "{x}"},
		{Consumer: "a", Key: "k"},
		{Consumer: "zahlungen", Key: "bestellung-ä-😀"},
		{Consumer: "支付", Key: "订单:1"},
	}
	tokens := map[dedup.Key]int64{}
	for _, k := range pairs {
		c, err := b.store.LeaseClaim(ctx, k, time.Minute, time.Hour)
		require.NoError(t, err)
		require.Equal(t, dedup.StateNew, c.State, "%q/%q shares a record with an earlier pair", k.Consumer, k.Key)
		tokens[k] = c.Token
	}
	require.Equal(t, len(pairs), b.keyCount(t), "one Redis key per pair")

	// Completing each with its own result: every pair reads back its own.
	for _, k := range pairs {
		require.NoError(t, b.store.LeaseComplete(ctx, k, tokens[k], []byte(k.Consumer+"|"+k.Key)))
	}
	for _, k := range pairs {
		c, err := b.store.LeaseClaim(ctx, k, time.Minute, time.Hour)
		require.NoError(t, err)
		require.Equal(t, dedup.StateDone, c.State)
		require.Equal(t, k.Consumer+"|"+k.Key, string(c.Result))
	}

	// The same key in two consumers is two records.
	x, y := dedup.Key{Consumer: "billing", Key: "order-1"}, dedup.Key{Consumer: "shipping", Key: "order-1"}
	cx, err := b.store.LeaseClaim(ctx, x, time.Minute, time.Hour)
	require.NoError(t, err)
	require.NoError(t, b.store.LeaseComplete(ctx, x, cx.Token, nil))
	cy, err := b.store.LeaseClaim(ctx, y, time.Minute, time.Hour)
	require.NoError(t, err)
	require.Equal(t, dedup.StateNew, cy.State)
}

func TestPeek(t *testing.T) {
	t.Parallel()
	b := setup(t, redis.Config{})
	ctx := context.Background()
	key := dedup.Key{Consumer: "c", Key: "peeked"}

	p, err := b.store.InboxPeek(ctx, key)
	require.NoError(t, err)
	require.Equal(t, dedup.Claim{State: dedup.StateNew}, p)
	require.Zero(t, b.keyCount(t), "a peek writes nothing")

	c, err := b.store.LeaseClaim(ctx, key, time.Hour, time.Hour)
	require.NoError(t, err)
	p, err = b.store.InboxPeek(ctx, key)
	require.NoError(t, err)
	require.Equal(t, dedup.Claim{State: dedup.StateInFlight, Attempts: 1, Until: c.Until}, p)

	// A failure without a time is stamped with the server's.
	require.NoError(t, b.store.LeaseRelease(ctx, key, c.Token, dedup.Failure{Err: "x"}))
	p, err = b.store.InboxPeek(ctx, key)
	require.NoError(t, err)
	require.WithinDuration(t, time.Now(), p.FirstFailedAt, time.Minute)
	firstFailed := p.FirstFailedAt
	require.Equal(t, dedup.Claim{State: dedup.StateNew, Attempts: 1, FirstFailedAt: firstFailed}, p, "a failed key is new to a peek")

	c, err = b.store.LeaseClaim(ctx, key, time.Hour, time.Hour)
	require.NoError(t, err)
	require.NoError(t, b.store.LeaseComplete(ctx, key, c.Token, []byte("r")))
	before := b.record(t, key)
	p, err = b.store.InboxPeek(ctx, key)
	require.NoError(t, err)
	require.Equal(t, dedup.Claim{State: dedup.StateDone, Attempts: 2, Result: []byte("r"), FirstFailedAt: firstFailed}, p)
	require.Equal(t, before, b.record(t, key), "a peek writes nothing")

	// An expired lease is new to a peek.
	short := dedup.Key{Consumer: "c", Key: "short"}
	_, err = b.store.LeaseClaim(ctx, short, 20*time.Millisecond, time.Hour)
	require.NoError(t, err)
	msgtest.WaitFor(t, "the lease to expire", func() bool {
		p, err = b.store.InboxPeek(ctx, short)
		require.NoError(t, err)
		return p.State == dedup.StateNew
	})
	require.Equal(t, 1, p.Attempts)
}

func TestDoneKeys(t *testing.T) {
	t.Parallel()
	b := setup(t, redis.Config{})
	ctx := context.Background()
	const consumer = "ord*ers{1}"

	complete := func(consumer, key string) {
		k := dedup.Key{Consumer: consumer, Key: key}
		c, err := b.store.LeaseClaim(ctx, k, time.Hour, time.Hour)
		require.NoError(t, err)
		require.Equal(t, dedup.StateNew, c.State)
		require.NoError(t, b.store.LeaseComplete(ctx, k, c.Token, nil))
	}
	var early []string
	for i := 0; i < 2000; i++ {
		k := fmt.Sprintf("early-%d", i)
		early = append(early, k)
		complete(consumer, k)
	}
	early = append(early, "*", "a?b", "[x]", `back\slash`, "}:{", "ключ")
	for _, k := range early[2000:] {
		complete(consumer, k)
	}

	// since lies after every early completion, on the server's clock.
	now, err := b.client.Time(ctx).Result()
	require.NoError(t, err)
	since := now.Truncate(time.Millisecond).Add(time.Millisecond)
	msgtest.WaitFor(t, "the server clock to pass since", func() bool {
		now, err := b.client.Time(ctx).Result()
		require.NoError(t, err)
		return !now.Before(since)
	})
	var late []string
	for i := 0; i < 1000; i++ {
		k := fmt.Sprintf("late-%d", i)
		late = append(late, k)
		complete(consumer, k)
	}
	// Keys that are not done, keys of other consumers (one whose name
	// the pattern would match unescaped), and a stray key of another type
	// are never listed.
	_, err = b.store.LeaseClaim(ctx, dedup.Key{Consumer: consumer, Key: "in-flight"}, time.Hour, time.Hour)
	require.NoError(t, err)
	f, err := b.store.LeaseClaim(ctx, dedup.Key{Consumer: consumer, Key: "failed"}, time.Hour, time.Hour)
	require.NoError(t, err)
	require.NoError(t, b.store.LeaseRelease(ctx, dedup.Key{Consumer: consumer, Key: "failed"}, f.Token, dedup.Failure{Err: "x"}))
	d, err := b.store.LeaseClaim(ctx, dedup.Key{Consumer: consumer, Key: "dead"}, time.Hour, time.Hour)
	require.NoError(t, err)
	require.NoError(t, b.store.LeaseBury(ctx, dedup.Key{Consumer: consumer, Key: "dead"}, d.Token, dedup.Failure{Err: "x"}))
	complete("ordXers{1}", "other-consumer")
	complete("ord*ers{1}x", "other-consumer")
	complete("ord", "other-consumer")
	require.NoError(t, b.client.Set(ctx, b.prefix+"{ord%2Aers%7B1%7D}:stray-string", "x", time.Hour).Err())

	collect := func(since time.Time) map[string]int {
		seen := map[string]int{}
		require.NoError(t, b.store.InboxDoneKeys(ctx, consumer, since, func(k string) error {
			seen[k]++
			return nil
		}))
		return seen
	}
	all := collect(time.Time{})
	require.Len(t, all, len(early)+len(late))
	for _, k := range append(append([]string{}, early...), late...) {
		require.Contains(t, all, k)
	}
	recent := collect(since)
	require.Len(t, recent, len(late))
	for _, k := range late {
		require.Contains(t, recent, k)
	}

	// fn's error stops the walk and is returned as it is.
	stop := errors.New("stop")
	calls := 0
	err = b.store.InboxDoneKeys(ctx, consumer, time.Time{}, func(string) error {
		calls++
		return stop
	})
	require.ErrorIs(t, err, stop)
	require.Equal(t, 1, calls)

	cancelled, cancel := context.WithCancel(ctx)
	cancel()
	err = b.store.InboxDoneKeys(cancelled, consumer, time.Time{}, func(string) error { return nil })
	require.ErrorIs(t, err, context.Canceled)
	require.NotErrorIs(t, err, redis.ErrUnavailable)
}

func TestConcurrentClaimsOneWinner(t *testing.T) {
	t.Parallel()
	b := setup(t, redis.Config{})
	ctx := context.Background()
	key := dedup.Key{Consumer: "mailer", Key: "burst"}
	const n = 50
	var (
		wg     sync.WaitGroup
		mu     sync.Mutex
		count  = map[dedup.State]int{}
		tokens = map[int64]int{}
		start  = make(chan struct{})
	)
	for i := 0; i < n; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			c, err := b.store.LeaseClaim(ctx, key, time.Hour, time.Hour)
			if err != nil {
				t.Error(err)
				return
			}
			mu.Lock()
			count[c.State]++
			tokens[c.Token]++
			mu.Unlock()
		}()
	}
	close(start)
	wg.Wait()
	require.Equal(t, 1, count[dedup.StateNew])
	require.Equal(t, n-1, count[dedup.StateInFlight])
	require.Len(t, tokens, 2, "one token issued, the others got none")
}

func TestRealErrorsAreNeitherUnavailableNorFailedOpen(t *testing.T) {
	t.Parallel()
	logs := watermill.NewCaptureLogger()
	b := setup(t, redis.Config{Policy: redis.FailOpen, Logger: logs})
	ctx := context.Background()
	key := dedup.Key{Consumer: "c", Key: "wrong-type"}
	// A key of another type where the record should be: the script's
	// HMGET fails with WRONGTYPE, a reply that retrying cannot fix.
	require.NoError(t, b.client.Set(ctx, b.recordKey(key), "not a hash", time.Hour).Err())

	_, err := b.store.LeaseClaim(ctx, key, time.Minute, time.Hour)
	require.ErrorContains(t, err, "WRONGTYPE")
	require.NotErrorIs(t, err, redis.ErrUnavailable)
	require.ErrorContains(t, err, "redis: lease claim")
	_, err = b.store.InboxPeek(ctx, key)
	require.ErrorContains(t, err, "WRONGTYPE")
	require.ErrorContains(t, b.store.LeaseComplete(ctx, key, 1, nil), "WRONGTYPE")
	require.ErrorContains(t, b.store.LeaseBury(ctx, key, 1, dedup.Failure{}), "WRONGTYPE")
	_, err = b.store.LeaseExtend(ctx, key, 1, time.Minute)
	require.ErrorContains(t, err, "WRONGTYPE")
	_, err = b.store.InboxReopen(ctx, key, "grant")
	require.ErrorContains(t, err, "WRONGTYPE")
	require.NotErrorIs(t, err, redis.ErrUnavailable)
	require.ErrorContains(t, b.store.InboxDeadCopy(ctx, key), "WRONGTYPE")
	require.Equal(t, redis.Stats{}, b.store.Stats(), "a real error never fails open")
	require.Empty(t, logs.Captured()[watermill.ErrorLogLevel])

	// The caller's own cancellation is returned as such.
	cancelled, cancel := context.WithCancel(ctx)
	cancel()
	_, err = b.store.LeaseClaim(cancelled, dedup.Key{Consumer: "c", Key: "k"}, time.Minute, time.Hour)
	require.ErrorIs(t, err, context.Canceled)
	require.NotErrorIs(t, err, redis.ErrUnavailable)
	require.Equal(t, redis.Stats{}, b.store.Stats())
}

// TestInboxLeaseModeUnderRouter runs the inbox in lease mode under a real
// router: 100 keys, each published 3 times to 3 handlers of one consumer,
// so that every key is delivered 3 times, concurrently.
func TestInboxLeaseModeUnderRouter(t *testing.T) {
	t.Parallel()
	b := setup(t, redis.Config{})
	const n, copies = 100, 3
	h := newHarness(t, b.store, copies)
	ks := msgtest.Keys("order", n)
	h.Publish(ks, copies)
	h.WaitAcked(n * copies)

	h.RequireNoOtherErrors()
	for _, k := range ks {
		require.Equal(t, 1, h.effectsOf(k), "key %s", k)
	}
	require.Equal(t, n, h.totalEffects())
	stats := h.inbox.Stats()
	require.Equal(t, int64(n), stats.Applied)
	require.Equal(t, int64(n*copies-n), stats.Duplicates)
	require.Equal(t, stats.InFlight, h.Count(middleware.ErrInFlight), "in-flight deliveries were nacked and redelivered")
}

// TestInboxLeaseModeFailureReleases shows the inbox's failure path on this
// store: a handler error releases the key, so that the redelivery is
// applied at once although the lease is an hour.
func TestInboxLeaseModeFailureReleases(t *testing.T) {
	t.Parallel()
	b := setup(t, redis.Config{})
	in, err := middleware.NewInbox(middleware.InboxConfig{LeaseStore: b.store, Consumer: "mailer", Lease: time.Hour})
	require.NoError(t, err)
	runs := 0
	h := in.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		runs++
		if runs == 1 {
			return nil, errors.New("smtp 451")
		}
		return nil, nil
	})
	_, err = h(delivery("mail-1"))
	require.ErrorContains(t, err, "smtp 451")
	_, err = h(delivery("mail-1"))
	require.NoError(t, err)
	_, err = h(delivery("mail-1"))
	require.NoError(t, err)
	require.Equal(t, 2, runs)
	require.Equal(t, middleware.InboxStats{Applied: 1, Duplicates: 1, Failed: 1}, in.Stats())
	rec := b.record(t, dedup.Key{Consumer: "mailer", Key: "mail-1"})
	require.Equal(t, "done", rec["status"])
	require.Equal(t, "2", rec["attempts"])
	require.Equal(t, "smtp 451", rec["first_error"])
}

func TestLeaseExtend(t *testing.T) {
	t.Parallel()
	b := setup(t, redis.Config{})
	ctx := context.Background()
	key := dedup.Key{Consumer: "payments", Key: "slow-charge"}

	// A lease about to end is extended by its holder; the record is kept
	// at least as long as the new lease.
	c, err := b.store.LeaseClaim(ctx, key, 50*time.Millisecond, time.Hour)
	require.NoError(t, err)
	until, err := b.store.LeaseExtend(ctx, key, c.Token, 3*time.Hour)
	require.NoError(t, err)
	require.WithinDuration(t, time.Now().Add(3*time.Hour), until, time.Minute, "on the server's clock")
	require.Equal(t, strconv.FormatInt(until.UnixMilli(), 10), b.record(t, key)["lease_until"])
	ttl, err := b.client.PTTL(ctx, b.recordKey(key)).Result()
	require.NoError(t, err)
	require.Greater(t, ttl, 2*time.Hour, "the record outlives the extended lease")

	dup, err := b.store.LeaseClaim(ctx, key, time.Minute, time.Hour)
	require.NoError(t, err)
	require.Equal(t, dedup.StateInFlight, dup.State, "the extended lease holds the key")
	require.Equal(t, until, dup.Until)

	// A shorter extension moves the lease end but never shortens the
	// record's life.
	until, err = b.store.LeaseExtend(ctx, key, c.Token, time.Minute)
	require.NoError(t, err)
	require.WithinDuration(t, time.Now().Add(time.Minute), until, time.Minute)
	ttl, err = b.client.PTTL(ctx, b.recordKey(key)).Result()
	require.NoError(t, err)
	require.Greater(t, ttl, 2*time.Hour)

	before := b.record(t, key)
	_, err = b.store.LeaseExtend(ctx, key, c.Token-1, time.Hour)
	require.ErrorIs(t, err, dedup.ErrLeaseLost, "only the current token extends")
	require.Equal(t, before, b.record(t, key), "a fenced extension changes nothing")
	require.NoError(t, b.store.LeaseComplete(ctx, key, c.Token, nil))
	_, err = b.store.LeaseExtend(ctx, key, c.Token, time.Hour)
	require.ErrorIs(t, err, dedup.ErrLeaseLost, "a done key has no lease")
	require.NotContains(t, b.record(t, key), "lease_until")

	_, err = b.store.LeaseExtend(ctx, dedup.Key{Consumer: "payments", Key: "ghost"}, 1, time.Hour)
	require.ErrorIs(t, err, dedup.ErrLeaseLost)
	require.Equal(t, 1, b.keyCount(t), "a fenced extension writes nothing")
	_, err = b.store.LeaseExtend(ctx, key, c.Token, 0)
	require.ErrorContains(t, err, "must be positive")
}

func TestBuryReopenAndDeadCopies(t *testing.T) {
	t.Parallel()
	b := setup(t, redis.Config{})
	ctx := context.Background()
	key := dedup.Key{Consumer: "mailer", Key: "poison-1"}
	firstFailed := time.UnixMilli(time.Date(2026, 3, 1, 12, 0, 0, 0, time.UTC).UnixMilli()) // as the store reads it back

	first, err := b.store.LeaseClaim(ctx, key, time.Hour, 2*time.Hour)
	require.NoError(t, err)
	require.NoError(t, b.store.LeaseRelease(ctx, key, first.Token, dedup.Failure{Err: "bad json", At: firstFailed}))
	second, err := b.store.LeaseClaim(ctx, key, time.Hour, 2*time.Hour)
	require.NoError(t, err)
	require.ErrorIs(t, b.store.LeaseBury(ctx, key, first.Token, dedup.Failure{Err: "zombie"}), dedup.ErrLeaseLost)
	require.Equal(t, "processing", b.record(t, key)["status"], "a fenced burial changes nothing")
	buriedAt := firstFailed.Add(time.Minute)
	require.NoError(t, b.store.LeaseBury(ctx, key, second.Token, dedup.Failure{Err: "still bad json", At: buriedAt}))

	rec := b.record(t, key)
	require.Equal(t, "dead", rec["status"])
	require.Equal(t, "bad json", rec["first_error"], "the first failure is kept")
	require.Equal(t, strconv.FormatInt(firstFailed.UnixMilli(), 10), rec["first_failed_at"])
	require.Equal(t, "still bad json", rec["last_error"])
	require.Equal(t, strconv.FormatInt(buriedAt.UnixMilli(), 10), rec["last_failed_at"])
	require.Equal(t, "2", rec["attempts"])
	require.NotContains(t, rec, "lease_until")
	ttl, err := b.client.PTTL(ctx, b.recordKey(key)).Result()
	require.NoError(t, err)
	require.LessOrEqual(t, ttl, 2*time.Hour, "burying keeps the window")
	require.Greater(t, ttl, 2*time.Hour-time.Minute)

	// A dead key is never claimed, and a claim does not extend its life.
	want := dedup.Claim{State: dedup.StateDead, Attempts: 2, FirstFailedAt: firstFailed}
	for i := 0; i < 3; i++ {
		c, err := b.store.LeaseClaim(ctx, key, time.Millisecond, 10*time.Hour)
		require.NoError(t, err)
		require.Equal(t, want, c)
	}
	ttl, err = b.client.PTTL(ctx, b.recordKey(key)).Result()
	require.NoError(t, err)
	require.LessOrEqual(t, ttl, 2*time.Hour)
	p, err := b.store.InboxPeek(ctx, key)
	require.NoError(t, err)
	require.Equal(t, want, p)
	require.ErrorIs(t, b.store.LeaseComplete(ctx, key, second.Token, nil), dedup.ErrLeaseLost, "a dead key has no lease")
	require.ErrorIs(t, b.store.LeaseRelease(ctx, key, second.Token, dedup.Failure{}), dedup.ErrLeaseLost)
	require.ErrorIs(t, b.store.LeaseBury(ctx, key, second.Token, dedup.Failure{}), dedup.ErrLeaseLost)
	_, err = b.store.LeaseExtend(ctx, key, second.Token, time.Hour)
	require.ErrorIs(t, err, dedup.ErrLeaseLost)
	require.NoError(t, b.store.InboxDoneKeys(ctx, "mailer", time.Time{}, func(k string) error {
		t.Errorf("dead key %q listed as done", k)
		return nil
	}))

	require.NoError(t, b.store.InboxDeadCopy(ctx, key))
	require.NoError(t, b.store.InboxDeadCopy(ctx, key))
	require.Equal(t, "2", b.record(t, key)["dead_copies"])

	// Only the grant written on the dead key reopens it: no marker, a
	// forged one or another grant leave it dead.
	reopened, err := b.store.InboxReopen(ctx, key, "")
	require.NoError(t, err)
	require.False(t, reopened, "no grant")
	reopened, err = b.store.InboxReopen(ctx, key, "1")
	require.NoError(t, err)
	require.False(t, reopened, "a marker the store never granted")
	_, err = b.store.InboxGrantReplay(ctx, key, "")
	require.ErrorIs(t, err, dedup.ErrNoGrant)
	granted, err := b.store.InboxGrantReplay(ctx, key, "grant-1")
	require.NoError(t, err)
	require.True(t, granted, "the key is dead")
	reopened, err = b.store.InboxReopen(ctx, key, "grant-2")
	require.NoError(t, err)
	require.False(t, reopened, "another grant")
	ok, err := b.store.InboxReplayGranted(ctx, key, "grant-2")
	require.NoError(t, err)
	require.False(t, ok)

	// Reopening makes it claimable, with its attempts reset; its history
	// and expiry stay.
	reopened, err = b.store.InboxReopen(ctx, key, "grant-1")
	require.NoError(t, err)
	require.True(t, reopened)
	rec = b.record(t, key)
	require.Equal(t, "failed", rec["status"])
	require.Equal(t, "0", rec["attempts"])
	require.Equal(t, "bad json", rec["first_error"])
	ttl, err = b.client.PTTL(ctx, b.recordKey(key)).Result()
	require.NoError(t, err)
	require.LessOrEqual(t, ttl, 2*time.Hour)
	p, err = b.store.InboxPeek(ctx, key)
	require.NoError(t, err)
	require.Equal(t, dedup.Claim{State: dedup.StateNew, FirstFailedAt: firstFailed}, p)
	reopened, err = b.store.InboxReopen(ctx, key, "grant-1")
	require.NoError(t, err)
	require.False(t, reopened, "the key is no longer dead")
	require.NoError(t, b.store.InboxDeadCopy(ctx, key), "a copy of a live key is no error")
	require.Equal(t, "2", b.record(t, key)["dead_copies"], "and is not counted")

	replay, err := b.store.LeaseClaim(ctx, key, time.Hour, 2*time.Hour)
	require.NoError(t, err)
	require.Equal(t, dedup.StateNew, replay.State)
	require.Equal(t, 1, replay.Attempts)
	require.Greater(t, replay.Token, second.Token)
	require.NoError(t, b.store.LeaseComplete(ctx, key, replay.Token, []byte("sent")))
	reopened, err = b.store.InboxReopen(ctx, key, "grant-1")
	require.NoError(t, err)
	require.False(t, reopened, "a done key is not reopened")
	require.Equal(t, "done", b.record(t, key)["status"])

	ghost := dedup.Key{Consumer: "mailer", Key: "ghost"}
	reopened, err = b.store.InboxReopen(ctx, ghost, "grant-1")
	require.NoError(t, err)
	require.False(t, reopened)
	require.NoError(t, b.store.InboxDeadCopy(ctx, ghost))
	require.Equal(t, 1, b.keyCount(t), "neither call created a record")
}

func TestTokensNeverRepeatAfterExpiry(t *testing.T) {
	t.Parallel()
	b := setup(t, redis.Config{})
	ctx := context.Background()
	key := dedup.Key{Consumer: "payments", Key: "charge-ttl"}

	// The record expires by itself.
	old, err := b.store.LeaseClaim(ctx, key, time.Millisecond, time.Millisecond)
	require.NoError(t, err)
	msgtest.WaitFor(t, "the record to expire", func() bool {
		n, err := b.client.Exists(ctx, b.recordKey(key)).Result()
		require.NoError(t, err)
		return n == 0
	})
	fresh, err := b.store.LeaseClaim(ctx, key, time.Hour, time.Hour)
	require.NoError(t, err)
	require.Equal(t, dedup.StateNew, fresh.State)
	require.Equal(t, 1, fresh.Attempts, "the record was forgotten")
	require.Greater(t, fresh.Token, old.Token)
	require.ErrorIs(t, b.store.LeaseComplete(ctx, key, old.Token, []byte("zombie")), dedup.ErrLeaseLost)
	require.ErrorIs(t, b.store.LeaseRelease(ctx, key, old.Token, dedup.Failure{}), dedup.ErrLeaseLost)
	require.ErrorIs(t, b.store.LeaseBury(ctx, key, old.Token, dedup.Failure{}), dedup.ErrLeaseLost)
	_, err = b.store.LeaseExtend(ctx, key, old.Token, time.Hour)
	require.ErrorIs(t, err, dedup.ErrLeaseLost)
	require.Equal(t, "processing", b.record(t, key)["status"])

	// A record deleted and claimed again at once, many times over: every
	// token is higher than the one before.
	prev := fresh.Token
	for i := 0; i < 200; i++ {
		require.NoError(t, b.client.Del(ctx, b.recordKey(key)).Err())
		c, err := b.store.LeaseClaim(ctx, key, time.Hour, time.Hour)
		require.NoError(t, err)
		require.Equal(t, dedup.StateNew, c.State)
		require.Greater(t, c.Token, prev, "claim %d reissued a token", i)
		require.ErrorIs(t, b.store.LeaseComplete(ctx, key, prev, nil), dedup.ErrLeaseLost)
		prev = c.Token
	}
	require.NoError(t, b.store.LeaseComplete(ctx, key, prev, []byte("ok")))
}

func TestAbandonedReleaseTakesTheAttemptBack(t *testing.T) {
	t.Parallel()
	b := setup(t, redis.Config{})
	ctx := context.Background()
	key := dedup.Key{Consumer: "mailer", Key: "deploy"}

	c, err := b.store.LeaseClaim(ctx, key, time.Hour, time.Hour)
	require.NoError(t, err)
	require.NoError(t, b.store.LeaseRelease(ctx, key, c.Token, dedup.Failure{Err: "timeout"}))
	c, err = b.store.LeaseClaim(ctx, key, time.Hour, time.Hour)
	require.NoError(t, err)
	require.Equal(t, 2, c.Attempts)
	before := b.record(t, key)
	require.NoError(t, b.store.LeaseRelease(ctx, key, c.Token, dedup.Failure{Err: "ignored", Abandoned: true}))
	rec := b.record(t, key)
	require.Equal(t, "failed", rec["status"], "the key is free at once")
	require.Equal(t, "1", rec["attempts"], "the abandoned attempt is not counted")
	require.NotContains(t, rec, "lease_until")
	for _, f := range []string{"first_error", "first_failed_at", "last_error", "last_failed_at", "token"} {
		require.Equal(t, before[f], rec[f], "an abandoned attempt records no failure: %s", f)
	}
	require.ErrorIs(t, b.store.LeaseRelease(ctx, key, c.Token, dedup.Failure{Abandoned: true}), dedup.ErrLeaseLost)

	next, err := b.store.LeaseClaim(ctx, key, time.Hour, time.Hour)
	require.NoError(t, err)
	require.Equal(t, dedup.StateNew, next.State)
	require.Equal(t, 2, next.Attempts)
	require.Greater(t, next.Token, c.Token)
}
