package forwarder_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"sort"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/adapters/amqp"
	"github.com/oncemill/oncemill/forwarder"
	"github.com/oncemill/oncemill/internal/testing/pgtest"
	"github.com/oncemill/oncemill/observe"
)

// batchOutcomes counts the relay's batches by outcome, from its hook.
type batchOutcomes struct {
	mu                    sync.Mutex
	unroutable, other, ok int
	rows                  int
	firstOther            error
}

func (b *batchOutcomes) OnRelayBatch(_ context.Context, rb observe.RelayBatch) {
	b.mu.Lock()
	defer b.mu.Unlock()
	switch {
	case rb.Err == nil:
		b.ok++
		b.rows += rb.Rows
	case errors.Is(rb.Err, amqp.ErrUnroutable):
		b.unroutable++
	default:
		b.other++
		if b.firstOther == nil {
			b.firstOther = rb.Err
		}
	}
}

func (b *batchOutcomes) snapshot() (unroutable, other, ok, rows int, firstOther error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.unroutable, b.other, b.ok, b.rows, b.firstOther
}

// TestRelayKeepsRowsWhileRabbitMQCannotRoute: the relay publishes through
// the AMQP adapter to a topic whose exchange no queue is bound to. RabbitMQ
// returns every such message (mandatory) and the publisher fails with
// ErrUnroutable, so the relay's batches roll back and every row stays in
// the outbox, however often it tries. Once the topic's queue is declared,
// the relay delivers every row to it exactly once, with its UUID and
// payload, and the outbox empties.
func TestRelayKeepsRowsWhileRabbitMQCannotRoute(t *testing.T) {
	t.Parallel()
	url := os.Getenv("ONCEMILL_AMQP_URL")
	if url == "" {
		url = "amqp://guest:guest@127.0.0.1:5672/"
	}
	admin, err := amqp091.DialConfig(url, amqp091.Config{Dial: amqp091.DefaultDial(3 * time.Second)})
	if err != nil {
		pgtest.Unavailable(t, "RabbitMQ", err)
	}
	var suffix [6]byte
	_, _ = rand.Read(suffix[:])
	topic := "oncemill-test-relay-unroutable-" + hex.EncodeToString(suffix[:])
	cfg := amqp.Config{URL: url}
	t.Cleanup(func() {
		ch, err := admin.Channel()
		require.NoError(t, err)
		_, err = ch.QueueDelete(cfg.QueueName(topic), false, false, false)
		require.NoError(t, err)
		require.NoError(t, ch.ExchangeDelete(cfg.ExchangeName(topic), false, false))
		require.NoError(t, ch.Close())
		require.NoError(t, admin.Close())
	})

	b := setup(t, 4)
	const n = 30
	want := map[string][]byte{}
	for tx := 0; tx < 3; tx++ {
		events := make([]*message.Message, 0, n/3)
		for i := 0; i < n/3; i++ {
			e := event(fmt.Sprintf("order-%d", i%7), tx*(n/3)+i)
			want[e.UUID] = e.Payload
			events = append(events, e)
		}
		b.write(t, topic, events...)
	}
	require.Equal(t, n, b.count(t, "outbox"))

	pub, err := amqp.NewPublisher(cfg, nil)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, pub.Close()) })
	outcomes := &batchOutcomes{}
	run(t, newRelay(t, b, pub, func(c *forwarder.RelayConfig) {
		c.BatchSize = 8 // several batches, several lanes
		c.Hooks = []observe.Hook{outcomes}
	}))

	require.Eventually(t, func() bool {
		unroutable, other, ok, _, _ := outcomes.snapshot()
		return unroutable >= 5 || other > 0 || ok > 0
	}, time.Minute, 5*time.Millisecond, "the relay tries, and the broker returns the messages")
	unroutable, other, ok, rows, firstOther := outcomes.snapshot()
	require.Zero(t, other, "every failed batch failed as unroutable: %v", firstOther)
	require.Zero(t, ok, "no batch went out")
	require.Zero(t, rows)
	require.GreaterOrEqual(t, unroutable, 5)
	require.Equal(t, n, b.count(t, "outbox"), "every row stays in the outbox while no queue can take it")

	require.NoError(t, amqp.Declare(context.Background(), cfg, topic))
	require.Eventually(t, func() bool { return b.count(t, "outbox") == 0 }, time.Minute, 5*time.Millisecond,
		"once the queue is bound, the relay empties the outbox")
	_, other, _, rows, firstOther = outcomes.snapshot()
	require.Zero(t, other, "%v", firstOther)
	require.Equal(t, n, rows, "every row published and deleted once")

	// Every row is in the queue, once: the relay confirmed and deleted
	// them all, and nothing consumes it yet.
	ch, err := admin.Channel()
	require.NoError(t, err)
	q, err := ch.QueueDeclarePassive(cfg.QueueName(topic), true, false, false, false, cfg.QueueArguments())
	require.NoError(t, err)
	require.NoError(t, ch.Close())
	require.Equal(t, n, q.Messages, "the queue holds each row once")

	sub, err := amqp.NewSubscriber(cfg, nil)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, sub.Close()) })
	subCtx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	msgs, err := sub.Subscribe(subCtx, topic)
	require.NoError(t, err)
	got := map[string]int{}
	for range n {
		select {
		case m := <-msgs:
			got[m.UUID]++
			require.Equal(t, string(want[m.UUID]), string(m.Payload), "message %s", m.UUID)
			m.Ack()
		case <-time.After(time.Minute):
			t.Fatalf("received %d of %d messages", len(got), n)
		}
	}
	uuids := make([]string, 0, len(got))
	for u, c := range got {
		require.Equal(t, 1, c, "message %s delivered once", u)
		uuids = append(uuids, u)
	}
	wantUUIDs := make([]string, 0, len(want))
	for u := range want {
		wantUUIDs = append(wantUUIDs, u)
	}
	sort.Strings(uuids)
	sort.Strings(wantUUIDs)
	require.Equal(t, wantUUIDs, uuids, "every row's UUID arrived, and no other")
}
