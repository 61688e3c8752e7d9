package middleware_test

import (
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/dedup/postgres"
	"github.com/oncemill/oncemill/middleware"
)

// fillRig is a batching inbox (MaxMessages 8, Parallel 4, MinFill 4) whose handler for order-0 waits for release, so that a test
// holds one batch running while it queues others.
type fillRig struct {
	b       txBackend
	store   *batchCounting
	inbox   *middleware.Inbox
	h       message.HandlerFunc
	ran0    chan struct{}
	release chan struct{}
	unblock func() // closes release, once
	wg      sync.WaitGroup
}

func newFillRig(t *testing.T) *fillRig {
	b := postgresBackend(t, 8)
	r := &fillRig{b: b, store: &batchCounting{Store: b.store.(*postgres.Store)},
		ran0: make(chan struct{}), release: make(chan struct{})}
	r.inbox = newInbox(t, middleware.InboxConfig{TxStore: r.store, Consumer: "charge",
		Tuning: middleware.InboxTuning{Batch: middleware.BatchConfig{MaxMessages: 8, Parallel: 4, MinFill: 4}}})
	r.h = r.inbox.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		key := middleware.IdempotencyKey(msg.Context())
		if key == "order-0" {
			close(r.ran0)
			<-r.release
		}
		return nil, b.effect(msg.Context(), key)
	})
	var once sync.Once
	t.Cleanup(func() {
		once.Do(func() { close(r.release) }) // a failed step must not leave order-0 blocked
		r.wg.Wait()
	})
	r.unblock = func() { once.Do(func() { close(r.release) }) }
	return r
}

func (r *fillRig) deliver(t *testing.T, k int) {
	r.wg.Go(func() {
		if _, err := r.h(delivery(fmt.Sprintf("order-%d", k), "x")); err != nil {
			t.Errorf("order-%d: %v", k, err)
		}
	})
}

func (r *fillRig) batchSizes() []int {
	r.store.mu.Lock()
	defer r.store.mu.Unlock()
	return append([]int(nil), r.store.sizes...)
}

// TestBatchWaitsForMinFillBeforeASecondSlot: while order-0's batch runs,
// three more deliveries of its consumer do not take the three free slots
// (the fixed scheme spread them one per slot): they wait, and the fourth
// (MinFill) starts one batch of all four. order-0, alone
// when it arrived, started at once.
func TestBatchWaitsForMinFillBeforeASecondSlot(t *testing.T) {
	t.Parallel()
	r := newFillRig(t)
	r.deliver(t, 0)
	awaitClosed(t, r.ran0, "order-0 starts at once: nothing else runs")
	for k := 1; k <= 3; k++ {
		r.deliver(t, k)
	}
	require.Eventually(t, func() bool { return middleware.BatchQueued(r.inbox) == 3 },
		5*time.Second, time.Millisecond, "three deliveries queue behind order-0's batch")
	time.Sleep(100 * time.Millisecond)
	require.Equal(t, 3, middleware.BatchQueued(r.inbox), "below MinFill they still wait")
	require.Equal(t, 1, middleware.BatchSlots(r.inbox), "only order-0's batch holds a slot")

	r.deliver(t, 4)
	require.Eventually(t, func() bool { return r.b.effects(t) == 4 },
		5*time.Second, 10*time.Millisecond, "the fourth starts a batch of all four")
	require.Equal(t, []int{1, 4}, r.batchSizes(), "order-0 alone, then one batch of four")
	for k := 1; k <= 4; k++ {
		require.Equal(t, "done", r.b.status(t, "charge", fmt.Sprintf("order-%d", k)))
	}

	r.unblock()
	r.wg.Wait()
	require.Equal(t, 5, r.b.effects(t), "each key applied once")
	require.Equal(t, "done", r.b.status(t, "charge", "order-0"))
	require.Equal(t, int64(5), r.inbox.Stats().Applied)
	require.Equal(t, 0, middleware.BatchSlots(r.inbox), "an idle inbox holds no batch slot")
}

// TestBatchBelowMinFillRunsWhenItsBatchEnds: three deliveries queued
// behind order-0's batch, fewer than MinFill, do not wait for a fourth:
// when order-0's batch ends its slot takes them, in one batch.
func TestBatchBelowMinFillRunsWhenItsBatchEnds(t *testing.T) {
	t.Parallel()
	r := newFillRig(t)
	r.deliver(t, 0)
	awaitClosed(t, r.ran0, "order-0 starts at once")
	for k := 1; k <= 3; k++ {
		r.deliver(t, k)
	}
	require.Eventually(t, func() bool { return middleware.BatchQueued(r.inbox) == 3 },
		5*time.Second, time.Millisecond, "three deliveries queue behind order-0's batch")
	r.unblock()
	r.wg.Wait()
	require.Equal(t, []int{1, 3}, r.batchSizes(), "order-0 alone, then the three together")
	require.Equal(t, 4, r.b.effects(t), "each key applied once")
	require.Equal(t, int64(4), r.inbox.Stats().Applied)
	require.Equal(t, 0, middleware.BatchSlots(r.inbox), "an idle inbox holds no batch slot")
}

// TestBatchFillsAtEightInFlight: eight workers, each delivering new keys
// one after the other (a consumer with eight deliveries in flight), with
// MinFill 4 and with MinFill 1 (the default: every free slot starts a
// batch at once). MinFill 4's batches hold more messages: eight in flight
// over four slots made batches of one or two.
func TestBatchFillsAtEightInFlight(t *testing.T) {
	t.Parallel()
	average := func(t *testing.T, minFill int) float64 {
		b := postgresBackend(t, 8)
		store := &batchCounting{Store: b.store.(*postgres.Store)}
		in := newInbox(t, middleware.InboxConfig{TxStore: store, Consumer: "charge",
			Tuning: middleware.InboxTuning{Batch: middleware.BatchConfig{MaxMessages: 32, MinFill: minFill}}})
		h := in.Middleware(func(msg *message.Message) ([]*message.Message, error) {
			return nil, b.effect(msg.Context(), middleware.IdempotencyKey(msg.Context()))
		})
		const workers, each = 8, 40
		var wg sync.WaitGroup
		for w := range workers {
			wg.Go(func() {
				for i := range each {
					if _, err := h(delivery(fmt.Sprintf("order-%d-%d", w, i), "x")); err != nil {
						t.Errorf("worker %d message %d: %v", w, i, err)
					}
				}
			})
		}
		wg.Wait()
		require.Equal(t, workers*each, b.effects(t), "each key applied once")
		store.mu.Lock()
		defer store.mu.Unlock()
		sum := 0
		for _, n := range store.sizes {
			sum += n
		}
		require.Equal(t, workers*each, sum, "every message claimed in one batch")
		return float64(sum) / float64(len(store.sizes))
	}
	fixed := average(t, 0)
	filled := average(t, 4)
	t.Logf("messages per batch at 8 in flight: %.2f with MinFill 1 (the default), %.2f with MinFill 4", fixed, filled)
	require.Greater(t, filled, fixed, "MinFill 4 gathers fuller batches than a slot per free delivery")
	require.Greater(t, filled, 3.0, "MinFill 4's batches hold more than three messages on average")
}

// TestBatchMinFillMustBePositive: a negative MinFill is refused with the
// field and the fix.
func TestBatchMinFillMustBePositive(t *testing.T) {
	t.Parallel()
	b := postgresBackend(t, 2)
	_, err := middleware.NewInbox(middleware.InboxConfig{TxStore: b.store,
		Tuning: middleware.InboxTuning{Batch: middleware.BatchConfig{MaxMessages: 8, MinFill: -1}}})
	require.EqualError(t, err, "middleware: InboxConfig.Tuning.Batch.MinFill must be at least 1 (1 starts a batch whenever a slot is free), got -1")
}
