package postgres_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/oncemill/oncemill/dedup"
	"github.com/oncemill/oncemill/dedup/postgres"
	"github.com/oncemill/oncemill/internal/testing/pgtest"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

type bundle struct {
	pool   *pgxpool.Pool
	store  *postgres.Store
	schema string
}

func setup(t *testing.T, maxConns int32) bundle {
	t.Helper()
	pool := pgtest.Pool(t, maxConns)
	schema := pgtest.Schema(t, pool)
	store, err := postgres.New(pool, postgres.Config{Schema: schema})
	require.NoError(t, err)
	return bundle{pool: pool, store: store, schema: schema}
}

type row struct {
	status             string
	attempts           int
	firstErr, lastErr  *string
	result             []byte
	expiresInFutureSec float64
}

func (b bundle) row(t *testing.T, key dedup.Key) (row, bool) {
	t.Helper()
	var r row
	err := b.pool.QueryRow(context.Background(), `SELECT i.status, COALESCE(f.attempts, CASE WHEN i.status = 'done' THEN 1 ELSE 0 END), f.first_error, f.last_error, i.result,
		extract(epoch FROM i.expires_at - now())::float8
		FROM "`+b.schema+`".inbox i LEFT JOIN "`+b.schema+`".inbox_failures f USING (consumer, key)
		WHERE consumer = $1 AND key = $2`, key.Consumer, key.Key).
		Scan(&r.status, &r.attempts, &r.firstErr, &r.lastErr, &r.result, &r.expiresInFutureSec)
	if err != nil {
		if errors.Is(err, context.Canceled) {
			t.Fatal(err)
		}
		return row{}, false
	}
	return r, true
}

func (b bundle) effects(t *testing.T) int {
	t.Helper()
	var n int
	require.NoError(t, b.pool.QueryRow(context.Background(), `SELECT count(*) FROM "`+b.schema+`".effects`).Scan(&n))
	return n
}

func (b bundle) createEffects(t *testing.T) {
	t.Helper()
	_, err := b.pool.Exec(context.Background(), `CREATE TABLE "`+b.schema+`".effects (key text NOT NULL)`)
	require.NoError(t, err)
}

func TestConfigValidate(t *testing.T) {
	t.Parallel()
	_, err := postgres.New(nil, postgres.Config{})
	require.ErrorContains(t, err, "db is nil")

	pool := pgtest.Pool(t, 1)
	_, err = postgres.New(pool, postgres.Config{InboxTable: `inbox"; DROP TABLE x; --`})
	require.ErrorContains(t, err, "InboxTable")
	_, err = postgres.New(pool, postgres.Config{Schema: "Bad-Schema"})
	require.ErrorContains(t, err, "Schema")
}

func TestNotMigratedHint(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t, 2)
	store, err := postgres.New(pool, postgres.Config{Schema: pgtest.Name(t)})
	require.NoError(t, err)
	_, err = store.LeaseClaim(context.Background(), dedup.Key{Consumer: "c", Key: "k"}, time.Second, time.Hour)
	require.ErrorIs(t, err, postgres.ErrNotMigrated)
}

func TestClaimCommitThenDuplicate(t *testing.T) {
	t.Parallel()
	b := setup(t, 4)
	ctx := context.Background()
	key := dedup.Key{Consumer: "billing", Key: "order-1"}

	tx, err := b.store.InboxBegin(ctx)
	require.NoError(t, err)
	c, err := tx.InboxClaim(ctx, key, time.Hour)
	require.NoError(t, err)
	require.Equal(t, dedup.StateNew, c.State)
	require.Equal(t, 1, c.Attempts)
	require.NoError(t, tx.InboxComplete(ctx, key, []byte("stored")))
	require.NoError(t, tx.Commit(ctx))
	require.NoError(t, tx.Rollback(ctx), "rollback after commit is a no-op")

	tx, err = b.store.InboxBegin(ctx)
	require.NoError(t, err)
	c, err = tx.InboxClaim(ctx, key, time.Hour)
	require.NoError(t, err)
	require.NoError(t, tx.Rollback(ctx))
	require.Equal(t, dedup.StateDone, c.State)
	require.Equal(t, []byte("stored"), c.Result)

	// Another consumer of the same key keeps its own record.
	tx, err = b.store.InboxBegin(ctx)
	require.NoError(t, err)
	c, err = tx.InboxClaim(ctx, dedup.Key{Consumer: "shipping", Key: "order-1"}, time.Hour)
	require.NoError(t, err)
	require.NoError(t, tx.Rollback(ctx))
	require.Equal(t, dedup.StateNew, c.State)

	r, ok := b.row(t, key)
	require.True(t, ok)
	require.Equal(t, "done", r.status)
	require.InDelta(t, time.Hour.Seconds(), r.expiresInFutureSec, 60)
}

func TestRollbackLeavesNothingAndFailureIsRecorded(t *testing.T) {
	t.Parallel()
	b := setup(t, 4)
	ctx := context.Background()
	key := dedup.Key{Consumer: "billing", Key: "order-2"}

	firstAt := time.Now().Add(-time.Minute).Truncate(time.Microsecond)
	for i, msg := range []string{"first boom", "second boom"} {
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
		require.NoError(t, tx.Rollback(ctx))
		require.NoError(t, b.store.InboxFail(ctx, key, dedup.Failure{Err: msg, At: firstAt.Add(time.Duration(i) * time.Second)}, time.Hour))
	}
	r, ok := b.row(t, key)
	require.True(t, ok)
	require.Equal(t, "failed", r.status)
	require.Equal(t, 2, r.attempts)
	require.Equal(t, "first boom", *r.firstErr)
	require.Equal(t, "second boom", *r.lastErr)

	tx, err := b.store.InboxBegin(ctx)
	require.NoError(t, err)
	c, err := tx.InboxClaim(ctx, key, time.Hour)
	require.NoError(t, err)
	require.Equal(t, dedup.StateNew, c.State)
	require.Equal(t, 3, c.Attempts)
	require.NoError(t, tx.Commit(ctx))

	// A late failure report never reopens a done key.
	require.NoError(t, b.store.InboxFail(ctx, key, dedup.Failure{Err: "late", At: time.Now()}, time.Hour))
	r, _ = b.row(t, key)
	require.Equal(t, "done", r.status)
	require.Equal(t, 3, r.attempts)
	require.Equal(t, "second boom", *r.lastErr)
}

func TestConcurrentClaimsApplyOnce(t *testing.T) {
	t.Parallel()
	// One after the other: each holds 50 connections.
	t.Run("new key", func(t *testing.T) { testConcurrentClaims(t, false) })
	// A key whose earlier attempt failed is taken by an UPDATE of its
	// row instead of the INSERT: still one winner.
	t.Run("failed key", func(t *testing.T) { testConcurrentClaims(t, true) })
}

func testConcurrentClaims(t *testing.T, failedBefore bool) {
	b := setup(t, 52)
	b.createEffects(t)
	ctx := context.Background()
	key := dedup.Key{Consumer: "billing", Key: "order-hot"}
	if failedBefore {
		require.NoError(t, b.store.InboxFail(ctx, key, dedup.Failure{Err: "timeout", At: time.Now()}, time.Hour))
	}

	const n = 50
	var (
		wg              sync.WaitGroup
		start           = make(chan struct{})
		mu              sync.Mutex
		states          = map[dedup.State]int{}
		errs            []error
		resultsReturned [][]byte
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
				defer tx.Rollback(ctx) //nolint:errcheck // no-op after commit
				c, err := tx.InboxClaim(ctx, key, time.Hour)
				if err != nil {
					return err
				}
				mu.Lock()
				states[c.State]++
				if c.State == dedup.StateDone {
					resultsReturned = append(resultsReturned, c.Result)
				}
				mu.Unlock()
				if c.State != dedup.StateNew {
					return nil
				}
				if _, err := postgres.Tx(tx.WithTx(ctx)).Exec(ctx, `INSERT INTO "`+b.schema+`".effects (key) VALUES ($1)`, key.Key); err != nil {
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
	require.Equal(t, 1, b.effects(t))
	require.Equal(t, 1, states[dedup.StateNew])
	require.Equal(t, n-1, states[dedup.StateDone])
	for _, r := range resultsReturned {
		require.Equal(t, []byte("r"), r, "every duplicate sees the stored result")
	}
}

func TestLease(t *testing.T) {
	t.Parallel()
	b := setup(t, 4)
	ctx := context.Background()
	key := dedup.Key{Consumer: "mailer", Key: "welcome-7"}

	first, err := b.store.LeaseClaim(ctx, key, time.Hour, time.Hour)
	require.NoError(t, err)
	require.Equal(t, dedup.StateNew, first.State)
	require.NotZero(t, first.Token)
	require.WithinDuration(t, time.Now().Add(time.Hour), first.Until, time.Minute)

	// A duplicate while the lease is live is in flight, never new.
	dup, err := b.store.LeaseClaim(ctx, key, time.Hour, time.Hour)
	require.NoError(t, err)
	require.Equal(t, dedup.StateInFlight, dup.State)
	require.Equal(t, first.Until.Unix(), dup.Until.Unix())

	// Release frees the key at once; the next claim gets a new token.
	require.NoError(t, b.store.LeaseRelease(ctx, key, first.Token, dedup.Failure{Err: "smtp down", At: time.Now()}))
	second, err := b.store.LeaseClaim(ctx, key, time.Hour, time.Hour)
	require.NoError(t, err)
	require.Equal(t, dedup.StateNew, second.State)
	require.Equal(t, 2, second.Attempts)
	require.Greater(t, second.Token, first.Token)

	// The old token can neither release nor complete.
	require.ErrorIs(t, b.store.LeaseRelease(ctx, key, first.Token, dedup.Failure{Err: "x", At: time.Now()}), dedup.ErrLeaseLost)
	require.ErrorIs(t, b.store.LeaseComplete(ctx, key, first.Token, []byte("zombie")), dedup.ErrLeaseLost)

	require.NoError(t, b.store.LeaseComplete(ctx, key, second.Token, []byte("sent")))
	done, err := b.store.LeaseClaim(ctx, key, time.Hour, time.Hour)
	require.NoError(t, err)
	require.Equal(t, dedup.StateDone, done.State)
	require.Equal(t, []byte("sent"), done.Result)
	require.ErrorIs(t, b.store.LeaseComplete(ctx, key, second.Token, []byte("again")), dedup.ErrLeaseLost, "a done key cannot be completed twice")

	r, _ := b.row(t, key)
	require.Equal(t, "smtp down", *r.firstErr)
}

func TestLeaseExpiredIsTakenOverAndZombieIsFenced(t *testing.T) {
	t.Parallel()
	b := setup(t, 4)
	ctx := context.Background()
	key := dedup.Key{Consumer: "payments", Key: "charge-9"}

	zombie, err := b.store.LeaseClaim(ctx, key, 50*time.Millisecond, time.Hour)
	require.NoError(t, err)
	require.Equal(t, dedup.StateNew, zombie.State)

	// Wait until the database clock has passed the lease end.
	var taker dedup.Claim
	require.Eventually(t, func() bool {
		taker, err = b.store.LeaseClaim(ctx, key, time.Hour, time.Hour)
		require.NoError(t, err)
		return taker.State == dedup.StateNew
	}, 5*time.Second, 20*time.Millisecond)
	require.Greater(t, taker.Token, zombie.Token)

	require.ErrorIs(t, b.store.LeaseComplete(ctx, key, zombie.Token, []byte("zombie")), dedup.ErrLeaseLost)
	require.NoError(t, b.store.LeaseComplete(ctx, key, taker.Token, []byte("taker")))
	r, _ := b.row(t, key)
	require.Equal(t, []byte("taker"), r.result)
	require.Equal(t, "done", r.status)
}

func TestConcurrentLeaseClaimsOneWinner(t *testing.T) {
	t.Parallel()
	b := setup(t, 20)
	ctx := context.Background()
	key := dedup.Key{Consumer: "mailer", Key: "burst"}
	var (
		wg    sync.WaitGroup
		mu    sync.Mutex
		count = map[dedup.State]int{}
		start = make(chan struct{})
	)
	for i := 0; i < 20; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			c, err := b.store.LeaseClaim(ctx, key, time.Hour, time.Hour)
			if !assertNoError(t, err) {
				return
			}
			mu.Lock()
			count[c.State]++
			mu.Unlock()
		}()
	}
	close(start)
	wg.Wait()
	require.Equal(t, 1, count[dedup.StateNew])
	require.Equal(t, 19, count[dedup.StateInFlight])
}

func assertNoError(t *testing.T, err error) bool {
	t.Helper()
	if err != nil {
		t.Error(err)
		return false
	}
	return true
}

func TestDeleteExpiredInBatches(t *testing.T) {
	t.Parallel()
	b := setup(t, 4)
	ctx := context.Background()
	for i := 0; i < 40; i++ {
		window := time.Hour
		if i < 35 {
			window = time.Millisecond // expired by the time we sweep
		}
		_, err := b.store.LeaseClaim(ctx, dedup.Key{Consumer: "c", Key: string(rune('A' + i))}, time.Second, window)
		require.NoError(t, err)
	}
	var n int
	require.Eventually(t, func() bool {
		require.NoError(t, b.pool.QueryRow(ctx, `SELECT count(*) FROM "`+b.schema+`".inbox WHERE expires_at < now()`).Scan(&n))
		return n == 35
	}, 5*time.Second, 10*time.Millisecond)

	var batches []int
	for {
		d, err := b.store.InboxDeleteExpired(ctx, 10)
		require.NoError(t, err)
		batches = append(batches, d)
		if d < 10 {
			break
		}
	}
	require.Equal(t, []int{10, 10, 10, 5}, batches)
	require.NoError(t, b.pool.QueryRow(ctx, `SELECT count(*) FROM "`+b.schema+`".inbox`).Scan(&n))
	require.Equal(t, 5, n, "live keys stay")

	_, err := b.store.InboxDeleteExpired(ctx, 0)
	require.ErrorContains(t, err, "limit must be positive")
}

func TestSweepAndJanitor(t *testing.T) {
	t.Parallel()
	b := setup(t, 4)
	ctx := context.Background()
	for i := 0; i < 25; i++ {
		_, err := b.store.LeaseClaim(ctx, dedup.Key{Consumer: "c", Key: string(rune('a' + i))}, time.Second, time.Millisecond)
		require.NoError(t, err)
	}
	_, err := b.store.LeaseClaim(ctx, dedup.Key{Consumer: "c", Key: "live"}, time.Second, time.Hour)
	require.NoError(t, err)

	count := func() int {
		var n int
		require.NoError(t, b.pool.QueryRow(ctx, `SELECT count(*) FROM "`+b.schema+`".inbox`).Scan(&n))
		return n
	}
	j, err := dedup.NewJanitor(b.store, dedup.JanitorConfig{Interval: 5 * time.Millisecond, BatchSize: 7})
	require.NoError(t, err)
	require.Eventually(t, func() bool { return count() == 1 }, 10*time.Second, 10*time.Millisecond)
	require.NoError(t, j.Close())
	require.NoError(t, j.Close(), "Close twice is safe")

	_, err = dedup.NewJanitor(b.store, dedup.JanitorConfig{BatchSize: -1})
	require.ErrorContains(t, err, "BatchSize")
}
