package dlq_test

import (
	"context"
	"database/sql"
	"errors"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/adapters"
	"github.com/oncemill/oncemill/dedup"
	"github.com/oncemill/oncemill/dedup/sqlstore"
	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/dlq"
	"github.com/oncemill/oncemill/internal/testing/msgtest"
	"github.com/oncemill/oncemill/internal/testing/mysqltest"
	"github.com/oncemill/oncemill/middleware"
	"github.com/oncemill/oncemill/sqlschema"
)

// myEnv is a dead-letter table, with its inbox table beside it, in a
// database of its own on the MySQL/MariaDB test server.
type myEnv struct {
	db    *sql.DB
	name  string
	cfg   sqlschema.Config
	store *dlq.Store
	pub   *dlq.Publisher
	inbox *sqlstore.Store
}

func setupMySQL(t *testing.T) myEnv {
	t.Helper()
	db, name := mysqltest.DB(t, 8)
	cfg := sqlschema.Config{Schema: name}
	require.NoError(t, sqlschema.MigrateSQL(context.Background(), db, sqlschema.MySQL, cfg))
	store, err := dlq.NewSQLStore(db, sqlschema.MySQL, cfg)
	require.NoError(t, err)
	pub, err := dlq.NewSQLPublisher(db, sqlschema.MySQL, cfg)
	require.NoError(t, err)
	inbox, err := sqlstore.New(db, sqlstore.Config{Dialect: sqlstore.MySQL, Schema: cfg})
	require.NoError(t, err)
	return myEnv{db: db, name: name, cfg: cfg, store: store, pub: pub, inbox: inbox}
}

func (e myEnv) ids(t *testing.T) []int64 {
	t.Helper()
	entries, err := e.store.List(context.Background(), dlq.Filter{})
	require.NoError(t, err)
	ids := make([]int64, len(entries))
	for i, en := range entries {
		ids[i] = en.ID
	}
	return ids
}

// bury marks key dead for consumer in the inbox table, as the inbox does
// when it gives up on a message.
func (e myEnv) bury(t *testing.T, consumer, key string) {
	t.Helper()
	ctx := context.Background()
	tx, err := e.inbox.InboxBegin(ctx)
	require.NoError(t, err)
	k := dedup.Key{Consumer: consumer, Key: key}
	c, err := tx.InboxClaim(ctx, k, time.Hour)
	require.NoError(t, err)
	require.Equal(t, dedup.StateNew, c.State)
	require.NoError(t, tx.InboxBury(ctx, k, dedup.Failure{Err: "seeded", At: time.Now()}))
	require.NoError(t, tx.Commit(ctx))
}

// seed dead-letters msgs as a consumer's inbox and poison middleware do.
func (e myEnv) seed(t *testing.T, msgs ...*message.Message) []int64 {
	t.Helper()
	before := len(e.ids(t))
	for _, m := range msgs {
		e.bury(t, m.Metadata.Get(delivery.DeadConsumer), m.Metadata.Get(delivery.DeadKey))
	}
	require.NoError(t, e.pub.Publish("orders.dlq", msgs...))
	ids := e.ids(t)
	require.Len(t, ids, before+len(msgs))
	return ids[before:]
}

// TestMySQLPublisherWritesOnce: a dead letter's fields survive the MariaDB
// table byte for byte; a copy of the same message for the same consumer
// and topic is not written again, also by writers at the same instant;
// another consumer's is.
func TestMySQLPublisherWritesOnce(t *testing.T) {
	t.Parallel()
	e := setupMySQL(t)
	ctx := context.Background()
	m := dead("orders", "charge", "card declined \xff")
	m.Payload = []byte{0, 0xfe, 'x'}
	m.Metadata.Set(delivery.DeadPermanent, "true")
	m.Metadata.Set(delivery.DeadPartition, "3")
	m.Metadata.Set(delivery.DeadOffset, "9000000000")
	long := strings.Repeat("t", 300)
	m.Metadata.Set("long", long)
	ids := e.seed(t, m)

	got, err := e.store.Get(ctx, ids[0])
	require.NoError(t, err)
	require.Equal(t, m.UUID, got.UUID)
	require.Equal(t, "orders", got.Topic)
	require.Equal(t, "orders.dlq", got.DLQTopic)
	require.Equal(t, "charge", got.Consumer)
	require.Equal(t, "key-"+m.UUID, got.Key)
	require.Equal(t, 5, got.Attempts)
	require.Equal(t, "card declined \uFFFD", got.Error, "invalid UTF-8 stored as U+FFFD")
	require.True(t, got.Permanent)
	require.True(t, got.FirstFailedAt.Equal(time.Date(2026, 3, 1, 10, 0, 0, 123456000, time.UTC)), "%s", got.FirstFailedAt)
	require.True(t, got.LastFailedAt.Equal(time.Date(2026, 3, 1, 10, 5, 0, 0, time.UTC)))
	require.Equal(t, int32(3), *got.Partition)
	require.Equal(t, int64(9000000000), *got.Offset)
	require.Equal(t, []byte{0, 0xfe, 'x'}, got.Payload)
	require.Equal(t, long, got.Metadata["long"])
	require.Equal(t, "card declined \uFFFD", got.Metadata[delivery.DeadError])
	require.WithinDuration(t, time.Now(), got.DeadAt, time.Hour)

	require.NoError(t, e.pub.Publish("orders.dlq", m.Copy()))
	require.Len(t, e.ids(t), 1, "the same message, consumer and topic: one entry")

	// Writers at the same instant: one entry.
	again := dead("orders", "charge", "timeout")
	var wg sync.WaitGroup
	errs := make(chan error, 8)
	for i := 0; i < 8; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			c := again.Copy()
			c.SetContext(ctx)
			errs <- e.pub.Publish("orders.dlq", c)
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		// A deadlock between the inserts of one key is the
		// infrastructure's: the poison middleware nacks and retries.
		if err != nil {
			require.ErrorContains(t, err, "Deadlock")
		}
	}
	require.Len(t, e.ids(t), 2, "concurrent writers of one message: one entry")

	other := m.Copy()
	other.Metadata.Set(delivery.DeadConsumer, "audit")
	require.NoError(t, e.pub.Publish("orders.dlq", other))
	require.Len(t, e.ids(t), 3, "another consumer's dead letter of the message is its own")

	_, err = e.store.Get(ctx, 999999)
	require.ErrorIs(t, err, dlq.ErrNotFound)
}

// TestMySQLStoreFilters: list, count, missing, counts and purge select what
// the filter says, on MariaDB.
func TestMySQLStoreFilters(t *testing.T) {
	t.Parallel()
	e := setupMySQL(t)
	ctx := context.Background()
	ids := e.seed(t,
		dead("orders", "charge", "Card DECLINED"),
		dead("orders", "ship", "timeout"),
		dead("payments", "charge", "card declined again"))
	list := func(f dlq.Filter) []int64 {
		t.Helper()
		entries, err := e.store.List(ctx, f)
		require.NoError(t, err)
		out := []int64{}
		for _, en := range entries {
			out = append(out, en.ID)
		}
		return out
	}
	require.Equal(t, ids, list(dlq.Filter{}))
	require.Equal(t, []int64{ids[0], ids[1]}, list(dlq.Filter{Topic: "orders"}))
	require.Equal(t, []int64{ids[0], ids[2]}, list(dlq.Filter{Consumer: "charge"}))
	require.Equal(t, []int64{ids[0], ids[2]}, list(dlq.Filter{ErrorContains: "card declined"}), "ignoring case")
	require.Equal(t, []int64{ids[2]}, list(dlq.Filter{Topic: "payments", Consumer: "charge"}))
	require.Equal(t, []int64{}, list(dlq.Filter{Topic: "ORDERS"}), "topics compared byte for byte")
	require.Equal(t, []int64{ids[0]}, list(dlq.Filter{Limit: 1}))
	require.Equal(t, []int64{ids[1]}, list(dlq.Filter{IDs: []int64{ids[1]}}))
	require.Equal(t, ids, list(dlq.Filter{Since: time.Now().Add(-time.Hour), Until: time.Now().Add(time.Hour)}))
	require.Equal(t, []int64{}, list(dlq.Filter{Since: time.Now().Add(time.Hour)}))

	n, err := e.store.Count(ctx, dlq.Filter{Consumer: "charge"})
	require.NoError(t, err)
	require.Equal(t, 2, n)
	missing, err := e.store.Missing(ctx, []int64{ids[2] + 10, ids[0], ids[2] + 5, ids[2] + 10})
	require.NoError(t, err)
	require.Equal(t, []int64{ids[2] + 5, ids[2] + 10}, missing)
	counts, err := e.store.Counts(ctx)
	require.NoError(t, err)
	require.Len(t, counts, 3)
	require.Equal(t, dlq.Count{Consumer: "charge", Topic: "orders", Entries: 1, Oldest: counts[0].Oldest}, counts[0])
	require.Equal(t, "ship", counts[2].Consumer)

	_, err = e.store.Purge(ctx, dlq.Filter{})
	require.ErrorIs(t, err, dlq.ErrNoSelection)
	n, err = e.store.Purge(ctx, dlq.Filter{Topic: "orders"})
	require.NoError(t, err)
	require.Equal(t, 2, n)
	require.Equal(t, []int64{ids[2]}, list(dlq.Filter{}))

	copies, ok, err := e.store.CopiesSince(ctx, dlq.Entry{Consumer: "charge", Key: "nope"})
	require.NoError(t, err)
	require.False(t, ok)
	require.Zero(t, copies)

	empty, name := mysqltest.DB(t, 2)
	bare, err := dlq.NewSQLStore(empty, sqlschema.MySQL, sqlschema.Config{Schema: name})
	require.NoError(t, err)
	_, err = bare.List(ctx, dlq.Filter{})
	require.ErrorIs(t, err, dlq.ErrNotMigrated)

	_, err = dlq.NewSQLStore(empty, sqlschema.Dialect("oracle"), sqlschema.Config{})
	require.ErrorContains(t, err, `unknown dialect "oracle"`)
	_, err = dlq.NewSQLStore(nil, sqlschema.MySQL, sqlschema.Config{})
	require.ErrorContains(t, err, "db is nil")
}

// TestMySQLPoisonDeadLettersOnceAndReplays: a consumer whose inbox is on
// MariaDB gives up on a message; it is in the MariaDB dead-letter table
// once, with the key dead, and later copies of it are acked without
// running and counted. The operator's replay publishes it to its topic
// with a grant; the consumer runs it once; the entry is gone.
func TestMySQLPoisonDeadLettersOnceAndReplays(t *testing.T) {
	t.Parallel()
	e := setupMySQL(t)
	ctx := context.Background()
	_, err := e.db.ExecContext(ctx, "CREATE TABLE `"+e.name+"`.effects (`key` VARCHAR(64) NOT NULL) ENGINE = InnoDB")
	require.NoError(t, err)
	inbox, err := middleware.NewInbox(middleware.InboxConfig{TxStore: e.inbox, Consumer: "charge"})
	require.NoError(t, err)
	poison, err := middleware.NewPoison(middleware.PoisonConfig{
		Publisher: e.pub, Topic: "orders.dlq", MaxAttempts: 2, Consumer: "charge",
		InitialBackoff: time.Millisecond, MaxBackoff: 5 * time.Millisecond,
	})
	require.NoError(t, err)
	broker := adapters.NewGoChannel(gochannel.Config{Persistent: true, OutputChannelBuffer: 16}, nil)
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
	require.NoError(t, err)
	var (
		broken atomic.Bool
		calls  atomic.Int32
	)
	broken.Store(true)
	router.AddMiddleware(poison.Middleware, inbox.Middleware)
	router.AddConsumerHandler("charge", "orders", broker, func(msg *message.Message) error {
		calls.Add(1)
		if broken.Load() {
			return errors.New("ledger refuses the order")
		}
		_, err := sqlstore.Tx(msg.Context()).ExecContext(msg.Context(), "INSERT INTO `"+e.name+"`.effects (`key`) VALUES (?)",
			middleware.IdempotencyKey(msg.Context()))
		return err
	})
	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- router.Run(runCtx) }()
	<-router.Running()
	t.Cleanup(func() {
		stop()
		require.NoError(t, <-done)
		require.NoError(t, broker.Close())
	})
	key := dedup.Key{Consumer: "charge", Key: "pay-1"}
	status := func() dedup.State {
		c, err := e.inbox.InboxPeek(ctx, key)
		require.NoError(t, err)
		return c.State
	}

	msg := message.NewMessage(watermill.NewUUID(), []byte("charge pay-1"))
	msg.Metadata.Set(delivery.IdempotencyKey, "pay-1")
	require.NoError(t, broker.Publish("orders", msg))
	msgtest.WaitFor(t, "dead-lettered, the key dead", func() bool { return len(e.ids(t)) == 1 && status() == dedup.StateDead })
	require.Equal(t, int32(2), calls.Load(), "two attempts")

	// The same message again, as a broker redelivers after a lost ack:
	// acked without running, not written again, counted on the key.
	require.NoError(t, broker.Publish("orders", msg.Copy()))
	entries, err := e.store.List(ctx, dlq.Filter{})
	require.NoError(t, err)
	require.Len(t, entries, 1)
	msgtest.WaitFor(t, "the copy counted on the dead key", func() bool {
		n, ok, err := e.store.CopiesSince(ctx, entries[0])
		require.NoError(t, err)
		return ok && n == 1
	})
	require.Equal(t, int32(2), calls.Load(), "the copy did not run")
	require.Len(t, e.ids(t), 1, "one entry")
	en := entries[0]
	require.Equal(t, msg.UUID, en.UUID)
	require.Equal(t, "orders", en.Topic)
	require.Equal(t, "charge", en.Consumer)
	require.Equal(t, "pay-1", en.Key)
	require.Equal(t, 2, en.Attempts)
	require.Contains(t, en.Error, "ledger refuses the order")

	broken.Store(false)
	n, err := e.store.Replay(ctx, broker, dlq.Filter{IDs: []int64{en.ID}}, nil)
	require.NoError(t, err)
	require.Equal(t, 1, n)
	effects := func() (n int) {
		require.NoError(t, e.db.QueryRow("SELECT COUNT(*) FROM `"+e.name+"`.effects").Scan(&n))
		return n
	}
	msgtest.WaitFor(t, "the replay applied", func() bool { return effects() == 1 })
	require.Equal(t, dedup.StateDone, status())
	require.Empty(t, e.ids(t), "the entry is gone")
	require.Equal(t, int32(3), calls.Load(), "the replay ran once")
}

// TestMySQLReplayToConsumer: entries whose replay was requested go to
// their consumer's replay subscriber only, with a fresh grant for every
// delivery; a nacked one comes back, an acked one is deleted; one whose
// key has no record in the inbox is withdrawn and stays.
func TestMySQLReplayToConsumer(t *testing.T) {
	t.Parallel()
	e := setupMySQL(t)
	ctx := context.Background()
	ids := e.seed(t, dead("orders", "charge", "one"), dead("orders", "charge", "two"), dead("orders", "ship", "three"))
	orphan := dead("orders", "charge", "no record")
	require.NoError(t, e.pub.Publish("orders.dlq", orphan))
	all := e.ids(t)
	require.Len(t, all, 4)

	n, err := e.store.RequestReplay(ctx, dlq.Filter{Consumer: "charge"})
	require.NoError(t, err)
	require.Equal(t, 3, n)
	n, err = e.store.RequestReplay(ctx, dlq.Filter{IDs: ids[:1]})
	require.NoError(t, err)
	require.Zero(t, n, "already requested")

	// A requested entry is outside the one-entry rule: the same message
	// dead-lettered again while it is on its way back is written.
	first, err := e.store.Get(ctx, ids[0])
	require.NoError(t, err)
	redead := first.Message("")
	for k, v := range first.Metadata {
		redead.Metadata.Set(k, v)
	}
	require.NoError(t, e.pub.Publish("orders.dlq", redead))
	require.Len(t, e.ids(t), 5)

	sub, err := dlq.NewSQLReplaySubscriber(e.db, sqlschema.MySQL, e.cfg, dlq.ReplaySubscriberConfig{Consumer: "charge", PollInterval: 10 * time.Millisecond})
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, sub.Close()) })
	msgs, err := sub.Subscribe(ctx, "orders")
	require.NoError(t, err)

	got := msgtest.Receive(t, msgs, 10*time.Second)
	require.Equal(t, first.UUID, got.UUID)
	grant := got.Metadata.Get(delivery.Replay)
	require.NotEmpty(t, grant)
	require.Equal(t, "charge", got.Metadata.Get(delivery.ReplayConsumer))
	got.Nack()
	again := msgtest.Receive(t, msgs, 10*time.Second)
	require.Equal(t, first.UUID, again.UUID, "a nacked replay comes back")
	require.NotEqual(t, grant, again.Metadata.Get(delivery.Replay), "with a fresh grant")
	granted, err := e.inbox.InboxReplayGranted(ctx, dedup.Key{Consumer: "charge", Key: first.Key}, again.Metadata.Get(delivery.Replay))
	require.NoError(t, err)
	require.True(t, granted, "the grant is on the dead key")
	again.Ack()

	second := msgtest.Receive(t, msgs, 10*time.Second)
	require.NotEqual(t, first.UUID, second.UUID)
	second.Ack()
	msgtest.Nothing(t, msgs, 200*time.Millisecond)
	msgtest.WaitFor(t, "the acked entries deleted", func() bool { return len(e.ids(t)) == 3 })

	// Left: the other consumer's, the orphan (its request withdrawn), and
	// the copy dead-lettered again.
	left, err := e.store.List(ctx, dlq.Filter{})
	require.NoError(t, err)
	byUUID := map[string]bool{}
	for _, en := range left {
		byUUID[en.UUID+"/"+en.Consumer] = true
	}
	require.True(t, byUUID[orphan.UUID+"/charge"], "the orphan stays")
	require.True(t, byUUID[first.UUID+"/charge"], "the copy dead-lettered again stays")
	n, err = e.store.RequestReplay(ctx, dlq.Filter{IDs: []int64{all[3]}})
	require.NoError(t, err)
	require.Equal(t, 1, n, "the orphan's request was withdrawn: it can be asked again")
}

// TestMySQLPublishInTheInboxTransaction: a dead letter published under an
// inbox transaction on the dead-letter table's server is written in that
// transaction, whichever database the inbox is in: it rolls back with it.
func TestMySQLPublishInTheInboxTransaction(t *testing.T) {
	t.Parallel()
	e := setupMySQL(t)
	ctx := context.Background()
	// The inbox in another database of the same server.
	otherDB, other := mysqltest.DB(t, 4)
	require.NoError(t, sqlschema.MigrateSQL(ctx, otherDB, sqlschema.MySQL, sqlschema.Config{Schema: other}))
	inbox, err := sqlstore.New(otherDB, sqlstore.Config{Dialect: sqlstore.MySQL, Schema: sqlschema.Config{Schema: other}})
	require.NoError(t, err)
	for _, commit := range []bool{false, true} {
		tx, err := inbox.InboxBegin(ctx)
		require.NoError(t, err)
		m := dead("orders", "billing", "card declined")
		m.SetContext(tx.WithTx(ctx))
		require.NoError(t, e.pub.Publish("orders.dlq", m))
		var seen int
		require.NoError(t, sqlstore.Tx(tx.WithTx(ctx)).QueryRowContext(ctx, "SELECT COUNT(*) FROM `"+e.name+"`.dlq").Scan(&seen))
		require.Equal(t, 1, seen, "the inbox's transaction holds the dead letter")
		if commit {
			require.NoError(t, tx.Commit(ctx))
			require.Len(t, e.ids(t), 1, "committed with the inbox's transaction")
		} else {
			require.NoError(t, tx.Rollback(ctx))
			require.Empty(t, e.ids(t), "rolled back with the inbox's transaction")
		}
	}
}
