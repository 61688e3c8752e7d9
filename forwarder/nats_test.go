package forwarder_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	natsgo "github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/adapters/nats"
	"github.com/oncemill/oncemill/forwarder"
	"github.com/oncemill/oncemill/internal/testing/natstest"
	"github.com/oncemill/oncemill/observe"
)

// natsBatches counts the relay's batches by outcome, from its hook.
type natsBatches struct {
	mu                        sync.Mutex
	noStream, other, ok, rows int
	firstOther                error
}

func (b *natsBatches) OnRelayBatch(_ context.Context, rb observe.RelayBatch) {
	b.mu.Lock()
	defer b.mu.Unlock()
	switch {
	case rb.Err == nil:
		b.ok++
		b.rows += rb.Rows
	case errors.Is(rb.Err, nats.ErrStreamNotFound):
		b.noStream++
	default:
		b.other++
		if b.firstOther == nil {
			b.firstOther = rb.Err
		}
	}
}

func (b *natsBatches) snapshot() natsBatches {
	b.mu.Lock()
	defer b.mu.Unlock()
	return natsBatches{noStream: b.noStream, other: b.other, ok: b.ok, rows: b.rows, firstOther: b.firstOther}
}

// TestRelayToNATS: the relay publishes through the NATS adapter to a
// private nats-server, and deletes a row only once JetStream has acked
// its message. While the topic has no stream (the publisher does not
// create streams), every batch fails with ErrStreamNotFound and every
// row stays. Once the stream exists, the relay empties the outbox and
// the stream holds each row once. While the server is stopped, the rows
// written meanwhile stay in the outbox, however long the relay tries;
// once it is back, they leave, and the stream holds each of them once
// too. A consumer receives every row, once, with its UUID, payload and
// metadata.
func TestRelayToNATS(t *testing.T) {
	t.Parallel()
	srv := natstest.StartServer(t)
	const topic = "orders.relayed"
	cfg := nats.Config{URL: srv.URL()}
	nc, err := natsgo.Connect(srv.URL(), natsgo.MaxReconnects(-1))
	require.NoError(t, err)
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	require.NoError(t, err)
	streamMsgs := func() int {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		s, err := js.Stream(ctx, cfg.StreamName(topic))
		require.NoError(t, err)
		info, err := s.Info(ctx)
		require.NoError(t, err)
		return int(info.State.Msgs)
	}

	b := setup(t, 4)
	want := map[string]*message.Message{}
	write := func(first, n int) {
		events := make([]*message.Message, 0, n)
		for i := first; i < first+n; i++ {
			e := event(fmt.Sprintf("order-%d", i%7), i)
			want[e.UUID] = e
			events = append(events, e)
		}
		b.write(t, topic, events...)
	}
	const n = 30
	for tx := range 3 {
		write(tx*n/3, n/3)
	}

	// A short publish timeout: while the server is down, each batch gives
	// up after it and the relay tries again after its backoff.
	pub, err := nats.NewPublisher(context.Background(), nats.PublisherConfig{Config: cfg, PublishTimeout: time.Second})
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, pub.Close()) })
	batches := &natsBatches{}
	run(t, newRelay(t, b, pub, func(c *forwarder.RelayConfig) {
		c.BatchSize = 8
		c.Hooks = []observe.Hook{batches}
	}))

	require.Eventually(t, func() bool {
		s := batches.snapshot()
		return s.noStream >= 5 || s.other > 0 || s.ok > 0
	}, time.Minute, 5*time.Millisecond, "the relay tries, and JetStream has no stream for the topic")
	s := batches.snapshot()
	require.Zero(t, s.other, "every failed batch failed for the missing stream: %v", s.firstOther)
	require.Zero(t, s.ok, "no batch went out")
	require.Equal(t, n, b.count(t, "outbox"), "every row stays in the outbox while no stream takes it")

	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	_, err = js.CreateStream(ctx, jetstream.StreamConfig{Name: cfg.StreamName(topic), Subjects: []string{topic}, Storage: jetstream.FileStorage})
	cancel()
	require.NoError(t, err)
	require.Eventually(t, func() bool { return b.count(t, "outbox") == 0 }, time.Minute, 5*time.Millisecond,
		"once the stream exists, the relay empties the outbox")
	// The hook hears of a batch after its delete commits: wait for it.
	require.Eventually(t, func() bool { return batches.snapshot().rows >= n }, 10*time.Second, 5*time.Millisecond)
	s = batches.snapshot()
	require.Zero(t, s.other, "%v", s.firstOther)
	require.Equal(t, n, s.rows, "every row published and deleted once")
	require.Equal(t, n, streamMsgs(), "the stream holds each row once")

	// The server goes away: rows written meanwhile stay until it is back.
	srv.Stop()
	const m = 12
	write(n, m)
	require.Eventually(t, func() bool { return batches.snapshot().other >= 2 }, time.Minute, 10*time.Millisecond,
		"the relay tries while the server is down")
	require.Equal(t, m, b.count(t, "outbox"), "no row is deleted while JetStream cannot ack it")
	srv.Start()
	require.Eventually(t, func() bool { return b.count(t, "outbox") == 0 }, time.Minute, 10*time.Millisecond,
		"once the server is back, the relay empties the outbox")
	require.Equal(t, n+m, streamMsgs(), "the stream holds each row once")
	require.Eventually(t, func() bool { return batches.snapshot().rows >= n+m }, 10*time.Second, 5*time.Millisecond)
	require.Equal(t, n+m, batches.snapshot().rows, "every row published and deleted once")

	sub, err := nats.NewSubscriber(context.Background(), nats.SubscriberConfig{Config: cfg, ConsumerGroup: "shipping"})
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, sub.Close()) })
	subCtx, stop := context.WithCancel(context.Background())
	t.Cleanup(stop)
	msgs, err := sub.Subscribe(subCtx, topic)
	require.NoError(t, err)
	got := map[string]int{}
	for range n + m {
		select {
		case msg := <-msgs:
			got[msg.UUID]++
			w, ok := want[msg.UUID]
			require.True(t, ok, "message %s was never written", msg.UUID)
			require.Equal(t, string(w.Payload), string(msg.Payload), "message %s", msg.UUID)
			require.Equal(t, w.Metadata.Get("seq"), msg.Metadata.Get("seq"), "message %s keeps its metadata", msg.UUID)
			msg.Ack()
		case <-time.After(time.Minute):
			t.Fatalf("received %d of %d messages", len(got), n+m)
		}
	}
	require.Len(t, got, n+m, "every row's UUID arrived, and no other")
	for u, c := range got {
		require.Equal(t, 1, c, "message %s delivered once", u)
	}
}
