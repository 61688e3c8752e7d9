package deduptest

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/dedup"
	"github.com/oncemill/oncemill/dedup/dedupdriver"
)

// OldRecord is a key's record as a store of an earlier schema held it,
// for an [UpgradeHarness] to write in that schema's form before it
// migrates the tables.
type OldRecord struct {
	// Key is the record's key.
	Key dedup.Key
	// Status is "done", "failed", "dead" or "processing" (a lease); ""
	// writes no record, only the start count.
	Status string
	// Attempts is the record's count of attempts.
	Attempts int
	// Result is what was stored with a done key.
	Result []byte
	// FirstError, LastError, FirstFailedAt and LastFailedAt are the
	// failures recorded; empty and zero for none.
	FirstError, LastError       string
	FirstFailedAt, LastFailedAt time.Time
	// DeadCopies counts the copies of a dead key acked without running.
	DeadCopies int
	// ReplayGrant is the grant written on a dead key; "" for none.
	ReplayGrant string
	// Token and LeaseUntil are a lease's (Status "processing").
	Token      int64
	LeaseUntil time.Time
	// Started is the key's count of attempts that started and did not
	// end (the start count, in its own table); 0 for none.
	Started int
}

// UpgradeHarness describes to [RunUpgrade] a store whose tables come from
// an earlier schema.
type UpgradeHarness struct {
	// New writes records in the form of the schema before the one under
	// test, with every migration up to that schema applied and recorded
	// as the migrator of that release left them, then runs the migrator
	// and returns the store on the migrated tables, and a reader of a
	// key's dead copies. Required.
	New func(t *testing.T, records []OldRecord) (dedup.TxStore, func(ctx context.Context, key dedup.Key) (int, error))
}

// RunUpgrade checks that a store answers, once its tables are migrated,
// what it answered of the records written in the earlier form: done keys
// (with and without failures before), a failed key, dead keys (with and
// without a replay grant and copies), a delivery in flight when its
// process died (a start count and no record) and a failed key with one,
// and a lease held (where the store can tell it).
func RunUpgrade(t *testing.T, h UpgradeHarness) {
	t.Helper()
	if h.New == nil {
		t.Fatal("deduptest: UpgradeHarness.New is required")
	}
	ctx := t.Context()
	now := failedAt(0).UTC()
	at := func(ago time.Duration) time.Time { return now.Add(-ago) }
	var (
		done        = key("up-done")
		doneRetried = key("up-done-retried")
		failed      = key("up-failed")
		dead        = key("up-dead")
		deadBare    = key("up-dead-no-grant")
		inFlight    = key("up-in-flight")
		failedStart = key("up-failed-started")
		leased      = key("up-leased")
	)
	records := []OldRecord{
		{Key: done, Status: "done", Attempts: 1, Result: []byte("r-done")},
		{Key: doneRetried, Status: "done", Attempts: 3, Result: []byte("r-retried"),
			FirstError: "e1", LastError: "e2", FirstFailedAt: at(3 * time.Minute), LastFailedAt: at(2 * time.Minute)},
		{Key: failed, Status: "failed", Attempts: 2, FirstError: "boom 1", LastError: "boom 2",
			FirstFailedAt: at(5 * time.Minute), LastFailedAt: at(4 * time.Minute)},
		{Key: dead, Status: "dead", Attempts: 3, FirstError: "bad", LastError: "still bad",
			FirstFailedAt: at(9 * time.Minute), LastFailedAt: at(8 * time.Minute), DeadCopies: 2, ReplayGrant: "grant-old"},
		{Key: deadBare, Status: "dead", Attempts: 1, FirstError: "permanent", LastError: "permanent",
			FirstFailedAt: at(time.Minute), LastFailedAt: at(time.Minute)},
		{Key: inFlight, Started: 2},
		{Key: failedStart, Status: "failed", Attempts: 1, FirstError: "x", LastError: "x",
			FirstFailedAt: at(time.Minute), LastFailedAt: at(time.Minute), Started: 2},
		{Key: leased, Status: "processing", Attempts: 1, Token: 7, LeaseUntil: time.Now().Add(time.Hour)},
	}
	store, deadCopies := h.New(t, records)
	claim := func(k dedup.Key) (dedup.InboxTx, dedup.Claim) {
		t.Helper()
		tx, err := store.InboxBegin(ctx)
		require.NoError(t, err)
		c, err := tx.InboxClaim(ctx, k, window)
		if err != nil {
			require.NoError(t, errors.Join(err, tx.Rollback(ctx)))
		}
		return tx, c
	}

	// Done keys are duplicates, with their results.
	for _, k := range []dedup.Key{done, doneRetried} {
		c, err := store.InboxStart(ctx, k, window)
		require.NoError(t, err)
		require.Equal(t, dedup.StateDone, c.State, "%s: the start answers a done key", k.Key)
		tx, c := claim(k)
		require.Equal(t, dedup.StateDone, c.State, k.Key)
		require.NoError(t, tx.Rollback(ctx))
	}
	c, err := store.InboxStart(ctx, done, window)
	require.NoError(t, err)
	require.Equal(t, []byte("r-done"), c.Result)
	if p, ok := store.(dedupdriver.Peeker); ok {
		c, err := p.InboxPeek(ctx, doneRetried)
		require.NoError(t, err)
		require.Equal(t, dedup.StateDone, c.State)
		require.Equal(t, []byte("r-retried"), c.Result)
		require.Equal(t, 3, c.Attempts, "its attempts are kept")
		require.True(t, at(3*time.Minute).Equal(c.FirstFailedAt), "its first failure: %s", c.FirstFailedAt)
	}

	// A failed key is claimed again, its attempts and first failure kept.
	c, err = store.InboxStart(ctx, failed, window)
	require.NoError(t, err)
	require.Equal(t, dedup.StateNew, c.State)
	require.Equal(t, 1, c.Attempts, "no attempt had started")
	tx, c := claim(failed)
	require.Equal(t, dedup.StateNew, c.State, "a failed key is claimed again")
	require.Equal(t, 3, c.Attempts, "its two failed attempts and this one")
	require.True(t, at(5*time.Minute).Equal(c.FirstFailedAt), "its first failure: %s", c.FirstFailedAt)
	require.NoError(t, tx.InboxComplete(ctx, failed, []byte("r-failed")))
	require.NoError(t, tx.Commit(ctx))
	tx, c = claim(failed)
	require.Equal(t, dedup.StateDone, c.State)
	require.Equal(t, []byte("r-failed"), c.Result)
	require.NoError(t, tx.Rollback(ctx))

	// A failed key with a start count: the count goes on.
	c, err = store.InboxStart(ctx, failedStart, window)
	require.NoError(t, err)
	require.Equal(t, 3, c.Attempts, "the two started attempts and this one")
	require.NoError(t, store.InboxFail(ctx, failedStart, dedup.Failure{Err: "again", At: at(0)}, window))
	tx, c = claim(failedStart)
	require.Equal(t, dedup.StateNew, c.State)
	require.Equal(t, 3, c.Attempts, "the failed attempt before the upgrade, the one after, and this one")
	require.NoError(t, tx.Rollback(ctx))

	// A delivery in flight when its process died is counted.
	c, err = store.InboxStart(ctx, inFlight, window)
	require.NoError(t, err)
	require.Equal(t, dedup.StateNew, c.State)
	require.Equal(t, 3, c.Attempts, "the two attempts that died and this one")

	// Dead keys stay dead; the grant written before reopens the key once,
	// and the copies counted before go on.
	for _, k := range []dedup.Key{dead, deadBare} {
		c, err := store.InboxStart(ctx, k, window)
		require.NoError(t, err)
		require.Equal(t, dedup.StateDead, c.State, "%s: the start answers a dead key", k.Key)
		tx, c := claim(k)
		require.Equal(t, dedup.StateDead, c.State, k.Key)
		require.NoError(t, tx.Rollback(ctx))
	}
	if deadCopies != nil {
		require.NoError(t, store.InboxDeadCopy(ctx, dead))
		n, err := deadCopies(ctx, dead)
		require.NoError(t, err)
		require.Equal(t, 3, n, "the two copies counted before and this one")
	}
	ok, err := store.InboxReplayGranted(ctx, dead, "grant-old")
	require.NoError(t, err)
	require.True(t, ok, "the grant written before the upgrade")
	ok, err = store.InboxReplayGranted(ctx, deadBare, "grant-old")
	require.NoError(t, err)
	require.False(t, ok, "another key holds no grant")
	reopened, err := store.InboxReopen(ctx, dead, "grant-old")
	require.NoError(t, err)
	require.True(t, reopened, "the grant reopens the key")
	tx, c = claim(dead)
	require.Equal(t, dedup.StateNew, c.State, "a reopened key is claimable")
	require.Equal(t, 1, c.Attempts, "its attempts were reset")
	require.NoError(t, tx.Commit(ctx))
	granted, err := store.InboxGrantReplay(ctx, deadBare, "grant-new")
	require.NoError(t, err)
	require.True(t, granted, "a key dead before the upgrade takes a new grant")
	reopened, err = store.InboxReopen(ctx, deadBare, "grant-new")
	require.NoError(t, err)
	require.True(t, reopened)

	// A lease held before the upgrade still holds the key.
	if p, ok := store.(dedupdriver.Peeker); ok {
		c, err := p.InboxPeek(ctx, leased)
		require.NoError(t, err)
		require.Equal(t, dedup.StateInFlight, c.State, "a live lease holds the key")
	}
	if ls, ok := store.(dedup.LeaseStore); ok {
		c, err := ls.LeaseClaim(ctx, leased, lease, window)
		require.NoError(t, err)
		require.Equal(t, dedup.StateInFlight, c.State)
		require.NoError(t, ls.LeaseComplete(ctx, leased, 7, []byte("r-leased")), "the lease's token completes it")
		c, err = ls.LeaseClaim(ctx, leased, lease, window)
		require.NoError(t, err)
		require.Equal(t, dedup.StateDone, c.State)
		require.Equal(t, []byte("r-leased"), c.Result)
	}

	// Every record is found, and the sweep keeps the live ones.
	if f, ok := store.(dedupdriver.RecordFinder); ok {
		for _, r := range records {
			if r.Status == "" {
				continue
			}
			found, err := f.InboxHasRecord(ctx, r.Key)
			require.NoError(t, err)
			require.True(t, found, r.Key.Key)
		}
	}
	if e, ok := store.(dedup.Expirer); ok {
		n, err := e.InboxDeleteExpired(ctx, 100)
		require.NoError(t, err)
		require.Zero(t, n, "no record has expired")
	}
}
