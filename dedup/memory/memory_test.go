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
