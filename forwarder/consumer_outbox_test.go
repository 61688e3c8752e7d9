package forwarder_test

import (
	"errors"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/dedup/postgres"
	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/forwarder"
	"github.com/oncemill/oncemill/middleware"
)

// TestConsumerOutboxSurvivesCrashBeforePublish: the handler's produced
// messages commit with its effect; the consumer dies after the commit and
// before anything is published or acked; the redelivery is a duplicate;
// the relay still publishes every produced message, once, by UUID.
func TestConsumerOutboxSurvivesCrashBeforePublish(t *testing.T) {
	t.Parallel()
	b := setup(t, 6)
	store, err := postgres.New(b.pool, postgres.Config{Schema: b.schema.Schema})
	require.NoError(t, err)
	inbox, err := middleware.NewInbox(middleware.InboxConfig{
		TxStore:  store,
		Consumer: "shipping",
		Outbox:   forwarder.InboxOutbox("orders.shipped", b.schema),
	})
	require.NoError(t, err)

	var produced []string
	handler := inbox.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		if _, err := postgres.Tx(msg.Context()).Exec(msg.Context(),
			`INSERT INTO "`+b.schema.Schema+`".orders (id) VALUES ($1)`, middleware.IdempotencyKey(msg.Context())); err != nil {
			return nil, err
		}
		out := []*message.Message{message.NewMessage(watermill.NewUUID(), []byte("label")), message.NewMessage(watermill.NewUUID(), []byte("mail"))}
		for _, m := range out {
			produced = append(produced, m.UUID)
		}
		return out, nil
	})
	crashed := errors.New("process died after commit, before publish and ack")
	crashing := func(msg *message.Message) ([]*message.Message, error) {
		if _, err := handler(msg); err != nil {
			return nil, err
		}
		return nil, crashed // what the router would have published is lost
	}

	msg := message.NewMessage(watermill.NewUUID(), nil)
	msg.Metadata.Set(delivery.IdempotencyKey, "order-9")
	_, err = crashing(msg)
	require.ErrorIs(t, err, crashed)

	// The broker redelivers; the inbox drops it and returns nothing to the
	// router: the events are in the outbox.
	again, err := handler(msg.Copy())
	require.NoError(t, err)
	require.Empty(t, again)
	require.Equal(t, 1, b.count(t, "orders"))
	require.Len(t, produced, 2)

	s := &sink{}
	r := newRelay(t, b, s, nil)
	relayAll(t, r, 2)
	got := s.snapshot()
	require.Len(t, got, 2)
	require.Equal(t, produced, []string{got[0].UUID, got[1].UUID}, "every produced message, in order, by UUID")
	require.Equal(t, []string{"orders.shipped", "orders.shipped"}, s.topics)

	_, err = middleware.NewInbox(middleware.InboxConfig{LeaseStore: nil, TxStore: nil, Outbox: forwarder.InboxOutbox("x", b.schema)})
	require.Error(t, err)
}
