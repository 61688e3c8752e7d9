package msgtest

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/delivery"
)

// HarnessConfig configures [StartHarness].
type HarnessConfig struct {
	// Name prefixes the handlers' names and topics.
	Name string
	// Handlers is how many handlers of one consumer run, each on a topic
	// of its own.
	Handlers int
	// Middlewares wrap every handler, outermost first (the inbox).
	Middlewares []message.HandlerMiddleware
	// Handler is the business handler.
	Handler message.NoPublishHandlerFunc
	// Expected are the errors a delivery may end with that are counted by
	// class ([Harness.Count]) rather than as unexpected: errors.Is
	// decides.
	Expected []error
}

// Harness runs middlewares under a real Watermill router on a GoChannel:
// several handlers of one consumer, each on a topic of its own, so that
// copies of one key published to different topics are delivered
// concurrently. A nacked delivery pauses 2ms, as a retry middleware would,
// and the GoChannel redelivers it.
type Harness struct {
	t      testing.TB
	pubSub *gochannel.GoChannel
	topics []string

	expected []error
	counts   []atomic.Int64 // by index of expected
	acked    atomic.Int64
	other    atomic.Int64
	first    atomic.Value

	// gate is held for reading by every delivery while it runs, and for
	// writing by Pause.
	gate sync.RWMutex
}

// StartHarness starts the router; it stops when the test ends.
func StartHarness(t testing.TB, cfg HarnessConfig) *Harness {
	t.Helper()
	logger := watermill.NopLogger{}
	h := &Harness{
		t:        t,
		pubSub:   gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 1024}, logger),
		expected: cfg.Expected,
		counts:   make([]atomic.Int64, len(cfg.Expected)),
	}
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, logger)
	require.NoError(t, err)
	router.AddMiddleware(h.observe)
	router.AddMiddleware(cfg.Middlewares...)
	for i := 0; i < cfg.Handlers; i++ {
		topic := fmt.Sprintf("%s-%d", cfg.Name, i)
		h.topics = append(h.topics, topic)
		router.AddConsumerHandler(topic, topic, h.pubSub, cfg.Handler)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- router.Run(ctx) }()
	<-router.Running()
	t.Cleanup(func() {
		cancel()
		require.NoError(t, <-done)
		require.NoError(t, router.Close())
		require.NoError(t, h.pubSub.Close())
	})
	return h
}

func (h *Harness) observe(next message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		h.gate.RLock()
		out, err := next(msg)
		h.gate.RUnlock()
		if err == nil {
			h.acked.Add(1)
			return out, nil
		}
		counted := false
		for i, e := range h.expected {
			if errors.Is(err, e) {
				h.counts[i].Add(1)
				counted = true
				break
			}
		}
		if !counted {
			h.other.Add(1)
			h.first.CompareAndSwap(nil, err.Error())
		}
		time.Sleep(2 * time.Millisecond)
		return nil, err
	}
}

// Count returns how many deliveries ended with err, one of the expected
// errors.
func (h *Harness) Count(err error) int64 {
	for i, e := range h.expected {
		if e == err {
			return h.counts[i].Load()
		}
	}
	h.t.Fatalf("msgtest: %v is not one of the harness's expected errors", err)
	return 0
}

// Acked returns how many deliveries were acked.
func (h *Harness) Acked() int64 { return h.acked.Load() }

// Pause waits until no delivery is running and holds new ones back until
// Resume.
func (h *Harness) Pause() { h.gate.Lock() }

// Resume lets deliveries run again.
func (h *Harness) Resume() { h.gate.Unlock() }

// Publish publishes copies deliveries of each key (a new UUID each, the
// key as idempotency key and payload), copy c to handler c modulo the
// number of handlers.
func (h *Harness) Publish(keys []string, copies int) {
	h.t.Helper()
	for c := 0; c < copies; c++ {
		topic := h.topics[c%len(h.topics)]
		for _, k := range keys {
			msg := message.NewMessage(watermill.NewUUID(), []byte(k))
			msg.Metadata.Set(delivery.IdempotencyKey, k)
			require.NoError(h.t, h.pubSub.Publish(topic, msg))
		}
	}
}

// WaitAcked waits until at least n deliveries were acked, failing the test
// after a minute: a liveness bound, not a measurement.
func (h *Harness) WaitAcked(n int64) {
	h.t.Helper()
	WaitFor(h.t, fmt.Sprintf("%d acked deliveries", n), func() bool { return h.acked.Load() >= n })
}

// RequireNoOtherErrors fails the test if a delivery ended with an error
// that is not one of the expected ones.
func (h *Harness) RequireNoOtherErrors() {
	h.t.Helper()
	require.Zero(h.t, h.other.Load(), "unexpected handler error: %v", h.first.Load())
}

// WaitFor polls cond until it holds, failing the test after a minute: a
// liveness bound, not a measurement.
func WaitFor(t testing.TB, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(time.Minute)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// Keys returns n keys: prefix-0 … prefix-(n-1).
func Keys(prefix string, n int) []string {
	out := make([]string, n)
	for i := range out {
		out[i] = fmt.Sprintf("%s-%d", prefix, i)
	}
	return out
}
