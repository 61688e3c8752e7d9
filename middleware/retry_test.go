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

	oncedelivery "github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/dlq"
	"github.com/oncemill/oncemill/internal/testing/msgtest"
	"github.com/oncemill/oncemill/internal/testing/sqltest"
	"github.com/oncemill/oncemill/middleware"
	"github.com/oncemill/oncemill/retry"
)

// parkingRig is a consumer on a persistent GoChannel whose poison
// middleware parks in the retries table of db and dead-letters into its
// dead-letter table, with no inbox: the handler records what it applied.
type parkingRig struct {
	pub     message.Publisher
	poison  *middleware.Poison
	dead    *dlq.Store
	parked  *retry.Store
	mu      sync.Mutex
	applied []string // payloads, in the order applied
}

func (r *parkingRig) appliedList() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]string(nil), r.applied...)
}

func newParkingRig(t *testing.T, db sqltest.Database, cfg middleware.PoisonConfig, fail func(msg *message.Message) error) *parkingRig {
	t.Helper()
	var (
		parked *retry.Store
		pub    message.Publisher
		dead   *dlq.Store
		err    error
	)
	if db.Pool != nil {
		parked, err = retry.NewStore(db.Pool, db.Schema)
		require.NoError(t, err)
		pub, err = dlq.NewPublisher(db.Pool, db.Schema)
		require.NoError(t, err)
		dead, err = dlq.NewStore(db.Pool, db.Schema)
	} else {
		parked, err = retry.NewSQLStore(db.DB, db.Dialect, db.Schema)
		require.NoError(t, err)
		pub, err = dlq.NewSQLPublisher(db.DB, db.Dialect, db.Schema)
		require.NoError(t, err)
		dead, err = dlq.NewSQLStore(db.DB, db.Dialect, db.Schema)
	}
	require.NoError(t, err)
	cfg.Publisher, cfg.Retries, cfg.Consumer = pub, parked, "ledger"
	poison, err := middleware.NewPoison(cfg)
	require.NoError(t, err)
	rig := &parkingRig{poison: poison, dead: dead, parked: parked}

	gc := gochannel.NewGoChannel(gochannel.Config{Persistent: true, OutputChannelBuffer: 64}, watermill.NopLogger{})
	rig.pub = gc
	sub, err := poison.Subscriber(gc)
	require.NoError(t, err)
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
	require.NoError(t, err)
	router.AddMiddleware(poison.Middleware)
	router.AddConsumerHandler("ledger", "payments", sub, func(msg *message.Message) error {
		if err := fail(msg); err != nil {
			return err
		}
		rig.mu.Lock()
		rig.applied = append(rig.applied, string(msg.Payload))
		rig.mu.Unlock()
		return nil
	})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- router.Run(ctx) }()
	<-router.Running()
	t.Cleanup(func() {
		cancel()
		require.NoError(t, <-done)
		require.NoError(t, gc.Close())
	})
	return rig
}

func (r *parkingRig) publish(t *testing.T, orderKey string, payloads ...string) {
	t.Helper()
	for _, p := range payloads {
		msg := message.NewMessage(watermill.NewUUID(), []byte(p))
		msg.Metadata.Set(oncedelivery.PartitionKey, orderKey)
		require.NoError(t, r.pub.Publish("payments", msg))
	}
}

// TestParkingOnEveryBackend: on PostgreSQL (pgx and database/sql), MariaDB
// and SQLite, an account's first payment fails twice (one quick attempt,
// parked, handed back, parked again) and then succeeds; the account's two later
// payments wait behind it, parked unrun, while another account's payment
// applies at once. Every payment applies once, the account's in order,
// nothing is dead-lettered and nothing is left parked.
func TestParkingOnEveryBackend(t *testing.T) {
	t.Parallel()
	for _, b := range sqltest.Backends {
		t.Run(b.Name, func(t *testing.T) {
			t.Parallel()
			db := b.Open(t, 8)
			var firstRuns atomic.Int32
			rig := newParkingRig(t, db, middleware.PoisonConfig{MaxAttempts: 1, Delays: []time.Duration{time.Second, time.Second, time.Hour}},
				func(msg *message.Message) error {
					if string(msg.Payload) == "a-1" && firstRuns.Add(1) <= 2 {
						return errors.New("ledger busy")
					}
					return nil
				})
			// One at a time: GoChannel does not keep publish order.
			rig.publish(t, "acct-a", "a-1")
			require.Eventually(t, func() bool { return rig.poison.Stats().Parked == 1 }, 10*time.Second, 5*time.Millisecond)
			rig.publish(t, "acct-a", "a-2")
			require.Eventually(t, func() bool { return rig.poison.Stats().ParkedBehind == 1 }, 10*time.Second, 5*time.Millisecond)
			rig.publish(t, "acct-a", "a-3")
			require.Eventually(t, func() bool { return rig.poison.Stats().ParkedBehind == 2 }, 10*time.Second, 5*time.Millisecond)
			rig.publish(t, "acct-b", "b-1")
			require.Eventually(t, func() bool { return len(rig.appliedList()) == 4 }, 20*time.Second, 20*time.Millisecond)

			got := rig.appliedList()
			var a []string
			for _, p := range got {
				if strings.HasPrefix(p, "a-") {
					a = append(a, p)
				}
			}
			require.Equal(t, []string{"a-1", "a-2", "a-3"}, a, "the account's payments apply in order")
			require.Equal(t, "b-1", got[0], "the other account applies while the first one's payments wait")
			require.Equal(t, int32(3), firstRuns.Load(), "two failed attempts, then the one that applied")
			st := rig.poison.Stats()
			require.Equal(t, int64(2), st.Parked)
			require.Equal(t, int64(2), st.ParkedBehind)
			require.Zero(t, st.DeadLettered)
			require.Eventually(t, func() bool {
				counts, err := rig.parked.Counts(context.Background(), time.Minute)
				require.NoError(t, err)
				return len(counts) == 0
			}, 5*time.Second, 20*time.Millisecond, "nothing left parked")
			n, err := rig.dead.Count(context.Background(), dlq.Filter{All: true})
			require.NoError(t, err)
			require.Zero(t, n)
		})
	}
}

// TestParkingNamesTheKeyAndRefusesWhatCannotWait: a message parked
// behind another of its ordering key is filed with its key (the
// operators' lists show it); a failing message with no UUID, which no
// park can tell from another, is dead-lettered at once with why, not
// nacked for ever.
func TestParkingNamesTheKeyAndRefusesWhatCannotWait(t *testing.T) {
	t.Parallel()
	db := sqltest.Backends[0].Open(t, 8)
	rig := newParkingRig(t, db, middleware.PoisonConfig{MaxAttempts: 1, Delays: []time.Duration{time.Hour}},
		func(msg *message.Message) error {
			if string(msg.Payload) != "b-2" {
				return errors.New("ledger busy")
			}
			return nil
		})
	first := message.NewMessage(watermill.NewUUID(), []byte("b-1"))
	first.Metadata.Set(oncedelivery.PartitionKey, "acct-b")
	first.Metadata.Set(oncedelivery.IdempotencyKey, "pay-b-1")
	require.NoError(t, rig.pub.Publish("payments", first))
	require.Eventually(t, func() bool { return rig.poison.Stats().Parked == 1 }, 10*time.Second, 5*time.Millisecond)
	second := message.NewMessage(watermill.NewUUID(), []byte("b-2"))
	second.Metadata.Set(oncedelivery.PartitionKey, "acct-b")
	second.Metadata.Set(oncedelivery.IdempotencyKey, "pay-b-2")
	require.NoError(t, rig.pub.Publish("payments", second))
	require.Eventually(t, func() bool { return rig.poison.Stats().ParkedBehind == 1 }, 10*time.Second, 5*time.Millisecond)
	behind, err := rig.parked.List(context.Background(), retry.Filter{UUID: second.UUID})
	require.NoError(t, err)
	require.Len(t, behind, 1)
	require.True(t, behind[0].Behind)
	require.Equal(t, "pay-b-2", behind[0].Key, "parked behind with its key")

	nameless := message.NewMessage("", []byte("c-1"))
	nameless.Metadata.Set(oncedelivery.IdempotencyKey, "pay-c-1")
	require.NoError(t, rig.pub.Publish("payments", nameless))
	require.Eventually(t, func() bool { return rig.poison.Stats().DeadLettered == 1 }, 10*time.Second, 5*time.Millisecond)
	entries, err := rig.dead.List(context.Background(), dlq.Filter{All: true})
	require.NoError(t, err)
	require.Len(t, entries, 1)
	require.Contains(t, entries[0].Error, "cannot be parked")
	require.Contains(t, entries[0].Error, "ledger busy")
	require.Equal(t, int64(1), rig.poison.Stats().Parked, "the nameless message was not parked")
}

var errLedgerRejects = errors.New("ledger rejects the account")

// TestDecisions: what each of Classify's answers does, on PostgreSQL.
func TestDecisions(t *testing.T) {
	t.Parallel()
	db := sqltest.Backends[0].Open(t, 8)
	classify := func(err error) middleware.Decision {
		switch {
		case errors.Is(err, errLedgerRejects):
			return middleware.DeadLetter
		case strings.Contains(err.Error(), "now"):
			return middleware.RetryNow
		}
		return middleware.DefaultClassify(err)
	}
	policy := middleware.PoisonConfig{MaxAttempts: 2, InitialBackoff: 10 * time.Millisecond, MaxBackoff: 10 * time.Millisecond,
		Delays: []time.Duration{100 * time.Millisecond}, Classify: classify}

	t.Run("RetryAfter parks for the wait the dependency asked", func(t *testing.T) {
		var runs atomic.Int32
		var firstAt, appliedAt atomic.Int64
		rig := newParkingRig(t, db, policy, func(msg *message.Message) error {
			if runs.Add(1) == 1 {
				firstAt.Store(time.Now().UnixNano())
				return middleware.RetryAfter(errors.New("429 Too Many Requests"), 1500*time.Millisecond)
			}
			appliedAt.Store(time.Now().UnixNano())
			return nil
		})
		rig.publish(t, "acct-r", "r-1")
		require.Eventually(t, func() bool { return len(rig.appliedList()) == 1 }, 10*time.Second, 10*time.Millisecond)
		waited := time.Duration(appliedAt.Load() - firstAt.Load())
		require.GreaterOrEqual(t, waited, 1500*time.Millisecond, "not handed back before the Retry-After")
		require.Equal(t, int32(2), runs.Load())
		require.Equal(t, int64(1), rig.poison.Stats().Parked)
	})
	t.Run("DeadLetter from the classifier skips every retry", func(t *testing.T) {
		var runs atomic.Int32
		rig := newParkingRig(t, db, policy, func(msg *message.Message) error {
			runs.Add(1)
			return fmt.Errorf("charge: %w", errLedgerRejects)
		})
		rig.publish(t, "acct-d", "d-1")
		require.Eventually(t, func() bool { return rig.poison.Stats().DeadLettered == 1 }, 10*time.Second, 10*time.Millisecond)
		require.Equal(t, int32(1), runs.Load())
		require.Zero(t, rig.poison.Stats().Parked)
	})
	t.Run("RetryNow is never parked and ends at the horizon", func(t *testing.T) {
		var runs atomic.Int32
		rig := newParkingRig(t, db, policy, func(msg *message.Message) error {
			runs.Add(1)
			return errors.New("retry me now")
		})
		rig.publish(t, "acct-n", "n-1")
		require.Eventually(t, func() bool { return rig.poison.Stats().DeadLettered == 1 }, 10*time.Second, 10*time.Millisecond)
		require.Equal(t, int32(3), runs.Load(), "MaxAttempts + len(Delays) attempts")
		require.Zero(t, rig.poison.Stats().Parked)
	})
	t.Run("Pause counts nothing", func(t *testing.T) {
		var runs atomic.Int32
		rig := newParkingRig(t, db, policy, func(msg *message.Message) error {
			if runs.Add(1) <= 3 {
				return middleware.Unavailable(errors.New("payment API: connection refused"))
			}
			return nil
		})
		rig.publish(t, "acct-p", "p-1")
		require.Eventually(t, func() bool { return len(rig.appliedList()) == 1 }, 10*time.Second, 10*time.Millisecond)
		st := rig.poison.Stats()
		require.Equal(t, int64(3), st.Infrastructure)
		require.Zero(t, st.Parked)
		require.Zero(t, st.DeadLettered)
		require.Zero(t, st.Retried, "no attempt counted")
	})
}

// TestSubscriberNeedsStoreAndConsumer: Poison.Subscriber says what is
// missing.
func TestSubscriberNeedsStoreAndConsumer(t *testing.T) {
	db := sqltest.Backends[0].Open(t, 2)
	pub, err := dlq.NewPublisher(db.Pool, db.Schema)
	require.NoError(t, err)
	p, err := middleware.NewPoison(middleware.PoisonConfig{Publisher: pub})
	require.NoError(t, err)
	_, err = p.Subscriber(nil)
	require.ErrorContains(t, err, "the subscriber is nil")
	// Without Retries there is nothing to merge: the subscriber comes back
	// checked against the broker's delivery limit, and delivers.
	gc := gochannel.NewGoChannel(gochannel.Config{Persistent: true}, watermill.NopLogger{})
	t.Cleanup(func() { require.NoError(t, gc.Close()) })
	checked, err := p.Subscriber(gc)
	require.NoError(t, err)
	msgs, err := checked.Subscribe(context.Background(), "orders")
	require.NoError(t, err)
	sent := message.NewMessage(watermill.NewUUID(), []byte("x"))
	require.NoError(t, gc.Publish("orders", sent))
	got := msgtest.Receive(t, msgs, 10*time.Second)
	require.Equal(t, sent.UUID, got.UUID)
	got.Ack()

	parked, err := retry.NewStore(db.Pool, db.Schema)
	require.NoError(t, err)
	p, err = middleware.NewPoison(middleware.PoisonConfig{Publisher: pub, Retries: parked})
	require.NoError(t, err)
	_, err = p.Subscriber(gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{}))
	require.ErrorContains(t, err, "InboxConfig.Consumer")

	_, err = middleware.NewPoison(middleware.PoisonConfig{Publisher: pub, Delays: []time.Duration{time.Second}})
	require.ErrorContains(t, err, "PoisonConfig.Delays needs PoisonConfig.Retries")
}
