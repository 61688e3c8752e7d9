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
	"github.com/oncemill/oncemill/dedup/postgres"
	"github.com/oncemill/oncemill/middleware"
)

// batchCounting is a PostgreSQL store that keeps the size of every batch
// it claims.
type batchCounting struct {
	*postgres.Store
	mu    sync.Mutex
	sizes []int
}

func (s *batchCounting) InboxBeginClaimBatch(ctx context.Context, consumer string, keys []string, window time.Duration) (dedup.InboxTx, []dedup.Claim, error) {
	s.mu.Lock()
	s.sizes = append(s.sizes, len(keys))
	s.mu.Unlock()
	return s.Store.InboxBeginClaimBatch(ctx, consumer, keys, window)
}

func (s *batchCounting) largest() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	n := 0
	for _, k := range s.sizes {
		n = max(n, k)
	}
	return n
}

// TestBatchAppliesEachKeyOnce: 50 keys delivered 4 times each, all at
// once, through the batching inbox with one batch slot: every key is
// applied once, the other copies are duplicates, and deliveries did share
// transactions.
func TestBatchAppliesEachKeyOnce(t *testing.T) {
	t.Parallel()
	for _, skip := range []bool{false, true} {
		t.Run(fmt.Sprintf("skip_attempt_record=%t", skip), func(t *testing.T) {
			t.Parallel()
			b := postgresBackend(t, 8)
			store := &batchCounting{Store: b.store.(*postgres.Store)}
			in := newInbox(t, middleware.InboxConfig{TxStore: store, Consumer: "charge",
				Tuning: middleware.InboxTuning{SkipAttemptRecord: skip, Batch: middleware.BatchConfig{MaxMessages: 8, Parallel: 1}}})
			var runs atomic.Int32
			h := in.Middleware(func(msg *message.Message) ([]*message.Message, error) {
				runs.Add(1)
				return nil, b.effect(msg.Context(), middleware.IdempotencyKey(msg.Context()))
			})
			const keys, copies = 50, 4
			wave := func(copies int) {
				var wg sync.WaitGroup
				for c := range copies {
					for k := range keys {
						wg.Go(func() {
							if _, err := h(delivery(fmt.Sprintf("order-%d", k), fmt.Sprint(c))); err != nil {
								t.Errorf("order-%d copy %d: %v", k, c, err)
							}
						})
					}
				}
				wg.Wait()
			}
			wave(1) // the first copies, all at once
			t.Logf("batch sizes %v", store.sizes)
			require.Greater(t, store.largest(), 1, "deliveries shared a transaction")
			wave(copies - 1) // the other copies, all at once
			require.Equal(t, keys, b.effects(t), "each key applied once")
			require.Equal(t, int32(keys), runs.Load(), "each handler ran once")
			st := in.Stats()
			require.Equal(t, int64(keys), st.Applied)
			require.Equal(t, int64(keys*(copies-1)), st.Duplicates)
			for k := range keys {
				require.Equal(t, 1, b.attempts(t, "charge", fmt.Sprintf("order-%d", k)))
			}
		})
	}
}

// TestBatchMateFailureFailsOnlyItself: in one batch of eight, one handler
// returns an error after writing its effect and another makes a statement
// fail (which aborts the transaction): both are rolled back and recorded
// as failed attempts of their own, and the six others are applied once.
func TestBatchMateFailureFailsOnlyItself(t *testing.T) {
	t.Parallel()
	b := postgresBackend(t, 8)
	store := &batchCounting{Store: b.store.(*postgres.Store)}
	in := newInbox(t, middleware.InboxConfig{TxStore: store, Consumer: "charge",
		Tuning: middleware.InboxTuning{Batch: middleware.BatchConfig{MaxMessages: 8, Parallel: 1, Linger: 200 * time.Millisecond}}})
	var runs atomic.Int32
	h := in.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		runs.Add(1)
		ctx := msg.Context()
		key := middleware.IdempotencyKey(ctx)
		if err := b.effect(ctx, key); err != nil {
			return nil, err
		}
		switch key {
		case "order-3":
			return nil, errors.New("card declined")
		case "order-5":
			_, err := postgres.Tx(ctx).Exec(ctx, `SELECT 1/0`)
			return nil, err
		}
		return nil, nil
	})
	errs := make([]error, 8)
	var wg sync.WaitGroup
	for k := range 8 {
		wg.Go(func() {
			_, errs[k] = h(delivery(fmt.Sprintf("order-%d", k), "x"))
		})
	}
	wg.Wait()
	for k, err := range errs {
		switch k {
		case 3, 5:
			require.Error(t, err, "order-%d", k)
			n, _, ok := middleware.StoredAttempts(err)
			require.True(t, ok, "order-%d: a counted attempt", k)
			require.Equal(t, 1, n)
			require.Equal(t, "failed", b.status(t, "charge", fmt.Sprintf("order-%d", k)))
		default:
			require.NoError(t, err, "order-%d", k)
			require.Equal(t, "done", b.status(t, "charge", fmt.Sprintf("order-%d", k)))
		}
	}
	require.Equal(t, 6, b.effects(t), "the six that succeeded, once each")
	require.Equal(t, int64(6), in.Stats().Applied)
	require.Equal(t, int64(2), in.Stats().Failed)
	require.Equal(t, 8, store.largest(), "all eight shared the first transaction")
}
