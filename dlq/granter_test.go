package dlq_test

import (
	"context"
	"errors"
	"path/filepath"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/dedup"
	"github.com/oncemill/oncemill/dedup/dedupdriver"
	"github.com/oncemill/oncemill/dedup/postgres"
	"github.com/oncemill/oncemill/dedup/redis"
	"github.com/oncemill/oncemill/dedup/sqlite"
	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/dlq"
	"github.com/oncemill/oncemill/internal/testing/redistest"
	"github.com/oncemill/oncemill/middleware"
)

// elsewhere is a consumer whose inbox is not the PostgreSQL table beside
// the dead-letter table: a router running poison (the dead-letter table on
// PostgreSQL) → inbox (on Redis or SQLite) → a handler that fails while
// broken and otherwise applies its effect once per key.
type elsewhere struct {
	env
	broker  *gochannel.GoChannel
	inbox   dlq.Granter
	peek    func(t *testing.T) string
	effects func(t *testing.T) int
	broken  atomic.Bool
}

const elsewhereTopic = "payments"

func startElsewhere(t *testing.T, backend string) *elsewhere {
	t.Helper()
	ctx := context.Background()
	c := &elsewhere{env: setup(t)}
	c.broken.Store(true)
	icfg := middleware.InboxConfig{Consumer: "charge"}
	var (
		effect func(ctx context.Context, key string) error
		peeker dedupdriver.Peeker
	)
	switch backend {
	case "redis":
		client := redistest.Client(t)
		store, err := redis.New(redis.Config{Client: client, Prefix: redistest.Prefix(t, client)})
		require.NoError(t, err)
		effects := pgx.Identifier{c.cfg.Schema, "effects"}.Sanitize()
		_, err = c.pool.Exec(ctx, `CREATE TABLE `+effects+` (key text NOT NULL)`)
		require.NoError(t, err)
		icfg.LeaseStore, c.inbox, peeker = store, store, store
		effect = func(ctx context.Context, key string) error {
			_, err := c.pool.Exec(ctx, `INSERT INTO `+effects+` (key) VALUES ($1)`, key)
			return err
		}
		c.effects = func(t *testing.T) (n int) {
			require.NoError(t, c.pool.QueryRow(ctx, `SELECT count(*) FROM `+effects).Scan(&n))
			return n
		}
	case "sqlite":
		store, err := sqlite.Open(ctx, filepath.Join(t.TempDir(), "inbox.db"), sqlite.Config{})
		require.NoError(t, err)
		t.Cleanup(func() { require.NoError(t, store.Close()) })
		_, err = store.DB().ExecContext(ctx, `CREATE TABLE effects (key TEXT NOT NULL)`)
		require.NoError(t, err)
		icfg.TxStore, c.inbox, peeker = store, store, store
		effect = func(ctx context.Context, key string) error {
			_, err := sqlite.Tx(ctx).ExecContext(ctx, `INSERT INTO effects (key) VALUES (?)`, key)
			return err
		}
		c.effects = func(t *testing.T) (n int) {
			require.NoError(t, store.DB().QueryRowContext(ctx, `SELECT count(*) FROM effects`).Scan(&n))
			return n
		}
	}
	c.peek = func(t *testing.T) string {
		got, err := peeker.InboxPeek(ctx, dedup.Key{Consumer: "charge", Key: "pay-1"})
		require.NoError(t, err)
		return got.State.String()
	}
	inbox, err := middleware.NewInbox(icfg)
	require.NoError(t, err)
	poison, err := middleware.NewPoison(middleware.PoisonConfig{
		Publisher: c.pub, Topic: "payments.dlq", MaxAttempts: 2, Consumer: "charge",
		InitialBackoff: time.Millisecond, MaxBackoff: 5 * time.Millisecond,
	})
	require.NoError(t, err)

	logger := watermill.NopLogger{}
	c.broker = gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 64, Persistent: true}, logger)
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, logger)
	require.NoError(t, err)
	router.AddMiddleware(poison.Middleware, inbox.Middleware)
	router.AddConsumerHandler("charge", elsewhereTopic, c.broker, func(msg *message.Message) error {
		if c.broken.Load() {
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
		require.NoError(t, c.broker.Close())
	})
	return c
}

// deadLetter publishes pay-1 while the handler fails, waits until its
// entry is in the table and its key dead in the consumer's store, then
// mends the handler; it returns the entry's id.
func (c *elsewhere) deadLetter(t *testing.T) int64 {
	t.Helper()
	m := message.NewMessage(watermill.NewUUID(), []byte(`{"amount":10}`))
	m.Metadata.Set(delivery.IdempotencyKey, "pay-1")
	require.NoError(t, c.broker.Publish(elsewhereTopic, m))
	require.Eventually(t, func() bool { return len(c.ids(t)) == 1 && c.peek(t) == "dead" }, 30*time.Second, 10*time.Millisecond)
	c.broken.Store(false)
	return c.ids(t)[0]
}

// TestReplayGrantsWhereTheConsumerKeepsItsKeys: a consumer on the Redis
// lease store, or on SQLite, dead-letters a message into the PostgreSQL
// table. A replay through a dlq.Store that grants on the PostgreSQL inbox
// table finds no record of the key there: it is refused with
// ErrNoDeadKey, naming the consumer and key, publishes nothing and keeps
// the entry, while the key stays dead in the consumer's store. Through
// WithGranter(the consumer's store), the copy reopens the key and runs
// once, and the entry is deleted.
func TestReplayGrantsWhereTheConsumerKeepsItsKeys(t *testing.T) {
	t.Parallel()
	for _, backend := range []string{"redis", "sqlite"} {
		t.Run(backend, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			c := startElsewhere(t, backend)
			id := c.deadLetter(t)
			sent := &recorder{}

			n, err := c.store.Replay(ctx, sent, dlq.Filter{IDs: []int64{id}}, nil)
			require.ErrorIs(t, err, dlq.ErrNoDeadKey)
			require.ErrorContains(t, err, `consumer "charge" key "pay-1"`)
			require.ErrorContains(t, err, "WithGranter")
			require.Zero(t, n)
			require.Empty(t, sent.uuids(), "nothing published")
			require.Equal(t, []int64{id}, c.ids(t), "the entry stays")
			require.Equal(t, "dead", c.peek(t))
			require.Zero(t, c.effects(t))

			entries, err := c.store.WithGranter(c.inbox)
			require.NoError(t, err)
			n, err = entries.Replay(ctx, c.broker, dlq.Filter{IDs: []int64{id}}, nil)
			require.NoError(t, err)
			require.Equal(t, 1, n)
			require.Empty(t, c.ids(t), "deleted once published")
			require.Eventually(t, func() bool { return c.peek(t) == "done" }, 30*time.Second, 10*time.Millisecond)
			require.Equal(t, 1, c.effects(t), "the replay ran once")
		})
	}
}

// TestReplayOfKeyNotDead: a replay whose key is not dead where it grants
// goes on when the store holds the key (done: the copy is a duplicate
// there) and for an entry with no key (it runs as a plain message); a
// key with no record is refused unless WithNewKeys says to run it as a
// new key.
func TestReplayOfKeyNotDead(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	e := setup(t)
	store, err := postgres.New(e.pool, postgres.Config{Schema: e.cfg.Schema})
	require.NoError(t, err)

	done := dead("orders", "charge", "declined")
	k := dedup.Key{Consumer: "charge", Key: done.Metadata.Get(delivery.DeadKey)}
	claim, err := store.LeaseClaim(ctx, k, time.Minute, time.Hour)
	require.NoError(t, err)
	require.NoError(t, store.LeaseComplete(ctx, k, claim.Token, nil))
	keyless := dead("orders", "", "no consumer")
	delete(keyless.Metadata, delivery.DeadKey)
	expired := dead("orders", "charge", "timeout")
	require.NoError(t, e.pub.Publish("orders.dlq", done, keyless, expired))
	ids := e.ids(t)
	require.Len(t, ids, 3)

	sent := &recorder{}
	n, err := e.store.Replay(ctx, sent, dlq.Filter{IDs: ids[:2]}, nil)
	require.NoError(t, err)
	require.Equal(t, 2, n)
	require.Equal(t, []string{done.UUID, keyless.UUID}, sent.uuids())

	n, err = e.store.Replay(ctx, sent, dlq.Filter{IDs: ids[2:]}, nil)
	require.ErrorIs(t, err, dlq.ErrNoDeadKey)
	require.Zero(t, n)
	require.Equal(t, ids[2:], e.ids(t))

	n, err = e.store.WithNewKeys().Replay(ctx, sent, dlq.Filter{IDs: ids[2:]}, nil)
	require.NoError(t, err)
	require.Equal(t, 1, n)
	require.Equal(t, []string{done.UUID, keyless.UUID, expired.UUID}, sent.uuids())
	require.Empty(t, e.ids(t))
}
