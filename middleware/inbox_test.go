package middleware_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/oncemill/oncemill/dedup"
	"github.com/oncemill/oncemill/dedup/memory"
	"github.com/oncemill/oncemill/dedup/postgres"
	dlv "github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/internal/testing/msgtest"
	"github.com/oncemill/oncemill/internal/testing/pgtest"
	"github.com/oncemill/oncemill/middleware"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// delivery returns a new delivery (its own UUID) of the message with key.
func delivery(key string, payload string) *message.Message {
	msg := message.NewMessage(watermill.NewUUID(), []byte(payload))
	msg.Metadata.Set(dlv.IdempotencyKey, key)
	return msg
}

func newInbox(t *testing.T, cfg middleware.InboxConfig) *middleware.Inbox {
	t.Helper()
	in, err := middleware.NewInbox(cfg)
	require.NoError(t, err)
	return in
}

func TestInboxAppliesOnceAndReplaysProducedMessages(t *testing.T) {
	t.Parallel()
	txBackends(t, 4, func(t *testing.T, b txBackend) {
		logs := watermill.NewCaptureLogger()
		in := newInbox(t, middleware.InboxConfig{TxStore: b.store, Consumer: "billing", Logger: logs})
		var calls atomic.Int32
		h := in.Middleware(func(msg *message.Message) ([]*message.Message, error) {
			calls.Add(1)
			if err := b.effect(msg.Context(), middleware.IdempotencyKey(msg.Context())); err != nil {
				return nil, err
			}
			charged := message.NewMessage(watermill.NewUUID(), []byte(`{"charged":true}`))
			charged.Metadata.Set("order", "o-1")
			receipt := message.NewMessage(watermill.NewUUID(), []byte("receipt"))
			return []*message.Message{charged, receipt}, nil
		})

		first, err := h(delivery("o-1", "pay"))
		require.NoError(t, err)
		require.Len(t, first, 2)
		require.Equal(t, int32(1), calls.Load())
		require.Equal(t, 1, b.effects(t))

		for i := 0; i < 3; i++ {
			again, err := h(delivery("o-1", "pay"))
			require.NoError(t, err)
			require.Equal(t, int32(1), calls.Load(), "a duplicate must not run the handler")
			require.Len(t, again, 2)
			for j := range first {
				require.Equal(t, first[j].UUID, again[j].UUID, "replayed messages keep their UUIDs")
				require.Equal(t, first[j].Payload, again[j].Payload)
				require.Equal(t, first[j].Metadata, again[j].Metadata)
			}
		}
		require.Equal(t, 1, b.effects(t))
		require.Equal(t, middleware.InboxStats{Applied: 1, Duplicates: 3}, in.Stats())

		dups := 0
		for _, l := range logs.Captured()[watermill.DebugLogLevel] {
			if l.Msg == "Duplicate message dropped" {
				dups++
				require.Equal(t, "o-1", l.Fields["key"])
				require.Equal(t, "billing", l.Fields["consumer"])
				require.Equal(t, 1, l.Fields["attempts"])
			}
		}
		require.Equal(t, 3, dups)
	})
}

func TestInboxConcurrentDuplicatesApplyOnce(t *testing.T) {
	t.Parallel()
	txBackends(t, 52, func(t *testing.T, b txBackend) {
		in := newInbox(t, middleware.InboxConfig{TxStore: b.store, Consumer: "billing"})
		var calls atomic.Int32
		h := in.Middleware(func(msg *message.Message) ([]*message.Message, error) {
			calls.Add(1)
			if err := b.effect(msg.Context(), "hot"); err != nil {
				return nil, err
			}
			return []*message.Message{message.NewMessage(watermill.NewUUID(), nil)}, nil
		})
		const n = 50
		var (
			wg    sync.WaitGroup
			start = make(chan struct{})
			mu    sync.Mutex
			uuids = map[string]int{}
			errs  []error
		)
		for i := 0; i < n; i++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				msg := delivery("hot", "pay")
				<-start
				out, err := h(msg)
				mu.Lock()
				defer mu.Unlock()
				if err != nil {
					errs = append(errs, err)
					return
				}
				for _, m := range out {
					uuids[m.UUID]++
				}
			}()
		}
		close(start)
		wg.Wait()
		require.Empty(t, errs)
		require.Equal(t, 1, b.effects(t))
		require.Equal(t, int32(1), calls.Load())
		require.Len(t, uuids, 1, "every delivery returns the one produced message")
		for _, c := range uuids {
			require.Equal(t, n, c)
		}
	})
}

func TestInboxHandlerErrorRollsBackAndCountsAttempt(t *testing.T) {
	t.Parallel()
	txBackends(t, 4, func(t *testing.T, b txBackend) {
		in := newInbox(t, middleware.InboxConfig{TxStore: b.store, Consumer: "billing"})
		boom := errors.New("card network timeout")
		fail := true
		h := in.Middleware(func(msg *message.Message) ([]*message.Message, error) {
			if err := b.effect(msg.Context(), "o-2"); err != nil {
				return nil, err
			}
			if fail {
				return nil, boom
			}
			return nil, nil
		})

		_, err := h(delivery("o-2", "pay"))
		require.ErrorIs(t, err, boom)
		require.False(t, middleware.IsPermanent(err), "a handler error is transient unless marked")
		require.Equal(t, 0, b.effects(t), "the effect rolled back with the claim")
		require.Equal(t, 1, b.attempts(t, "billing", "o-2"), "the failed attempt is recorded")

		fail = false
		_, err = h(delivery("o-2", "pay"))
		require.NoError(t, err)
		require.Equal(t, 1, b.effects(t))
		require.Equal(t, 2, b.attempts(t, "billing", "o-2"))
		require.Equal(t, middleware.InboxStats{Applied: 1, Failed: 1}, in.Stats())
	})
}

// TestInboxHandlerPanicIsAFailedAttempt: a panic in the handler is
// recovered by the inbox, rolls the effect back and is recorded as a failed
// attempt with the panic value, so that the poison middleware can count it;
// the router's own recovery would only nack it, forever.
func TestInboxHandlerPanicIsAFailedAttempt(t *testing.T) {
	t.Parallel()
	txBackends(t, 4, func(t *testing.T, b txBackend) {
		in := newInbox(t, middleware.InboxConfig{TxStore: b.store, Consumer: "billing"})
		panics := true
		h := in.Middleware(func(msg *message.Message) ([]*message.Message, error) {
			if err := b.effect(msg.Context(), "o-3"); err != nil {
				return nil, err
			}
			if panics {
				panic("nil map in handler")
			}
			return nil, nil
		})
		_, err := h(delivery("o-3", "pay"))
		require.ErrorIs(t, err, middleware.ErrPanicked)
		require.ErrorContains(t, err, "nil map in handler")
		require.Equal(t, 0, b.effects(t))
		require.Equal(t, 1, b.attempts(t, "billing", "o-3"), "the panic is a recorded attempt")
		require.Equal(t, "failed", b.status(t, "billing", "o-3"))
		n, _, ok := middleware.StoredAttempts(err)
		require.True(t, ok)
		require.Equal(t, 1, n)

		panics = false
		_, err = h(delivery("o-3", "pay"))
		require.NoError(t, err, "the key was not left claimed")
		require.Equal(t, 1, b.effects(t))
		require.Equal(t, middleware.InboxStats{Applied: 1, Failed: 1, Panicked: 1}, in.Stats())
	})
}

func TestInboxBadInputIsPermanent(t *testing.T) {
	t.Parallel()
	store := memory.New()
	cases := []struct {
		name    string
		key     middleware.KeyFunc
		msg     *message.Message
		wantErr error
		wantMsg string
	}{
		{"empty metadata key", middleware.KeyFromMetadata("order_id"), message.NewMessage("u1", []byte("{}")), middleware.ErrEmptyKey, `metadata field "order_id" is missing or empty`},
		{"missing JSON field", middleware.KeyFromJSON("orderId"), message.NewMessage("u2", []byte(`{"amount": 5}`)), middleware.ErrEmptyKey, `key field "orderId" is missing from the payload`},
		{"non-JSON payload", middleware.KeyFromJSON("orderId"), message.NewMessage("u3", []byte("not json")), middleware.ErrKey, `payload is not JSON, so key field "orderId" cannot be read`},
		{"JSON field of wrong type", middleware.KeyFromJSON("order.id"), message.NewMessage("u4", []byte(`{"order": {"id": true}}`)), middleware.ErrKey, `key field "order.id" is a bool`},
		{"empty JSON string", middleware.KeyFromJSON("orderId"), message.NewMessage("u5", []byte(`{"orderId": ""}`)), middleware.ErrEmptyKey, `empty string`},
		{"no UUID and no key", middleware.DefaultKey, message.NewMessage("", nil), middleware.ErrEmptyKey, `no "idempotency_key" metadata and no message UUID`},
		{"key function returns empty", func(*message.Message) (string, error) { return "", nil }, message.NewMessage("u6", nil), middleware.ErrEmptyKey, "empty key"},
		{"key function fails", func(*message.Message) (string, error) { return "", errors.New("schema registry said no") }, message.NewMessage("u7", nil), middleware.ErrKey, "schema registry said no"},
		{"key with NUL byte", func(*message.Message) (string, error) { return "a\x00b", nil }, message.NewMessage("u8", nil), middleware.ErrKey, "NUL"},
		{"key too long", func(*message.Message) (string, error) { return string(make([]byte, 600)), nil }, message.NewMessage("u9", nil), middleware.ErrKey, "more than 512"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			in := newInbox(t, middleware.InboxConfig{LeaseStore: store, Consumer: "c", Key: tc.key})
			called := false
			_, err := in.Middleware(func(*message.Message) ([]*message.Message, error) {
				called = true
				return nil, nil
			})(tc.msg)
			require.ErrorIs(t, err, tc.wantErr)
			require.ErrorIs(t, err, middleware.ErrKey)
			require.True(t, middleware.IsPermanent(err))
			require.ErrorContains(t, err, tc.wantMsg)
			require.False(t, called)
		})
	}
	require.Zero(t, store.Len(), "no key was recorded for a message without one")

	// Without a router the handler name is unknown.
	in := newInbox(t, middleware.InboxConfig{LeaseStore: store})
	_, err := in.Middleware(func(*message.Message) ([]*message.Message, error) { return nil, nil })(delivery("k", ""))
	require.ErrorIs(t, err, middleware.ErrNoConsumer)
	require.True(t, middleware.IsPermanent(err))
}

func TestKeyFuncs(t *testing.T) {
	t.Parallel()
	msg := message.NewMessage("uuid-1", []byte(`{"orderId": 1234567890123, "order": {"id": "A-1"}}`))
	k, err := middleware.DefaultKey(msg)
	require.NoError(t, err)
	require.Equal(t, "uuid-1", k)
	msg.Metadata.Set("idempotency_key", "idem-1")
	k, err = middleware.DefaultKey(msg)
	require.NoError(t, err)
	require.Equal(t, "idem-1", k)

	// A key the producer set empty is an error, not the UUID: two
	// retries of such a message would carry two UUIDs and apply twice.
	empty := message.NewMessage("uuid-3", nil)
	empty.Metadata.Set("idempotency_key", "")
	_, err = middleware.DefaultKey(empty)
	require.ErrorIs(t, err, middleware.ErrEmptyKey)
	require.True(t, middleware.IsPermanent(err))

	k, err = middleware.KeyFromJSON("orderId")(msg)
	require.NoError(t, err)
	require.Equal(t, "1234567890123", k, "large numbers keep every digit")
	k, err = middleware.KeyFromJSON("order.id")(msg)
	require.NoError(t, err)
	require.Equal(t, "A-1", k)

	msg.Metadata.Set("tenant", "t1")
	h1, err := middleware.KeyFromHash("tenant")(msg)
	require.NoError(t, err)
	require.Len(t, h1, 64)
	msg.Metadata.Set("tenant", "t2")
	h2, err := middleware.KeyFromHash("tenant")(msg)
	require.NoError(t, err)
	require.NotEqual(t, h1, h2, "chosen metadata is part of the hash")
	other := message.NewMessage("uuid-2", msg.Payload)
	other.Metadata.Set("tenant", "t2")
	h3, err := middleware.KeyFromHash("tenant")(other)
	require.NoError(t, err)
	require.Equal(t, h2, h3, "the UUID is not part of the hash")
}

func TestInboxConfigValidate(t *testing.T) {
	t.Parallel()
	store := memory.New()
	cases := []struct {
		cfg  middleware.InboxConfig
		want string
	}{
		{middleware.InboxConfig{}, "set TxStore (transactional mode) or LeaseStore"},
		{middleware.InboxConfig{LeaseStore: store, Window: time.Second}, "InboxConfig.Window"},
		{middleware.InboxConfig{LeaseStore: store, Lease: time.Nanosecond}, "InboxConfig.Lease"},
		{middleware.InboxConfig{LeaseStore: store, Tuning: middleware.InboxTuning{InFlightDelay: -time.Second}}, "InboxConfig.Tuning.InFlightDelay"},
		{middleware.InboxConfig{LeaseStore: store, Lease: time.Hour, Window: time.Hour}, "InboxConfig.Lease (1h0m0s) must be shorter than Window"},
		{middleware.InboxConfig{LeaseStore: store, FinishTimeout: -time.Second}, "InboxConfig.FinishTimeout"},
		// A consumer name that no table can store would fail every
		// delivery at run time, and its dead letter too: refused here.
		{middleware.InboxConfig{LeaseStore: store, Consumer: "pay\x00ments"}, "InboxConfig.Consumer \"pay\\x00ments\" holds the control character U+0000"},
		{middleware.InboxConfig{LeaseStore: store, Consumer: "pay\xffments"}, "InboxConfig.Consumer \"pay\\xffments\" is not valid UTF-8"},
		{middleware.InboxConfig{LeaseStore: store, Consumer: strings.Repeat("c", 1<<20)}, "InboxConfig.Consumer is 1048576 bytes long, more than 255"},
		{middleware.InboxConfig{LeaseStore: store, Tuning: middleware.InboxTuning{SkipAttemptRecord: true}}, "InboxConfig.Tuning.SkipAttemptRecord needs TxStore"},
	}
	for _, tc := range cases {
		cfg := tc.cfg
		_, err := middleware.NewInbox(cfg)
		require.ErrorContains(t, err, tc.want)
		require.Equal(t, tc.cfg, cfg, "the caller's config is not changed")
	}
}

// leaseStores runs fn for each lease store.
func leaseStores(t *testing.T, fn func(t *testing.T, store dedup.LeaseStore)) {
	t.Run("memory", func(t *testing.T) {
		t.Parallel()
		fn(t, memory.New())
	})
	t.Run("postgres", func(t *testing.T) {
		t.Parallel()
		pool := pgtest.Pool(t, 4)
		store, err := postgres.New(pool, postgres.Config{Schema: pgtest.Schema(t, pool)})
		require.NoError(t, err)
		fn(t, store)
	})
}

func TestInboxLeaseInFlightDuplicateIsNacked(t *testing.T) {
	t.Parallel()
	leaseStores(t, func(t *testing.T, store dedup.LeaseStore) {
		in := newInbox(t, middleware.InboxConfig{LeaseStore: store, Consumer: "payments", Tuning: middleware.InboxTuning{InFlightDelay: 10 * time.Millisecond}})
		var charges atomic.Int32
		entered, release := make(chan string), make(chan struct{})
		h := in.Middleware(func(msg *message.Message) ([]*message.Message, error) {
			entered <- middleware.IdempotencyKey(msg.Context())
			<-release
			charges.Add(1)
			return []*message.Message{message.NewMessage("receipt-1", nil)}, nil
		})

		firstDone := make(chan error, 1)
		go func() {
			_, err := h(delivery("pay-1", ""))
			firstDone <- err
		}()
		require.Equal(t, "pay-1", <-entered, "the key is handed to the effect")

		_, err := h(delivery("pay-1", ""))
		require.ErrorIs(t, err, middleware.ErrInFlight, "an in-flight duplicate is nacked, never acked")
		require.False(t, middleware.IsPermanent(err))

		close(release)
		require.NoError(t, <-firstDone)
		out, err := h(delivery("pay-1", ""))
		require.NoError(t, err)
		require.Len(t, out, 1)
		require.Equal(t, "receipt-1", out[0].UUID)
		require.Equal(t, int32(1), charges.Load())
		require.Equal(t, middleware.InboxStats{Applied: 1, Duplicates: 1, InFlight: 1}, in.Stats())
	})
}

// TestInboxLeaseInFlightDuplicateAnsweredWhenHolderFinishes: a duplicate
// that arrives while the first delivery runs waits, and when the first
// completes within InFlightDelay it is answered as a duplicate (acked with
// the stored result) instead of nacked.
func TestInboxLeaseInFlightDuplicateAnsweredWhenHolderFinishes(t *testing.T) {
	t.Parallel()
	leaseStores(t, func(t *testing.T, store dedup.LeaseStore) {
		in := newInbox(t, middleware.InboxConfig{LeaseStore: store, Consumer: "payments", Tuning: middleware.InboxTuning{InFlightDelay: time.Minute}})
		entered, release := make(chan struct{}), make(chan struct{})
		h := in.Middleware(func(msg *message.Message) ([]*message.Message, error) {
			close(entered)
			<-release
			return []*message.Message{message.NewMessage("receipt-2", nil)}, nil
		})
		firstDone := make(chan error, 1)
		go func() {
			_, err := h(delivery("pay-2", ""))
			firstDone <- err
		}()
		<-entered
		dupDone := make(chan []*message.Message, 1)
		go func() {
			out, err := h(delivery("pay-2", ""))
			require.NoError(t, err)
			dupDone <- out
		}()
		msgtest.WaitFor(t, "the duplicate to wait", func() bool { return in.Stats().InFlight == 1 })
		close(release)
		require.NoError(t, <-firstDone)
		out := <-dupDone
		require.Len(t, out, 1)
		require.Equal(t, "receipt-2", out[0].UUID)
		require.Equal(t, middleware.InboxStats{Applied: 1, Duplicates: 1}, in.Stats())
	})
}

func TestInboxLeaseExpiredIsTakenOverAndZombieCannotComplete(t *testing.T) {
	t.Parallel()
	leaseStores(t, func(t *testing.T, store dedup.LeaseStore) {
		// The zombie's process cannot reach the store to renew its lease
		// (a partition, a long pause) and ignores its cancelled context.
		zombie := newInbox(t, middleware.InboxConfig{LeaseStore: slowLease{store, errors.New("partitioned")}, Consumer: "payments", Lease: 100 * time.Millisecond})
		in := newInbox(t, middleware.InboxConfig{LeaseStore: store, Consumer: "payments", Lease: 100 * time.Millisecond})
		var runs atomic.Int32
		zombieIn, zombieGo := make(chan struct{}), make(chan struct{})
		handler := func(msg *message.Message) ([]*message.Message, error) {
			if runs.Add(1) == 1 {
				close(zombieIn)
				<-zombieGo // outlives its lease
			}
			return nil, nil
		}
		h := in.Middleware(handler)
		zombieErr := make(chan error, 1)
		go func() {
			_, err := zombie.Middleware(handler)(delivery("pay-2", ""))
			zombieErr <- err
		}()
		<-zombieIn

		// Redeliver until the lease has expired and the key is taken over.
		require.Eventually(t, func() bool {
			_, err := h(delivery("pay-2", ""))
			return err == nil
		}, 5*time.Second, 20*time.Millisecond)
		require.Equal(t, int32(2), runs.Load())

		close(zombieGo)
		require.ErrorIs(t, <-zombieErr, dedup.ErrLeaseLost, "the zombie's completion is fenced off")

		_, err := h(delivery("pay-2", ""))
		require.NoError(t, err)
		require.Equal(t, int32(2), runs.Load(), "the taker's completion stands")
	})
}

func TestInboxLeaseHandlerErrorReleases(t *testing.T) {
	t.Parallel()
	leaseStores(t, func(t *testing.T, store dedup.LeaseStore) {
		in := newInbox(t, middleware.InboxConfig{LeaseStore: store, Consumer: "mailer", Lease: time.Hour})
		fail := true
		h := in.Middleware(func(msg *message.Message) ([]*message.Message, error) {
			if fail {
				return nil, errors.New("smtp 451")
			}
			return nil, nil
		})
		_, err := h(delivery("mail-1", ""))
		require.ErrorContains(t, err, "smtp 451")
		fail = false
		// The lease is an hour, yet the next delivery claims at once.
		_, err = h(delivery("mail-1", ""))
		require.NoError(t, err)
		require.Equal(t, middleware.InboxStats{Applied: 1, Failed: 1}, in.Stats())
	})
}

// TestInboxRouterEndToEnd runs the inbox under a real router: 200 keys,
// each published 3 times, the copies consumed by 3 handlers of one consumer
// at once, so that every key is delivered 3 times, concurrently.
func TestInboxRouterEndToEnd(t *testing.T) {
	t.Parallel()
	txBackends(t, 16, func(t *testing.T, b txBackend) {
		const keys, copies = 200, 3
		logger := watermill.NopLogger{}
		pubSub := gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 4096}, logger)
		t.Cleanup(func() { require.NoError(t, pubSub.Close()) })

		in := newInbox(t, middleware.InboxConfig{TxStore: b.store, Consumer: "orders"})
		router, err := message.NewRouter(message.RouterConfig{}, logger)
		require.NoError(t, err)
		router.AddMiddleware(in.Middleware)
		var runs atomic.Int32
		for i := 0; i < copies; i++ {
			router.AddHandler(fmt.Sprintf("orders-%d", i), fmt.Sprintf("orders-%d", i), pubSub, "orders.charged", pubSub,
				func(msg *message.Message) ([]*message.Message, error) {
					runs.Add(1)
					if err := b.effect(msg.Context(), middleware.IdempotencyKey(msg.Context())); err != nil {
						return nil, err
					}
					return []*message.Message{message.NewMessage(watermill.NewUUID(), msg.Payload)}, nil
				})
		}

		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		events, err := pubSub.Subscribe(ctx, "orders.charged")
		require.NoError(t, err)
		routerDone := make(chan error, 1)
		go func() { routerDone <- router.Run(ctx) }()
		<-router.Running()

		var pubs sync.WaitGroup
		for c := 0; c < copies; c++ {
			pubs.Add(1)
			go func() {
				defer pubs.Done()
				for k := 0; k < keys; k++ {
					if err := pubSub.Publish(fmt.Sprintf("orders-%d", c), delivery(fmt.Sprintf("order-%d", k), fmt.Sprint(k))); err != nil {
						t.Error(err)
						return
					}
				}
			}()
		}
		pubs.Wait()

		uuids := map[string]string{}
		timeout := time.After(2 * time.Minute)
		for received := 0; received < keys*copies; received++ {
			select {
			case m := <-events:
				if prev, ok := uuids[m.UUID]; ok {
					require.Equal(t, prev, string(m.Payload))
				}
				uuids[m.UUID] = string(m.Payload)
				m.Ack()
			case <-timeout:
				t.Fatalf("received %d of %d produced messages", received, keys*copies)
			}
		}
		cancel()
		require.NoError(t, <-routerDone)
		require.NoError(t, router.Close())

		require.Equal(t, keys, b.effects(t), "one effect per key")
		require.Equal(t, int32(keys), runs.Load(), "the handler ran once per key")
		require.Len(t, uuids, keys, "one produced message per key, republished under the same UUID")
		st := in.Stats()
		// A transaction that lost to a concurrent one (SQLite's busy
		// writer, on a loaded machine) is run again at once: a retry the
		// outcome does not show.
		st.ConflictRetries = 0
		require.Equal(t, middleware.InboxStats{Applied: keys, Duplicates: keys*copies - keys}, st)
	})
}
