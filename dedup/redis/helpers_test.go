package redis_test

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
	goredis "github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/oncemill/oncemill/dedup"
	"github.com/oncemill/oncemill/dedup/redis"
	"github.com/oncemill/oncemill/internal/redistest"
	"github.com/oncemill/oncemill/middleware"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// bundle is a store on the shared test server with a prefix of its own,
// whose keys are deleted when the test ends.
type bundle struct {
	client *goredis.Client
	prefix string
	store  *redis.Store
}

func setup(t *testing.T, cfg redis.Config) bundle {
	t.Helper()
	client := redistest.Client(t)
	prefix := redistest.Prefix(t, client)
	cfg.Client, cfg.Prefix = client, prefix
	store, err := redis.New(cfg)
	require.NoError(t, err)
	return bundle{client: client, prefix: prefix, store: store}
}

// recordKey is the documented layout, for a consumer that needs no
// escaping: <prefix>{<consumer>}:<key>.
func (b bundle) recordKey(key dedup.Key) string {
	return b.prefix + "{" + key.Consumer + "}:" + key.Key
}

// record reads a key's hash.
func (b bundle) record(t *testing.T, key dedup.Key) map[string]string {
	t.Helper()
	h, err := b.client.HGetAll(context.Background(), b.recordKey(key)).Result()
	require.NoError(t, err)
	return h
}

// keyCount counts the Redis keys under the bundle's prefix.
func (b bundle) keyCount(t *testing.T) int {
	t.Helper()
	n := 0
	iter := b.client.Scan(context.Background(), 0, b.prefix+"*", 1000).Iterator()
	for iter.Next(context.Background()) {
		n++
	}
	require.NoError(t, iter.Err())
	return n
}

// delivery returns a new delivery (its own UUID) of the message with key.
func delivery(key string) *message.Message {
	msg := message.NewMessage(watermill.NewUUID(), []byte(key))
	msg.Metadata.Set(middleware.IdempotencyKeyMetadata, key)
	return msg
}

// harness runs a lease-mode inbox under a real Watermill router on a
// GoChannel: several handlers of one consumer, each on a topic of its own,
// so that copies of one key published to different topics are delivered
// concurrently. A nacked message is redelivered by the GoChannel.
type harness struct {
	t      *testing.T
	pubSub *gochannel.GoChannel
	inbox  *middleware.Inbox
	topics []string

	mu      sync.Mutex
	effects map[string]int // handler runs per key: the effect

	acked, unavailable, inFlight atomic.Int64
	otherErrs                    atomic.Int64
	firstOther                   atomic.Value

	// gate is held for reading by every delivery while it runs, and for
	// writing by pause.
	gate sync.RWMutex
}

func newHarness(t *testing.T, store dedup.LeaseStore, handlers int) *harness {
	t.Helper()
	logger := watermill.NopLogger{}
	h := &harness{
		t:       t,
		pubSub:  gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 1024}, logger),
		effects: map[string]int{},
	}
	inbox, err := middleware.NewInbox(middleware.InboxConfig{
		LeaseStore:    store,
		Consumer:      "payments",
		Lease:         time.Minute,
		InFlightDelay: 5 * time.Millisecond,
	})
	require.NoError(t, err)
	h.inbox = inbox

	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, logger)
	require.NoError(t, err)
	router.AddMiddleware(h.observe, inbox.Middleware)
	for i := 0; i < handlers; i++ {
		topic := fmt.Sprintf("payments-%d", i)
		h.topics = append(h.topics, topic)
		router.AddConsumerHandler(topic, topic, h.pubSub, func(msg *message.Message) error {
			key := middleware.IdempotencyKey(msg.Context())
			h.mu.Lock()
			h.effects[key]++
			h.mu.Unlock()
			return nil
		})
	}
	ctx, cancel := context.WithCancel(context.Background())
	routerDone := make(chan error, 1)
	go func() { routerDone <- router.Run(ctx) }()
	<-router.Running()
	t.Cleanup(func() {
		cancel()
		require.NoError(t, <-routerDone)
		require.NoError(t, router.Close())
		require.NoError(t, h.pubSub.Close())
	})
	return h
}

// observe counts how each delivery ended. A failed delivery pauses a
// little before its nack, as a retry middleware would, so that the
// GoChannel does not redeliver it in a tight loop.
func (h *harness) observe(next message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		h.gate.RLock()
		out, err := next(msg)
		h.gate.RUnlock()
		switch {
		case err == nil:
			h.acked.Add(1)
			return out, nil
		case errors.Is(err, redis.ErrUnavailable):
			h.unavailable.Add(1)
		case errors.Is(err, middleware.ErrInFlight):
			h.inFlight.Add(1)
		default:
			h.otherErrs.Add(1)
			h.firstOther.CompareAndSwap(nil, err.Error())
		}
		time.Sleep(2 * time.Millisecond)
		return nil, err
	}
}

// pause waits until no delivery is running and holds new ones back until
// resume.
func (h *harness) pause() { h.gate.Lock() }

// resume lets deliveries run again.
func (h *harness) resume() { h.gate.Unlock() }

// publish publishes copies deliveries of each key, copy c to handler c
// (modulo the number of handlers).
func (h *harness) publish(keys []string, copies int) {
	h.t.Helper()
	for c := 0; c < copies; c++ {
		topic := h.topics[c%len(h.topics)]
		for _, k := range keys {
			require.NoError(h.t, h.pubSub.Publish(topic, delivery(k)))
		}
	}
}

// waitFor polls cond until it holds, failing the test after a minute: a
// liveness bound, not a measurement.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(time.Minute)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func (h *harness) waitAcked(n int64) {
	h.t.Helper()
	waitFor(h.t, fmt.Sprintf("%d acked deliveries", n), func() bool { return h.acked.Load() >= n })
}

func (h *harness) effectsOf(key string) int {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.effects[key]
}

func (h *harness) totalEffects() int {
	h.mu.Lock()
	defer h.mu.Unlock()
	n := 0
	for _, c := range h.effects {
		n += c
	}
	return n
}

func (h *harness) requireNoOtherErrors() {
	h.t.Helper()
	require.Zero(h.t, h.otherErrs.Load(), "unexpected handler error: %v", h.firstOther.Load())
}

func keys(prefix string, n int) []string {
	out := make([]string, n)
	for i := range out {
		out[i] = fmt.Sprintf("%s-%d", prefix, i)
	}
	return out
}
