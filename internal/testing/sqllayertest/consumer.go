package sqllayertest

import (
	"context"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/dedup"
	"github.com/oncemill/oncemill/middleware"
)

// consumer is a consumer as an application runs it: a router whose
// handler runs behind the poison middleware (dead letters into the
// dead-letter table) and the inbox (on the inbox table beside it). Its
// effect is counted per key each time the handler succeeds.
type consumer struct {
	e     *env
	name  string
	store inboxStore
	// fail decides whether the handler fails for a key; nil for none.
	fail func(key string) error

	mu      sync.Mutex
	effects map[string]int
	calls   map[string]int
	// applied is the payload of the last copy applied, per key.
	applied map[string]string
}

// newConsumer returns a consumer named name on the env's inbox; fail,
// when not nil, gives the handler's error for a key.
func (e *env) newConsumer(name string, fail func(key string) error) *consumer {
	return &consumer{e: e, name: name, store: e.inbox(), fail: fail, effects: map[string]int{}, calls: map[string]int{}, applied: map[string]string{}}
}

// key is the consumer's inbox key k.
func (c *consumer) key(k string) dedup.Key { return dedup.Key{Consumer: c.name, Key: k} }

// run starts a router that consumes topic from sub, and returns the
// function that stops it (also called when the subtest ends).
func (c *consumer) run(topic string, sub message.Subscriber) (stop func()) {
	t := c.e.t
	t.Helper()
	inbox, err := middleware.NewInbox(middleware.InboxConfig{TxStore: c.store, Consumer: c.name})
	require.NoError(t, err)
	poison, err := middleware.NewPoison(middleware.PoisonConfig{
		Inbox: inbox, Publisher: c.e.dlqPublisher(), MaxAttempts: 2,
		InitialBackoff: time.Millisecond, MaxBackoff: 5 * time.Millisecond,
	})
	require.NoError(t, err)
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
	require.NoError(t, err)
	router.AddMiddleware(poison.Middleware, inbox.Middleware)
	router.AddConsumerHandler(c.name, topic, sub, func(msg *message.Message) error {
		key := middleware.IdempotencyKey(msg.Context())
		c.mu.Lock()
		c.calls[key]++
		c.mu.Unlock()
		if c.fail != nil {
			if err := c.fail(key); err != nil {
				return err
			}
		}
		c.mu.Lock()
		c.effects[key]++
		c.applied[key] = string(msg.Payload)
		c.mu.Unlock()
		return nil
	})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- router.Run(ctx) }()
	<-router.Running()
	var once sync.Once
	stop = func() {
		once.Do(func() {
			cancel()
			require.NoError(t, <-done)
			require.NoError(t, router.Close())
		})
	}
	t.Cleanup(stop)
	return stop
}

// effectsOf is how many times the handler applied key.
func (c *consumer) effectsOf(key string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.effects[key]
}

// callsOf is how many times the handler ran for key.
func (c *consumer) callsOf(key string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.calls[key]
}

// appliedOf is the payload the handler last applied for key.
func (c *consumer) appliedOf(key string) string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.applied[key]
}
