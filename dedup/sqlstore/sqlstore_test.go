package sqlstore_test

import (
	"context"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/dedup"
	"github.com/oncemill/oncemill/dedup/sqlstore"
	"github.com/oncemill/oncemill/sqlschema"
)

func TestConfigValidate(t *testing.T) {
	t.Parallel()
	_, err := sqlstore.New(nil, sqlstore.Config{Dialect: sqlstore.MySQL})
	require.ErrorContains(t, err, "db is nil")
	require.ErrorContains(t, sqlstore.Config{}.Validate(), "Config.Dialect is required")
	require.ErrorContains(t, sqlstore.Config{Dialect: sqlstore.Postgres, Schema: sqlschema.Config{InboxTable: "In-box"}}.Validate(), "Schema.InboxTable")
	require.ErrorContains(t, sqlstore.Config{Dialect: sqlstore.MySQL, Schema: sqlschema.Config{Schema: "x`; DROP DATABASE y"}}.Validate(), "Schema.Schema")
	require.NoError(t, sqlstore.Config{Dialect: sqlstore.MySQL}.Validate())
	require.Equal(t, "mysql", sqlstore.MySQL.String())
	require.Equal(t, sqlschema.Postgres, sqlstore.Postgres.Schema())
}

func TestNotMigratedHint(t *testing.T) {
	t.Parallel()
	each(t, 2, func(t *testing.T, b backend) {
		store, err := sqlstore.New(b.db, sqlstore.Config{Dialect: b.dialect, Schema: sqlschema.Config{Schema: b.schema.Schema, InboxTable: "missing"}})
		require.NoError(t, err)
		_, err = store.InboxStart(context.Background(), dedup.Key{Consumer: "c", Key: "k"}, time.Hour)
		require.ErrorIs(t, err, sqlstore.ErrNotMigrated)
	})
}

func TestClaimCommitThenDuplicate(t *testing.T) {
	t.Parallel()
	each(t, 4, func(t *testing.T, b backend) {
		ctx := context.Background()
		key := dedup.Key{Consumer: "billing", Key: "order-1"}

		start, err := b.store.InboxStart(ctx, key, time.Hour)
		require.NoError(t, err)
		require.Equal(t, dedup.Claim{State: dedup.StateNew, Attempts: 1}, start)
		require.Equal(t, 1, b.starts(t, key))

		require.Equal(t, dedup.StateNew, b.apply(t, key, []byte("stored")))
		require.Zero(t, b.starts(t, key), "the start count commits away with the key")
		require.Equal(t, 1, b.effects(t, key.Key))

		// A duplicate is answered by the start, without a transaction,
		// and by the claim.
		start, err = b.store.InboxStart(ctx, key, time.Hour)
		require.NoError(t, err)
		require.Equal(t, dedup.StateDone, start.State)
		require.Equal(t, []byte("stored"), start.Result)
		require.Zero(t, b.starts(t, key), "a done key is not counted")

		tx, err := b.store.InboxBegin(ctx)
		require.NoError(t, err)
		c, err := tx.InboxClaim(ctx, key, time.Hour)
		require.NoError(t, err)
		require.NoError(t, tx.Rollback(ctx))
		require.Equal(t, dedup.StateDone, c.State)
		require.Equal(t, 1, c.Attempts)
		require.Equal(t, []byte("stored"), c.Result)
		require.NoError(t, tx.Rollback(ctx), "a second rollback is a no-op")

		// Another consumer of the same key keeps its own record.
		require.Equal(t, dedup.StateNew, b.apply(t, dedup.Key{Consumer: "shipping", Key: "order-1"}, nil))
		require.Equal(t, 2, b.effects(t, key.Key))

		r, ok := b.row(t, key)
		require.True(t, ok)
		require.Equal(t, "done", r.status)
		require.Equal(t, []byte("stored"), r.result)
	})
}

// TestKeysAreExact: keys that differ only in case or trailing spaces are
// two keys, and a key longer than MySQL's column is applied once, not
// refused and not truncated into another.
func TestKeysAreExact(t *testing.T) {
	t.Parallel()
	each(t, 4, func(t *testing.T, b backend) {
		long := strings.Repeat("x", 3000)
		for _, k := range []string{"order-1", "Order-1", "order-1 ", long, long + "y"} {
			key := dedup.Key{Consumer: "billing", Key: k}
			require.Equal(t, dedup.StateNew, b.apply(t, key, nil), "%.20q", k)
			require.Equal(t, dedup.StateDone, b.apply(t, key, nil), "%.20q", k)
		}
		longConsumer := dedup.Key{Consumer: strings.Repeat("c", 300), Key: "order-1"}
		require.Equal(t, dedup.StateNew, b.apply(t, longConsumer, nil))
		require.Equal(t, dedup.StateDone, b.apply(t, longConsumer, nil))
		var keys []string
		require.NoError(t, b.store.InboxDoneKeys(context.Background(), "billing", time.Time{}, func(k string) error {
			keys = append(keys, k)
			return nil
		}))
		require.Len(t, keys, 5)
	})
}

func TestRollbackLeavesNothingAndFailureIsRecorded(t *testing.T) {
	t.Parallel()
	each(t, 4, func(t *testing.T, b backend) {
		ctx := context.Background()
		key := dedup.Key{Consumer: "billing", Key: "order-2"}
		firstAt := time.Now().Add(-time.Minute).Truncate(time.Microsecond)
		for i, msg := range []string{"first boom", "second \x00boom \xff"} {
			tx, err := b.store.InboxBegin(ctx)
			require.NoError(t, err)
			c, err := tx.InboxClaim(ctx, key, time.Hour)
			require.NoError(t, err)
			require.Equal(t, dedup.StateNew, c.State)
			require.Equal(t, i+1, c.Attempts)
			if i == 0 {
				require.True(t, c.FirstFailedAt.IsZero(), "no failure yet")
			} else {
				require.True(t, c.FirstFailedAt.Equal(firstAt), "first failure %s, want %s", c.FirstFailedAt, firstAt)
			}
			require.NoError(t, b.effect(tx.WithTx(ctx), key.Key))
			require.NoError(t, tx.Rollback(ctx))
			require.NoError(t, b.store.InboxFail(ctx, key, dedup.Failure{Err: msg, At: firstAt.Add(time.Duration(i) * time.Second)}, time.Hour))
		}
		require.Zero(t, b.effects(t, key.Key), "rolled back")
		r, ok := b.row(t, key)
		require.True(t, ok)
		require.Equal(t, "failed", r.status)
		require.Equal(t, 2, r.attempts)
		require.Equal(t, "first boom", r.firstErr.String)
		require.Equal(t, "second \uFFFDboom \uFFFD", r.lastErr.String, "stored as valid text, NUL and invalid UTF-8 as U+FFFD")

		require.Equal(t, dedup.StateNew, b.apply(t, key, nil))
		r, _ = b.row(t, key)
		require.Equal(t, "done", r.status)
		require.Equal(t, 3, r.attempts)

		// A late failure report never reopens a done key.
		require.NoError(t, b.store.InboxFail(ctx, key, dedup.Failure{Err: "late", At: time.Now()}, time.Hour))
		r, _ = b.row(t, key)
		require.Equal(t, "done", r.status)
		require.Equal(t, 3, r.attempts)
		require.Equal(t, "second \uFFFDboom \uFFFD", r.lastErr.String)
		require.Equal(t, 1, b.effects(t, key.Key))
	})
}

// TestConcurrentClaimsApplyOnce: 50 transactions claim one key at once;
// one applies the effect, the others wait on its row and see it done with
// its result. The dialects run one after the other: each holds 50
// connections.
func TestConcurrentClaimsApplyOnce(t *testing.T) {
	t.Parallel()
	for _, name := range []string{"pgx", "pq", "mysql"} {
		t.Run(name, func(t *testing.T) {
			// A key whose earlier attempt failed is taken by the update
			// half of the claim instead of the insert: still one winner.
			for _, failedBefore := range []bool{false, true} {
				testConcurrentClaims(t, open(t, name, 52), failedBefore)
			}
		})
	}
}

func testConcurrentClaims(t *testing.T, b backend, failedBefore bool) {
	ctx := context.Background()
	key := dedup.Key{Consumer: "billing", Key: "order-hot"}
	if failedBefore {
		key.Key += "-failed"
		require.NoError(t, b.store.InboxFail(ctx, key, dedup.Failure{Err: "timeout", At: time.Now()}, time.Hour))
	}
	const n = 50
	var (
		wg      sync.WaitGroup
		start   = make(chan struct{})
		mu      sync.Mutex
		states  = map[dedup.State]int{}
		results [][]byte
		errs    []error
	)
	for i := 0; i < n; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			err := func() error {
				tx, err := b.store.InboxBegin(ctx)
				if err != nil {
					return err
				}
				defer tx.Rollback(ctx) //nolint:errcheck // a no-op after commit
				c, err := tx.InboxClaim(ctx, key, time.Hour)
				if err != nil {
					return err
				}
				mu.Lock()
				states[c.State]++
				if c.State == dedup.StateDone {
					results = append(results, c.Result)
				}
				mu.Unlock()
				if c.State != dedup.StateNew {
					return nil
				}
				if err := b.effect(tx.WithTx(ctx), key.Key); err != nil {
					return err
				}
				if err := tx.InboxComplete(ctx, key, []byte("r")); err != nil {
					return err
				}
				return tx.Commit(ctx)
			}()
			if err != nil {
				mu.Lock()
				errs = append(errs, err)
				mu.Unlock()
			}
		}()
	}
	close(start)
	wg.Wait()
	require.Empty(t, errs)
	require.Equal(t, 1, b.effects(t, key.Key))
	require.Equal(t, 1, states[dedup.StateNew])
	require.Equal(t, n-1, states[dedup.StateDone])
	for _, r := range results {
		require.Equal(t, []byte("r"), r, "every duplicate sees the stored result")
	}
}

// TestStartCountsCrashedAttempts: an attempt whose session dies mid-handler
// (the process was killed: the server rolls its transaction back) stays
// counted, so that a crash loop is seen; a shut-down attempt is taken
// back; the commit forgets the count.
func TestStartCountsCrashedAttempts(t *testing.T) {
	t.Parallel()
	each(t, 4, func(t *testing.T, b backend) {
		ctx := context.Background()
		key := dedup.Key{Consumer: "billing", Key: "order-crash"}
		for i := 1; i <= 3; i++ {
			start, err := b.store.InboxStart(ctx, key, time.Hour)
			require.NoError(t, err)
			require.Equal(t, dedup.StateNew, start.State)
			require.Equal(t, i, start.Attempts, "every attempt that started and did not finish")
			tx, err := b.store.InboxBegin(ctx)
			require.NoError(t, err)
			c, err := tx.InboxClaim(ctx, key, time.Hour)
			require.NoError(t, err)
			require.Equal(t, dedup.StateNew, c.State)
			hctx := tx.WithTx(ctx)
			require.NoError(t, b.effect(hctx, key.Key))
			var id int64
			require.NoError(t, sqlstore.Tx(hctx).QueryRowContext(hctx, b.sessionID).Scan(&id))
			b.kill(t, id) // the process dies here
			_ = tx.Rollback(ctx)
		}
		require.Equal(t, 3, b.starts(t, key))
		require.Zero(t, b.effects(t, key.Key), "no crashed attempt committed")

		start, err := b.store.InboxStart(ctx, key, time.Hour)
		require.NoError(t, err)
		require.Equal(t, 4, start.Attempts)
		require.NoError(t, b.store.InboxUnstart(ctx, key), "a shutdown takes its count back")
		require.Equal(t, 3, b.starts(t, key))

		require.Equal(t, dedup.StateNew, b.apply(t, key, nil))
		require.Zero(t, b.starts(t, key))
		require.Equal(t, 1, b.effects(t, key.Key))
	})
}

// TestDeadKeyAndReplayGrant: a buried key answers dead until the replay
// that carries its grant reopens it, once, with its counts reset.
func TestDeadKeyAndReplayGrant(t *testing.T) {
	t.Parallel()
	each(t, 4, func(t *testing.T, b backend) {
		ctx := context.Background()
		key := dedup.Key{Consumer: "billing", Key: "order-dead"}
		require.NoError(t, b.store.InboxFail(ctx, key, dedup.Failure{Err: "declined", At: time.Now()}, time.Hour))
		_, err := b.store.InboxStart(ctx, key, time.Hour)
		require.NoError(t, err)

		ok, err := b.store.InboxGrantReplay(ctx, key, "g0")
		require.NoError(t, err)
		require.False(t, ok, "no grant on a key that is not dead")
		_, err = b.store.InboxGrantReplay(ctx, key, "")
		require.ErrorIs(t, err, dedup.ErrNoGrant)

		tx, err := b.store.InboxBegin(ctx)
		require.NoError(t, err)
		c, err := tx.InboxClaim(ctx, key, time.Hour)
		require.NoError(t, err)
		require.Equal(t, dedup.StateNew, c.State)
		require.Equal(t, 2, c.Attempts)
		require.False(t, c.FirstFailedAt.IsZero())
		require.NoError(t, tx.InboxBury(ctx, key, dedup.Failure{Err: "gave up", At: time.Now()}))
		require.NoError(t, tx.Commit(ctx))

		r, _ := b.row(t, key)
		require.Equal(t, "dead", r.status)
		require.Equal(t, 1, r.attempts, "the burying claim is not an attempt")
		require.Equal(t, "declined", r.firstErr.String)
		require.Equal(t, "gave up", r.lastErr.String)

		start, err := b.store.InboxStart(ctx, key, time.Hour)
		require.NoError(t, err)
		require.Equal(t, dedup.StateDead, start.State)
		tx, err = b.store.InboxBegin(ctx)
		require.NoError(t, err)
		c, err = tx.InboxClaim(ctx, key, time.Hour)
		require.NoError(t, err)
		require.NoError(t, tx.Rollback(ctx))
		require.Equal(t, dedup.StateDead, c.State)
		require.NoError(t, b.store.InboxFail(ctx, key, dedup.Failure{Err: "late", At: time.Now()}, time.Hour))
		require.NoError(t, b.store.InboxDeadCopy(ctx, key))
		r, _ = b.row(t, key)
		require.Equal(t, "dead", r.status, "a failure report never revives a dead key")
		require.Equal(t, 1, r.deadCopies)

		ok, err = b.store.InboxReopen(ctx, key, "forged")
		require.NoError(t, err)
		require.False(t, ok, "no grant, no reopen")
		ok, err = b.store.InboxGrantReplay(ctx, key, "g1")
		require.NoError(t, err)
		require.True(t, ok)
		ok, err = b.store.InboxReplayGranted(ctx, key, "g1")
		require.NoError(t, err)
		require.True(t, ok)
		ok, err = b.store.InboxReplayGranted(ctx, key, "G1")
		require.NoError(t, err)
		require.False(t, ok, "grants compare exactly")
		ok, err = b.store.InboxReopen(ctx, key, "g1")
		require.NoError(t, err)
		require.True(t, ok)
		ok, err = b.store.InboxReopen(ctx, key, "g1")
		require.NoError(t, err)
		require.False(t, ok, "a grant reopens once")
		require.Zero(t, b.starts(t, key), "the reopened key's started attempts are forgotten")

		start, err = b.store.InboxStart(ctx, key, time.Hour)
		require.NoError(t, err)
		require.Equal(t, dedup.Claim{State: dedup.StateNew, Attempts: 1}, start)
		tx, err = b.store.InboxBegin(ctx)
		require.NoError(t, err)
		c, err = tx.InboxClaim(ctx, key, time.Hour)
		require.NoError(t, err)
		require.Equal(t, dedup.StateNew, c.State)
		require.Equal(t, 1, c.Attempts, "counts reset")
		require.NoError(t, tx.Commit(ctx))
	})
}

func TestPeekAndRecordsAndDoneKeys(t *testing.T) {
	t.Parallel()
	each(t, 4, func(t *testing.T, b backend) {
		ctx := context.Background()
		done := dedup.Key{Consumer: "billing", Key: "done"}
		failed := dedup.Key{Consumer: "billing", Key: "failed"}
		unknown := dedup.Key{Consumer: "billing", Key: "unknown"}
		require.Equal(t, dedup.StateNew, b.apply(t, done, []byte("res")))
		require.Equal(t, dedup.StateNew, b.apply(t, dedup.Key{Consumer: "other", Key: "x"}, nil))
		require.NoError(t, b.store.InboxFail(ctx, failed, dedup.Failure{Err: "e", At: time.Now()}, time.Hour))

		c, err := b.store.InboxPeek(ctx, done)
		require.NoError(t, err)
		require.Equal(t, dedup.StateDone, c.State)
		require.Equal(t, []byte("res"), c.Result)
		c, err = b.store.InboxPeek(ctx, failed)
		require.NoError(t, err)
		require.Equal(t, dedup.StateNew, c.State)
		require.Equal(t, 1, c.Attempts)
		c, err = b.store.InboxPeek(ctx, unknown)
		require.NoError(t, err)
		require.Equal(t, dedup.Claim{State: dedup.StateNew}, c)

		for k, want := range map[dedup.Key]bool{done: true, failed: true, unknown: false} {
			ok, err := b.store.InboxHasRecord(ctx, k)
			require.NoError(t, err)
			require.Equal(t, want, ok, k.Key)
		}

		var keys []string
		require.NoError(t, b.store.InboxDoneKeys(ctx, "billing", time.Now().Add(-time.Hour), func(k string) error {
			keys = append(keys, k)
			return nil
		}))
		require.Equal(t, []string{"done"}, keys)
		keys = nil
		require.NoError(t, b.store.InboxDoneKeys(ctx, "billing", time.Now().Add(time.Hour), func(k string) error {
			keys = append(keys, k)
			return nil
		}))
		require.Empty(t, keys)
	})
}

func TestDeleteExpiredInBatches(t *testing.T) {
	t.Parallel()
	each(t, 4, func(t *testing.T, b backend) {
		ctx := context.Background()
		for i := 0; i < 40; i++ {
			window := time.Hour
			if i < 35 {
				window = time.Millisecond // expired by the time we sweep
			}
			key := dedup.Key{Consumer: "c", Key: string(rune('A' + i))}
			_, err := b.store.InboxStart(ctx, key, window)
			require.NoError(t, err)
			require.NoError(t, b.store.InboxFail(ctx, key, dedup.Failure{Err: "e", At: time.Now()}, window))
		}
		// Wait until the database clock has passed the short windows.
		var n int
		require.Eventually(t, func() bool {
			c, err := b.store.InboxPeek(ctx, dedup.Key{Consumer: "c", Key: "A"})
			require.NoError(t, err)
			return c.Attempts == 0
		}, 5*time.Second, 10*time.Millisecond)

		// A record another transaction holds is skipped, not waited for.
		held := dedup.Key{Consumer: "c", Key: "A"}
		tx, err := b.store.InboxBegin(ctx)
		require.NoError(t, err)
		t.Cleanup(func() { _ = tx.Rollback(ctx) }) // a no-op once rolled back
		_, err = tx.InboxClaim(ctx, held, time.Hour)
		require.NoError(t, err)

		var batches []int
		for {
			d, err := b.store.InboxDeleteExpired(ctx, 10)
			require.NoError(t, err)
			batches = append(batches, d)
			if d < 10 {
				break
			}
		}
		require.Equal(t, []int{10, 10, 10, 4}, batches)
		require.NoError(t, tx.Rollback(ctx))
		d, err := dedup.Sweep(ctx, b.store, 10)
		require.NoError(t, err)
		require.Equal(t, 1, d, "the held record, once free")
		require.NoError(t, b.db.QueryRowContext(ctx, `SELECT COUNT(*) FROM `+b.names.Inbox).Scan(&n))
		require.Equal(t, 5, n, "live keys stay")
		require.NoError(t, b.db.QueryRowContext(ctx, `SELECT COUNT(*) FROM `+b.names.InboxStarts).Scan(&n))
		require.Equal(t, 5, n, "expired start counts go too")

		_, err = b.store.InboxDeleteExpired(ctx, 0)
		require.ErrorContains(t, err, "limit must be positive")
	})
}
