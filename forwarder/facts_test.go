package forwarder_test

import (
	"context"
	"sync"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/forwarder"
	"github.com/oncemill/oncemill/sqlschema"
)

// keptPublisher keeps the messages it is given as they are, as a broker's
// wire would carry them before its adapter drops anything.
type keptPublisher struct {
	mu   sync.Mutex
	msgs []*message.Message
}

func (p *keptPublisher) Publish(_ string, msgs ...*message.Message) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.msgs = append(p.msgs, msgs...)
	return nil
}

func (p *keptPublisher) Close() error { return nil }

// factsEvent is an event whose producer copied a consumed message's
// delivery facts into it (and a forged decode error), with metadata of
// its own.
func factsEvent() *message.Message {
	m := event("k", 1)
	for _, k := range []string{delivery.Topic, delivery.Partition, delivery.Offset, delivery.Stream,
		delivery.StreamSequence, delivery.Attempts, delivery.Redelivered, delivery.DecodeError} {
		m.Metadata.Set(k, "3")
	}
	m.Metadata.Set(delivery.IdempotencyKey, "order-7")
	m.Metadata.Set(delivery.Replay, "grant-1")
	return m
}

// requireNoFacts checks that the relay published want without a delivery
// fact, its own metadata kept.
func requireNoFacts(t *testing.T, pub *keptPublisher, want *message.Message) {
	t.Helper()
	require.Len(t, pub.msgs, 1)
	got := pub.msgs[0]
	require.Equal(t, want.UUID, got.UUID)
	for k := range got.Metadata {
		require.False(t, delivery.IsAdapterFact(k), "the relay publishes no delivery fact: %s", k)
	}
	for _, k := range []string{delivery.IdempotencyKey, delivery.Replay, delivery.PartitionKey, "seq"} {
		require.Equal(t, want.Metadata.Get(k), got.Metadata.Get(k), "%s travels", k)
	}
}

// TestRelayDropsDeliveryFacts: an outbox row whose metadata holds
// delivery facts (delivery.IsAdapterFact) is published without them, on
// PostgreSQL and on MariaDB, as every broker adapter publishes: they
// would lie about the delivery the publish makes (a decode error would
// have the message dead-lettered unread).
func TestRelayDropsDeliveryFacts(t *testing.T) {
	t.Parallel()
	t.Run("postgres", func(t *testing.T) {
		t.Parallel()
		b := setup(t, 2)
		m := factsEvent()
		b.write(t, "orders", m)
		pub := &keptPublisher{}
		r, err := forwarder.NewRelay(forwarder.RelayConfig{Pool: b.pool, Schema: b.schema, Publisher: pub, LockOrderedWriters: true})
		require.NoError(t, err)
		n, err := r.RelayBatch(context.Background())
		require.NoError(t, err)
		require.Equal(t, 1, n)
		requireNoFacts(t, pub, m)
	})
	t.Run("mysql", func(t *testing.T) {
		t.Parallel()
		b := setupMySQL(t, 2)
		m := factsEvent()
		w := b.begin(t)
		b.publish(t, w.tx, m)
		require.NoError(t, w.tx.Commit())
		pub := &keptPublisher{}
		r, err := forwarder.NewRelay(forwarder.RelayConfig{DB: b.db, Dialect: sqlschema.MySQL, Schema: b.schema, Publisher: pub})
		require.NoError(t, err)
		n, err := r.RelayBatch(context.Background())
		require.NoError(t, err)
		require.Equal(t, 1, n)
		requireNoFacts(t, pub, m)
	})
}
