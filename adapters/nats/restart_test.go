package nats_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	natsgo "github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/adapters/nats"
	"github.com/oncemill/oncemill/internal/testing/natstest"
)

// TestServerRestart: eight publishers publish without pause, and a
// subscription consumes, while a private nats-server restarts (SIGTERM,
// 2s down, started again on its port and store). Every Publish returns
// nil: one whose ack the dropped connection lost is published again on
// the next connection, and the stream drops the copy by its Nats-Msg-Id,
// so the stream holds each published message once. The subscription
// pulls again once it has reconnected and receives every message; the
// consumer has nothing pending at the end.
func TestServerRestart(t *testing.T) {
	t.Parallel()
	srv := natstest.StartServer(t)
	cfg := nats.Config{URL: srv.URL(), CreateStreams: true, Logger: testLogger()}
	topic := "restart.orders"
	pub := publisher(t, cfg)
	sub := subscriber(t, nats.SubscriberConfig{Config: cfg, ConsumerGroup: "billing", MaxInFlight: 8, AckWait: 5 * time.Second})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	msgs, err := sub.Subscribe(ctx, topic)
	require.NoError(t, err)

	var (
		mu        sync.Mutex
		published = map[string]bool{}
		received  = map[string]int{}
		failures  []string
		slowest   time.Duration
	)
	consumed := make(chan struct{})
	go func() {
		defer close(consumed)
		for m := range msgs {
			mu.Lock()
			received[m.UUID]++
			mu.Unlock()
			m.Ack()
		}
	}()

	stop := make(chan struct{})
	var producers sync.WaitGroup
	for g := range 8 {
		producers.Add(1)
		go func() {
			defer producers.Done()
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				m := message.NewMessage(watermill.NewUUID(), []byte(fmt.Sprintf("%d/%d", g, i)))
				start := time.Now()
				err := pub.Publish(topic, m)
				took := time.Since(start)
				mu.Lock()
				slowest = max(slowest, took)
				if err != nil {
					failures = append(failures, fmt.Sprintf("%v (after %s)", err, took.Round(time.Millisecond)))
				} else {
					published[m.UUID] = true
				}
				mu.Unlock()
			}
		}()
	}
	count := func() int {
		mu.Lock()
		defer mu.Unlock()
		return len(published)
	}
	require.Eventually(t, func() bool { return count() >= 200 }, time.Minute, 10*time.Millisecond, "publishes before the restart")
	before := count()
	srv.Restart(2 * time.Second)
	require.Eventually(t, func() bool { return count() >= before+200 }, time.Minute, 10*time.Millisecond, "publishes after the restart")
	close(stop)
	producers.Wait()

	mu.Lock()
	require.Empty(t, failures, "no publish fails across the restart")
	n := len(published)
	mu.Unlock()

	nc, err := natsgo.Connect(srv.URL())
	require.NoError(t, err)
	defer nc.Close()
	js, err := jetstream.New(nc)
	require.NoError(t, err)
	info := func() (*jetstream.StreamInfo, *jetstream.ConsumerInfo) {
		c, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		s, err := js.Stream(c, cfg.StreamName(topic))
		require.NoError(t, err)
		si, err := s.Info(c)
		require.NoError(t, err)
		cons, err := s.Consumer(c, "billing")
		require.NoError(t, err)
		ci, err := cons.Info(c)
		require.NoError(t, err)
		return si, ci
	}
	si, _ := info()
	require.Equal(t, uint64(n), si.State.Msgs, "the stream holds each published message once")

	require.Eventually(t, func() bool {
		_, ci := info()
		return ci.NumPending == 0 && ci.NumAckPending == 0
	}, time.Minute, 50*time.Millisecond, "the subscription consumes and acks every message")
	cancel()
	<-consumed
	mu.Lock()
	defer mu.Unlock()
	for id := range published {
		require.Positive(t, received[id], "message %s received", id)
	}
	require.Len(t, received, n, "nothing received that was not published")
	redelivered := 0
	for _, c := range received {
		redelivered += c - 1
	}
	t.Logf("%d messages published across a restart, the slowest Publish took %s; %d received, %d of them more than once",
		n, slowest.Round(time.Millisecond), len(received), redelivered)
}
