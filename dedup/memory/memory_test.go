package memory

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/dedup"
)

type clock struct{ t time.Time }

func (c *clock) now() time.Time          { return c.t }
func (c *clock) advance(d time.Duration) { c.t = c.t.Add(d) }

func newStore() (*Store, *clock) {
	c := &clock{t: time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)}
	s := New()
	s.now = c.now
	return s, c
}

func TestLeaseLifecycle(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	s, clk := newStore()
	key := dedup.Key{Consumer: "c", Key: "k"}

	first, err := s.LeaseClaim(ctx, key, time.Minute, time.Hour)
	require.NoError(t, err)
	require.Equal(t, dedup.StateNew, first.State)
	require.Equal(t, clk.t.Add(time.Minute), first.Until)

	dup, err := s.LeaseClaim(ctx, key, time.Minute, time.Hour)
	require.NoError(t, err)
	require.Equal(t, dedup.StateInFlight, dup.State)

	clk.advance(2 * time.Minute)
	taker, err := s.LeaseClaim(ctx, key, time.Minute, time.Hour)
	require.NoError(t, err)
	require.Equal(t, dedup.StateNew, taker.State, "an expired lease is taken over")
	require.Equal(t, 2, taker.Attempts)
	require.ErrorIs(t, s.LeaseComplete(ctx, key, first.Token, []byte("zombie")), dedup.ErrLeaseLost)
	require.ErrorIs(t, s.LeaseRelease(ctx, key, first.Token, dedup.Failure{}), dedup.ErrLeaseLost)

	result := []byte("ok")
	require.NoError(t, s.LeaseComplete(ctx, key, taker.Token, result))
	result[0] = 'X' // the store keeps its own copy
	done, err := s.LeaseClaim(ctx, key, time.Minute, time.Hour)
	require.NoError(t, err)
	require.Equal(t, dedup.StateDone, done.State)
	require.Equal(t, []byte("ok"), done.Result)

	other := dedup.Key{Consumer: "c", Key: "other"}
	c, err := s.LeaseClaim(ctx, other, time.Minute, time.Hour)
	require.NoError(t, err)
	require.NoError(t, s.LeaseRelease(ctx, other, c.Token, dedup.Failure{Err: "x"}))
	again, err := s.LeaseClaim(ctx, other, time.Minute, time.Hour)
	require.NoError(t, err)
	require.Equal(t, dedup.StateNew, again.State, "a released key is claimable at once")
}

func TestSweepDeletesOnlyExpired(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	s, clk := newStore()
	for i := 0; i < 23; i++ {
		_, err := s.LeaseClaim(ctx, dedup.Key{Consumer: "c", Key: string(rune('a' + i))}, time.Second, time.Minute)
		require.NoError(t, err)
	}
	_, err := s.LeaseClaim(ctx, dedup.Key{Consumer: "c", Key: "live"}, time.Second, time.Hour)
	require.NoError(t, err)
	clk.advance(2 * time.Minute)

	n, err := dedup.Sweep(ctx, s, 5)
	require.NoError(t, err)
	require.Equal(t, 23, n)
	require.Equal(t, 1, s.Len())

	_, err = dedup.Sweep(ctx, s, 0)
	require.ErrorContains(t, err, "batch must be positive")
}

func TestLeaseExtend(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	s, clk := newStore()
	key := dedup.Key{Consumer: "c", Key: "slow"}

	c, err := s.LeaseClaim(ctx, key, time.Minute, time.Hour)
	require.NoError(t, err)
	clk.advance(50 * time.Second)
	until, err := s.LeaseExtend(ctx, key, c.Token, time.Minute)
	require.NoError(t, err)
	require.Equal(t, clk.t.Add(time.Minute), until)
	clk.advance(50 * time.Second)
	dup, err := s.LeaseClaim(ctx, key, time.Minute, time.Hour)
	require.NoError(t, err)
	require.Equal(t, dedup.StateInFlight, dup.State, "the extended lease still holds the key")
	require.Equal(t, until, dup.Until)

	// A lease longer than the window keeps the record as long.
	until, err = s.LeaseExtend(ctx, key, c.Token, 2*time.Hour)
	require.NoError(t, err)
	clk.advance(90 * time.Minute)
	n, err := s.InboxDeleteExpired(ctx, 10)
	require.NoError(t, err)
	require.Zero(t, n, "the record outlives its lease")
	p, err := s.InboxPeek(ctx, key)
	require.NoError(t, err)
	require.Equal(t, dedup.Claim{State: dedup.StateInFlight, Attempts: 1, Until: until}, p)

	_, err = s.LeaseExtend(ctx, key, c.Token+1, time.Minute)
	require.ErrorIs(t, err, dedup.ErrLeaseLost, "only the current token extends")
	require.NoError(t, s.LeaseComplete(ctx, key, c.Token, nil))
	_, err = s.LeaseExtend(ctx, key, c.Token, time.Minute)
	require.ErrorIs(t, err, dedup.ErrLeaseLost, "a done key has no lease to extend")
	_, err = s.LeaseExtend(ctx, dedup.Key{Consumer: "c", Key: "ghost"}, 1, time.Minute)
	require.ErrorIs(t, err, dedup.ErrLeaseLost)
}

func TestBuryReopenAndDeadCopies(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	s, clk := newStore()
	key := dedup.Key{Consumer: "c", Key: "poison"}

	first, err := s.LeaseClaim(ctx, key, time.Minute, time.Hour)
	require.NoError(t, err)
	firstFailed := clk.t
	require.NoError(t, s.LeaseRelease(ctx, key, first.Token, dedup.Failure{Err: "bad json", At: firstFailed}))
	second, err := s.LeaseClaim(ctx, key, time.Minute, time.Hour)
	require.NoError(t, err)
	require.ErrorIs(t, s.LeaseBury(ctx, key, first.Token, dedup.Failure{Err: "zombie"}), dedup.ErrLeaseLost)
	clk.advance(time.Second)
	require.NoError(t, s.LeaseBury(ctx, key, second.Token, dedup.Failure{Err: "still bad json", At: clk.t}))
	e := s.keys[key]
	require.Equal(t, dead, e.status)
	require.Equal(t, firstFailed, e.firstFailed, "the first failure is kept")
	require.Equal(t, clk.t, e.lastFailed)
	require.Equal(t, "still bad json", e.lastErr)
	require.Equal(t, firstFailed.Add(time.Hour), e.expires, "burying keeps the window")

	// A dead key is never taken over, however long its lease ended.
	clk.advance(10 * time.Minute)
	c, err := s.LeaseClaim(ctx, key, time.Minute, time.Hour)
	require.NoError(t, err)
	require.Equal(t, dedup.Claim{State: dedup.StateDead, Attempts: 2, FirstFailedAt: firstFailed}, c)
	p, err := s.InboxPeek(ctx, key)
	require.NoError(t, err)
	require.Equal(t, dedup.Claim{State: dedup.StateDead, Attempts: 2, FirstFailedAt: firstFailed}, p)
	require.ErrorIs(t, s.LeaseComplete(ctx, key, second.Token, nil), dedup.ErrLeaseLost, "a dead key has no lease")
	require.ErrorIs(t, s.LeaseRelease(ctx, key, second.Token, dedup.Failure{}), dedup.ErrLeaseLost)
	require.ErrorIs(t, s.LeaseBury(ctx, key, second.Token, dedup.Failure{}), dedup.ErrLeaseLost)
	_, err = s.LeaseExtend(ctx, key, second.Token, time.Minute)
	require.ErrorIs(t, err, dedup.ErrLeaseLost)
	require.NoError(t, s.InboxDoneKeys(ctx, "c", time.Time{}, func(k string) error {
		t.Errorf("dead key %q listed as done", k)
		return nil
	}))

	require.NoError(t, s.InboxDeadCopy(ctx, key))
	require.NoError(t, s.InboxDeadCopy(ctx, key))
	require.Equal(t, 2, s.keys[key].deadCopies)

	// Only the grant written on the dead key reopens it: no marker, a
	// forged one or another grant leave it dead.
	reopened, err := s.InboxReopen(ctx, key, "")
	require.NoError(t, err)
	require.False(t, reopened, "no grant")
	reopened, err = s.InboxReopen(ctx, key, "1")
	require.NoError(t, err)
	require.False(t, reopened, "a marker the store never granted")
	_, err = s.InboxGrantReplay(ctx, key, "")
	require.ErrorIs(t, err, dedup.ErrNoGrant)
	granted, err := s.InboxGrantReplay(ctx, key, "grant-1")
	require.NoError(t, err)
	require.True(t, granted, "the key is dead")
	reopened, err = s.InboxReopen(ctx, key, "grant-2")
	require.NoError(t, err)
	require.False(t, reopened, "another grant")
	ok, err := s.InboxReplayGranted(ctx, key, "grant-2")
	require.NoError(t, err)
	require.False(t, ok)

	// Reopening makes it claimable, with its attempts reset.
	reopened, err = s.InboxReopen(ctx, key, "grant-1")
	require.NoError(t, err)
	require.True(t, reopened)
	p, err = s.InboxPeek(ctx, key)
	require.NoError(t, err)
	require.Equal(t, dedup.Claim{State: dedup.StateNew, FirstFailedAt: firstFailed}, p)
	reopened, err = s.InboxReopen(ctx, key, "grant-1")
	require.NoError(t, err)
	require.False(t, reopened, "the key is no longer dead")
	require.NoError(t, s.InboxDeadCopy(ctx, key), "a copy of a live key is no error")
	require.Equal(t, 2, s.keys[key].deadCopies, "and is not counted")
	replay, err := s.LeaseClaim(ctx, key, time.Minute, time.Hour)
	require.NoError(t, err)
	require.Equal(t, dedup.StateNew, replay.State)
	require.Equal(t, 1, replay.Attempts)
	require.Greater(t, replay.Token, second.Token)
	require.NoError(t, s.LeaseComplete(ctx, key, replay.Token, []byte("ok")))
	reopened, err = s.InboxReopen(ctx, key, "grant-1")
	require.NoError(t, err)
	require.False(t, reopened, "a done key is not reopened")

	ghost := dedup.Key{Consumer: "c", Key: "ghost"}
	reopened, err = s.InboxReopen(ctx, ghost, "grant-1")
	require.NoError(t, err)
	require.False(t, reopened)
	require.NoError(t, s.InboxDeadCopy(ctx, ghost))
	require.Equal(t, 1, s.Len(), "neither call created a record")
}

func TestDeadKeyExpiresWithItsWindow(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	s, clk := newStore()
	key := dedup.Key{Consumer: "c", Key: "dead"}
	c, err := s.LeaseClaim(ctx, key, time.Minute, time.Hour)
	require.NoError(t, err)
	require.NoError(t, s.LeaseBury(ctx, key, c.Token, dedup.Failure{Err: "x", At: clk.t}))
	clk.advance(time.Hour + time.Second)
	p, err := s.InboxPeek(ctx, key)
	require.NoError(t, err)
	require.Equal(t, dedup.StateNew, p.State, "an expired dead key is unknown to a peek")
	n, err := s.InboxDeleteExpired(ctx, 10)
	require.NoError(t, err)
	require.Equal(t, 1, n)
}

func TestTokensNeverRepeatAfterDeletion(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	s, clk := newStore()
	key := dedup.Key{Consumer: "c", Key: "k"}
	start := clk.t

	old, err := s.LeaseClaim(ctx, key, time.Minute, time.Minute)
	require.NoError(t, err)
	require.GreaterOrEqual(t, old.Token, start.UnixMicro(), "the token starts from the clock")
	clk.advance(2 * time.Minute)
	n, err := s.InboxDeleteExpired(ctx, 10)
	require.NoError(t, err)
	require.Equal(t, 1, n)

	// Even with the clock stepped back to the first claim's time, the new
	// token is higher.
	clk.t = start
	fresh, err := s.LeaseClaim(ctx, key, time.Minute, time.Hour)
	require.NoError(t, err)
	require.Equal(t, dedup.StateNew, fresh.State)
	require.Equal(t, 1, fresh.Attempts, "the record was forgotten")
	require.Greater(t, fresh.Token, old.Token)
	require.ErrorIs(t, s.LeaseComplete(ctx, key, old.Token, []byte("zombie")), dedup.ErrLeaseLost)
	require.ErrorIs(t, s.LeaseBury(ctx, key, old.Token, dedup.Failure{}), dedup.ErrLeaseLost)
	_, err = s.LeaseExtend(ctx, key, old.Token, time.Minute)
	require.ErrorIs(t, err, dedup.ErrLeaseLost)
	require.NoError(t, s.LeaseComplete(ctx, key, fresh.Token, []byte("ok")))
}

func TestAbandonedReleaseTakesTheAttemptBack(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	s, clk := newStore()
	key := dedup.Key{Consumer: "c", Key: "deploy"}

	c, err := s.LeaseClaim(ctx, key, time.Minute, time.Hour)
	require.NoError(t, err)
	failedAt := clk.t
	require.NoError(t, s.LeaseRelease(ctx, key, c.Token, dedup.Failure{Err: "timeout", At: failedAt}))
	c, err = s.LeaseClaim(ctx, key, time.Minute, time.Hour)
	require.NoError(t, err)
	require.Equal(t, 2, c.Attempts)
	clk.advance(time.Second)
	require.NoError(t, s.LeaseRelease(ctx, key, c.Token, dedup.Failure{Abandoned: true}))
	e := s.keys[key]
	require.Equal(t, failed, e.status, "the key is free at once")
	require.Equal(t, 1, e.attempts, "the abandoned attempt is not counted")
	require.Equal(t, "timeout", e.lastErr, "and records no failure")
	require.Equal(t, failedAt, e.lastFailed)
	require.ErrorIs(t, s.LeaseRelease(ctx, key, c.Token, dedup.Failure{Abandoned: true}), dedup.ErrLeaseLost)
	c, err = s.LeaseClaim(ctx, key, time.Minute, time.Hour)
	require.NoError(t, err)
	require.Equal(t, dedup.StateNew, c.State)
	require.Equal(t, 2, c.Attempts)
	require.Equal(t, failedAt, c.FirstFailedAt)
}
