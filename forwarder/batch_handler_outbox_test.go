package forwarder_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/dedup/postgres"
	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/forwarder"
	"github.com/oncemill/oncemill/middleware"
)

// TestBatchHandlerWritesTheOutbox: a batching inbox whose handler is a
// middleware.BatchHandler: it inserts the orders of its batch with one
// statement and writes one event a message to the consumer outbox in the
// batch's transaction, through the function InboxConfig.Outbox holds.
// One order of eight is refused (BatchErrors): its event never reaches
// the outbox. The relay publishes seven events, one per applied order,
// and the duplicates of the eight write nothing more.
func TestBatchHandlerWritesTheOutbox(t *testing.T) {
	t.Parallel()
	const n, refused = 8, "order-4"
	b := setup(t, 8)
	store, err := postgres.New(b.pool, postgres.Config{Schema: b.schema.Schema})
	require.NoError(t, err)
	outbox := forwarder.InboxOutbox("orders.shipped", b.schema)
	inbox, err := middleware.NewInbox(middleware.InboxConfig{
		TxStore: store, Consumer: "shipping", Outbox: outbox,
		Tuning: middleware.InboxTuning{Batch: middleware.BatchConfig{MaxMessages: n, Parallel: 1, Linger: 300 * time.Millisecond}},
	})
	require.NoError(t, err)

	var (
		mu     sync.Mutex
		sizes  []int
		events = map[string]string{} // event UUID by order
	)
	bulk := middleware.BatchHandler(func(ctx context.Context, msgs []*message.Message) error {
		mu.Lock()
		sizes = append(sizes, len(msgs))
		mu.Unlock()
		var ids []string
		var out []*message.Message
		for _, msg := range msgs {
			id := middleware.IdempotencyKey(msg.Context())
			if id == refused {
				return middleware.BatchErrors{msg.UUID: errors.New("address unknown")}
			}
			ids = append(ids, id)
			e := message.NewMessage(watermill.NewUUID(), []byte(id))
			out = append(out, e)
			mu.Lock()
			events[id] = e.UUID
			mu.Unlock()
		}
		if _, err := postgres.Tx(ctx).Exec(ctx, `INSERT INTO "`+b.schema.Schema+`".orders (id) SELECT unnest($1::text[])`, ids); err != nil {
			return err
		}
		return outbox(ctx, out)
	})
	handler := inbox.Middleware(func(msg *message.Message) ([]*message.Message, error) { return nil, bulk(msg) })
	deliver := func() map[string]error {
		var (
			wg   sync.WaitGroup
			errs sync.Map
		)
		for i := range n {
			id := fmt.Sprintf("order-%d", i)
			wg.Go(func() {
				msg := message.NewMessage(id+"-delivery", nil)
				msg.Metadata.Set(delivery.IdempotencyKey, id)
				produced, err := handler(msg)
				assert.Empty(t, produced, "the events are in the outbox")
				errs.Store(id, err)
			})
		}
		wg.Wait()
		out := map[string]error{}
		errs.Range(func(k, v any) bool {
			err, _ := v.(error)
			out[k.(string)] = err
			return true
		})
		return out
	}
	for id, err := range deliver() {
		if id == refused {
			require.ErrorContains(t, err, "address unknown")
			continue
		}
		require.NoError(t, err, id)
	}
	for id, err := range deliver() {
		if id != refused {
			require.NoError(t, err, "%s: a duplicate", id)
		}
	}
	require.Equal(t, n-1, b.count(t, "orders"))
	require.Equal(t, n-1, b.count(t, "outbox"), "one event per applied order")

	s := &sink{}
	relayAll(t, newRelay(t, b, s, nil), n-1)
	var got, want []string
	for _, m := range s.snapshot() {
		got = append(got, m.UUID)
	}
	mu.Lock()
	for id, uuid := range events {
		if id != refused {
			want = append(want, uuid)
		}
	}
	mu.Unlock()
	require.ElementsMatch(t, want, got, "the committed events, each once")
	require.NotContains(t, got, events[refused])
	require.Equal(t, int64(n-1), inbox.Stats().Duplicates)
	t.Logf("%d orders, %d events relayed, BatchFunc calls by size %v", b.count(t, "orders"), len(got), slices.Clone(sizes))
}
