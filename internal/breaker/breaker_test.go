package breaker

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// TestBreakerStates walks the breaker through its states on a clock of
// the test's own.
func TestBreakerStates(t *testing.T) {
	t.Parallel()
	const probe = time.Second
	b := New(3, probe)
	now := time.Date(2026, 3, 1, 12, 0, 0, 0, time.UTC)
	requireState := func(open bool, opens, skipped int64) {
		t.Helper()
		gotOpen, gotOpens, gotSkipped := b.State()
		require.Equal(t, open, gotOpen, "open")
		require.Equal(t, opens, gotOpens, "opens")
		require.Equal(t, skipped, gotSkipped, "skipped")
	}
	call := func(o Outcome) Transition {
		t.Helper()
		pass, probe := b.Allow(now)
		require.True(t, pass)
		require.False(t, probe)
		return b.Record(now, probe, o)
	}

	// Closed: only unavailability in a row counts.
	require.Equal(t, Unchanged, call(Unreachable))
	require.Equal(t, Unchanged, call(Unreachable))
	require.Equal(t, Unchanged, call(Answered), "an answer ends the streak")
	require.Equal(t, Unchanged, call(Unreachable))
	require.Equal(t, Unchanged, call(Unreachable))
	require.Equal(t, Unchanged, call(Inconclusive), "the caller's cancellation says nothing")
	requireState(false, 0, 0)
	require.Equal(t, Opened, call(Unreachable), "the third in a row")
	requireState(true, 1, 0)

	// Open: calls are skipped until the probe is due.
	for i := 0; i < 5; i++ {
		pass, _ := b.Allow(now.Add(probe - time.Millisecond))
		require.False(t, pass)
	}
	requireState(true, 1, 5)
	// A failure of a call that was not the probe (one that settles a
	// lease) does not move the probe.
	require.Equal(t, Unchanged, b.Record(now.Add(probe/2), false, Unreachable))

	// Half-open: one probe per interval, the others still skipped.
	now = now.Add(probe)
	pass, isProbe := b.Allow(now)
	require.True(t, pass)
	require.True(t, isProbe)
	pass, _ = b.Allow(now.Add(probe / 2))
	require.False(t, pass, "one probe at a time")
	requireState(true, 1, 6)
	// The probe fails after the client's dial cycle: the next one is a
	// whole interval after that.
	now = now.Add(400 * time.Millisecond)
	require.Equal(t, Unchanged, b.Record(now, true, Unreachable))
	pass, _ = b.Allow(now.Add(probe - time.Millisecond))
	require.False(t, pass)
	now = now.Add(probe)
	pass, isProbe = b.Allow(now)
	require.True(t, pass)
	require.True(t, isProbe)
	// A probe cancelled by its caller told nothing: the next call probes.
	require.Equal(t, Unchanged, b.Record(now, true, Inconclusive))
	pass, isProbe = b.Allow(now)
	require.True(t, pass)
	require.True(t, isProbe)
	require.Equal(t, Closed, b.Record(now, true, Answered), "the probe was answered")
	requireState(false, 1, 7)
	pass, isProbe = b.Allow(now)
	require.True(t, pass)
	require.False(t, isProbe)

	// The streak starts over after closing; an answer to any call, probe
	// or not, closes an open breaker.
	require.Equal(t, Unchanged, call(Unreachable))
	require.Equal(t, Unchanged, call(Unreachable))
	require.Equal(t, Opened, call(Unreachable))
	require.Equal(t, Closed, b.Record(now, false, Answered))
	requireState(false, 2, 7)
}
