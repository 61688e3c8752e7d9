package middleware_test

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
	wmmiddleware "github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/dedup"
	"github.com/oncemill/oncemill/dedup/postgres"
	dlv "github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/dlq"
	"github.com/oncemill/oncemill/internal/testing/msgtest"
	"github.com/oncemill/oncemill/internal/testing/pgtest"
	"github.com/oncemill/oncemill/middleware"
	"github.com/oncemill/oncemill/sqlschema"
)

// chain is a router over GoChannel running the given middlewares around a
// handler, with the dead-letter topic subscribed to.
type chain struct {
	pubSub *gochannel.GoChannel
	dead   <-chan *message.Message
	router *message.Router
	done   chan error
}

func startChain(t *testing.T, h message.NoPublishHandlerFunc, mws ...message.HandlerMiddleware) *chain {
	t.Helper()
	c := &chain{pubSub: gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 64, Persistent: true}, watermill.NopLogger{})}
	dead, err := c.pubSub.Subscribe(context.Background(), deadTopic)
	require.NoError(t, err)
	c.dead = dead
	c.router, err = message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
	require.NoError(t, err)
	c.router.AddMiddleware(mws...)
	c.router.AddConsumerHandler("charge", poisonTopic, c.pubSub, h)
	c.done = make(chan error, 1)
	go func() { c.done <- c.router.Run(context.Background()) }()
	<-c.router.Running()
	t.Cleanup(func() {
		require.NoError(t, c.router.Close())
		require.NoError(t, <-c.done)
		require.NoError(t, c.pubSub.Close())
	})
	return c
}

func (c *chain) publish(t *testing.T, key string) {
	t.Helper()
	require.NoError(t, c.pubSub.Publish(poisonTopic, delivery(key, "charge "+key)))
}

func newPoison(t *testing.T, pub message.Publisher, maxAttempts int) *middleware.Poison {
	t.Helper()
	p, err := middleware.NewPoison(middleware.PoisonConfig{
		Publisher: pub, Topic: deadTopic, MaxAttempts: maxAttempts,
		InitialBackoff: time.Millisecond, MaxBackoff: 5 * time.Millisecond,
	})
	require.NoError(t, err)
	return p
}

// lateDLQ hands the chain's GoChannel to a poison middleware made before it.
type lateDLQ struct {
	pub atomic.Pointer[gochannel.GoChannel]
}

func (l *lateDLQ) Publish(topic string, msgs ...*message.Message) error {
	return l.pub.Load().Publish(topic, msgs...)
}
func (l *lateDLQ) Close() error { return nil }

// TestPoisonPanicEndsInDLQ: a handler that always panics is attempted
// exactly MaxAttempts times, then dead-lettered with the panic as its
// reason; its effect is never committed and its key is dead.
func TestPoisonPanicEndsInDLQ(t *testing.T) {
	t.Parallel()
	txBackends(t, 4, func(t *testing.T, b txBackend) {
		var calls atomic.Int32
		rig := startPoisonRig(t, b, middleware.PoisonConfig{MaxAttempts: 3}, func(int32, *message.Message) error {
			calls.Add(1)
			var ledger map[string]int
			ledger["acct-1"]++ // assignment to entry in nil map
			return nil
		})
		rig.publish(t, "order-p")
		dead := msgtest.Receive(t, rig.dead, 30*time.Second)
		dead.Ack()
		require.Equal(t, "3", dead.Metadata.Get(dlv.DeadAttempts))
		require.Contains(t, dead.Metadata.Get(dlv.DeadError), "handler panicked")
		require.Contains(t, dead.Metadata.Get(dlv.DeadError), "nil map")
		msgtest.Nothing(t, rig.dead, 200*time.Millisecond)
		require.Equal(t, int32(3), calls.Load(), "exactly MaxAttempts attempts")
		require.Equal(t, 0, b.effects(t))
		require.Equal(t, "dead", b.status(t, "charge", "order-p"))
		require.Equal(t, int64(3), rig.inbox.Stats().Panicked)
	})
}

// TestPanicWithRecovererOutermost: Watermill's Recoverer in front of
// Poison and the inbox, where a user who always adds it puts it, sees no
// panic (the inbox recovers it in its own frame) and changes nothing: the
// message is attempted exactly MaxAttempts times and dead-lettered with
// the panic as its reason, its effect never committed.
func TestPanicWithRecovererOutermost(t *testing.T) {
	t.Parallel()
	txBackends(t, 4, func(t *testing.T, b txBackend) {
		dlq := &lateDLQ{}
		// Each attempt a delivery of its own, so that the store's start
		// never runs inside the previous attempt's 50 ms.
		poison, err := middleware.NewPoison(middleware.PoisonConfig{
			Publisher: dlq, Topic: deadTopic, MaxAttempts: 3, InProcessRetries: middleware.NoInProcessRetries,
			InitialBackoff: time.Millisecond, MaxBackoff: 5 * time.Millisecond,
		})
		require.NoError(t, err)
		in := newInbox(t, middleware.InboxConfig{TxStore: b.store})
		var calls atomic.Int32
		c := startChain(t, func(msg *message.Message) error {
			calls.Add(1)
			if err := b.effect(msg.Context(), middleware.IdempotencyKey(msg.Context())); err != nil {
				return err
			}
			panic("ledger: negative balance")
		}, wmmiddleware.Recoverer, poison.Middleware, in.Middleware)
		dlq.pub.Store(c.pubSub)
		c.publish(t, "order-r")
		dead := msgtest.Receive(t, c.dead, 30*time.Second)
		dead.Ack()
		require.Equal(t, "3", dead.Metadata.Get(dlv.DeadAttempts))
		require.Contains(t, dead.Metadata.Get(dlv.DeadError), middleware.ErrPanicked.Error())
		require.Contains(t, dead.Metadata.Get(dlv.DeadError), "negative balance")
		msgtest.Nothing(t, c.dead, 200*time.Millisecond)
		require.Equal(t, int32(3), calls.Load(), "exactly MaxAttempts attempts")
		require.Equal(t, 0, b.effects(t), "the effect never committed")
		require.Equal(t, "dead", b.status(t, "charge", "order-r"))
		require.Equal(t, int64(3), in.Stats().Panicked)
	})
}

// TestPoisonPanicWithoutInbox: with no inbox in the chain, the poison
// middleware recovers the panic itself and counts it.
func TestPoisonPanicWithoutInbox(t *testing.T) {
	t.Parallel()
	dlq := &lateDLQ{}
	poison := newPoison(t, dlq, 2)
	var calls atomic.Int32
	c := startChain(t, func(*message.Message) error {
		calls.Add(1)
		panic(errors.New("decoder bug"))
	}, poison.Middleware)
	dlq.pub.Store(c.pubSub)
	c.publish(t, "order-q")
	dead := msgtest.Receive(t, c.dead, 30*time.Second)
	dead.Ack()
	require.Equal(t, "2", dead.Metadata.Get(dlv.DeadAttempts))
	require.Contains(t, dead.Metadata.Get(dlv.DeadError), "decoder bug")
	msgtest.Nothing(t, c.dead, 200*time.Millisecond)
	require.Equal(t, int32(2), calls.Load())
	require.Equal(t, int64(2), poison.Stats().Panicked)
}

// TestPoisonDeadlineIsCounted: Watermill's Timeout middleware between the
// poison middleware and the inbox cancels a slow attempt; the deadline is
// the attempt's failure, counted and dead-lettered after MaxAttempts (it
// used to be taken for a shutdown and nacked forever).
func TestPoisonDeadlineIsCounted(t *testing.T) {
	t.Parallel()
	txBackends(t, 4, func(t *testing.T, b txBackend) {
		dlq := &lateDLQ{}
		// Each attempt a delivery of its own, so that the store's start
		// never runs inside the previous attempt's 50 ms.
		poison, err := middleware.NewPoison(middleware.PoisonConfig{
			Publisher: dlq, Topic: deadTopic, MaxAttempts: 3, InProcessRetries: middleware.NoInProcessRetries,
			InitialBackoff: time.Millisecond, MaxBackoff: 5 * time.Millisecond,
		})
		require.NoError(t, err)
		in := newInbox(t, middleware.InboxConfig{TxStore: b.store})
		var calls atomic.Int32
		c := startChain(t, func(msg *message.Message) error {
			calls.Add(1)
			if err := b.effect(msg.Context(), middleware.IdempotencyKey(msg.Context())); err != nil {
				return err
			}
			<-msg.Context().Done() // the card network never answers
			return fmt.Errorf("card network: %w", msg.Context().Err())
		}, poison.Middleware, wmmiddleware.Timeout(50*time.Millisecond), in.Middleware)
		dlq.pub.Store(c.pubSub)
		c.publish(t, "order-d")
		dead := msgtest.Receive(t, c.dead, 30*time.Second)
		dead.Ack()
		require.Equal(t, "3", dead.Metadata.Get(dlv.DeadAttempts))
		require.Contains(t, dead.Metadata.Get(dlv.DeadError), "deadline exceeded")
		msgtest.Nothing(t, c.dead, 200*time.Millisecond)
		require.Equal(t, int32(3), calls.Load())
		require.Equal(t, 0, b.effects(t))
		require.Equal(t, "dead", b.status(t, "charge", "order-d"))
	})
}

// TestInboxCrashLoopDeadLettersWithoutRunning: three attempts of a key
// started and never finished (their process died: InboxStart is what the
// inbox writes before the handler runs). With MaxAttempts 3, the next
// delivery is dead-lettered without running the handler.
func TestInboxCrashLoopDeadLettersWithoutRunning(t *testing.T) {
	t.Parallel()
	txBackends(t, 4, func(t *testing.T, b txBackend) {
		key := dedup.Key{Consumer: "charge", Key: "order-oom"}
		for range 3 {
			_, err := b.store.InboxStart(context.Background(), key, time.Hour)
			require.NoError(t, err)
		}
		require.Equal(t, 3, b.starts(t, key.Consumer, key.Key))
		rig := startPoisonRig(t, b, middleware.PoisonConfig{MaxAttempts: 3}, func(int32, *message.Message) error { return nil })
		rig.publish(t, key.Key)
		dead := msgtest.Receive(t, rig.dead, 30*time.Second)
		dead.Ack()
		require.Equal(t, "3", dead.Metadata.Get(dlv.DeadAttempts))
		require.Equal(t, "true", dead.Metadata.Get(dlv.DeadPermanent))
		require.Contains(t, dead.Metadata.Get(dlv.DeadError), middleware.ErrCrashLoop.Error())
		msgtest.Nothing(t, rig.dead, 200*time.Millisecond)
		require.Equal(t, int32(0), rig.calls.Load(), "the handler never ran")
		require.Equal(t, 0, b.effects(t))
		require.Equal(t, "dead", b.status(t, key.Consumer, key.Key))
		require.Equal(t, int64(1), rig.inbox.Stats().CrashLooped)

		// Fewer unfinished starts than MaxAttempts run as usual.
		other := dedup.Key{Consumer: "charge", Key: "order-ok"}
		for range 2 {
			_, err := b.store.InboxStart(context.Background(), other, time.Hour)
			require.NoError(t, err)
		}
		rig.publish(t, other.Key)
		require.Eventually(t, func() bool { return b.effects(t) == 1 }, 30*time.Second, 5*time.Millisecond)
		require.Equal(t, "done", b.status(t, other.Consumer, other.Key))
		require.Equal(t, 0, b.starts(t, other.Consumer, other.Key), "the start count commits away with the effect")
	})
}

// TestInboxShutdownCommitsFinishedWork: the router closes while a handler
// runs; the handler finishes its effect after the message's context was
// cancelled, and the effect is committed (not rolled back with the
// cancelled context). A second handler gives up on the cancellation: its
// attempt is rolled back and not counted, so even MaxAttempts 1 does not
// dead-letter it. PostgreSQL only: the two attempts hold write
// transactions at once, which SQLite serialises.
func TestInboxShutdownCommitsFinishedWork(t *testing.T) {
	t.Parallel()
	func(t *testing.T, b txBackend) {
		dlq := &lateDLQ{}
		poison := newPoison(t, dlq, 1)
		// The handlers wait for their context to end: at the end of the
		// drain, which the router's close starts.
		in := newInbox(t, middleware.InboxConfig{TxStore: b.store, DrainTimeout: 500 * time.Millisecond})
		started := make(chan string, 2)
		c := &chain{pubSub: gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 64, Persistent: true}, watermill.NopLogger{})}
		t.Cleanup(func() { require.NoError(t, c.pubSub.Close()) })
		dlq.pub.Store(c.pubSub)
		dead, err := c.pubSub.Subscribe(context.Background(), deadTopic)
		require.NoError(t, err)
		router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
		require.NoError(t, err)
		router.AddMiddleware(poison.Middleware, in.Middleware)
		for _, name := range []string{"finishes", "gives-up"} {
			topic := poisonTopic + "." + name
			router.AddConsumerHandler(name, topic, c.pubSub, func(msg *message.Message) error {
				ctx := msg.Context()
				if err := b.effect(ctx, name); err != nil {
					return err
				}
				started <- name
				<-ctx.Done() // the deploy begins
				if name == "gives-up" {
					return ctx.Err()
				}
				return nil
			})
			require.NoError(t, c.pubSub.Publish(topic, delivery(name, "charge")))
		}
		done := make(chan error, 1)
		go func() { done <- router.Run(context.Background()) }()
		<-router.Running()
		<-started
		<-started
		require.NoError(t, router.Close())
		require.NoError(t, <-done)

		require.Equal(t, "done", b.status(t, "finishes", "finishes"), "finished work is committed during shutdown")
		require.Equal(t, 1, b.effects(t), "only the finished handler's effect")
		require.Equal(t, "", b.status(t, "gives-up", "gives-up"), "the cut attempt recorded no failure")
		require.Equal(t, 0, b.starts(t, "gives-up", "gives-up"), "and its start was taken back")
		require.Equal(t, int64(1), in.Stats().Abandoned)
		require.Equal(t, int64(0), in.Stats().Failed)
		msgtest.Nothing(t, dead, 200*time.Millisecond)
	}(t, postgresBackend(t, 8))
}

// slowLease fails every renewal of its lease store with err.
type slowLease struct {
	dedup.LeaseStore
	err error
}

func (s slowLease) LeaseExtend(context.Context, dedup.Key, int64, time.Duration) (time.Time, error) {
	return time.Time{}, s.err
}

// TestLeaseRenewedWhileHandlerRuns: a handler 2.5 times slower than its
// lease keeps the key: a duplicate delivered after the lease's first end is
// in flight, not a takeover, and the effect runs once.
//
// The lease is long enough for a renewal to get through on a loaded
// machine under the race detector: it has about 0.47 of a lease to finish
// (Lease/3 in, cut 0.8 of a lease in), which a 400 ms lease left at
// 190 ms, less than a loaded CI runner sometimes takes.
func TestLeaseRenewedWhileHandlerRuns(t *testing.T) {
	t.Parallel()
	leaseStores(t, func(t *testing.T, store dedup.LeaseStore) {
		const lease = 1500 * time.Millisecond
		in := newInbox(t, middleware.InboxConfig{LeaseStore: store, Consumer: "payments", Lease: lease, Tuning: middleware.InboxTuning{InFlightDelay: time.Millisecond}})
		var runs atomic.Int32
		release := make(chan struct{})
		h := in.Middleware(func(msg *message.Message) ([]*message.Message, error) {
			runs.Add(1)
			select {
			case <-release: // the payment provider answers, slowly
				return nil, nil
			case <-msg.Context().Done():
				return nil, context.Cause(msg.Context())
			}
		})
		first := make(chan error, 1)
		go func() {
			_, err := h(delivery("pay-1", "charge"))
			first <- err
		}()
		require.Eventually(t, func() bool { return runs.Load() == 1 }, 10*time.Second, time.Millisecond)
		deadline := time.Now().Add(lease * 5 / 2) // two and a half leases
		for time.Now().Before(deadline) {
			_, err := h(delivery("pay-1", "charge"))
			require.ErrorIs(t, err, middleware.ErrInFlight, "the renewed lease is not taken over")
		}
		close(release)
		require.NoError(t, <-first)
		_, err := h(delivery("pay-1", "charge"))
		require.NoError(t, err)
		require.Equal(t, int32(1), runs.Load(), "the effect ran once")
		require.Equal(t, int64(1), in.Stats().Applied)
	})
}

// TestLeaseHolderStopsWhenRenewalsFail: renewals fail; the handler's
// context is cancelled with the lease lost (by a timer set a margin before
// the lease ends; how long it took is logged, not asserted), the attempt
// records nothing, and the stale token cannot complete once another
// delivery took over.
func TestLeaseHolderStopsWhenRenewalsFail(t *testing.T) {
	t.Parallel()
	leaseStores(t, func(t *testing.T, store dedup.LeaseStore) {
		lease := 200 * time.Millisecond
		in := newInbox(t, middleware.InboxConfig{LeaseStore: slowLease{store, errors.New("store unreachable")}, Consumer: "payments", Lease: lease})
		var token int64
		var cancelledAfter time.Duration
		h := in.Middleware(func(msg *message.Message) ([]*message.Message, error) {
			token = middleware.LeaseToken(msg.Context())
			began := time.Now()
			select {
			case <-msg.Context().Done():
				cancelledAfter = time.Since(began)
				return nil, context.Cause(msg.Context())
			case <-time.After(10 * time.Second):
				return nil, errors.New("never cancelled")
			}
		})
		_, err := h(delivery("pay-2", "charge"))
		require.ErrorIs(t, err, dedup.ErrLeaseLost)
		require.Positive(t, token, "the fencing token is handed to the handler")
		t.Logf("holder cancelled %s into a %s lease", cancelledAfter, lease)

		// Another delivery takes the key over once the lease has ended;
		// the stale holder can neither complete nor release it.
		key := dedup.Key{Consumer: "payments", Key: "pay-2"}
		var c dedup.Claim
		require.Eventually(t, func() bool {
			c, err = store.LeaseClaim(context.Background(), key, time.Minute, time.Hour)
			require.NoError(t, err)
			return c.State == dedup.StateNew
		}, 10*time.Second, 10*time.Millisecond)
		require.Greater(t, c.Token, token)
		require.ErrorIs(t, store.LeaseComplete(context.Background(), key, token, nil), dedup.ErrLeaseLost)
		require.NoError(t, store.LeaseComplete(context.Background(), key, c.Token, nil))
	})
}

// TestLeaseTokensNeverRepeat: the PostgreSQL store's tokens keep growing
// after the record was swept, so a holder from before the sweep cannot
// complete a lease taken after it.
func TestLeaseTokensNeverRepeat(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pgtest.Pool(t, 4)
	schema := pgtest.Schema(t, pool)
	store, err := postgres.New(pool, postgres.Config{Schema: schema})
	require.NoError(t, err)
	key := dedup.Key{Consumer: "payments", Key: "pay-3"}
	old, err := store.LeaseClaim(ctx, key, time.Minute, time.Hour)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `DELETE FROM "`+schema+`".inbox`) // what the sweep does once the window passed
	require.NoError(t, err)
	fresh, err := store.LeaseClaim(ctx, key, time.Minute, time.Hour)
	require.NoError(t, err)
	require.Equal(t, dedup.StateNew, fresh.State)
	require.Greater(t, fresh.Token, old.Token)
	require.ErrorIs(t, store.LeaseComplete(ctx, key, old.Token, nil), dedup.ErrLeaseLost)
}

// buryFails fails the first n burials of its store.
type buryFails struct {
	dedup.TxStore
	left *atomic.Int32
}

func (b buryFails) InboxBegin(ctx context.Context) (dedup.InboxTx, error) {
	tx, err := b.TxStore.InboxBegin(ctx)
	return buryFailsTx{InboxTx: tx, left: b.left}, err
}

type buryFailsTx struct {
	dedup.InboxTx
	left *atomic.Int32
}

func (t buryFailsTx) InboxBury(ctx context.Context, key dedup.Key, f dedup.Failure) error {
	if t.left.Add(-1) >= 0 {
		return errors.New("connection reset while marking the key dead")
	}
	return t.InboxTx.InboxBury(ctx, key, f)
}

// TestDeadLetterRowCommitsWithDeadMark: with the dead-letter table on the
// inbox's database, the dead letter is written in the claim's transaction:
// when marking the key dead fails, the dead-letter row goes too (the
// message is nacked and tried again), so the table never holds a message
// whose key is not dead; once it succeeds there is exactly one row.
func TestDeadLetterRowCommitsWithDeadMark(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pgtest.Pool(t, 8)
	schema := pgtest.Schema(t, pool)
	b := postgresBackendIn(t, pool, schema)
	left := &atomic.Int32{}
	left.Store(2)
	b.store = buryFails{TxStore: b.store, left: left}
	table, err := dlq.NewPublisher(pool, sqlschema.Config{Schema: schema})
	require.NoError(t, err)
	rows := func() (n int) {
		require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM "`+schema+`".dlq`).Scan(&n))
		return n
	}
	rig := startPoisonRig(t, b, middleware.PoisonConfig{Publisher: table}, func(int32, *message.Message) error {
		return middleware.Permanent(errors.New("unknown currency XTS"))
	})
	rig.publish(t, "order-x")
	require.Eventually(t, func() bool { return rig.poison.Stats().DeadLettered == 1 }, 30*time.Second, 5*time.Millisecond)
	require.Equal(t, "dead", b.status(t, "charge", "order-x"))
	require.Equal(t, 1, rows(), "one dead letter, the failed burials' rows rolled back")
	require.Equal(t, int64(2), rig.poison.Stats().DeadLetterFailed)
	require.Equal(t, int64(1), rig.poison.Stats().DeadLettered)
	require.Equal(t, 0, b.effects(t))
}

// TestInboxSkipAttemptRecord: without the attempt record the inbox still
// applies each key once and counts failures, but writes nothing before the
// transaction.
func TestInboxSkipAttemptRecord(t *testing.T) {
	t.Parallel()
	txBackends(t, 4, func(t *testing.T, b txBackend) {
		in := newInbox(t, middleware.InboxConfig{TxStore: b.store, Consumer: "billing", Tuning: middleware.InboxTuning{SkipAttemptRecord: true}})
		fail := true
		h := in.Middleware(func(msg *message.Message) ([]*message.Message, error) {
			if fail {
				return nil, errors.New("ledger busy")
			}
			return nil, b.effect(msg.Context(), "o-9")
		})
		_, err := h(delivery("o-9", "pay"))
		n, _, ok := middleware.StoredAttempts(err)
		require.True(t, ok)
		require.Equal(t, 1, n)
		require.Equal(t, 0, b.starts(t, "billing", "o-9"), "no attempt record")
		fail = false
		for range 3 {
			_, err := h(delivery("o-9", "pay"))
			require.NoError(t, err)
		}
		require.Equal(t, 1, b.effects(t))
		require.Equal(t, middleware.InboxStats{Applied: 1, Duplicates: 2, Failed: 1}, in.Stats())
	})
}

// TestLeaseHolderFinishingAfterLostRenewalsStillCompletes: renewals fail,
// but no other delivery took the key over, and the handler finishes all
// the same (its effect is done): the completion, fenced by the token,
// still records it, so the next copy is a duplicate rather than a second
// effect.
func TestLeaseHolderFinishingAfterLostRenewalsStillCompletes(t *testing.T) {
	t.Parallel()
	leaseStores(t, func(t *testing.T, store dedup.LeaseStore) {
		in := newInbox(t, middleware.InboxConfig{LeaseStore: slowLease{store, errors.New("store unreachable")}, Consumer: "payments", Lease: 100 * time.Millisecond})
		var runs atomic.Int32
		h := in.Middleware(func(msg *message.Message) ([]*message.Message, error) {
			runs.Add(1)
			<-msg.Context().Done() // the payment went through; the answer comes late
			return nil, nil
		})
		_, err := h(delivery("pay-4", "charge"))
		require.NoError(t, err, "completed with the still-current token")
		_, err = h(delivery("pay-4", "charge"))
		require.NoError(t, err)
		require.Equal(t, int32(1), runs.Load(), "the copy is a duplicate")
		require.Equal(t, int64(1), in.Stats().Duplicates)
	})
}

// TestReplayReachesOnlyItsConsumer: two consumers read one topic; one of
// them dead-letters a message the other applied long ago and whose done
// key it has swept since. The replay is applied by the dead letter's
// consumer once and never by the other, which would apply it a second
// time: requested for the consumer and delivered through its
// ReplaySubscriber, the other never sees it; published to the topic, the
// other's inbox acks it without running. The entry goes once the replay
// was acked (through the ReplaySubscriber) or published (to the topic).
func TestReplayReachesOnlyItsConsumer(t *testing.T) {
	t.Parallel()
	for _, toTopic := range []bool{false, true} {
		name := "to_consumer"
		if toTopic {
			name = "to_topic"
		}
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			testReplayReachesOnlyItsConsumer(t, toTopic)
		})
	}
}

func testReplayReachesOnlyItsConsumer(t *testing.T, toTopic bool) {
	ctx := context.Background()
	pool := pgtest.Pool(t, 12)
	schema := pgtest.Schema(t, pool)
	store, err := postgres.New(pool, postgres.Config{Schema: schema})
	require.NoError(t, err)
	effects := `"` + schema + `".ledger`
	_, err = pool.Exec(ctx, `CREATE TABLE `+effects+` (consumer text NOT NULL, key text NOT NULL)`)
	require.NoError(t, err)
	count := func(consumer string) (n int) {
		require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM `+effects+` WHERE consumer = $1`, consumer).Scan(&n))
		return n
	}
	table, err := dlq.NewPublisher(pool, sqlschema.Config{Schema: schema})
	require.NoError(t, err)
	entries, err := dlq.NewStore(pool, sqlschema.Config{Schema: schema})
	require.NoError(t, err)
	replays, err := dlq.NewReplaySubscriber(pool, sqlschema.Config{Schema: schema}, dlq.ReplaySubscriberConfig{Consumer: "ledger-b", PollInterval: 10 * time.Millisecond})
	require.NoError(t, err)

	poison := newPoison(t, table, 3)
	in := newInbox(t, middleware.InboxConfig{TxStore: store})
	var broken atomic.Bool
	broken.Store(true)
	var calls sync.Map // consumer → *atomic.Int32
	handler := func(msg *message.Message) error {
		ctx := msg.Context()
		consumer := message.HandlerNameFromCtx(ctx)
		n, _ := calls.LoadOrStore(consumer, &atomic.Int32{})
		n.(*atomic.Int32).Add(1)
		if consumer == "ledger-b" && broken.Load() {
			return middleware.Permanent(errors.New("ledger-b: account schema v1"))
		}
		_, err := postgres.Tx(ctx).Exec(ctx, `INSERT INTO `+effects+` VALUES ($1, $2)`, consumer, middleware.IdempotencyKey(ctx))
		return err
	}
	ps := gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 64, Persistent: true}, watermill.NopLogger{})
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
	require.NoError(t, err)
	router.AddMiddleware(poison.Middleware, in.Middleware)
	router.AddConsumerHandler("ledger-a", poisonTopic, ps, handler)
	router.AddConsumerHandler("ledger-b", poisonTopic, dlq.WithReplays(ps, replays), handler)
	done := make(chan error, 1)
	go func() { done <- router.Run(ctx) }()
	<-router.Running()
	t.Cleanup(func() {
		require.NoError(t, router.Close())
		require.NoError(t, <-done)
		require.NoError(t, ps.Close())
	})

	require.NoError(t, ps.Publish(poisonTopic, delivery("pay-1", "charge")))
	require.Eventually(t, func() bool {
		n, err := entries.Count(ctx, dlq.Filter{Consumer: "ledger-b"})
		require.NoError(t, err)
		return n == 1 && count("ledger-a") == 1
	}, 30*time.Second, 10*time.Millisecond)
	// ledger-a's window passes: its done key is swept.
	_, err = pool.Exec(ctx, `DELETE FROM "`+schema+`".inbox WHERE consumer = 'ledger-a'`)
	require.NoError(t, err)

	broken.Store(false)
	if toTopic {
		n, err := entries.Replay(ctx, ps, dlq.Filter{Consumer: "ledger-b"}, nil)
		require.NoError(t, err)
		require.Equal(t, 1, n)
	} else {
		n, err := entries.RequestReplay(ctx, dlq.Filter{Consumer: "ledger-b"})
		require.NoError(t, err)
		require.Equal(t, 1, n)
	}
	require.Eventually(t, func() bool { return count("ledger-b") == 1 }, 30*time.Second, 10*time.Millisecond, "the replay reaches ledger-b")
	require.Eventually(t, func() bool {
		n, err := entries.Count(ctx, dlq.Filter{All: true})
		require.NoError(t, err)
		return n == 0
	}, 30*time.Second, 10*time.Millisecond, "the entry goes once ledger-b took it")
	a, _ := calls.Load("ledger-a")
	if toTopic {
		require.Eventually(t, func() bool { return in.Stats().OthersReplays == 1 }, 30*time.Second, 10*time.Millisecond,
			"ledger-a's inbox acks the replay meant for ledger-b")
	} else {
		require.Zero(t, in.Stats().OthersReplays, "ledger-a never saw the replay")
	}
	require.Equal(t, int32(1), a.(*atomic.Int32).Load(), "ledger-a never ran the replay")
	require.Equal(t, 1, count("ledger-a"), "ledger-a never applied it again")
	require.Equal(t, 1, count("ledger-b"), "ledger-b applied it once")
}
