package middleware_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/dedup"
	dlv "github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/internal/testing/msgtest"
	"github.com/oncemill/oncemill/internal/testing/pgtest"
	"github.com/oncemill/oncemill/middleware"
	"github.com/oncemill/oncemill/observe"
)

// TestHandlerErrorWrappingEOFIsTheMessages: a handler whose payload fails
// to decode returns an error that wraps io.EOF, and one whose HTTP call is
// refused returns a net.Error. Both are the message's failures, whatever
// they wrap: counted, and dead-lettered after MaxAttempts with no effect.
// Both used to be taken for a store outage (the store scanned the
// handler's error chain) and retried forever.
func TestHandlerErrorWrappingEOFIsTheMessages(t *testing.T) {
	t.Parallel()
	closed, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	refused := closed.Addr().String()
	require.NoError(t, closed.Close())

	for name, fail := range map[string]func() error{
		"empty body": func() error {
			var v struct{ OrderID string }
			return json.NewDecoder(bytes.NewReader(nil)).Decode(&v) // io.EOF
		},
		"connection refused": func() error {
			c, err := net.DialTimeout("tcp", refused, time.Second)
			if err == nil {
				_ = c.Close()
				return errors.New("a closed port accepted")
			}
			return err // *net.OpError wrapping ECONNREFUSED
		},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			b := postgresBackend(t, 4)
			rig := startPoisonRig(t, b, middleware.PoisonConfig{MaxAttempts: 3}, func(int32, *message.Message) error {
				return fail()
			})
			rig.publish(t, "order-"+name)
			dead := msgtest.Receive(t, rig.dead, 30*time.Second)
			require.Equal(t, "3", dead.Metadata.Get(dlv.DeadAttempts))
			require.Equal(t, int32(3), rig.calls.Load(), "three runs, then the dead-letter queue")
			require.Equal(t, 0, b.effects(t))
			require.Zero(t, rig.poison.Stats().Infrastructure, "never taken for an outage")
			msgtest.Nothing(t, rig.dead, 100*time.Millisecond)
		})
	}
}

// TestUnavailableIsNeverDeadLettered: a handler that says its downstream
// is down (middleware.Unavailable) is nacked without counting, even past
// MaxAttempts, and applied once when the downstream is back; in both
// modes.
func TestUnavailableIsNeverDeadLettered(t *testing.T) {
	t.Parallel()
	b := postgresBackend(t, 4)
	const outage = 5
	rig := startPoisonRig(t, b, middleware.PoisonConfig{MaxAttempts: 2}, func(n int32, _ *message.Message) error {
		if n <= outage {
			return middleware.Unavailable(errors.New("payment API: 503 Service Unavailable"))
		}
		return nil
	})
	rig.publish(t, "order-503")
	require.Eventually(t, func() bool { return b.effects(t) == 1 }, 30*time.Second, 5*time.Millisecond)
	require.Equal(t, int32(outage+1), rig.calls.Load())
	msgtest.Nothing(t, rig.dead, 100*time.Millisecond)
	require.Equal(t, int64(outage), rig.poison.Stats().Infrastructure)
	require.Equal(t, 1, b.attempts(t, "charge", "order-503"), "only the run that applied it is counted")

	require.True(t, middleware.IsInfrastructure(middleware.Unavailable(errors.New("x"))))
	require.NoError(t, middleware.Unavailable(nil))
}

// TestUnavailableInLeaseMode: the same in lease mode: the lease is given
// back with its count taken back.
func TestUnavailableInLeaseMode(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t, 4)
	b := postgresBackendIn(t, pool, pgtest.Schema(t, pool))
	store := b.store.(dedup.LeaseStore)
	in := newInbox(t, middleware.InboxConfig{LeaseStore: store, Consumer: "mailer"})
	var runs atomic.Int32
	h := in.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		if runs.Add(1) <= 3 {
			return nil, middleware.Unavailable(errors.New("smtp: connection refused"))
		}
		return nil, nil
	})
	msg := delivery("mail-1", "hello")
	for range 3 {
		_, err := h(msg)
		require.True(t, middleware.IsInfrastructure(err), "%v", err)
	}
	_, err := h(msg)
	require.NoError(t, err)
	require.Equal(t, 1, b.attempts(t, "mailer", "mail-1"), "the three outages took their counts back")
	require.Equal(t, int64(3), in.Stats().Infrastructure)
}

// TestOutagesMidAttemptNeverAddUp: with MaxAttempts 2, the inbox loses
// its database (every connection cut, new ones refused; the server stays
// up) after the attempt was counted and before its COMMIT, three times,
// and each time the database stays out of reach until the attempt has
// ended, so that the inbox cannot take the count back then. The message
// is applied once and never dead-lettered: the counts are taken back when
// the store answers again. It used to be dead-lettered as a crash loop at
// the third outage, its handler never run again.
func TestOutagesMidAttemptNeverAddUp(t *testing.T) {
	t.Parallel()
	for name, pipelined := range map[string]bool{"plain": false, "pipelined": true} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			admin := pgtest.Pool(t, 2)
			schema := pgtest.Schema(t, admin)
			server, closed := testServer(t), closedPort(t)
			var down atomic.Bool
			app := pgtest.Name(t)
			pool := testPool(t, func(cfg *pgxpool.Config) {
				dialing(time.Second, func() string {
					if down.Load() {
						return closed
					}
					return server
				})(cfg)
				cfg.ConnConfig.RuntimeParams["application_name"] = app
			})
			b := postgresBackendIn(t, pool, schema)
			const outages = 3
			stopped := make(chan struct{}, outages)
			rig := startPoisonRigWith(t, b, middleware.PoisonConfig{MaxAttempts: 2},
				middleware.InboxConfig{Tuning: middleware.InboxTuning{Pipeline: pipelineMode(pipelined)}},
				func(n int32, _ *message.Message) error {
					if n <= outages {
						// The effect and the COMMIT that follow fail.
						down.Store(true)
						_, err := admin.Exec(context.Background(),
							`SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = $1`, app)
						require.NoError(t, err)
						stopped <- struct{}{}
					}
					return nil
				})
			rig.publish(t, "order-outage")
			for i := range outages {
				select {
				case <-stopped:
				case <-time.After(60 * time.Second):
					t.Fatalf("outage %d: the handler did not run again (inbox %+v, %d dead letters)", i+1, rig.inbox.Stats(), len(rig.dead))
				}
				require.Eventually(t, func() bool { return rig.poison.Stats().Infrastructure >= int64(2*(i+1)) }, 60*time.Second, 5*time.Millisecond,
					"the attempt ends for the outage, and a redelivery finds the database out of reach")
				down.Store(false)
			}
			require.Eventually(t, func() bool { return b.effects(t) == 1 }, 60*time.Second, 10*time.Millisecond)
			msgtest.Nothing(t, rig.dead, 200*time.Millisecond)
			require.Equal(t, int32(outages+1), rig.calls.Load())
			require.Zero(t, rig.inbox.Stats().CrashLooped)
			require.Equal(t, 1, b.effects(t))
		})
	}
}

// closedPort is a host:port on which nothing listens.
func closedPort(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	addr := l.Addr().String()
	require.NoError(t, l.Close())
	return addr
}

// TestConcurrentCopiesCountOnlyTheirRuns: copies of one failing key that
// arrive together wait on each other's claim; a copy that waits has not
// run, and the key is dead-lettered only after MaxAttempts runs.
func TestConcurrentCopiesCountOnlyTheirRuns(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		copies, max int
		pipelined   bool
	}{{3, 2, false}, {5, 3, false}, {3, 2, true}, {5, 3, true}} {
		b := postgresBackend(t, int32(c.copies+4))
		var runs atomic.Int32
		p, dead := poisonInFront(t, b, c.max)
		h := p.Middleware(newInbox(t, middleware.InboxConfig{TxStore: b.store, Consumer: "charge", Tuning: middleware.InboxTuning{Pipeline: pipelineMode(c.pipelined)}}).Middleware(
			func(msg *message.Message) ([]*message.Message, error) {
				runs.Add(1)
				time.Sleep(300 * time.Millisecond) // the other copies queue on the claim
				return nil, errors.New("card declined")
			}))
		var wg sync.WaitGroup
		for range c.copies {
			wg.Go(func() {
				_, _ = h(delivery("order-together", "charge"))
			})
		}
		wg.Wait()
		require.Equal(t, 1, dead(), "dead-lettered once")
		require.Equal(t, int32(c.max), runs.Load(), "%d copies, MaxAttempts %d, pipelined %t: it ran MaxAttempts times before the dead letter", c.copies, c.max, c.pipelined)
		require.Equal(t, 0, b.effects(t))
	}
}

// TestTopicLabelFromTheRouter: a producer that sets oncemill_topic on a
// GoChannel message does not choose the hooks' topic label: it is the
// topic the router subscribed to.
func TestTopicLabelFromTheRouter(t *testing.T) {
	t.Parallel()
	b := postgresBackend(t, 4)
	rec := &recorder{}
	in := newInbox(t, middleware.InboxConfig{TxStore: b.store, Hooks: []observeHook{rec}})
	pubSub := gochannel.NewGoChannel(gochannel.Config{Persistent: true}, watermill.NopLogger{})
	router, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	require.NoError(t, err)
	router.AddMiddleware(in.Middleware)
	router.AddConsumerHandler("charge", "orders", pubSub, func(msg *message.Message) error {
		return b.effect(msg.Context(), middleware.IdempotencyKey(msg.Context()))
	})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- router.Run(ctx) }()
	<-router.Running()
	t.Cleanup(func() { cancel(); require.NoError(t, <-done) })

	for i := range 3 {
		msg := delivery("forged-"+string(rune('a'+i)), "x")
		msg.Metadata.Set(dlv.Topic, "forged-topic-"+msg.UUID)
		require.NoError(t, pubSub.Publish("orders", msg))
	}
	require.Eventually(t, func() bool { return b.effects(t) == 3 }, 30*time.Second, 5*time.Millisecond)
	// The hooks hear of an attempt once it has committed and returned.
	require.Eventually(t, func() bool {
		rec.mu.Lock()
		defer rec.mu.Unlock()
		return len(rec.attempts) == 3
	}, 30*time.Second, 5*time.Millisecond)
	rec.mu.Lock()
	defer rec.mu.Unlock()
	require.Len(t, rec.attempts, 3)
	for _, a := range rec.attempts {
		require.Equal(t, "orders", a.Topic)
	}
}

type observeHook = observe.Hook

// poisonInFront is a poison middleware with maxAttempts that
// dead-letters into a GoChannel topic, and a count of what it
// dead-lettered so far.
func poisonInFront(t *testing.T, b txBackend, maxAttempts int) (*middleware.Poison, func() int) {
	t.Helper()
	var n atomic.Int32
	pub := publisherFunc(func(string, ...*message.Message) error { n.Add(1); return nil })
	p, err := middleware.NewPoison(middleware.PoisonConfig{MaxAttempts: maxAttempts, Publisher: pub, Topic: deadTopic,
		InitialBackoff: time.Millisecond, MaxBackoff: time.Millisecond})
	require.NoError(t, err)
	return p, func() int { return int(n.Load()) }
}

// publisherFunc is a message.Publisher that calls itself.
type publisherFunc func(topic string, msgs ...*message.Message) error

func (f publisherFunc) Publish(topic string, msgs ...*message.Message) error {
	return f(topic, msgs...)
}
func (f publisherFunc) Close() error { return nil }

// TestCloseDrainsInFlightHandlers: the router closes while a handler is
// in the middle of its work, done through msg.Context(). The handler
// keeps a live context for DrainTimeout: its effect is committed and the
// message acked. A handler slower than the budget is cancelled when it
// runs out, rolled back and not counted. Watermill's router cancels every
// in-flight context at once, and such work used to be thrown away.
func TestCloseDrainsInFlightHandlers(t *testing.T) {
	t.Parallel()
	for name, c := range map[string]struct {
		work, drain time.Duration
		applied     int
	}{
		"within the budget": {work: time.Second, drain: 10 * time.Second, applied: 1},
		"past the budget":   {work: time.Minute, drain: 300 * time.Millisecond, applied: 0},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			b := postgresBackend(t, 4)
			in := newInbox(t, middleware.InboxConfig{TxStore: b.store, DrainTimeout: c.drain})
			pubSub := gochannel.NewGoChannel(gochannel.Config{Persistent: true}, watermill.NopLogger{})
			router, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
			require.NoError(t, err)
			router.AddMiddleware(in.Middleware)
			running := make(chan struct{})
			var workErr atomic.Value
			router.AddConsumerHandler("charge", "orders", pubSub, func(msg *message.Message) error {
				ctx := msg.Context()
				close(running)
				select {
				case <-time.After(c.work):
				case <-ctx.Done():
					workErr.Store(ctx.Err())
					return ctx.Err()
				}
				return b.effect(ctx, middleware.IdempotencyKey(ctx))
			})
			done := make(chan error, 1)
			go func() { done <- router.Run(context.Background()) }()
			<-router.Running()

			msg := delivery("order-drain", "charge")
			require.NoError(t, pubSub.Publish("orders", msg))
			<-running
			require.NoError(t, router.Close())
			require.NoError(t, <-done)

			require.Equal(t, c.applied, b.effects(t))
			st := in.Stats()
			if c.applied == 1 {
				require.Nil(t, workErr.Load(), "the handler's context stayed live")
				require.Equal(t, int64(1), st.Applied)
				require.Equal(t, 1, b.attempts(t, "charge", "order-drain"))
			} else {
				require.ErrorIs(t, workErr.Load().(error), context.Canceled)
				require.Equal(t, int64(1), st.Abandoned, "rolled back, not counted")
				require.Equal(t, -1, b.attempts(t, "charge", "order-drain"), "no record of the key")
			}
		})
	}
}

// pipelineMode is PipelineAlways for pipelined, PipelineNever otherwise.
func pipelineMode(pipelined bool) middleware.PipelineMode {
	if pipelined {
		return middleware.PipelineAlways
	}
	return middleware.PipelineNever
}
