package middleware_test

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/dedup"
	"github.com/oncemill/oncemill/dedup/redis"
	dlv "github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/dlq"
	"github.com/oncemill/oncemill/internal/testing/pgtest"
	"github.com/oncemill/oncemill/internal/testing/redistest"
	"github.com/oncemill/oncemill/middleware"
	"github.com/oncemill/oncemill/sqlschema"
)

// grantRig is a router running poison (MaxAttempts 2, the dead-letter
// table on PostgreSQL) → inbox → a handler that fails while broken, over
// one of the stores, with a dlq.Store that writes its replay grants where
// that store keeps its dead keys.
type grantRig struct {
	pubSub    *gochannel.GoChannel
	inbox     *middleware.Inbox
	entries   *dlq.Store
	graveyard dedup.Graveyard
	status    func(t *testing.T) string
	effects   func(t *testing.T) int
	calls     atomic.Int32
	broken    atomic.Bool
}

// grantBackends runs fn with a rig over PostgreSQL (the dlq.Store writes
// grants on the inbox table beside the dead-letter table), SQLite and
// Redis (lease mode; grants written through dlq.Store.WithGranter).
func grantBackends(t *testing.T, fn func(t *testing.T, rig *grantRig)) {
	for _, name := range []string{"postgres", "sqlite", "redis"} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			fn(t, startGrantRig(t, name))
		})
	}
}

func startGrantRig(t *testing.T, backend string) *grantRig {
	t.Helper()
	ctx := context.Background()
	pool := pgtest.Pool(t, 8)
	schema := pgtest.Schema(t, pool)
	cfg := sqlschema.Config{Schema: schema}
	table, err := dlq.NewPublisher(pool, cfg)
	require.NoError(t, err)
	entries, err := dlq.NewStore(pool, cfg)
	require.NoError(t, err)

	rig := &grantRig{}
	rig.broken.Store(true)
	icfg := middleware.InboxConfig{Consumer: "charge"}
	var effect func(ctx context.Context, key string) error
	switch backend {
	case "postgres", "sqlite":
		var b txBackend
		if backend == "postgres" {
			b = postgresBackendIn(t, pool, schema)
		} else {
			b = sqliteBackend(t)
			entries, err = entries.WithGranter(b.store)
			require.NoError(t, err)
		}
		icfg.TxStore, rig.graveyard, effect = b.store, b.store, b.effect
		rig.effects = b.effects
		rig.status = func(t *testing.T) string { return b.status(t, "charge", "pay-1") }
	case "redis":
		client := redistest.Client(t)
		store, err := redis.New(redis.Config{Client: client, Prefix: redistest.Prefix(t, client)})
		require.NoError(t, err)
		entries, err = entries.WithGranter(store)
		require.NoError(t, err)
		q := `"` + schema + `"`
		_, err = pool.Exec(ctx, `CREATE TABLE `+q+`.effects (key text NOT NULL)`)
		require.NoError(t, err)
		icfg.LeaseStore, rig.graveyard = store, store
		// A release that a loaded machine's Redis answers too late
		// leaves the key leased until the lease ends; a short lease keeps
		// that within the test's waits.
		icfg.Lease = 2 * time.Second
		effect = func(ctx context.Context, key string) error {
			_, err := pool.Exec(ctx, `INSERT INTO `+q+`.effects (key) VALUES ($1)`, key)
			return err
		}
		rig.effects = func(t *testing.T) (n int) {
			require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM `+q+`.effects`).Scan(&n))
			return n
		}
		rig.status = func(t *testing.T) string {
			c, err := store.InboxPeek(ctx, dedup.Key{Consumer: "charge", Key: "pay-1"})
			require.NoError(t, err)
			return c.State.String()
		}
	}
	rig.entries = entries
	rig.inbox = newInbox(t, icfg)
	poison, err := middleware.NewPoison(middleware.PoisonConfig{
		Publisher: table, Topic: deadTopic, MaxAttempts: 2, Consumer: "charge",
		InitialBackoff: time.Millisecond, MaxBackoff: 5 * time.Millisecond,
	})
	require.NoError(t, err)

	logger := watermill.NopLogger{}
	rig.pubSub = gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 64, Persistent: true}, logger)
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, logger)
	require.NoError(t, err)
	router.AddMiddleware(poison.Middleware, rig.inbox.Middleware)
	router.AddConsumerHandler("charge", poisonTopic, rig.pubSub, func(msg *message.Message) error {
		rig.calls.Add(1)
		if rig.broken.Load() {
			return errors.New("ledger unreachable through a bug")
		}
		return effect(msg.Context(), middleware.IdempotencyKey(msg.Context()))
	})
	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- router.Run(runCtx) }()
	<-router.Running()
	t.Cleanup(func() {
		stop()
		require.NoError(t, <-done)
		require.NoError(t, rig.pubSub.Close())
	})
	return rig
}

// deadLetter publishes pay-1 while the handler fails and waits until it is
// dead-lettered; it returns the entry.
func (r *grantRig) deadLetter(t *testing.T) dlq.Entry {
	t.Helper()
	require.NoError(t, r.pubSub.Publish(poisonTopic, delivery("pay-1", "charge pay-1")))
	var list []dlq.Entry
	require.Eventually(t, func() bool {
		var err error
		list, err = r.entries.List(context.Background(), dlq.Filter{Consumer: "charge"})
		require.NoError(t, err)
		// The dead letter may commit before the dead mark when the
		// inbox is on another database.
		return len(list) == 1 && r.status(t) == "dead"
	}, 30*time.Second, 10*time.Millisecond)
	r.broken.Store(false)
	return list[0]
}

// replayRecorder is a publisher that keeps what it is given and passes it on.
type replayRecorder struct {
	message.Publisher
	mu   sync.Mutex
	sent []*message.Message
}

func (p *replayRecorder) Publish(topic string, msgs ...*message.Message) error {
	p.mu.Lock()
	for _, m := range msgs {
		p.sent = append(p.sent, m.Copy())
	}
	p.mu.Unlock()
	return p.Publisher.Publish(topic, msgs...)
}

func (p *replayRecorder) Close() error { return nil }

// TestForgedReplayDoesNotReopenDeadKey: a key dead-lettered after two
// attempts stays dead for every copy whose replay marker the store did
// not grant: a producer's copy with oncemill_replay=1, one with a guessed
// grant, and one with the grant of an earlier replay that a later one
// replaced. Each is acked without running and counted as a dead copy;
// nothing is applied. The operator's replay through dlq.Store then runs
// the handler once, and the same replayed copy delivered again is a
// duplicate: the grant opened the key once.
func TestForgedReplayDoesNotReopenDeadKey(t *testing.T) {
	t.Parallel()
	grantBackends(t, func(t *testing.T, rig *grantRig) {
		ctx := context.Background()
		entry := rig.deadLetter(t)
		require.Equal(t, int32(2), rig.calls.Load(), "two attempts")
		require.Empty(t, entry.Metadata[dlv.Replay], "the dead letter carries no replay marker")

		key := dedup.Key{Consumer: "charge", Key: "pay-1"}
		guessed, err := dedup.NewReplayGrant()
		require.NoError(t, err)
		old, err := dedup.NewReplayGrant()
		require.NoError(t, err)
		granted, err := rig.graveyard.InboxGrantReplay(ctx, key, old)
		require.NoError(t, err)
		require.True(t, granted)
		newer, err := dedup.NewReplayGrant()
		require.NoError(t, err)
		granted, err = rig.graveyard.InboxGrantReplay(ctx, key, newer)
		require.NoError(t, err)
		require.True(t, granted, "a later replay's grant replaces the earlier one")

		for i, marker := range []string{"1", guessed, old} {
			forged := delivery("pay-1", "charge pay-1")
			forged.Metadata.Set(dlv.Replay, marker)
			forged.Metadata.Set(dlv.ReplayConsumer, "charge")
			require.NoError(t, rig.pubSub.Publish(poisonTopic, forged))
			require.Eventually(t, func() bool { return rig.inbox.Stats().DeadCopies == int64(i+1) }, 30*time.Second, 10*time.Millisecond,
				"forged copy %d is acked as a copy of the dead key", i+1)
		}
		require.Equal(t, int32(2), rig.calls.Load(), "no forged copy ran the handler")
		require.Zero(t, rig.effects(t), "nothing applied")
		require.Equal(t, "dead", rig.status(t), "the key stays dead")
		copies, ok, err := rig.entries.CopiesSince(ctx, entry)
		require.NoError(t, err)
		if ok { // the dead-letter table's inbox holds the PostgreSQL store's rows only
			require.Equal(t, 3, copies, "the operator sees the forged copies on the dead letter")
		}

		pub := &replayRecorder{Publisher: rig.pubSub}
		n, err := rig.entries.Replay(ctx, pub, dlq.Filter{IDs: []int64{entry.ID}}, nil)
		require.NoError(t, err)
		require.Equal(t, 1, n)
		require.Eventually(t, func() bool { return rig.effects(t) == 1 }, 30*time.Second, 10*time.Millisecond,
			"the operator's replay reopens the key and applies it")
		require.Equal(t, int32(3), rig.calls.Load(), "the handler ran once for the replay")
		require.Equal(t, "done", rig.status(t))

		pub.mu.Lock()
		require.Len(t, pub.sent, 1)
		again := pub.sent[0].Copy()
		pub.mu.Unlock()
		require.NotEqual(t, newer, again.Metadata.Get(dlv.Replay), "the replay wrote a grant of its own")
		dups := rig.inbox.Stats().Duplicates
		require.NoError(t, rig.pubSub.Publish(poisonTopic, again))
		require.Eventually(t, func() bool { return rig.inbox.Stats().Duplicates == dups+1 }, 30*time.Second, 10*time.Millisecond)
		require.Equal(t, 1, rig.effects(t), "the replayed copy, delivered twice, is applied once")
		require.Equal(t, int32(3), rig.calls.Load())
	})
}

// TestReplayGrantOpensTheKeyOnce: the replayed copy fails again and is
// dead-lettered again; delivered once more with the same grant it stays
// a copy of the dead key, since dead-lettering cleared the grant. Only
// the next replay applies it.
func TestReplayGrantOpensTheKeyOnce(t *testing.T) {
	t.Parallel()
	grantBackends(t, func(t *testing.T, rig *grantRig) {
		ctx := context.Background()
		entry := rig.deadLetter(t)
		rig.broken.Store(true)
		pub := &replayRecorder{Publisher: rig.pubSub}
		n, err := rig.entries.Replay(ctx, pub, dlq.Filter{IDs: []int64{entry.ID}}, nil)
		require.NoError(t, err)
		require.Equal(t, 1, n)
		var again dlq.Entry
		require.Eventually(t, func() bool {
			list, err := rig.entries.List(ctx, dlq.Filter{Consumer: "charge"})
			require.NoError(t, err)
			if len(list) == 1 {
				again = list[0]
			}
			return len(list) == 1 && rig.status(t) == "dead"
		}, 30*time.Second, 10*time.Millisecond, "the replay is dead-lettered again")
		require.Empty(t, again.Metadata[dlv.Replay], "without the replay marker it was delivered with")
		rig.broken.Store(false)

		pub.mu.Lock()
		copyOfReplay := pub.sent[0].Copy()
		pub.mu.Unlock()
		dead := rig.inbox.Stats().DeadCopies
		require.NoError(t, rig.pubSub.Publish(poisonTopic, copyOfReplay))
		require.Eventually(t, func() bool { return rig.inbox.Stats().DeadCopies == dead+1 }, 30*time.Second, 10*time.Millisecond)
		require.Zero(t, rig.effects(t), "a used grant does not reopen the key")

		n, err = rig.entries.Replay(ctx, rig.pubSub, dlq.Filter{IDs: []int64{again.ID}}, nil)
		require.NoError(t, err)
		require.Equal(t, 1, n)
		require.Eventually(t, func() bool { return rig.effects(t) == 1 }, 30*time.Second, 10*time.Millisecond)
		require.Equal(t, "done", rig.status(t))
	})
}

// TestForgedOtherConsumerReplayRuns: a producer's message that says it is
// the replay of another consumer's dead letter, with no grant the store
// holds for that consumer, is not acked unseen: it runs like any message,
// once. A copy of a real replay for the other consumer, whose record
// holds its grant, is acked without running.
func TestForgedOtherConsumerReplayRuns(t *testing.T) {
	t.Parallel()
	grantBackends(t, func(t *testing.T, rig *grantRig) {
		ctx := context.Background()
		rig.broken.Store(false)
		forged := delivery("pay-1", "charge pay-1")
		forged.Metadata.Set(dlv.Replay, "1")
		forged.Metadata.Set(dlv.ReplayConsumer, "refunds")
		require.NoError(t, rig.pubSub.Publish(poisonTopic, forged))
		require.Eventually(t, func() bool { return rig.effects(t) == 1 }, 30*time.Second, 10*time.Millisecond,
			"a forged marker does not make the consumer skip a live message")
		require.Zero(t, rig.inbox.Stats().OthersReplays)

		// refunds dead-letters pay-2 in the same store, and its replay is
		// granted: charge acks that replay without running.
		other := dedup.Key{Consumer: "refunds", Key: "pay-2"}
		buryIn(t, rig.graveyard, other)
		grant, err := dedup.NewReplayGrant()
		require.NoError(t, err)
		granted, err := rig.graveyard.InboxGrantReplay(ctx, other, grant)
		require.NoError(t, err)
		require.True(t, granted)
		replay := delivery("pay-2", "charge pay-2")
		replay.Metadata.Set(dlv.Replay, grant)
		replay.Metadata.Set(dlv.ReplayConsumer, "refunds")
		require.NoError(t, rig.pubSub.Publish(poisonTopic, replay))
		require.Eventually(t, func() bool { return rig.inbox.Stats().OthersReplays == 1 }, 30*time.Second, 10*time.Millisecond)
		require.Equal(t, 1, rig.effects(t), "refunds' replay is not applied by charge")
		require.Equal(t, int32(1), rig.calls.Load())
	})
}

// buryIn marks key dead in g, as the poison middleware's dead-lettering
// does.
func buryIn(t *testing.T, g dedup.Graveyard, key dedup.Key) {
	t.Helper()
	ctx := context.Background()
	f := dedup.Failure{Err: "bug", At: time.Now()}
	switch s := g.(type) {
	case dedup.TxStore:
		tx, err := s.InboxBegin(ctx)
		require.NoError(t, err)
		c, err := tx.InboxClaim(ctx, key, time.Hour)
		require.NoError(t, err)
		require.Equal(t, dedup.StateNew, c.State)
		require.NoError(t, tx.InboxBury(ctx, key, f))
		require.NoError(t, tx.Commit(ctx))
	case dedup.LeaseStore:
		c, err := s.LeaseClaim(ctx, key, time.Minute, time.Hour)
		require.NoError(t, err)
		require.Equal(t, dedup.StateNew, c.State)
		require.NoError(t, s.LeaseBury(ctx, key, c.Token, f))
	default:
		t.Fatalf("%T is neither a TxStore nor a LeaseStore", g)
	}
}
