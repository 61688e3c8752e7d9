package postgres_test

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/dedup"
	"github.com/oncemill/oncemill/dedup/dedupdriver"
	"github.com/oncemill/oncemill/dedup/postgres"
	"github.com/oncemill/oncemill/internal/testing/pgtest"
)

// startRows reads the key's start count, from another connection.
func (b bundle) started(t *testing.T, key dedup.Key) int {
	t.Helper()
	var n int
	err := b.pool.QueryRow(context.Background(), `SELECT COALESCE(sum(started), 0) FROM "`+b.schema+`".inbox_starts
		WHERE consumer = $1 AND key = $2`, key.Consumer, key.Key).Scan(&n)
	require.NoError(t, err)
	return n
}

func requireIdle(t *testing.T, pool *pgxpool.Pool) {
	t.Helper()
	require.Eventually(t, func() bool { return pool.Stat().AcquiredConns() == 0 }, 2*time.Second, 5*time.Millisecond,
		"every connection back in the pool")
}

func TestStartClaimNewKeyStartDurableBeforeCommit(t *testing.T) {
	t.Parallel()
	b := setup(t, 4)
	b.createEffects(t)
	ctx := context.Background()
	key := dedup.Key{Consumer: "billing", Key: "order-1"}

	start, tx, claim, err := b.store.InboxStartClaim(ctx, key, time.Hour)
	require.NoError(t, err)
	require.Equal(t, dedup.StateNew, start.State)
	require.Equal(t, 1, start.Attempts)
	require.NotNil(t, tx)
	require.Equal(t, dedup.StateNew, claim.State)
	require.Equal(t, 1, claim.Attempts)

	// The start committed on its own: another connection sees it while
	// the transaction is open; the claim it does not see.
	require.Equal(t, 1, b.started(t, key))
	_, ok := b.row(t, key)
	require.False(t, ok, "the claim is not visible before the commit")

	htx := postgres.Tx(tx.WithTx(ctx))
	require.NotNil(t, htx)
	_, err = htx.Exec(ctx, `INSERT INTO "`+b.schema+`".effects (key) VALUES ($1)`, key.Key)
	require.NoError(t, err)
	require.Equal(t, 0, b.effects(t))
	require.NoError(t, tx.InboxComplete(ctx, key, []byte("stored")))
	require.NoError(t, tx.Commit(ctx))
	require.NoError(t, tx.Rollback(ctx), "rollback after commit is a no-op")

	require.Equal(t, 1, b.effects(t))
	r, ok := b.row(t, key)
	require.True(t, ok)
	require.Equal(t, "done", r.status)
	require.Equal(t, 0, b.started(t, key), "the commit deletes the start count")
	requireIdle(t, b.pool)

	// A duplicate: answered by the start, nothing held.
	start, tx, claim, err = b.store.InboxStartClaim(ctx, key, time.Hour)
	require.NoError(t, err)
	require.Equal(t, dedup.StateDone, start.State)
	require.Equal(t, []byte("stored"), start.Result)
	require.Nil(t, tx)
	require.Equal(t, dedup.Claim{}, claim)
	require.Equal(t, 0, b.started(t, key))
	requireIdle(t, b.pool)
	requireHealthy(t, b)
}

// requireHealthy checks that every pooled connection is idle and usable.
func requireHealthy(t *testing.T, b bundle) {
	t.Helper()
	requireIdle(t, b.pool)
	for _, c := range b.pool.AcquireAllIdle(context.Background()) {
		require.Equal(t, byte('I'), c.Conn().PgConn().TxStatus())
		var one int
		require.NoError(t, c.Conn().QueryRow(context.Background(), "SELECT 1").Scan(&one))
		c.Release()
	}
}

func TestStartClaimDeadKey(t *testing.T) {
	t.Parallel()
	b := setup(t, 4)
	ctx := context.Background()
	key := dedup.Key{Consumer: "billing", Key: "poison"}

	_, tx, _, err := b.store.InboxStartClaim(ctx, key, time.Hour)
	require.NoError(t, err)
	require.NoError(t, tx.InboxBury(ctx, key, dedup.Failure{Err: "boom", At: time.Now()}))
	require.NoError(t, tx.Commit(ctx))

	start, tx, _, err := b.store.InboxStartClaim(ctx, key, time.Hour)
	require.NoError(t, err)
	require.Equal(t, dedup.StateDead, start.State)
	require.Nil(t, start.Result)
	require.Nil(t, tx)
	requireHealthy(t, b)
}

func TestStartClaimRollbackKeepsCountAndFailedKeyIsReclaimed(t *testing.T) {
	t.Parallel()
	b := setup(t, 4)
	ctx := context.Background()
	key := dedup.Key{Consumer: "billing", Key: "order-2"}

	start, tx, _, err := b.store.InboxStartClaim(ctx, key, time.Hour)
	require.NoError(t, err)
	require.Equal(t, 1, start.Attempts)
	require.NoError(t, tx.Rollback(ctx))
	require.NoError(t, tx.Rollback(ctx), "a second rollback is a no-op")
	require.Equal(t, 1, b.started(t, key), "a rolled-back attempt stays counted")
	require.NoError(t, b.store.InboxFail(ctx, key, dedup.Failure{Err: "boom", At: time.Now()}, time.Hour))

	// The failed key: the claim finds it failed and takes it again.
	start, tx, claim, err := b.store.InboxStartClaim(ctx, key, time.Hour)
	require.NoError(t, err)
	require.Equal(t, dedup.StateNew, start.State)
	require.Equal(t, 2, start.Attempts)
	require.Equal(t, dedup.StateNew, claim.State)
	require.Equal(t, 2, claim.Attempts)
	require.False(t, claim.FirstFailedAt.IsZero())
	require.NoError(t, tx.Commit(ctx))
	r, ok := b.row(t, key)
	require.True(t, ok)
	require.Equal(t, "done", r.status)
	requireHealthy(t, b)
}

func TestStartClaimConcurrentClaimers(t *testing.T) {
	t.Parallel()
	b := setup(t, 8)
	ctx := context.Background()
	key := dedup.Key{Consumer: "billing", Key: "race"}

	// The first holds the key; the second's claim waits on it, then finds
	// the key done (the re-read path) in its own transaction.
	_, tx1, c1, err := b.store.InboxStartClaim(ctx, key, time.Hour)
	require.NoError(t, err)
	require.Equal(t, dedup.StateNew, c1.State)

	type answer struct {
		start, claim dedup.Claim
		tx           dedup.InboxTx
		err          error
	}
	done := make(chan answer, 1)
	go func() {
		s, tx, c, err := b.store.InboxStartClaim(ctx, key, time.Hour)
		done <- answer{s, c, tx, err}
	}()
	// Its start waits on the start row the first one's claim deleted:
	// the first commits only once the server shows it waiting on a lock.
	require.Eventually(t, func() bool {
		var waiting int
		require.NoError(t, b.pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity
			WHERE wait_event_type = 'Lock' AND position($1 IN query) > 0`, `"`+b.schema+`"`).Scan(&waiting))
		return waiting > 0
	}, 30*time.Second, 5*time.Millisecond, "the second start waits on the first claim")
	require.NoError(t, tx1.InboxComplete(ctx, key, []byte("first")))
	require.NoError(t, tx1.Commit(ctx))

	a := <-done
	require.NoError(t, a.err)
	require.Equal(t, dedup.StateNew, a.start.State, "it started before the first committed")
	require.Equal(t, dedup.StateDone, a.claim.State)
	require.Equal(t, []byte("first"), a.claim.Result)
	require.NoError(t, a.tx.Rollback(ctx))
	requireHealthy(t, b)

	// Many at once: exactly one commits a new claim.
	key = dedup.Key{Consumer: "billing", Key: "crowd"}
	var (
		wg    sync.WaitGroup
		wins  atomic.Int32
		dupes atomic.Int32
	)
	for range 6 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			s, tx, c, err := b.store.InboxStartClaim(ctx, key, time.Hour)
			if err != nil {
				t.Error(err)
				return
			}
			if tx == nil {
				dupes.Add(1)
				return
			}
			if c.State == dedup.StateNew {
				wins.Add(1)
				if err := tx.Commit(ctx); err != nil {
					t.Error(err)
				}
				return
			}
			_ = s
			dupes.Add(1)
			_ = tx.Rollback(ctx)
		}()
	}
	wg.Wait()
	require.Equal(t, int32(1), wins.Load())
	require.Equal(t, int32(5), dupes.Load())
	requireHealthy(t, b)
}

func TestStartClaimConflictAndErrors(t *testing.T) {
	t.Parallel()
	b := setup(t, 4)
	ctx := context.Background()

	// A deadlock between two handler transactions: one of them gets an
	// error that wraps ErrConflict once it goes through InboxClassify,
	// and the loser's connection comes back healthy.
	b.createEffects(t)
	_, err := b.pool.Exec(ctx, `INSERT INTO "`+b.schema+`".effects (key) VALUES ('a'), ('b')`)
	require.NoError(t, err)
	_, tx1, _, err := b.store.InboxStartClaim(ctx, dedup.Key{Consumer: "c", Key: "1"}, time.Hour)
	require.NoError(t, err)
	_, tx2, _, err := b.store.InboxStartClaim(ctx, dedup.Key{Consumer: "c", Key: "2"}, time.Hour)
	require.NoError(t, err)
	h1, h2 := postgres.Tx(tx1.WithTx(ctx)), postgres.Tx(tx2.WithTx(ctx))
	upd := `UPDATE "` + b.schema + `".effects SET key = key WHERE key = $1`
	_, err = h1.Exec(ctx, upd, "a")
	require.NoError(t, err)
	_, err = h2.Exec(ctx, upd, "b")
	require.NoError(t, err)
	errs := make(chan error, 2)
	go func() { _, err := h1.Exec(ctx, upd, "b"); errs <- err }()
	go func() { _, err := h2.Exec(ctx, upd, "a"); errs <- err }()
	e1, e2 := <-errs, <-errs
	if e1 == nil {
		e1, e2 = e2, e1
	}
	require.NoError(t, e2, "one of them goes on")
	require.ErrorIs(t, tx1.(dedupdriver.Classifier).InboxClassify(e1), dedup.ErrConflict, "the other is a conflict")
	require.NoError(t, tx1.Rollback(ctx))
	require.NoError(t, tx2.Rollback(ctx))
	requireHealthy(t, b)

	// A missing table: the start fails, not counted, with the hint.
	store, err := postgres.New(b.pool, postgres.Config{Schema: b.schema, InboxTable: "missing"})
	require.NoError(t, err)
	start, tx, _, err := store.InboxStartClaim(ctx, dedup.Key{Consumer: "c", Key: "k"}, time.Hour)
	require.ErrorIs(t, err, postgres.ErrNotMigrated)
	require.Zero(t, start.Attempts)
	require.Nil(t, tx)
	requireHealthy(t, b)

	// A canceled context: nothing sent.
	cctx, cancel := context.WithCancel(ctx)
	cancel()
	_, tx, _, err = b.store.InboxStartClaim(cctx, dedup.Key{Consumer: "c", Key: "k"}, time.Hour)
	require.ErrorIs(t, err, context.Canceled)
	require.Nil(t, tx)
	requireIdle(t, b.pool)
}

func TestStartClaimHandlerTxSemantics(t *testing.T) {
	t.Parallel()
	b := setup(t, 4)
	b.createEffects(t)
	ctx := context.Background()
	ins := `INSERT INTO "` + b.schema + `".effects (key) VALUES ($1)`

	_, tx, _, err := b.store.InboxStartClaim(ctx, dedup.Key{Consumer: "c", Key: "nested"}, time.Hour)
	require.NoError(t, err)
	h := postgres.Tx(tx.WithTx(ctx))

	// Nested transactions are savepoints.
	sp, err := h.Begin(ctx)
	require.NoError(t, err)
	_, err = sp.Exec(ctx, ins, "undone")
	require.NoError(t, err)
	require.NoError(t, sp.Rollback(ctx))
	require.ErrorIs(t, sp.Rollback(ctx), pgx.ErrTxClosed)
	sp, err = h.Begin(ctx)
	require.NoError(t, err)
	sp2, err := sp.Begin(ctx)
	require.NoError(t, err)
	_, err = sp2.Exec(ctx, ins, "kept")
	require.NoError(t, err)
	require.NoError(t, sp2.Commit(ctx))
	require.NoError(t, sp.Commit(ctx))

	// Query, QueryRow, SendBatch, CopyFrom, Prepare, Conn.
	var n int
	require.NoError(t, h.QueryRow(ctx, `SELECT count(*) FROM "`+b.schema+`".effects`).Scan(&n))
	require.Equal(t, 1, n)
	rows, err := h.Query(ctx, `SELECT key FROM "`+b.schema+`".effects`)
	require.NoError(t, err)
	keys, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	require.Equal(t, []string{"kept"}, keys)
	batch := &pgx.Batch{}
	batch.Queue(ins, "batched")
	require.NoError(t, h.SendBatch(ctx, batch).Close())
	copied, err := h.CopyFrom(ctx, pgx.Identifier{b.schema, "effects"}, []string{"key"}, pgx.CopyFromRows([][]any{{"copied"}}))
	require.NoError(t, err)
	require.EqualValues(t, 1, copied)
	_, err = h.Prepare(ctx, "count_effects", `SELECT count(*) FROM "`+b.schema+`".effects`)
	require.NoError(t, err)
	require.NoError(t, h.QueryRow(ctx, "count_effects").Scan(&n))
	require.Equal(t, 3, n)
	require.Equal(t, byte('T'), h.Conn().PgConn().TxStatus())

	require.NoError(t, tx.Commit(ctx))
	require.Equal(t, 3, b.effects(t))
	_, err = h.Exec(ctx, ins, "late")
	require.ErrorIs(t, err, pgx.ErrTxClosed)
	_, err = h.Query(ctx, "SELECT 1")
	require.ErrorIs(t, err, pgx.ErrTxClosed)
	require.ErrorIs(t, h.QueryRow(ctx, "SELECT 1").Scan(&n), pgx.ErrTxClosed)
	require.ErrorIs(t, h.Commit(ctx), dedup.ErrTxOwned, "ending the inbox's transaction is the inbox's")
	require.ErrorIs(t, h.Rollback(ctx), dedup.ErrTxOwned)
	_, err = h.Begin(ctx)
	require.ErrorIs(t, err, pgx.ErrTxClosed)
	requireHealthy(t, b)

	// Commit of an aborted transaction rolls back and says so; the
	// connection is idle again and goes back to the pool.
	key := dedup.Key{Consumer: "c", Key: "aborted"}
	_, tx, _, err = b.store.InboxStartClaim(ctx, key, time.Hour)
	require.NoError(t, err)
	h = postgres.Tx(tx.WithTx(ctx))
	_, err = h.Exec(ctx, "SELECT 1/0")
	require.Error(t, err)
	err = tx.Commit(ctx)
	require.ErrorIs(t, err, pgx.ErrTxCommitRollback)
	_, ok := b.row(t, key)
	require.False(t, ok)
	require.Equal(t, 1, b.started(t, key))
	requireHealthy(t, b)

	// A handler that commits or rolls back the transaction itself is
	// refused, and the transaction goes on: what it wrote before and
	// after commits with the inbox's Commit, with the key's done mark.
	self := dedup.Key{Consumer: "c", Key: "self"}
	_, tx, _, err = b.store.InboxStartClaim(ctx, self, time.Hour)
	require.NoError(t, err)
	h = postgres.Tx(tx.WithTx(ctx))
	_, err = h.Exec(ctx, ins, "before")
	require.NoError(t, err)
	require.ErrorIs(t, h.Commit(ctx), dedup.ErrTxOwned)
	require.ErrorIs(t, h.Rollback(ctx), dedup.ErrTxOwned)
	_, err = h.Exec(ctx, ins, "after")
	require.NoError(t, err)
	require.NoError(t, tx.Commit(ctx))
	require.Equal(t, 5, b.effects(t), "both writes committed with the inbox's Commit")
	c, err := b.store.InboxStart(ctx, self, time.Hour)
	require.NoError(t, err)
	require.Equal(t, dedup.StateDone, c.State, "and the key is done")
	requireHealthy(t, b)
}

func TestStartClaimRoundTrips(t *testing.T) {
	t.Parallel()
	setupPool := pgtest.Pool(t, 1)
	schema := pgtest.Schema(t, setupPool)

	pool, flights := pgtest.FlightPool(t, 1)
	store, err := postgres.New(pool, postgres.Config{Schema: schema})
	require.NoError(t, err)
	ctx := context.Background()

	// Warm the connection (connect, and the statements' preparation,
	// which happens once per connection).
	_, tx, _, err := store.InboxStartClaim(ctx, dedup.Key{Consumer: "c", Key: "warm"}, time.Hour)
	require.NoError(t, err)
	require.NoError(t, tx.Commit(ctx))
	for i, hint := range []dedupdriver.ClaimHint{{}, {New: true, Unstarted: true}} {
		// A new key, then its duplicate: the read after an expected-new
		// claim is prepared too.
		for range 2 {
			tx, _, err := store.InboxBeginClaim(ctx, dedup.Key{Consumer: "c", Key: fmt.Sprint("warm-", i)}, time.Hour, hint)
			require.NoError(t, err)
			require.NoError(t, tx.Commit(ctx))
		}
	}

	measure := flights.Measure
	key := dedup.Key{Consumer: "c", Key: "k"}
	require.EqualValues(t, 2, measure(func() {
		_, tx, c, err := store.InboxStartClaim(ctx, key, time.Hour)
		require.NoError(t, err)
		require.Equal(t, dedup.StateNew, c.State)
		require.NoError(t, tx.Commit(ctx))
	}), "a new key: the pipeline, then COMMIT")
	require.EqualValues(t, 2, measure(func() {
		s, tx, _, err := store.InboxStartClaim(ctx, key, time.Hour)
		require.NoError(t, err)
		require.Equal(t, dedup.StateDone, s.State)
		require.Nil(t, tx)
	}), "a duplicate: the pipeline, then the ROLLBACK of the transaction it opened")

	// Without the attempt record: BEGIN and the claim in one round trip,
	// then COMMIT for a new key, ROLLBACK for a duplicate; a claim that
	// expects a new key is the INSERT alone, and a duplicate is read after
	// it.
	for _, c := range []struct {
		hint     dedupdriver.ClaimHint
		new, dup int64
	}{
		{dedupdriver.ClaimHint{}, 2, 2},
		{dedupdriver.ClaimHint{New: true, Unstarted: true}, 2, 3},
	} {
		k := dedup.Key{Consumer: "c", Key: fmt.Sprintf("other-%t", c.hint.New)}
		for _, want := range []struct {
			state dedup.State
			trips int64
		}{{dedup.StateNew, c.new}, {dedup.StateDone, c.dup}} {
			require.EqualValues(t, want.trips, measure(func() {
				tx, got, err := store.InboxBeginClaim(ctx, k, time.Hour, c.hint)
				require.NoError(t, err)
				require.Equal(t, want.state, got.State)
				require.NoError(t, tx.Commit(ctx))
			}), "%+v, a %v key", c.hint, want.state)
		}
	}
}

// TestBeginClaim: BEGIN and the claim pipelined give the handler's
// transaction as InboxBegin and InboxClaim do: the claim and the effect
// commit together, a rollback leaves the key new, a failed key is taken
// again, and of concurrent claimers of one key exactly one applies it.
func TestBeginClaim(t *testing.T) {
	t.Parallel()
	b := setup(t, 8)
	ctx := context.Background()
	key := dedup.Key{Consumer: "c", Key: "order-1"}
	_, err := b.pool.Exec(ctx, `CREATE TABLE "`+b.schema+`".effects (key text PRIMARY KEY)`)
	require.NoError(t, err)

	tx, c, err := b.store.InboxBeginClaim(ctx, key, time.Hour, dedupdriver.ClaimHint{})
	require.NoError(t, err)
	require.Equal(t, dedup.StateNew, c.State)
	require.Equal(t, 1, c.Attempts)
	_, err = postgres.Tx(tx.WithTx(ctx)).Exec(ctx, `INSERT INTO "`+b.schema+`".effects VALUES ('rolled-back')`)
	require.NoError(t, err)
	require.NoError(t, tx.Rollback(ctx))
	requireIdle(t, b.pool)

	require.NoError(t, b.store.InboxFail(ctx, key, dedup.Failure{Err: "card declined", At: time.Now()}, time.Hour))
	tx, c, err = b.store.InboxBeginClaim(ctx, key, time.Hour, dedupdriver.ClaimHint{})
	require.NoError(t, err)
	require.Equal(t, dedup.StateNew, c.State, "a failed key is taken again")
	require.Equal(t, 2, c.Attempts, "the failed attempt and this one")
	_, err = postgres.Tx(tx.WithTx(ctx)).Exec(ctx, `INSERT INTO "`+b.schema+`".effects VALUES ($1)`, key.Key)
	require.NoError(t, err)
	require.NoError(t, tx.Commit(ctx))
	requireIdle(t, b.pool)

	var effects int
	require.NoError(t, b.pool.QueryRow(ctx, `SELECT count(*) FROM "`+b.schema+`".effects`).Scan(&effects))
	require.Equal(t, 1, effects, "the rolled-back effect is gone, the committed one stays")

	for _, hint := range []dedupdriver.ClaimHint{{}, {New: true}, {New: true, Unstarted: true}} {
		concurrentBeginClaims(t, b, hint)
	}
}

// concurrentBeginClaims: of six concurrent claimers of one key with hint,
// exactly one applies it; the others, whose claim waited on its row, find
// it done.
func concurrentBeginClaims(t *testing.T, b bundle, hint dedupdriver.ClaimHint) {
	ctx := context.Background()
	k := dedup.Key{Consumer: "c", Key: fmt.Sprintf("order-2-%t-%t", hint.New, hint.Unstarted)}
	var applied atomic.Int32
	var wg sync.WaitGroup
	for range 6 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			tx, c, err := b.store.InboxBeginClaim(ctx, k, time.Hour, hint)
			if !assert.NoError(t, err) {
				return
			}
			if c.State == dedup.StateNew {
				applied.Add(1)
				assert.NoError(t, tx.Commit(ctx))
				return
			}
			assert.Equal(t, dedup.StateDone, c.State)
			assert.NoError(t, tx.Rollback(ctx))
		}()
	}
	wg.Wait()
	require.EqualValues(t, 1, applied.Load(), "six concurrent claimers, one applies (%+v)", hint)
	var done int
	require.NoError(t, b.pool.QueryRow(ctx, `SELECT count(*) FROM "`+b.schema+`".inbox WHERE key = $1 AND status = 'done'`, k.Key).Scan(&done))
	require.Equal(t, 1, done)
	requireIdle(t, b.pool)
}
