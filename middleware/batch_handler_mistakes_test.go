package middleware_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/dedup"
	"github.com/oncemill/oncemill/dedup/postgres"
	dlv "github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/internal/testing/pgtest"
	"github.com/oncemill/oncemill/middleware"
)

// routedBulk is a BatchHandler behind Poison and a PostgreSQL inbox on a
// real message.Router: each key is published to a topic of its own (a
// GoChannel subscription hands out one message at a time, and a batch
// needs them together), every topic's handler is the one BatchHandler,
// and the inbox's consumer is shared, so that the deliveries meet in
// its batches. Every delivery is recorded with what the chain returned
// for it: nil acks it, an error nacks it.
type routedBulk struct {
	b      txBackend
	pool   *pgxpool.Pool
	schema string
	inbox  *middleware.Inbox
	poison *middleware.Poison
	router *message.Router
	pubSub *gochannel.GoChannel
	runErr chan error
	logs   *watermill.CaptureLoggerAdapter

	mu        sync.Mutex
	dead      []*message.Message
	delivered map[string][]*message.Message // by key, every delivery
	inboxErrs map[string][]error            // by key, what the inbox returned
}

// newRoutedBulk starts the router with the BatchHandler of the BatchFunc
// that fn makes as every topic's handler; batch is the inbox's
// Tuning.Batch.MaxMessages (0: batching off).
func newRoutedBulk(t *testing.T, keys []string, batch, maxAttempts int, fn func(r *routedBulk) middleware.BatchFunc) *routedBulk {
	return newRouted(t, keys, batch, maxAttempts, func(r *routedBulk) message.NoPublishHandlerFunc {
		return middleware.BatchHandler(fn(r))
	})
}

// newRouted starts the router with the handler that h makes as every
// topic's handler.
func newRouted(t *testing.T, keys []string, batch, maxAttempts int, h func(r *routedBulk) message.NoPublishHandlerFunc) *routedBulk {
	t.Helper()
	pool := pgtest.Pool(t, 8)
	schema := pgtest.Schema(t, pool)
	r := &routedBulk{b: postgresBackendIn(t, pool, schema), pool: pool, schema: schema,
		delivered: map[string][]*message.Message{}, inboxErrs: map[string][]error{}, runErr: make(chan error, 1),
		logs: watermill.NewCaptureLogger()}
	r.inbox = newInbox(t, middleware.InboxConfig{TxStore: r.b.store, Consumer: "charge", Logger: r.logs,
		Tuning: middleware.InboxTuning{Batch: middleware.BatchConfig{MaxMessages: batch, Parallel: 1, Linger: 300 * time.Millisecond}}})
	var err error
	r.poison, err = middleware.NewPoison(middleware.PoisonConfig{Inbox: r.inbox, MaxAttempts: maxAttempts, Topic: deadTopic,
		InitialBackoff: time.Millisecond, MaxBackoff: 5 * time.Millisecond, Logger: watermill.NopLogger{},
		Publisher: publisherFunc(func(_ string, msgs ...*message.Message) error {
			r.mu.Lock()
			r.dead = append(r.dead, msgs...)
			r.mu.Unlock()
			return nil
		})})
	require.NoError(t, err)
	r.pubSub = gochannel.NewGoChannel(gochannel.Config{Persistent: true}, watermill.NopLogger{})
	t.Cleanup(func() { require.NoError(t, r.pubSub.Close()) })
	r.router, err = message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
	require.NoError(t, err)
	record := func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			r.mu.Lock()
			key := msg.Metadata.Get(dlv.IdempotencyKey)
			r.delivered[key] = append(r.delivered[key], msg)
			r.mu.Unlock()
			return h(msg)
		}
	}
	inboxErr := func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			produced, err := h(msg)
			r.mu.Lock()
			key := msg.Metadata.Get(dlv.IdempotencyKey)
			r.inboxErrs[key] = append(r.inboxErrs[key], err)
			r.mu.Unlock()
			return produced, err
		}
	}
	r.router.AddMiddleware(record, r.poison.Middleware, inboxErr, r.inbox.Middleware)
	handler := h(r)
	for _, key := range keys {
		r.router.AddConsumerHandler("charge-"+key, "orders-"+key, r.pubSub, handler)
	}
	go func() { r.runErr <- r.router.Run(context.Background()) }()
	<-r.router.Running()
	t.Cleanup(func() {
		// A failed step must not leave the router running; Close is
		// idempotent.
		_ = r.router.Close()
	})
	for _, key := range keys {
		msg := message.NewMessage(watermill.NewUUID(), []byte("charge "+key))
		msg.Metadata.Set(dlv.IdempotencyKey, key)
		require.NoError(t, r.pubSub.Publish("orders-"+key, msg))
	}
	return r
}

// settled reports whether every key has a delivery that was acked.
func (r *routedBulk) settled(keys []string) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, key := range keys {
		acked := false
		for _, msg := range r.delivered[key] {
			select {
			case <-msg.Acked():
				acked = true
			default:
			}
		}
		if !acked {
			return false
		}
	}
	return true
}

// awaitSettled waits until every key's message is acked, then closes the
// router, which must not wait out its timeout.
func (r *routedBulk) awaitSettled(t *testing.T, keys []string) {
	t.Helper()
	require.Eventually(t, func() bool { return r.settled(keys) }, 30*time.Second, 10*time.Millisecond,
		"every message acked: applied or dead-lettered")
	began := time.Now()
	require.NoError(t, r.router.Close(), "the router closes: no handler hangs")
	require.NoError(t, <-r.runErr)
	require.Less(t, time.Since(began), 5*time.Second, "the router closed without waiting out its timeout")
}

func (r *routedBulk) deadLetters() map[string]*message.Message {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := map[string]*message.Message{}
	for _, msg := range r.dead {
		out[msg.Metadata.Get(dlv.IdempotencyKey)] = msg
	}
	return out
}

// inboxErrors returns what the inbox returned for key's deliveries.
func (r *routedBulk) inboxErrors(key string) []error {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.inboxErrs[key])
}

// TestBatchErrorsThatFailNoMessageFailIt: sixteen keys reach a
// BatchHandler behind Poison (MaxAttempts 3) and a PostgreSQL inbox on a
// router, with batching off (each message runs alone) and on (sixteen in
// a batch, a key retried after a failure running alone). The BatchFunc
// writes every message's effect but order-7's, and for order-7 returns a
// BatchErrors that fails none of its messages: keyed by the idempotency
// key instead of the UUID, empty, wrapped empty, naming an unknown UUID,
// or naming every message with a nil error. order-7 used to be marked
// done with its effect missing. Now it is never applied: each of its
// attempts fails with ErrBatchErrorsFailNone, and it is dead-lettered
// once after three with the reason, naming the fix; the fifteen others
// are applied once each and acked.
func TestBatchErrorsThatFailNoMessageFailIt(t *testing.T) {
	t.Parallel()
	const victim = "order-7"
	keys := orderKeys(16)
	for name, bad := range map[string]func(msgs []*message.Message, m *message.Message) error{
		"keyed by the idempotency key": func(_ []*message.Message, m *message.Message) error {
			return middleware.BatchErrors{m.Metadata.Get(dlv.IdempotencyKey): errors.New("card declined")}
		},
		"empty": func([]*message.Message, *message.Message) error { return middleware.BatchErrors{} },
		"wrapped empty": func([]*message.Message, *message.Message) error {
			return fmt.Errorf("bulk charge: %w", middleware.BatchErrors{})
		},
		"unknown uuid": func([]*message.Message, *message.Message) error {
			return middleware.BatchErrors{watermill.NewUUID(): errors.New("card declined")}
		},
		"nil for all": func(msgs []*message.Message, _ *message.Message) error {
			be := middleware.BatchErrors{}
			for _, msg := range msgs {
				be[msg.UUID] = nil
			}
			return be
		},
	} {
		for _, batch := range []int{0, 16} {
			t.Run(fmt.Sprintf("%s/batch %d", name, batch), func(t *testing.T) {
				t.Parallel()
				rig := newRoutedBulk(t, keys, batch, 3, func(rig *routedBulk) middleware.BatchFunc {
					return func(ctx context.Context, msgs []*message.Message) error {
						var failing *message.Message
						for _, msg := range msgs {
							key := middleware.IdempotencyKey(msg.Context())
							if key == victim {
								failing = msg
								continue
							}
							if err := rig.b.effect(ctx, key); err != nil {
								return err
							}
						}
						if failing != nil {
							return bad(msgs, failing)
						}
						return nil
					}
				})
				rig.awaitSettled(t, keys)

				dead := rig.deadLetters()
				require.Len(t, dead, 1, "order-7 alone dead-lettered")
				require.Contains(t, dead, victim)
				require.Equal(t, "3", dead[victim].Metadata.Get(dlv.DeadAttempts))
				reason := dead[victim].Metadata.Get(dlv.DeadError)
				require.Contains(t, reason, "fails none of its messages", "the dead letter says why")
				require.Contains(t, reason, "return nil when every effect is written", "and how to fix it")
				require.Equal(t, "dead", rig.b.status(t, "charge", victim), "never marked done")
				require.Zero(t, effectsOf(t, rig.pool, rig.schema, victim))
				failures := 0
				for _, err := range rig.inboxErrors(victim) {
					if err != nil {
						require.ErrorIs(t, err, middleware.ErrBatchErrorsFailNone)
						failures++
					}
				}
				require.Equal(t, 3, failures, "each of its three attempts failed with the reason")
				for _, key := range keys {
					if key == victim {
						continue
					}
					require.Equal(t, 1, effectsOf(t, rig.pool, rig.schema, key), key)
					require.Equal(t, "done", rig.b.status(t, "charge", key), key)
				}
				require.Equal(t, 15, rig.b.effects(t))
				st := rig.inbox.Stats()
				require.Equal(t, int64(15), st.Applied)
				require.Equal(t, int64(3), st.Failed, "order-7's attempts, and no other")
				t.Logf("dead letter's reason: %s", reason)
			})
		}
	}
}

// TestBatchHandlerNilIsRefused: BatchHandler(nil) is refused where it is
// written, with the reason, not at the first message.
func TestBatchHandlerNilIsRefused(t *testing.T) {
	t.Parallel()
	require.PanicsWithError(t, "middleware: BatchHandler needs a BatchFunc, got nil", func() { middleware.BatchHandler(nil) })
}

// TestBatchFuncThatEndsItsTransaction: fifteen keys reach a BatchHandler
// in one batch on a router; the BatchFunc writes their effects, then
// commits, or rolls back, the batch's transaction itself. That used to
// panic in the batch's leader and leave its fourteen mates neither acked
// nor nacked; then to commit the done marks of messages whose effects
// were not written. Now the transaction a handler is given refuses to
// be ended (dedup.ErrTxOwned): the call does nothing and returns the
// error, which the function returns. The same code fails every attempt
// the same way, so each message is dead-lettered once, at once, with
// ErrTxEnded and the fix in its reason; no effect stays (the inbox rolled
// the transaction back), no delivery hangs and the router closes.
func TestBatchFuncThatEndsItsTransaction(t *testing.T) {
	t.Parallel()
	keys := orderKeys(15)
	for _, end := range []string{"commit", "rollback"} {
		t.Run(end, func(t *testing.T) {
			t.Parallel()
			rig := newRoutedBulk(t, keys, 16, 3, func(rig *routedBulk) middleware.BatchFunc {
				return func(ctx context.Context, msgs []*message.Message) error {
					for _, msg := range msgs {
						if err := rig.b.effect(ctx, middleware.IdempotencyKey(msg.Context())); err != nil {
							return err
						}
					}
					if end == "commit" {
						return postgres.Tx(ctx).Commit(ctx)
					}
					return postgres.Tx(ctx).Rollback(ctx)
				}
			})
			rig.awaitSettled(t, keys)

			require.Zero(t, rig.b.effects(t), "no effect stays: the inbox rolled the transaction back")
			dead := rig.deadLetters()
			require.Len(t, dead, len(keys), "each dead-lettered once")
			for _, key := range keys {
				require.Contains(t, dead, key)
				reason := dead[key].Metadata.Get(dlv.DeadError)
				require.Contains(t, reason, middleware.ErrTxEnded.Error(), key)
				require.Contains(t, reason, end+": "+dedup.ErrTxOwned.Error(), key)
				require.Equal(t, "dead", rig.b.status(t, "charge", key), key)
			}
			t.Logf("%s: %d dead letters, the first's reason %q", end, len(dead), dead[keys[0]].Metadata.Get(dlv.DeadError))
		})
	}
}

// TestHandlerThatEndsItsTransactionInABatch: eight keys in one batch on a
// router; the handler of order-3 commits the batch's transaction itself
// and then returns an error. That used to commit its mates' done marks
// with it, or panic the batch's leader. Now the commit is refused
// (dedup.ErrTxOwned): order-3 is dead-lettered with ErrTxEnded and no
// effect, its seven mates are applied once each and none is
// dead-lettered.
func TestHandlerThatEndsItsTransactionInABatch(t *testing.T) {
	t.Parallel()
	keys := orderKeys(8)
	rig := newRouted(t, keys, 16, 3, func(rig *routedBulk) message.NoPublishHandlerFunc {
		return func(msg *message.Message) error {
			ctx := msg.Context()
			key := middleware.IdempotencyKey(ctx)
			if err := rig.b.effect(ctx, key); err != nil {
				return err
			}
			if key == "order-3" {
				if err := postgres.Tx(ctx).Commit(ctx); err != nil {
					return err
				}
				return errors.New("charged it myself")
			}
			return nil
		}
	})
	rig.awaitSettled(t, keys)

	dead := rig.deadLetters()
	require.Len(t, dead, 1, "only the message whose handler ended the transaction is dead-lettered")
	require.Contains(t, dead, "order-3")
	require.Contains(t, dead["order-3"].Metadata.Get(dlv.DeadError), middleware.ErrTxEnded.Error())
	require.Contains(t, dead["order-3"].Metadata.Get(dlv.DeadError), dedup.ErrTxOwned.Error())
	for _, key := range keys {
		want := 1
		if key == "order-3" {
			want = 0
		}
		require.Equal(t, want, effectsOf(t, rig.pool, rig.schema, key), "%s: applied once, or not at all when dead-lettered", key)
	}
}
