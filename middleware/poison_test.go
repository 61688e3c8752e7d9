package middleware_test

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/adapters"
	dlv "github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/dlq"
	"github.com/oncemill/oncemill/internal/testing/msgtest"
	"github.com/oncemill/oncemill/internal/testing/pgtest"
	"github.com/oncemill/oncemill/middleware"
	"github.com/oncemill/oncemill/retry"
	"github.com/oncemill/oncemill/sqlschema"
)

// poisonRig is a router over GoChannel running poison → inbox → handler,
// with the dead-letter topic on the same GoChannel and subscribed to.
type poisonRig struct {
	pubSub *gochannel.GoChannel
	dead   <-chan *message.Message
	poison *middleware.Poison
	inbox  *middleware.Inbox
	calls  atomic.Int32
}

const poisonTopic, deadTopic = "payments", "payments.dlq"

// startPoisonRig runs handler (which gets the attempt number, from 1) under
// poison and the inbox of b, until the test ends.
func startPoisonRig(t *testing.T, b txBackend, cfg middleware.PoisonConfig, handler func(n int32, msg *message.Message) error) *poisonRig {
	t.Helper()
	return startPoisonRigWith(t, b, cfg, middleware.InboxConfig{}, handler)
}

// startPoisonRigWith is startPoisonRig with the inbox configured by icfg,
// its TxStore set to b's.
func startPoisonRigWith(t *testing.T, b txBackend, cfg middleware.PoisonConfig, icfg middleware.InboxConfig, handler func(n int32, msg *message.Message) error) *poisonRig {
	t.Helper()
	logger := watermill.NopLogger{}
	rig := &poisonRig{pubSub: gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 64, Persistent: true}, logger)}
	ctx, cancel := context.WithCancel(context.Background())
	dead, err := rig.pubSub.Subscribe(ctx, deadTopic)
	require.NoError(t, err)
	rig.dead = dead

	if cfg.Publisher == nil {
		cfg.Publisher = rig.pubSub
	}
	cfg.Topic = deadTopic
	if cfg.InitialBackoff == 0 {
		cfg.InitialBackoff, cfg.MaxBackoff = time.Millisecond, 5*time.Millisecond
	}
	rig.poison, err = middleware.NewPoison(cfg)
	require.NoError(t, err)
	icfg.TxStore = b.store
	rig.inbox = newInbox(t, icfg)

	router, err := message.NewRouter(message.RouterConfig{}, logger)
	require.NoError(t, err)
	router.AddMiddleware(rig.poison.Middleware, rig.inbox.Middleware)
	router.AddConsumerHandler("charge", poisonTopic, rig.pubSub, func(msg *message.Message) error {
		n := rig.calls.Add(1)
		if err := handler(n, msg); err != nil {
			return err
		}
		return b.effect(msg.Context(), middleware.IdempotencyKey(msg.Context()))
	})
	done := make(chan error, 1)
	go func() { done <- router.Run(ctx) }()
	<-router.Running()
	t.Cleanup(func() {
		cancel()
		require.NoError(t, <-done)
		require.NoError(t, rig.pubSub.Close())
	})
	return rig
}

func (r *poisonRig) publish(t *testing.T, key string) *message.Message {
	t.Helper()
	msg := delivery(key, "charge "+key)
	require.NoError(t, r.pubSub.Publish(poisonTopic, msg))
	return msg
}

// TestPoisonTransientThenSuccess: two transient failures, then success:
// one effect, nothing dead-lettered.
func TestPoisonTransientThenSuccess(t *testing.T) {
	t.Parallel()
	txBackends(t, 4, func(t *testing.T, b txBackend) {
		rig := startPoisonRig(t, b, middleware.PoisonConfig{MaxAttempts: 3}, func(n int32, _ *message.Message) error {
			if n <= 2 {
				return errors.New("payment provider timed out")
			}
			return nil
		})
		rig.publish(t, "order-1")
		require.Eventually(t, func() bool { return b.effects(t) == 1 }, 30*time.Second, 5*time.Millisecond)
		msgtest.Nothing(t, rig.dead, 200*time.Millisecond)
		require.Equal(t, int32(3), rig.calls.Load())
		require.Equal(t, middleware.PoisonStats{Retried: 2}, rig.poison.Stats())
		require.Equal(t, 3, b.attempts(t, "charge", "order-1"), "two failures and the success recorded")
	})
}

// TestPoisonPermanentGoesToDLQAtOnce: a permanent error is dead-lettered at
// its first attempt, with the reason and where it came from; the original
// is acked (never delivered again) and no effect is applied.
func TestPoisonPermanentGoesToDLQAtOnce(t *testing.T) {
	t.Parallel()
	txBackends(t, 4, func(t *testing.T, b txBackend) {
		rig := startPoisonRig(t, b, middleware.PoisonConfig{MaxAttempts: 5}, func(int32, *message.Message) error {
			return middleware.Permanent(errors.New("card number fails the Luhn check"))
		})
		before := time.Now()
		orig := rig.publish(t, "order-7")
		dead := msgtest.Receive(t, rig.dead, 30*time.Second)
		dead.Ack()

		require.Equal(t, orig.UUID, dead.UUID)
		require.Equal(t, orig.Payload, dead.Payload)
		md := dead.Metadata
		require.Equal(t, "order-7", md.Get(dlv.IdempotencyKey), "original metadata kept")
		require.Equal(t, poisonTopic, md.Get(dlv.DeadTopic))
		require.Equal(t, "charge", md.Get(dlv.DeadConsumer))
		require.Equal(t, "order-7", md.Get(dlv.DeadKey))
		require.Equal(t, "1", md.Get(dlv.DeadAttempts))
		require.Equal(t, "true", md.Get(dlv.DeadPermanent))
		require.Contains(t, md.Get(dlv.DeadError), "Luhn check")
		first, err := time.Parse(time.RFC3339Nano, md.Get(dlv.DeadFirstFailedAt))
		require.NoError(t, err)
		last, err := time.Parse(time.RFC3339Nano, md.Get(dlv.DeadLastFailedAt))
		require.NoError(t, err)
		require.False(t, first.Before(before.Add(-time.Second)))
		require.False(t, last.Before(first))

		msgtest.Nothing(t, rig.dead, 200*time.Millisecond)
		require.Equal(t, int32(1), rig.calls.Load(), "acked after the dead-letter: never delivered again")
		require.Equal(t, 0, b.effects(t))
		require.Equal(t, middleware.PoisonStats{DeadLettered: 1}, rig.poison.Stats())
	})
}

// TestPoisonAlwaysFailingAfterMaxAttempts: a message that always fails is
// tried exactly MaxAttempts times, then dead-lettered with the count and
// its first and last failure.
func TestPoisonAlwaysFailingAfterMaxAttempts(t *testing.T) {
	t.Parallel()
	txBackends(t, 4, func(t *testing.T, b txBackend) {
		rig := startPoisonRig(t, b, middleware.PoisonConfig{MaxAttempts: 4}, func(n int32, _ *message.Message) error {
			return errors.New("ledger service answered 503 (attempt " + strconv.Itoa(int(n)) + ")")
		})
		rig.publish(t, "order-9")
		dead := msgtest.Receive(t, rig.dead, 30*time.Second)
		dead.Ack()
		require.Equal(t, "4", dead.Metadata.Get(dlv.DeadAttempts))
		require.Equal(t, dlv.AttemptsFromInbox, dead.Metadata.Get(dlv.DeadAttemptsSource), "the inbox counted them")
		require.Equal(t, "false", dead.Metadata.Get(dlv.DeadPermanent))
		require.Contains(t, dead.Metadata.Get(dlv.DeadError), "attempt 4")
		first, err := time.Parse(time.RFC3339Nano, dead.Metadata.Get(dlv.DeadFirstFailedAt))
		require.NoError(t, err)
		last, err := time.Parse(time.RFC3339Nano, dead.Metadata.Get(dlv.DeadLastFailedAt))
		require.NoError(t, err)
		require.True(t, last.After(first), "first failure %s, last %s", first, last)

		msgtest.Nothing(t, rig.dead, 200*time.Millisecond)
		require.Equal(t, int32(4), rig.calls.Load())
		require.Equal(t, 4, b.attempts(t, "charge", "order-9"))
		require.Equal(t, middleware.PoisonStats{Retried: 3, DeadLettered: 1}, rig.poison.Stats())
	})
}

// TestPoisonDurableCountAcrossRestarts: each attempt runs in a fresh poison
// middleware, as after a restart, on a broker without a count of its own
// (Kafka): the inbox store's count still dead-letters at MaxAttempts.
func TestPoisonDurableCountAcrossRestarts(t *testing.T) {
	t.Parallel()
	txBackends(t, 4, func(t *testing.T, b txBackend) {
		dead := gochannel.NewGoChannel(gochannel.Config{Persistent: true}, watermill.NopLogger{})
		t.Cleanup(func() { require.NoError(t, dead.Close()) })
		inbox := newInbox(t, middleware.InboxConfig{TxStore: b.store, Consumer: "charge"})
		var calls int
		handler := inbox.Middleware(func(*message.Message) ([]*message.Message, error) {
			calls++
			return nil, errors.New("ledger down")
		})
		msg := delivery("order-3", "x")
		const maxAttempts = 3
		for attempt := 1; attempt <= maxAttempts; attempt++ {
			// Each attempt is a delivery to a new process: failures are
			// nacked for redelivery, not retried in process.
			poison, err := middleware.NewPoison(middleware.PoisonConfig{
				Publisher: dead, Topic: deadTopic, MaxAttempts: maxAttempts, Consumer: "charge",
				InitialBackoff: time.Millisecond, MaxBackoff: time.Millisecond, InProcessRetries: middleware.NoInProcessRetries,
			})
			require.NoError(t, err)
			_, err = poison.Middleware(handler)(msg)
			if attempt < maxAttempts {
				require.Error(t, err, "attempt %d is nacked", attempt)
				n, _, ok := middleware.StoredAttempts(err)
				require.True(t, ok)
				require.Equal(t, attempt, n)
				require.Zero(t, poison.Stats().DeadLettered)
			} else {
				require.NoError(t, err, "the last attempt is dead-lettered and acked")
				require.Equal(t, int64(1), poison.Stats().DeadLettered)
			}
		}
		require.Equal(t, maxAttempts, calls)
		msgs, err := dead.Subscribe(context.Background(), deadTopic)
		require.NoError(t, err)
		got := msgtest.Receive(t, msgs, 10*time.Second)
		require.Equal(t, strconv.Itoa(maxAttempts), got.Metadata.Get(dlv.DeadAttempts))
		got.Ack()
	})
}

// TestPoisonBrokerCountIsUsed: a broker's own delivery count (SQS,
// RabbitMQ) dead-letters a message at once when earlier deliveries
// crashed before anything was recorded.
func TestPoisonBrokerCountIsUsed(t *testing.T) {
	t.Parallel()
	dead := gochannel.NewGoChannel(gochannel.Config{Persistent: true}, watermill.NopLogger{})
	t.Cleanup(func() { require.NoError(t, dead.Close()) })
	poison, err := middleware.NewPoison(middleware.PoisonConfig{
		Publisher: dead, Topic: deadTopic, MaxAttempts: 5, Consumer: "charge",
		InitialBackoff: time.Millisecond, MaxBackoff: time.Millisecond,
	})
	require.NoError(t, err)
	msg := delivery("order-4", "x")
	msg.Metadata.Set(dlv.Attempts, "5")
	msg.Metadata.Set(dlv.Partition, "2")
	msg.Metadata.Set(dlv.Offset, "1234")
	_, err = poison.Middleware(func(*message.Message) ([]*message.Message, error) {
		return nil, errors.New("segfault in the PDF renderer")
	})(msg)
	require.NoError(t, err)
	msgs, err := dead.Subscribe(context.Background(), deadTopic)
	require.NoError(t, err)
	got := msgtest.Receive(t, msgs, 10*time.Second)
	got.Ack()
	require.Equal(t, "5", got.Metadata.Get(dlv.DeadAttempts))
	require.Equal(t, "2", got.Metadata.Get(dlv.DeadPartition))
	require.Equal(t, "1234", got.Metadata.Get(dlv.DeadOffset))
}

// TestPoisonUndecodableNeverReachesHandler: a message its adapter could not
// decode goes to the DLQ at once, raw bytes and reason kept.
func TestPoisonUndecodableNeverReachesHandler(t *testing.T) {
	t.Parallel()
	txBackends(t, 4, func(t *testing.T, b txBackend) {
		rig := startPoisonRig(t, b, middleware.PoisonConfig{}, func(int32, *message.Message) error { return nil })
		msg := message.NewMessage(watermill.NewUUID(), []byte{0xff, 0x00, 0x13})
		msg.Metadata.Set(dlv.DecodeError, "record header 7 is not valid UTF-8")
		require.NoError(t, rig.pubSub.Publish(poisonTopic, msg))
		dead := msgtest.Receive(t, rig.dead, 30*time.Second)
		dead.Ack()
		require.Equal(t, msg.Payload, dead.Payload)
		require.Contains(t, dead.Metadata.Get(dlv.DeadError), "header 7")
		require.Equal(t, "true", dead.Metadata.Get(dlv.DeadPermanent))
		require.Zero(t, rig.calls.Load())
		require.Zero(t, b.effects(t))
	})
}

// switchPublisher fails while down: a dead-letter destination that is
// unreachable for a while.
type switchPublisher struct {
	message.Publisher
	down atomic.Bool
}

func (p *switchPublisher) Publish(topic string, msgs ...*message.Message) error {
	if p.down.Load() {
		return errors.New("dial tcp 10.0.0.9:9092: connect: connection refused")
	}
	return p.Publisher.Publish(topic, msgs...)
}

func (p *switchPublisher) Close() error { return nil }

// TestPoisonDLQDownNacksOriginal: while the DLQ cannot be written, the
// poison message is nacked and delivered again, never acked; once the DLQ
// is back, it lands there exactly once and the original is acked.
func TestPoisonDLQDownNacksOriginal(t *testing.T) {
	t.Parallel()
	txBackends(t, 4, func(t *testing.T, b txBackend) {
		sw := &switchPublisher{}
		sw.down.Store(true)
		var rig *poisonRig
		rig = startPoisonRig(t, b, middleware.PoisonConfig{Publisher: sw, MaxAttempts: 2}, func(int32, *message.Message) error {
			return errors.New("always")
		})
		sw.Publisher = rig.pubSub
		rig.publish(t, "order-5")
		require.Eventually(t, func() bool { return rig.poison.Stats().DeadLetterFailed >= 3 }, 30*time.Second, 5*time.Millisecond)
		msgtest.Nothing(t, rig.dead, 100*time.Millisecond)

		sw.down.Store(false)
		dead := msgtest.Receive(t, rig.dead, 30*time.Second)
		dead.Ack()
		require.Equal(t, "order-5", dead.Metadata.Get(dlv.DeadKey))
		msgtest.Nothing(t, rig.dead, 200*time.Millisecond)
		calls := rig.calls.Load()
		time.Sleep(100 * time.Millisecond)
		require.Equal(t, calls, rig.calls.Load(), "acked once dead-lettered: no more deliveries")
		require.Equal(t, int64(1), rig.poison.Stats().DeadLettered)
		require.Zero(t, b.effects(t))
	})
}

// TestPoisonInFlightIsNotCounted: a key held by another live lease is
// waited for in process, not counted and not nacked, until the key is
// free (the attempt then runs) or the hold ends (OutageHold: then it is
// nacked, once).
func TestPoisonInFlightIsNotCounted(t *testing.T) {
	t.Parallel()
	dead := gochannel.NewGoChannel(gochannel.Config{Persistent: true}, watermill.NopLogger{})
	t.Cleanup(func() { require.NoError(t, dead.Close()) })
	poison, err := middleware.NewPoison(middleware.PoisonConfig{
		Publisher: dead, Topic: deadTopic, MaxAttempts: 1, Consumer: "charge",
		InitialBackoff: time.Millisecond, MaxBackoff: time.Millisecond, OutageHold: 200 * time.Millisecond,
	})
	require.NoError(t, err)
	msg := delivery("order-6", "x")
	var runs atomic.Int32
	for range 3 {
		before := runs.Load()
		_, err = poison.Middleware(func(*message.Message) ([]*message.Message, error) {
			runs.Add(1)
			return nil, middleware.ErrInFlight
		})(msg)
		require.ErrorIs(t, err, middleware.ErrInFlight, "nacked once the hold ended")
		require.Greater(t, runs.Load()-before, int32(1), "tried again in process while held")
	}
	require.Equal(t, middleware.PoisonStats{}, poison.Stats())

	// The other delivery ends: the held one runs and is acked.
	var held atomic.Int32
	_, err = poison.Middleware(func(*message.Message) ([]*message.Message, error) {
		if held.Add(1) < 3 {
			return nil, middleware.ErrInFlight
		}
		return nil, nil
	})(msg)
	require.NoError(t, err)
	require.Equal(t, int32(3), held.Load())
	require.Equal(t, middleware.PoisonStats{}, poison.Stats())
}

// hungPublisher is a dead-letter publisher that never answers: Publish
// returns only once the message's context is done.
type hungPublisher struct{ calls atomic.Int32 }

func (p *hungPublisher) Publish(_ string, msgs ...*message.Message) error {
	p.calls.Add(1)
	<-msgs[0].Context().Done()
	return fmt.Errorf("dead-letter queue did not answer: %w", msgs[0].Context().Err())
}

func (p *hungPublisher) Close() error { return nil }

// TestPoisonHungPublisherIsBounded: with no inbox behind it, the poison
// middleware dead-letters on a context detached from the message's
// cancellation; a publisher that hangs gives up after PublishTimeout,
// even once the consumer is shutting down, and the message is nacked (the
// error returned), never acked without its dead letter.
func TestPoisonHungPublisherIsBounded(t *testing.T) {
	t.Parallel()
	pub := &hungPublisher{}
	poison, err := middleware.NewPoison(middleware.PoisonConfig{
		Publisher: pub, Topic: deadTopic, MaxAttempts: 1, Consumer: "charge",
		InitialBackoff: time.Millisecond, MaxBackoff: time.Millisecond, PublishTimeout: 200 * time.Millisecond,
	})
	require.NoError(t, err)
	ctx, shutdown := context.WithCancel(context.Background())
	msg := delivery("order-9", "x")
	msg.SetContext(ctx)
	returned := make(chan error, 1)
	go func() {
		_, err := poison.Middleware(func(*message.Message) ([]*message.Message, error) {
			return nil, middleware.Permanent(errors.New("card number malformed"))
		})(msg)
		returned <- err
	}()
	require.Eventually(t, func() bool { return pub.calls.Load() == 1 }, 10*time.Second, time.Millisecond)
	shutdown() // the router closes while the dead letter is being written
	select {
	case err := <-returned:
		require.ErrorIs(t, err, middleware.ErrDeadLetter, "nacked: the dead letter was not written")
		require.ErrorIs(t, err, context.DeadlineExceeded, "given up at PublishTimeout, not at the shutdown")
	case <-time.After(30 * time.Second):
		t.Fatal("a hung dead-letter publisher hangs the consumer")
	}
	require.Equal(t, int64(1), poison.Stats().DeadLetterFailed)
	require.Zero(t, poison.Stats().DeadLettered)
}

// TestPoisonInProcessRetries: in-process retries run the handler again in
// the same delivery.
func TestPoisonInProcessRetries(t *testing.T) {
	t.Parallel()
	txBackends(t, 4, func(t *testing.T, b txBackend) {
		rig := startPoisonRig(t, b, middleware.PoisonConfig{MaxAttempts: 5, InProcessRetries: 3}, func(n int32, _ *message.Message) error {
			if n <= 3 {
				return errors.New("deadlock detected")
			}
			return nil
		})
		rig.publish(t, "order-8")
		require.Eventually(t, func() bool { return b.effects(t) == 1 }, 30*time.Second, 5*time.Millisecond)
		time.Sleep(100 * time.Millisecond) // a nack would be redelivered meanwhile
		require.Equal(t, int32(4), rig.calls.Load(), "one delivery, four runs, then acked")
		require.Equal(t, middleware.PoisonStats{Retried: 3}, rig.poison.Stats())
	})
}

// TestPoisonRefusesInProcessPublisher: Poison acks the original once the
// dead letter is published, so a non-persistent GoChannel, which keeps
// nothing (and reports success for a topic nobody subscribes to), is
// refused; a persistent one, for tests, is accepted.
func TestPoisonRefusesInProcessPublisher(t *testing.T) {
	t.Parallel()
	lossy := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})
	t.Cleanup(func() { require.NoError(t, lossy.Close()) })
	_, err := middleware.NewPoison(middleware.PoisonConfig{Publisher: lossy, Topic: "dlq"})
	require.ErrorIs(t, err, adapters.ErrInProcess)
	require.ErrorContains(t, err, "PoisonConfig.Publisher would lose the dead letters")
	require.ErrorContains(t, err, "set gochannel.Config.Persistent")

	kept := gochannel.NewGoChannel(gochannel.Config{Persistent: true}, watermill.NopLogger{})
	t.Cleanup(func() { require.NoError(t, kept.Close()) })
	_, err = middleware.NewPoison(middleware.PoisonConfig{Publisher: kept, Topic: "dlq"})
	require.NoError(t, err)
}

func TestPoisonConfigValidate(t *testing.T) {
	t.Parallel()
	pub := gochannel.NewGoChannel(gochannel.Config{Persistent: true}, watermill.NopLogger{})
	t.Cleanup(func() { require.NoError(t, pub.Close()) })
	for _, tc := range []struct {
		cfg  middleware.PoisonConfig
		want string
	}{
		{middleware.PoisonConfig{Topic: "t"}, "PoisonConfig.Publisher"},
		{middleware.PoisonConfig{Publisher: pub}, "PoisonConfig.Topic"},
		{middleware.PoisonConfig{Publisher: pub, Topic: "t", MaxAttempts: -1}, "PoisonConfig.MaxAttempts"},
		{middleware.PoisonConfig{Publisher: pub, Topic: "t", InProcessRetries: -2}, "PoisonConfig.InProcessRetries"},
		{middleware.PoisonConfig{Publisher: pub, Topic: "t", OutageHold: -time.Second}, "PoisonConfig.OutageHold"},
		{middleware.PoisonConfig{Publisher: pub, Topic: "t", Retries: &retry.Store{}}, "PoisonConfig.Retries: retry: the store is nil or was not made by retry.NewStore"},
		{middleware.PoisonConfig{Publisher: pub, Topic: "t", Consumer: "led\x00ger"}, "PoisonConfig.Consumer \"led\\x00ger\" holds the control character"},
		{middleware.PoisonConfig{Publisher: pub, Topic: "t", InitialBackoff: -time.Second}, "PoisonConfig.InitialBackoff"},
		{middleware.PoisonConfig{Publisher: pub, Topic: "t", InitialBackoff: time.Minute, MaxBackoff: time.Second}, "PoisonConfig.MaxBackoff"},
		{middleware.PoisonConfig{Publisher: pub, Topic: "t", PublishTimeout: -time.Second}, "PoisonConfig.PublishTimeout"},
	} {
		_, err := middleware.NewPoison(tc.cfg)
		require.ErrorContains(t, err, tc.want)
	}
}

// TestPoisonDeadKeyStaysDeadUntilReplayed: a message is dead-lettered into
// the PostgreSQL DLQ table, and its key is recorded dead; a producer's
// retry of the same key (another UUID) is acked without running, even
// though the handler would now succeed, and counted on the dead key; the
// operator's replay reopens the key and applies it once; a copy after
// that is a plain duplicate. The key is never both applied and dead.
func TestPoisonDeadKeyStaysDeadUntilReplayed(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pgtest.Pool(t, 8)
	schema := pgtest.Schema(t, pool)
	b := postgresBackendIn(t, pool, schema)
	table, err := dlq.NewPublisher(pool, sqlschema.Config{Schema: schema})
	require.NoError(t, err)
	entries, err := dlq.NewStore(pool, sqlschema.Config{Schema: schema})
	require.NoError(t, err)

	var broken atomic.Bool
	broken.Store(true)
	rig := startPoisonRig(t, b, middleware.PoisonConfig{Publisher: table}, func(int32, *message.Message) error {
		if broken.Load() {
			return middleware.Permanent(errors.New("schema v2 payload not understood"))
		}
		return nil
	})
	rig.publish(t, "order-11")
	require.Eventually(t, func() bool {
		n, err := entries.Count(ctx, dlq.Filter{All: true})
		require.NoError(t, err)
		return n == 1
	}, 30*time.Second, 10*time.Millisecond)
	list, err := entries.List(ctx, dlq.Filter{Consumer: "charge"})
	require.NoError(t, err)
	require.Len(t, list, 1)
	require.Equal(t, "order-11", list[0].Key)
	require.Equal(t, poisonTopic, list[0].Topic)
	require.True(t, list[0].Permanent)
	require.Contains(t, list[0].Error, "schema v2")

	// The fix ships; the producer's own retry of order-11 is applied.
	deadCopies := func() (n int) {
		require.NoError(t, pool.QueryRow(ctx, `SELECT dead_copies FROM "`+schema+`".inbox_failures WHERE consumer = 'charge' AND key = 'order-11'`).Scan(&n))
		return n
	}
	require.Equal(t, "dead", b.status(t, "charge", "order-11"))

	// The fix ships, and the producer's own retry of order-11 arrives: it
	// is not run, since its message sits in the DLQ for an operator.
	broken.Store(false)
	rig.publish(t, "order-11")
	require.Eventually(t, func() bool { return rig.inbox.Stats().DeadCopies == 1 }, 30*time.Second, 10*time.Millisecond,
		"the copy of the dead key is acked without running")
	require.Equal(t, 0, b.effects(t), "nothing applied while the key is dead")
	require.Equal(t, 1, deadCopies(), "the copy is counted on the dead key")
	copies, ok, err := entries.CopiesSince(ctx, list[0])
	require.NoError(t, err)
	require.True(t, ok)
	require.Equal(t, 1, copies, "the operator sees the copy on the dead letter")
	require.Equal(t, int32(1), rig.calls.Load(), "the handler ran for the first delivery only")

	n, err := entries.Replay(ctx, rig.pubSub, dlq.Filter{IDs: []int64{list[0].ID}}, nil)
	require.NoError(t, err)
	require.Equal(t, 1, n)
	require.Eventually(t, func() bool { return b.effects(t) == 1 }, 30*time.Second, 10*time.Millisecond,
		"the replay reopens the key and applies it")
	require.Equal(t, "done", b.status(t, "charge", "order-11"))
	left, err := entries.Count(ctx, dlq.Filter{All: true})
	require.NoError(t, err)
	require.Zero(t, left, "a replayed entry leaves the table")

	rig.publish(t, "order-11")
	require.Eventually(t, func() bool { return rig.inbox.Stats().Duplicates == 1 }, 30*time.Second, 10*time.Millisecond)
	require.Equal(t, 1, b.effects(t), "the effect happened once")
}
