package deduptest

import (
	"context"
	"reflect"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/dedup"
	"github.com/oncemill/oncemill/dedup/dedupdriver"
)

// subject is a store under test of either mode, with the ways the
// subtests that both modes share bring a key into each state.
type subject struct {
	// store is the store, for the optional interfaces.
	store      any
	graveyard  dedup.Graveyard
	deadCopies func(ctx context.Context, key dedup.Key) (int, error)
	// leaseMode is set for a lease store.
	leaseMode bool

	// apply claims key as new, with window, and completes it with result.
	apply func(t *testing.T, key dedup.Key, result []byte, window time.Duration)
	// fail claims key as new, with window, and records a failed attempt
	// at at.
	fail func(t *testing.T, key dedup.Key, at time.Time, window time.Duration)
	// bury claims key as new, with window, and dead-letters it.
	bury func(t *testing.T, key dedup.Key, at time.Time, window time.Duration)
	// look claims key and gives it back as it was (a rolled-back
	// transaction, an abandoned lease), returning what the claim found.
	// In lease mode a key that had no record is left with one.
	look func(t *testing.T, key dedup.Key) dedup.Claim
	// hold claims key as new with a lease of d and keeps it (lease mode
	// only; nil for a transactional store).
	hold func(t *testing.T, key dedup.Key, d time.Duration) dedup.Claim
}

// need returns store as the optional interface I, or skips the test,
// naming I, when the store does not implement it: a store need not claim
// every capability.
func need[I any](t *testing.T, store any) I {
	t.Helper()
	i, ok := store.(I)
	if !ok {
		t.Skipf("%T does not implement %s", store, reflect.TypeFor[I]())
	}
	return i
}

// sweep deletes expired records once, if the store is a [dedup.Expirer];
// a store that is not one expires its records by itself.
func (s subject) sweep(t *testing.T) {
	t.Helper()
	if e, ok := s.store.(dedup.Expirer); ok {
		_, err := e.InboxDeleteExpired(t.Context(), 1000)
		require.NoError(t, err)
	}
}

// requireState requires what look finds of key.
func (s subject) requireState(t *testing.T, k dedup.Key, want dedup.State, msgAndArgs ...any) dedup.Claim {
	t.Helper()
	c := s.look(t, k)
	require.Equal(t, want, c.State, msgAndArgs...)
	return c
}

// replayGrant checks the replay grants of a dead key.
func (s subject) replayGrant(t *testing.T) {
	ctx := t.Context()
	g := s.graveyard
	k, done, unknown := key("poison"), key("applied"), key("unknown")

	_, err := g.InboxGrantReplay(ctx, k, "")
	require.ErrorIs(t, err, dedup.ErrNoGrant, "an empty grant is refused")

	// A key that is not dead takes no grant and is never reopened.
	s.apply(t, done, []byte("r"), window)
	for _, nd := range []dedup.Key{unknown, done} {
		granted, err := g.InboxGrantReplay(ctx, nd, "grant-0")
		require.NoError(t, err)
		require.False(t, granted, "%s: a key that is not dead needs no grant", nd.Key)
		ok, err := g.InboxReplayGranted(ctx, nd, "grant-0")
		require.NoError(t, err)
		require.False(t, ok, "%s holds no grant", nd.Key)
		reopened, err := g.InboxReopen(ctx, nd, "grant-0")
		require.NoError(t, err)
		require.False(t, reopened, "%s: only a dead key is reopened", nd.Key)
	}
	s.requireState(t, done, dedup.StateDone, "the done key stays done")

	s.bury(t, k, failedAt(time.Minute), window)
	for _, forged := range []string{"", "1", "forged"} {
		reopened, err := g.InboxReopen(ctx, k, forged)
		require.NoError(t, err)
		require.False(t, reopened, "grant %q was never written", forged)
	}
	s.requireState(t, k, dedup.StateDead, "no grant, no reopening")

	// A grant replaces the one written before it.
	for _, grant := range []string{"grant-1", "grant-2"} {
		granted, err := g.InboxGrantReplay(ctx, k, grant)
		require.NoError(t, err)
		require.True(t, granted, "the key is dead")
	}
	for grant, want := range map[string]bool{"grant-1": false, "grant-2": true, "": false} {
		ok, err := g.InboxReplayGranted(ctx, k, grant)
		require.NoError(t, err)
		require.Equal(t, want, ok, "the record holds grant-2 only, asked about %q", grant)
	}
	ok, err := g.InboxReplayGranted(ctx, dedup.Key{Consumer: "other-" + consumer, Key: k.Key}, "grant-2")
	require.NoError(t, err)
	require.False(t, ok, "another consumer's record of the key holds no grant")
	reopened, err := g.InboxReopen(ctx, k, "grant-1")
	require.NoError(t, err)
	require.False(t, reopened, "a replaced grant reopens nothing")
	s.requireState(t, k, dedup.StateDead)

	// The grant reopens the key once, with its attempts reset; the grant
	// stays on the reopened record.
	reopened, err = g.InboxReopen(ctx, k, "grant-2")
	require.NoError(t, err)
	require.True(t, reopened)
	reopened, err = g.InboxReopen(ctx, k, "grant-2")
	require.NoError(t, err)
	require.False(t, reopened, "the key is no longer dead")
	ok, err = g.InboxReplayGranted(ctx, k, "grant-2")
	require.NoError(t, err)
	require.True(t, ok, "the grant stays on the key its replay reopened")
	if ts, isTx := s.store.(dedup.TxStore); isTx {
		c, err := ts.InboxStart(ctx, k, window)
		require.NoError(t, err)
		require.Equal(t, dedup.StateNew, c.State, "a reopened key runs")
		require.Equal(t, 1, c.Attempts, "the replay's attempt is the first counted")
		require.NoError(t, ts.InboxUnstart(ctx, k))
	}
	c := s.requireState(t, k, dedup.StateNew, "a reopened key is claimable")
	require.Equal(t, 1, c.Attempts, "its attempts were reset")

	// Dead-lettered again, the key drops the grant: one grant reopens it
	// once.
	s.bury(t, k, failedAt(time.Second), window)
	ok, err = g.InboxReplayGranted(ctx, k, "grant-2")
	require.NoError(t, err)
	require.False(t, ok, "burying clears the grant")
	reopened, err = g.InboxReopen(ctx, k, "grant-2")
	require.NoError(t, err)
	require.False(t, reopened, "a used grant reopens nothing")
	s.requireState(t, k, dedup.StateDead)

	// A new grant reopens it again, and its replay applies it.
	granted, err := g.InboxGrantReplay(ctx, k, "grant-3")
	require.NoError(t, err)
	require.True(t, granted)
	reopened, err = g.InboxReopen(ctx, k, "grant-3")
	require.NoError(t, err)
	require.True(t, reopened)
	s.apply(t, k, []byte("replayed"), window)
	c = s.requireState(t, k, dedup.StateDone)
	require.Equal(t, []byte("replayed"), c.Result)
	granted, err = g.InboxGrantReplay(ctx, k, "grant-4")
	require.NoError(t, err)
	require.False(t, granted, "a done key takes no grant")
	reopened, err = g.InboxReopen(ctx, k, "grant-3")
	require.NoError(t, err)
	require.False(t, reopened, "a done key is never reopened")
}

// deadCopyRequired checks what every store must do with a copy of a dead
// key: count it without failing and leave every key as it was.
func (s subject) deadCopyRequired(t *testing.T, dead dedup.Key) {
	ctx := t.Context()
	require.NoError(t, s.graveyard.InboxDeadCopy(ctx, dead))
	require.NoError(t, s.graveyard.InboxDeadCopy(ctx, dead))
	s.requireState(t, dead, dedup.StateDead, "a dead copy leaves the key dead")

	done, unknown := key("dead-copy-of-done"), key("dead-copy-of-unknown")
	s.apply(t, done, []byte("r"), window)
	require.NoError(t, s.graveyard.InboxDeadCopy(ctx, done), "a copy of a live key is no error")
	c := s.requireState(t, done, dedup.StateDone, "and changes nothing")
	require.Equal(t, []byte("r"), c.Result)
	require.NoError(t, s.graveyard.InboxDeadCopy(ctx, unknown))
	if f, ok := s.store.(dedupdriver.RecordFinder); ok {
		found, err := f.InboxHasRecord(ctx, unknown)
		require.NoError(t, err)
		require.False(t, found, "a dead copy of an unknown key creates no record")
	}
}

// deadCopiesCounted checks the count of dead copies, with the harness's
// reader.
func (s subject) deadCopiesCounted(t *testing.T) {
	if s.deadCopies == nil {
		t.Skip("the bundle has no DeadCopies reader")
	}
	ctx := t.Context()
	dead, done := key("dead"), key("done")
	s.bury(t, dead, failedAt(time.Minute), window)
	s.apply(t, done, nil, window)
	n, err := s.deadCopies(ctx, dead)
	require.NoError(t, err)
	require.Zero(t, n, "no copy arrived yet")
	for range 3 {
		require.NoError(t, s.graveyard.InboxDeadCopy(ctx, dead))
	}
	require.NoError(t, s.graveyard.InboxDeadCopy(ctx, done))
	n, err = s.deadCopies(ctx, dead)
	require.NoError(t, err)
	require.Equal(t, 3, n, "every copy of the dead key is counted")
	n, err = s.deadCopies(ctx, done)
	require.NoError(t, err)
	require.Zero(t, n, "a copy of a key that is not dead is not counted")
}

// sweepExpired checks [dedup.Expirer]: expired records of every state go,
// in bounded batches; live ones stay.
func (s subject) sweepExpired(t *testing.T) {
	e := need[dedup.Expirer](t, s.store)
	ctx := t.Context()
	const expired, limit = 7, 3
	at := failedAt(time.Minute)
	for i, k := range []string{"done-1", "done-2", "done-3"} {
		s.apply(t, key("expired-"+k), []byte{byte(i)}, shortWindow)
	}
	s.fail(t, key("expired-failed-1"), at, shortWindow)
	s.fail(t, key("expired-failed-2"), at, shortWindow)
	s.bury(t, key("expired-dead-1"), at, shortWindow)
	s.bury(t, key("expired-dead-2"), at, shortWindow)
	s.apply(t, key("live-done"), []byte("live"), window)
	s.fail(t, key("live-failed"), at, window)
	s.bury(t, key("live-dead"), at, window)
	var held dedup.Claim
	if s.hold != nil {
		held = s.hold(t, key("live-held"), lease)
	}

	deleted := 0
	eventually(t, "the expired records to be swept", func() bool {
		n, err := e.InboxDeleteExpired(ctx, limit)
		require.NoError(t, err)
		require.LessOrEqual(t, n, limit, "a sweep deletes at most limit records")
		deleted += n
		require.LessOrEqual(t, deleted, expired, "only expired records are deleted")
		return deleted == expired
	})
	n, err := e.InboxDeleteExpired(ctx, limit)
	require.NoError(t, err)
	require.Zero(t, n, "nothing is left to sweep")

	c := s.requireState(t, key("live-done"), dedup.StateDone, "a live record stays")
	require.Equal(t, []byte("live"), c.Result)
	c = s.requireState(t, key("live-failed"), dedup.StateNew)
	require.Equal(t, 2, c.Attempts, "the live failed record kept its attempt")
	s.requireState(t, key("live-dead"), dedup.StateDead)
	if s.hold != nil {
		c = s.requireState(t, key("live-held"), dedup.StateInFlight, "a live lease stays")
		require.True(t, held.Until.Equal(c.Until))
	}
	if f, ok := s.store.(dedupdriver.RecordFinder); ok {
		found, err := f.InboxHasRecord(ctx, key("expired-done-1"))
		require.NoError(t, err)
		require.False(t, found, "a swept record is gone")
	}
}

// peek checks [dedupdriver.Peeker] on every state.
func (s subject) peek(t *testing.T) {
	p := need[dedupdriver.Peeker](t, s.store)
	ctx := t.Context()
	unknown := key("unknown")
	c, err := p.InboxPeek(ctx, unknown)
	require.NoError(t, err)
	require.Equal(t, dedup.StateNew, c.State, "an unknown key is new")
	if f, ok := s.store.(dedupdriver.RecordFinder); ok {
		found, err := f.InboxHasRecord(ctx, unknown)
		require.NoError(t, err)
		require.False(t, found, "a peek writes nothing")
	}

	s.apply(t, key("done"), []byte("r"), window)
	s.fail(t, key("failed"), failedAt(time.Minute), window)
	s.bury(t, key("dead"), failedAt(time.Minute), window)
	for k, want := range map[string]dedup.State{"done": dedup.StateDone, "failed": dedup.StateNew, "dead": dedup.StateDead} {
		c, err := p.InboxPeek(ctx, key(k))
		require.NoError(t, err)
		require.Equal(t, want, c.State, k)
		if want == dedup.StateDone {
			require.Equal(t, []byte("r"), c.Result, "a done key's peek answers its result")
		}
	}
	s.requireState(t, key("done"), dedup.StateDone, "a peek changes nothing")
	c = s.requireState(t, key("failed"), dedup.StateNew)
	require.Equal(t, 2, c.Attempts, "a peek counts no attempt")

	if s.hold == nil {
		return
	}
	held := s.hold(t, key("held"), lease)
	c, err = p.InboxPeek(ctx, key("held"))
	require.NoError(t, err)
	require.Equal(t, dedup.StateInFlight, c.State, "a live lease is in flight")
	require.True(t, held.Until.Equal(c.Until), "with the lease's end: %s, want %s", c.Until, held.Until)
	s.hold(t, key("short"), shortLease)
	eventually(t, "the short lease to end", func() bool {
		c, err := p.InboxPeek(ctx, key("short"))
		require.NoError(t, err)
		return c.State == dedup.StateNew
	})
}

// hasRecord checks [dedupdriver.RecordFinder] on every state.
func (s subject) hasRecord(t *testing.T) {
	f := need[dedupdriver.RecordFinder](t, s.store)
	ctx := t.Context()
	found, err := f.InboxHasRecord(ctx, key("unknown"))
	require.NoError(t, err)
	require.False(t, found, "an unknown key")
	if !s.leaseMode {
		s.requireState(t, key("rolled-back"), dedup.StateNew)
		found, err = f.InboxHasRecord(ctx, key("rolled-back"))
		require.NoError(t, err)
		require.False(t, found, "a claim that was rolled back leaves no record")
	}
	s.apply(t, key("done"), nil, window)
	s.fail(t, key("failed"), failedAt(time.Minute), window)
	s.bury(t, key("dead"), failedAt(time.Minute), window)
	ks := []string{"done", "failed", "dead"}
	if s.hold != nil {
		s.hold(t, key("held"), lease)
		ks = append(ks, "held")
	}
	for _, k := range ks {
		found, err := f.InboxHasRecord(ctx, key(k))
		require.NoError(t, err)
		require.True(t, found, "a %s key has a record", k)
	}
	found, err = f.InboxHasRecord(ctx, dedup.Key{Consumer: "other-" + consumer, Key: "done"})
	require.NoError(t, err)
	require.False(t, found, "another consumer's record is its own")
}

// doneKeys checks [dedupdriver.KeyLister]: done keys of the consumer only.
func (s subject) doneKeys(t *testing.T) {
	l := need[dedupdriver.KeyLister](t, s.store)
	ctx := t.Context()
	s.apply(t, key("a"), nil, window)
	s.apply(t, key("b"), []byte("r"), window)
	s.fail(t, key("failed"), failedAt(time.Minute), window)
	s.bury(t, key("dead"), failedAt(time.Minute), window)
	s.apply(t, dedup.Key{Consumer: "other-" + consumer, Key: "c"}, nil, window)
	if s.hold != nil {
		s.hold(t, key("held"), lease)
	}
	collect := func(since time.Time) map[string]bool {
		seen := map[string]bool{} // a key may be seen twice (dedup/redis)
		require.NoError(t, l.InboxDoneKeys(ctx, consumer, since, func(k string) error {
			seen[k] = true
			return nil
		}))
		return seen
	}
	require.Equal(t, map[string]bool{"a": true, "b": true}, collect(time.Time{}), "the consumer's done keys, and no other")
	require.Empty(t, collect(time.Now().Add(time.Hour)), "none was completed after since")

	stop := suiteError("stop")
	calls := 0
	err := l.InboxDoneKeys(ctx, consumer, time.Time{}, func(string) error {
		calls++
		return stop
	})
	require.ErrorIs(t, err, stop, "fn's error is returned")
	require.Equal(t, 1, calls, "and stops the walk")
}

// results checks that a stored result comes back byte for byte, whatever
// its bytes and size, and that none stored answers nil.
func (s subject) results(t *testing.T) {
	binary := make([]byte, 256)
	for i := range binary {
		binary[i] = byte(i) // NUL, invalid UTF-8 and every other byte
	}
	large := make([]byte, 200<<10) // produced messages with their payloads: more than a 64 KiB column holds
	for i := range large {
		large[i] = "0123456789abcdef"[i%16]
	}
	for name, result := range map[string][]byte{"binary": binary, "large": large, "json": []byte(`[{"uuid":"u-1","payload":"eyJhIjoxfQ=="}]`)} {
		s.apply(t, key(name), result, window)
		c := s.requireState(t, key(name), dedup.StateDone)
		require.Equal(t, result, c.Result, "the %s result comes back as it was stored", name)
		if ts, ok := s.store.(dedup.TxStore); ok {
			c, err := ts.InboxStart(t.Context(), key(name), window)
			require.NoError(t, err)
			require.Equal(t, dedup.StateDone, c.State)
			require.Equal(t, result, c.Result, "the start answers the %s result too", name)
		}
	}
	s.apply(t, key("nil"), nil, window)
	require.Nil(t, s.requireState(t, key("nil"), dedup.StateDone).Result, "no result stored answers nil")
}

// suiteError is an error of the suite's own, for a store to pass on.
type suiteError string

func (e suiteError) Error() string { return "deduptest: " + string(e) }
