package redis_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	goredis "github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/oncemill/oncemill/dedup"
	"github.com/oncemill/oncemill/dedup/redis"
	dlv "github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/internal/testing/msgtest"
	"github.com/oncemill/oncemill/internal/testing/redistest"
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
	msg.Metadata.Set(dlv.IdempotencyKey, key)
	return msg
}

// harness runs a lease-mode inbox under a real Watermill router (see
// msgtest.Harness) and counts the handler's runs per key: the effect.
type harness struct {
	*msgtest.Harness
	inbox *middleware.Inbox

	mu      sync.Mutex
	effects map[string]int
}

func newHarness(t *testing.T, store dedup.LeaseStore, handlers int) *harness {
	t.Helper()
	inbox, err := middleware.NewInbox(middleware.InboxConfig{
		LeaseStore: store,
		Consumer:   "payments",
		Lease:      time.Minute,
		Tuning:     middleware.InboxTuning{InFlightDelay: 5 * time.Millisecond},
	})
	require.NoError(t, err)
	h := &harness{inbox: inbox, effects: map[string]int{}}
	h.Harness = msgtest.StartHarness(t, msgtest.HarnessConfig{
		Name:        "payments",
		Handlers:    handlers,
		Middlewares: []message.HandlerMiddleware{inbox.Middleware},
		Expected:    []error{redis.ErrUnavailable, middleware.ErrInFlight},
		Handler: func(msg *message.Message) error {
			key := middleware.IdempotencyKey(msg.Context())
			h.mu.Lock()
			h.effects[key]++
			h.mu.Unlock()
			return nil
		},
	})
	return h
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

// waitBreakerClosed makes peeks, which may probe Redis, until the store's
// breaker is closed, and returns how long that took; it fails the test
// after within. Each peek made while the breaker is open fails open.
func waitBreakerClosed(t *testing.T, store *redis.Store, within time.Duration) time.Duration {
	t.Helper()
	start := time.Now()
	require.Eventually(t, func() bool {
		if _, err := store.InboxPeek(context.Background(), dedup.Key{Consumer: "probe", Key: "probe"}); err != nil {
			t.Errorf("peek under FailOpen: %v", err)
		}
		return !store.Stats().BreakerOpen
	}, within, 10*time.Millisecond, "the breaker closes once Redis answers a probe")
	return time.Since(start)
}
