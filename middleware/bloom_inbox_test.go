package middleware_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/middleware"
)

// TestBloomFromInbox: a prefilter made from its inbox takes the inbox's
// store, key function, consumer and window, so that keys the inbox applied
// under a business key are answered as duplicates by the filter; giving
// any of those settings twice is refused, naming the field.
func TestBloomFromInbox(t *testing.T) {
	t.Parallel()
	b := postgresBackend(t, 8)
	key := middleware.KeyFromJSON("orderId")
	inbox := newInbox(t, middleware.InboxConfig{TxStore: b.store, Consumer: "ship", Key: key, Window: 48 * time.Hour})
	handler := inbox.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		return nil, b.effect(msg.Context(), middleware.IdempotencyKey(msg.Context()))
	})
	order := func(i int) *message.Message {
		return message.NewMessage(fmt.Sprintf("uuid-%d-%d", i, time.Now().UnixNano()), []byte(fmt.Sprintf(`{"orderId":"o-%d"}`, i)))
	}
	const n = 50
	for i := range n {
		_, err := handler(order(i))
		require.NoError(t, err)
	}

	bloom, err := middleware.NewBloom(middleware.BloomConfig{Inbox: inbox, ExpectedKeys: 1000})
	require.NoError(t, err)
	loaded, err := bloom.Warm(context.Background())
	require.NoError(t, err)
	require.Equal(t, n, loaded, "the inbox's consumer's keys are loaded")
	h := bloom.Middleware(handler)
	for i := range n {
		_, err := h(order(i)) // new UUIDs, the same business keys
		require.NoError(t, err)
	}
	require.Equal(t, int64(n), bloom.Stats().Duplicates, "every copy answered by the filter under the inbox's key")
	require.Equal(t, n, b.effects(t))

	for field, cfg := range map[string]middleware.BloomConfig{
		"Key":      {Inbox: inbox, Key: middleware.DefaultKey},
		"Consumer": {Inbox: inbox, Consumer: "ship"},
		"Window":   {Inbox: inbox, Window: time.Hour},
	} {
		_, err := middleware.NewBloom(cfg)
		require.ErrorContains(t, err, "BloomConfig."+field, field)
	}
}
