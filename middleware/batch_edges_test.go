package middleware_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	wmw "github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/dedup"
	"github.com/oncemill/oncemill/dedup/postgres"
	dlv "github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/internal/testing/pgtest"
	"github.com/oncemill/oncemill/middleware"
)

// TestBatchLeadPassesAcrossConsumers: one batching inbox added with
// router.AddMiddleware, so that each handler is a consumer of its own, and
// a single batch slot. While handler A's delivery holds the slot, handler
// B's delivery queues; when A's batch ends, B's delivery must be handed
// the slot, whatever its consumer. It used to wait forever: the lead
// passed only to a delivery of the leader's own consumer. Once both are
// acked, the idle inbox holds no slot.
func TestBatchLeadPassesAcrossConsumers(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t, 4)
	schema := pgtest.Schema(t, pool)
	b := postgresBackendIn(t, pool, schema)
	inbox := newInbox(t, middleware.InboxConfig{TxStore: b.store,
		Tuning: middleware.InboxTuning{Batch: middleware.BatchConfig{MaxMessages: 8, Parallel: 1}}})

	pubSub := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, watermill.NopLogger{})
	require.NoError(t, err)
	router.AddMiddleware(inbox.Middleware)

	releaseA := make(chan struct{})
	var releaseOnce sync.Once
	release := func() { releaseOnce.Do(func() { close(releaseA) }) }
	ranA, ranB := make(chan struct{}), make(chan struct{})
	router.AddConsumerHandler("charge-a", "orders-a", pubSub, func(msg *message.Message) error {
		close(ranA)
		<-releaseA
		return b.effect(msg.Context(), "a")
	})
	router.AddConsumerHandler("charge-b", "orders-b", pubSub, func(msg *message.Message) error {
		close(ranB)
		return b.effect(msg.Context(), "b")
	})
	ctx, cancel := context.WithCancel(context.Background())
	runDone := make(chan error, 1)
	go func() { runDone <- router.Run(ctx) }()
	t.Cleanup(func() {
		release() // a failed step must not leave A's handler blocked
		cancel()
		require.NoError(t, <-runDone)
	})
	<-router.Running()

	idA, idB := watermill.NewUUID(), watermill.NewUUID()
	require.NoError(t, pubSub.Publish("orders-a", message.NewMessage(idA, []byte("a"))))
	awaitClosed(t, ranA, "handler A runs")
	require.NoError(t, pubSub.Publish("orders-b", message.NewMessage(idB, []byte("b"))))
	require.Eventually(t, func() bool { return middleware.BatchQueued(inbox) == 1 },
		5*time.Second, time.Millisecond, "B's delivery queues behind A's batch")
	release()
	awaitClosed(t, ranB, "handler B's delivery is handed the slot when A's batch ends")

	require.Eventually(t, func() bool { return b.effects(t) == 2 }, 5*time.Second, 10*time.Millisecond)
	require.Equal(t, "done", b.status(t, "charge-a", idA))
	require.Equal(t, "done", b.status(t, "charge-b", idB))
	require.Eventually(t, func() bool { return middleware.BatchSlots(inbox) == 0 },
		5*time.Second, time.Millisecond, "an idle inbox holds no batch slot")
}

// TestBatchSlotsAreAlwaysReturned: many rounds of deliveries, more than
// the slots, with small batches, so that a slot is often handed to a
// delivery that another leader takes into its batch and finishes first.
// After every round, every delivery acked, the idle inbox holds no slot,
// and every key is applied once. Slots used to leak there: Parallel
// decayed toward 1, then to 0, and deliveries waited forever.
func TestBatchSlotsAreAlwaysReturned(t *testing.T) {
	t.Parallel()
	const rounds, perRound, parallel = 40, 12, 3
	pool := pgtest.Pool(t, 8)
	schema := pgtest.Schema(t, pool)
	b := postgresBackendIn(t, pool, schema)
	rig := newBatchRig(t, b, middleware.PoisonConfig{MaxAttempts: 3},
		middleware.InboxConfig{Tuning: middleware.InboxTuning{Batch: middleware.BatchConfig{MaxMessages: 2, Parallel: parallel}}},
		func(string, int, *message.Message) error { return nil })
	leaked := 0
	for round := range rounds {
		keys := orderKeysFrom(round*perRound, (round+1)*perRound)
		done := make(chan map[string]error, 1)
		go func() { done <- rig.deliver(keys) }()
		select {
		case errs := <-done:
			for key, err := range errs {
				require.NoError(t, err, key)
			}
		case <-time.After(20 * time.Second):
			t.Fatalf("round %d: deliveries still waiting after 20s, %d slots held", round, middleware.BatchSlots(rig.inbox))
		}
		if middleware.BatchSlots(rig.inbox) != 0 {
			leaked++
		}
	}
	require.Zero(t, leaked, "rounds after which the idle inbox still held a slot")
	require.Equal(t, rounds*perRound, b.effects(t), "every key applied once")
}

// TestBatchMateUnavailableDoesNotStallOthers: eight deliveries in one
// batch; the handler of one finds its payment API unavailable
// (middleware.Unavailable) on every run. That delivery is nacked and never
// counted; the seven others are applied in the same round, once each
// (those that ran before it in the batch run again, once), never counted
// for it. They used to be nacked with it, uncounted, round
// after round: nothing of the consumer was applied while one dependency
// was down.
func TestBatchMateUnavailableDoesNotStallOthers(t *testing.T) {
	t.Parallel()
	const n, downKey = 8, "order-5"
	pool := pgtest.Pool(t, 8)
	schema := pgtest.Schema(t, pool)
	b := postgresBackendIn(t, pool, schema)
	rig := newBatchRig(t, b, middleware.PoisonConfig{MaxAttempts: 2},
		middleware.InboxConfig{Tuning: middleware.InboxTuning{Batch: middleware.BatchConfig{MaxMessages: n, Parallel: 1, Linger: 300 * time.Millisecond}}},
		func(key string, _ int, _ *message.Message) error {
			if key == downKey {
				return middleware.Unavailable(errors.New("payment API: 503 Service Unavailable"))
			}
			return nil
		})
	keys := orderKeys(n)
	for round := 1; round <= 3; round++ {
		errs := rig.deliver(keys)
		require.ErrorIs(t, errs[downKey], dedup.ErrUnavailable, "round %d", round)
		for _, key := range keys {
			if key != downKey {
				require.NoError(t, errs[key], "round %d: %s", round, key)
			}
		}
		keys = []string{downKey}
	}
	require.Equal(t, n, rig.store.largest(), "the eight shared the first transaction")
	require.Equal(t, n-1, b.effects(t), "the seven healthy keys applied in the first round")
	for _, key := range orderKeys(n) {
		if key == downKey {
			require.Zero(t, effectsOf(t, pool, schema, key))
			require.NotEqual(t, "failed", b.status(t, "charge", key), "an unavailable dependency is never counted")
			require.NotEqual(t, "dead", b.status(t, "charge", key))
			continue
		}
		require.Equal(t, 1, effectsOf(t, pool, schema, key), key)
		require.LessOrEqual(t, rig.runsOf(key), 2, "%s: run again at most once, for the rollback its mate caused", key)
		require.Equal(t, 1, b.attempts(t, "charge", key), key)
	}
	require.Empty(t, rig.deadLetters())
	require.Zero(t, rig.inbox.Stats().Failed, "nothing counted")
	require.Equal(t, 0, middleware.BatchSlots(rig.inbox))
}

// TestBatchMateConflictRunsAlone: the first run of one handler of a batch
// of eight loses a serialization conflict (the database's own 40001
// answer, which aborts the transaction). That delivery runs again alone,
// as a conflict on the single-message path does, and the seven others in
// a new transaction: all eight are applied in the first round, once each,
// none counted. They used to be nacked, all eight, uncounted.
func TestBatchMateConflictRunsAlone(t *testing.T) {
	t.Parallel()
	const n, unluckyKey = 8, "order-2"
	pool := pgtest.Pool(t, 8)
	schema := pgtest.Schema(t, pool)
	b := postgresBackendIn(t, pool, schema)
	rig := newBatchRig(t, b, middleware.PoisonConfig{MaxAttempts: 2},
		middleware.InboxConfig{Tuning: middleware.InboxTuning{Batch: middleware.BatchConfig{MaxMessages: n, Parallel: 1, Linger: 300 * time.Millisecond}}},
		func(key string, run int, msg *message.Message) error {
			if key != unluckyKey || run > 1 {
				return nil
			}
			_, err := postgres.Tx(msg.Context()).Exec(msg.Context(),
				`DO $$ BEGIN RAISE EXCEPTION 'could not serialize access' USING ERRCODE = '40001'; END $$`)
			return err
		})
	keys := orderKeys(n)
	for key, err := range rig.deliver(keys) {
		require.NoError(t, err, key)
	}
	require.Equal(t, n, b.effects(t), "all eight applied in the first round")
	for _, key := range keys {
		require.Equal(t, 1, effectsOf(t, pool, schema, key), key)
		require.Equal(t, "done", b.status(t, "charge", key), key)
	}
	require.Equal(t, 2, rig.runsOf(unluckyKey), "the conflicted run, then alone")
	require.Zero(t, rig.inbox.Stats().Failed, "a conflict is never counted")
	require.Zero(t, rig.inbox.Stats().Infrastructure, "nobody nacked")
	require.Empty(t, rig.deadLetters())
}

// TestBatchDeadlineCountsFromHandlerStart: Watermill's Timeout middleware
// gives each delivery 400 ms, and eight handlers of 80 ms share one batch
// and its transaction, one after the other (640 ms in all). Each handler
// gets its 400 ms from when it starts, not from when its delivery
// arrived: all eight are applied, each run once, none counted. The late
// ones used to run past a deadline that started while they queued: 8 of
// 8 counted as failed (reason: deadline) and 11 handler runs.
func TestBatchDeadlineCountsFromHandlerStart(t *testing.T) {
	t.Parallel()
	const n, timeout, work = 8, 400 * time.Millisecond, 80 * time.Millisecond
	pool := pgtest.Pool(t, 8)
	schema := pgtest.Schema(t, pool)
	b := postgresBackendIn(t, pool, schema)
	var mu sync.Mutex
	var lateness []time.Duration
	rig := newBatchRig(t, b, middleware.PoisonConfig{MaxAttempts: 3},
		middleware.InboxConfig{Tuning: middleware.InboxTuning{Batch: middleware.BatchConfig{MaxMessages: n, Parallel: 1, Linger: 300 * time.Millisecond}}},
		func(_ string, _ int, msg *message.Message) error {
			d, ok := msg.Context().Deadline()
			if !ok {
				return errors.New("the handler has no deadline")
			}
			mu.Lock()
			lateness = append(lateness, timeout-time.Until(d))
			mu.Unlock()
			select {
			case <-time.After(work):
				return nil
			case <-msg.Context().Done():
				return msg.Context().Err()
			}
		})
	rig.h = wmw.Timeout(timeout)(rig.h)
	keys := orderKeys(n)
	for key, err := range rig.deliver(keys) {
		require.NoError(t, err, key)
	}
	require.Equal(t, n, rig.store.largest(), "the eight shared one transaction")
	require.Equal(t, n, b.effects(t))
	for _, key := range keys {
		require.Equal(t, 1, rig.runsOf(key), key)
		require.Equal(t, 1, b.attempts(t, "charge", key), key)
	}
	require.Zero(t, rig.inbox.Stats().Failed)
	mu.Lock()
	defer mu.Unlock()
	for i, late := range lateness {
		require.Less(t, late, work, "run %d: its budget was charged %s before it started", i, late)
	}
}

// TestBatchSwallowedStatementFailureIsBlamedOnItsHandler: one handler of
// a batch runs a statement that fails (a unique violation it reads as
// "already done"), swallows the error and returns nil, which leaves the
// PostgreSQL transaction aborted. That handler's delivery is the one
// counted ([middleware.ErrTxAborted]), and dead-lettered at MaxAttempts 1;
// the mate that runs after it is not blamed for the "current transaction
// is aborted" its first statement would get: the seven others are
// applied, none counted. The innocent next mate used to be counted, and
// the culprit committed with the batch.
func TestBatchSwallowedStatementFailureIsBlamedOnItsHandler(t *testing.T) {
	t.Parallel()
	const n, culprit = 8, "order-3"
	pool := pgtest.Pool(t, 8)
	schema := pgtest.Schema(t, pool)
	b := postgresBackendIn(t, pool, schema)
	q := `"` + schema + `"`
	_, err := pool.Exec(context.Background(), `CREATE TABLE `+q+`.payments (id text PRIMARY KEY)`)
	require.NoError(t, err)
	_, err = pool.Exec(context.Background(), `INSERT INTO `+q+`.payments VALUES ('p-1')`)
	require.NoError(t, err)
	rig := newBatchRig(t, b, middleware.PoisonConfig{MaxAttempts: 1},
		middleware.InboxConfig{Tuning: middleware.InboxTuning{Batch: middleware.BatchConfig{MaxMessages: n, Parallel: 1, Linger: 300 * time.Millisecond}}},
		func(key string, _ int, msg *message.Message) error {
			if key == culprit {
				// "Already paid": the error is swallowed, the transaction
				// is aborted.
				_, _ = postgres.Tx(msg.Context()).Exec(msg.Context(), `INSERT INTO `+q+`.payments VALUES ('p-1')`)
				return errNoEffect // and returns nil
			}
			return nil
		})
	keys := orderKeys(n)
	for key, err := range rig.deliver(keys) {
		require.NoError(t, err, "%s: acked (the culprit once dead-lettered)", key)
	}
	dead := rig.deadLetters()
	require.Len(t, dead, 1)
	require.Equal(t, culprit, dead[0].Metadata.Get(dlv.IdempotencyKey))
	require.Contains(t, dead[0].Metadata.Get(dlv.DeadError), middleware.ErrTxAborted.Error())
	require.Zero(t, effectsOf(t, pool, schema, culprit), "the culprit's effect never commits")
	for _, key := range keys {
		if key == culprit {
			continue
		}
		require.Equal(t, 1, effectsOf(t, pool, schema, key), key)
		require.Equal(t, 1, b.attempts(t, "charge", key), "%s: never counted", key)
	}
	require.Equal(t, int64(1), rig.inbox.Stats().Failed, "the culprit, and no other")
	t.Logf("dead-lettered %s with %q", culprit, firstLineOf(dead[0].Metadata.Get(dlv.DeadError)))
}

// awaitClosed waits up to 10 s for ch to close.
func awaitClosed(t *testing.T, ch <-chan struct{}, msgAndArgs ...any) {
	t.Helper()
	select {
	case <-ch:
	case <-time.After(10 * time.Second):
		require.Fail(t, "not closed within 10s", msgAndArgs...)
	}
}
