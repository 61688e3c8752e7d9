package middleware_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/dedup"
	"github.com/oncemill/oncemill/dedup/memory"
	"github.com/oncemill/oncemill/dedup/postgres"
	dlv "github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/internal/testing/pgtest"
	"github.com/oncemill/oncemill/middleware"
)

// TestPipelineClaim: with the attempt record, BEGIN and claim pipelined,
// the inbox keeps its guarantee: one effect per key under concurrent
// copies, a failure counted and rolled back, and a key whose attempts all
// died with their process dead-lettered without running.
func TestPipelineClaim(t *testing.T) {
	t.Parallel()
	b := postgresBackend(t, 16)
	ctx := context.Background()
	inbox, err := middleware.NewInbox(middleware.InboxConfig{TxStore: b.store, Consumer: "ledger", Tuning: middleware.InboxTuning{Pipeline: middleware.PipelineAlways}})
	require.NoError(t, err)
	sink := &deadSink{}
	poison, err := middleware.NewPoison(middleware.PoisonConfig{Publisher: sink, Topic: "dlq", MaxAttempts: 3, Consumer: "ledger"})
	require.NoError(t, err)
	var runs atomic.Int32
	chain := poison.Middleware(inbox.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		ctx := msg.Context()
		runs.Add(1)
		key := middleware.IdempotencyKey(ctx)
		if key == "declined" {
			return nil, errors.New("card declined")
		}
		return nil, b.effect(ctx, key)
	}))

	var wg sync.WaitGroup
	for range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				if _, err := chain(hookMsg("paid")); !errors.Is(err, middleware.ErrInFlight) {
					require.NoError(t, err)
					return
				}
			}
		}()
	}
	wg.Wait()
	require.Equal(t, 1, b.effects(t), "eight concurrent copies, one effect")
	require.Equal(t, "done", b.status(t, "ledger", "paid"))
	st := inbox.Stats()
	require.Equal(t, int64(1), st.Applied)
	require.Equal(t, int64(7), st.Duplicates)

	_, err = chain(hookMsg("solo"))
	require.NoError(t, err)
	require.Zero(t, b.starts(t, "ledger", "solo"), "the commit took the attempt record back")

	_, err = inbox.Middleware(func(*message.Message) ([]*message.Message, error) { return nil, errors.New("card declined") })(hookMsg("declined"))
	require.ErrorContains(t, err, "card declined")
	require.Equal(t, 1, b.attempts(t, "ledger", "declined"), "the failed attempt is counted")
	require.Equal(t, 2, b.effects(t))

	// Three attempts started and never finished, as processes killed
	// mid-handler leave them: the next delivery is dead-lettered without
	// running the handler.
	for range 3 {
		_, err := b.store.InboxStart(ctx, dedup.Key{Consumer: "ledger", Key: "killer"}, dedup.DefaultWindow)
		require.NoError(t, err)
	}
	before := runs.Load()
	_, err = chain(hookMsg("killer"))
	require.NoError(t, err, "dead-lettered, acked")
	require.Equal(t, before, runs.Load(), "the handler did not run")
	require.Len(t, sink.msgs, 1)
	require.ErrorContains(t, errors.New(sink.msgs[0].Metadata.Get("oncemill_dlq_error")), middleware.ErrCrashLoop.Error())
	require.Equal(t, "dead", b.status(t, "ledger", "killer"))
}

// TestPipelineClaimWithoutRecord: PipelineClaim with SkipAttemptRecord,
// BEGIN and claim in one round trip, keeps the guarantee: one effect per
// key under concurrent copies, a failure counted and rolled back, the
// failed key applied on its next delivery.
func TestPipelineClaimWithoutRecord(t *testing.T) {
	t.Parallel()
	b := postgresBackend(t, 16)
	inbox, err := middleware.NewInbox(middleware.InboxConfig{TxStore: b.store, Consumer: "ledger", Tuning: middleware.InboxTuning{Pipeline: middleware.PipelineAlways, SkipAttemptRecord: true}})
	require.NoError(t, err)
	var declines atomic.Int32
	chain := inbox.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		ctx := msg.Context()
		key := middleware.IdempotencyKey(ctx)
		if err := b.effect(ctx, key); err != nil {
			return nil, err
		}
		if key == "declined-once" && declines.Add(1) == 1 {
			return nil, errors.New("card declined")
		}
		return nil, nil
	})

	var wg sync.WaitGroup
	for range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				if _, err := chain(hookMsg("paid")); !errors.Is(err, middleware.ErrInFlight) {
					require.NoError(t, err)
					return
				}
			}
		}()
	}
	wg.Wait()
	require.Equal(t, 1, b.effects(t), "eight concurrent copies, one effect")
	st := inbox.Stats()
	require.Equal(t, int64(1), st.Applied)
	require.Equal(t, int64(7), st.Duplicates)

	_, err = chain(hookMsg("declined-once"))
	require.ErrorContains(t, err, "card declined")
	require.Equal(t, 1, b.effects(t), "the failed attempt's effect is rolled back")
	require.Equal(t, 1, b.attempts(t, "ledger", "declined-once"), "the failed attempt is counted")
	_, err = chain(hookMsg("declined-once"))
	require.NoError(t, err)
	require.Equal(t, 2, b.effects(t), "applied on its next delivery")
	require.Equal(t, "done", b.status(t, "ledger", "declined-once"))
	_, err = chain(hookMsg("declined-once"))
	require.NoError(t, err)
	require.Equal(t, 2, b.effects(t), "and only once")
}

// TestCrashLoopWaitsForRunningAttempt: an attempt that another delivery
// still runs (a handler that ignores its cancelled context, as one of a
// revoked Kafka partition may) is not taken for a dead one. Four attempts
// failed; the fifth is running and holds the key when a sixth delivery
// arrives and counts six starts, over MaxAttempts 5. The sixth waits for
// the fifth, which ends cut short and is not counted, then runs as the
// fifth attempt and is dead-lettered with its own error, not as a crash
// loop.
func TestCrashLoopWaitsForRunningAttempt(t *testing.T) {
	t.Parallel()
	b := postgresBackend(t, 8)
	inbox, err := middleware.NewInbox(middleware.InboxConfig{TxStore: b.store, Consumer: "ledger"})
	require.NoError(t, err)
	sink := &deadSink{}
	// Each call is one delivery and one attempt: failures are nacked for
	// redelivery, not retried in process.
	poison, err := middleware.NewPoison(middleware.PoisonConfig{Publisher: sink, Topic: "dlq", MaxAttempts: 5, Consumer: "ledger",
		InProcessRetries: middleware.NoInProcessRetries})
	require.NoError(t, err)
	var runs atomic.Int32
	holding, release := make(chan struct{}), make(chan struct{})
	chain := poison.Middleware(inbox.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		ctx := msg.Context()
		if err := b.effect(ctx, middleware.IdempotencyKey(ctx)); err != nil {
			return nil, err
		}
		if runs.Add(1) == 5 {
			close(holding)
			<-release // ignores ctx until released
			return nil, fmt.Errorf("interrupted: %w", ctx.Err())
		}
		return nil, errors.New("card declined")
	}))

	for range 4 {
		_, err := chain(hookMsg("x"))
		require.ErrorContains(t, err, "card declined")
	}
	require.Equal(t, 4, b.attempts(t, "ledger", "x"))

	fifth := hookMsg("x")
	ctx, cancel := context.WithCancel(context.Background())
	fifth.SetContext(ctx)
	fifthDone := make(chan error, 1)
	go func() { _, err := chain(fifth); fifthDone <- err }()
	<-holding

	sixthDone := make(chan error, 1)
	go func() { _, err := chain(hookMsg("x")); sixthDone <- err }()
	// The sixth has counted its start and waits on the fifth's claim;
	// now the fifth is cut short.
	require.Eventually(t, func() bool { return b.starts(t, "ledger", "x") >= 2 }, 5*time.Second, 5*time.Millisecond,
		"the sixth delivery counted its start")
	cancel()
	close(release)
	require.ErrorIs(t, <-fifthDone, middleware.ErrShutdown, "the fifth is cut short, not counted")
	require.NoError(t, <-sixthDone, "dead-lettered, acked")

	require.Equal(t, int32(6), runs.Load(), "the sixth delivery ran the handler")
	require.Len(t, sink.msgs, 1)
	reason := sink.msgs[0].Metadata.Get("oncemill_dlq_error")
	require.Contains(t, reason, "card declined", "dead-lettered with its own error")
	require.NotContains(t, reason, middleware.ErrCrashLoop.Error())
	require.Equal(t, "dead", b.status(t, "ledger", "x"))
	require.Zero(t, b.effects(t), "no failed attempt's effect was committed")
}

// TestPipelineAutoFollowsDuplicates: the default pipelining counted in round
// trips on the wire. While duplicates are rare, a new key costs three (the
// attempt record, BEGIN and the claim together; the effect; COMMIT) and a
// duplicate two; once a run of duplicates arrives (a redelivery after a
// crash), the record goes alone again and answers each duplicate in one,
// a new key costing four; a handful of new keys does not switch it back,
// a long run of them does. A broker-counted first delivery, which has no
// record, sends BEGIN and the claim together whatever the duplicates: the
// INSERT alone while duplicates are rare (a duplicate then costs a read
// more), the claim that answers a duplicate while they are common.
// PipelineNever sends every statement alone.
func TestPipelineAutoFollowsDuplicates(t *testing.T) {
	t.Parallel()
	pool, flights := pgtest.FlightPool(t, 1)
	schema := pgtest.Schema(t, pool)
	ctx := context.Background()
	_, err := pool.Exec(ctx, `CREATE TABLE "`+schema+`".effects (key text NOT NULL)`)
	require.NoError(t, err)
	store, err := postgres.New(pool, postgres.Config{Schema: schema})
	require.NoError(t, err)
	effect := func(msg *message.Message) ([]*message.Message, error) {
		ctx := msg.Context()
		_, err := postgres.Tx(ctx).Exec(ctx, `INSERT INTO "`+schema+`".effects VALUES ($1)`, middleware.IdempotencyKey(ctx))
		return nil, err
	}
	effects := func() int {
		var n int
		require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM "`+schema+`".effects`).Scan(&n))
		return n
	}
	deliver := func(h message.HandlerFunc, msg *message.Message) int64 {
		return flights.Measure(func() {
			_, err := h(msg)
			require.NoError(t, err)
		})
	}

	counted := func(key string) *message.Message {
		msg := hookMsg(key)
		msg.Metadata.Set(dlv.Attempts, "1")
		return msg
	}
	auto := newInbox(t, middleware.InboxConfig{TxStore: store, Consumer: "auto"}).Middleware(effect)
	// Connect, and prepare the statements of each path.
	deliver(auto, hookMsg("warm"))
	deliver(auto, counted("warm-counted"))
	deliver(auto, counted("warm-counted"))
	require.EqualValues(t, 3, deliver(auto, hookMsg("new-1")), "a new key while duplicates are rare")
	require.EqualValues(t, 2, deliver(auto, hookMsg("new-1")), "a duplicate while duplicates are rare")
	require.EqualValues(t, 3, deliver(auto, counted("new-c1")), "a broker-counted first delivery: BEGIN and the INSERT together, then the effect, COMMIT")
	require.EqualValues(t, 3, deliver(auto, counted("new-c1")), "its duplicate while duplicates are rare: BEGIN and the INSERT, the read, ROLLBACK")

	for range 40 { // a redelivery storm
		deliver(auto, hookMsg("new-1"))
	}
	require.EqualValues(t, 1, deliver(auto, hookMsg("new-1")), "a duplicate among many")
	require.EqualValues(t, 4, deliver(auto, hookMsg("new-2")), "a new key among many duplicates")
	deliver(auto, counted("new-c1")) // prepares the claim that answers a duplicate
	require.EqualValues(t, 2, deliver(auto, counted("new-c1")), "a broker-counted duplicate among many: BEGIN and the claim that answers it, ROLLBACK")
	require.EqualValues(t, 3, deliver(auto, counted("new-3")), "a broker-counted first delivery among many duplicates: BEGIN and the claim together")

	const few = 20
	for i := range few {
		require.EqualValues(t, 4, deliver(auto, hookMsg(fmt.Sprintf("after-%d", i))), "new key %d after the storm: the record still goes alone", i)
	}
	rejoined := 0
	for i := few; i < 3000 && rejoined == 0; i++ {
		if deliver(auto, hookMsg(fmt.Sprintf("after-%d", i))) == 3 {
			rejoined = i
		}
	}
	require.NotZero(t, rejoined, "a long run of new keys puts the record back into the pipeline")
	t.Logf("the record rejoined the pipeline at the %dth new key after the storm", rejoined+1)
	require.Equal(t, 6+(rejoined+1), effects(), "one effect per key: warm, warm-counted, new-1, new-c1, new-2, new-3 and every after-N")

	never := newInbox(t, middleware.InboxConfig{TxStore: store, Consumer: "never", Tuning: middleware.InboxTuning{Pipeline: middleware.PipelineNever}}).Middleware(effect)
	require.EqualValues(t, 5, deliver(never, hookMsg("new-1")), "PipelineNever: record, BEGIN, claim, effect, COMMIT")
	require.EqualValues(t, 1, deliver(never, hookMsg("new-1")), "PipelineNever: a duplicate")
}

// TestPipelineModeIsChecked: a Pipeline outside the three modes is refused
// by name, and so is a pinned one in lease mode, where there is no
// transaction to pipeline.
func TestPipelineModeIsChecked(t *testing.T) {
	_, err := middleware.NewInbox(middleware.InboxConfig{TxStore: postgresBackend(t, 1).store, Tuning: middleware.InboxTuning{Pipeline: 7}})
	require.ErrorContains(t, err, "InboxConfig.Tuning.Pipeline is PipelineMode(7): use PipelineAuto, PipelineAlways or PipelineNever")
	_, err = middleware.NewInbox(middleware.InboxConfig{LeaseStore: memory.New(), Tuning: middleware.InboxTuning{Pipeline: middleware.PipelineAlways}})
	require.ErrorContains(t, err, "InboxConfig.Tuning.Pipeline PipelineAlways needs TxStore")
}
