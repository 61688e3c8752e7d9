package middleware_test

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/dedup"
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
	inbox, err := middleware.NewInbox(middleware.InboxConfig{TxStore: b.store, Consumer: "ledger", PipelineClaim: true})
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
	inbox, err := middleware.NewInbox(middleware.InboxConfig{TxStore: b.store, Consumer: "ledger", PipelineClaim: true, SkipAttemptRecord: true})
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
