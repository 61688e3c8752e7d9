package forwarder_test

import (
	"context"
	"database/sql"
	"fmt"
	"hash/crc32"
	"math/rand/v2"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/adapters"
	"github.com/oncemill/oncemill/dedup/sqlstore"
	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/forwarder"
	"github.com/oncemill/oncemill/internal/sqldb"
	"github.com/oncemill/oncemill/internal/testing/mysqltest"
	"github.com/oncemill/oncemill/middleware"
	"github.com/oncemill/oncemill/sqlschema"
)

// myBundle is an outbox in a database of its own on the MySQL/MariaDB
// test server, with an orders table whose rows the writers lock.
type myBundle struct {
	db     *sql.DB
	name   string
	schema sqlschema.Config
}

func setupMySQL(t *testing.T, maxConns int) myBundle {
	t.Helper()
	db, name := mysqltest.DB(t, maxConns)
	schema := sqlschema.Config{Schema: name}
	ctx := context.Background()
	require.NoError(t, sqlschema.MigrateSQL(ctx, db, sqlschema.MySQL, schema))
	_, err := db.ExecContext(ctx, "CREATE TABLE `"+name+"`.orders (id VARCHAR(64) NOT NULL PRIMARY KEY, seq INT NOT NULL DEFAULT 0) ENGINE = InnoDB")
	require.NoError(t, err)
	return myBundle{db: db, name: name, schema: schema}
}

func (b myBundle) count(t *testing.T, table string) int {
	t.Helper()
	var n int
	require.NoError(t, b.db.QueryRow("SELECT COUNT(*) FROM `"+b.name+"`."+table).Scan(&n))
	return n
}

func (b myBundle) relay(t *testing.T, pub message.Publisher, mod func(*forwarder.RelayConfig)) *forwarder.Relay {
	t.Helper()
	cfg := forwarder.RelayConfig{DB: b.db, Dialect: sqlschema.MySQL, Publisher: pub, Schema: b.schema,
		MinBackoff: 10 * time.Millisecond, MaxBackoff: 50 * time.Millisecond}
	if mod != nil {
		mod(&cfg)
	}
	r, err := forwarder.NewRelay(cfg)
	require.NoError(t, err)
	return r
}

// writeOrdered is [writeOrdered] on b's database.
func (b myBundle) writeOrdered(ctx context.Context, topic, key string, n int, commit bool) ([]string, error) {
	return writeOrdered(ctx, b.db, sqldb.MySQL, b.schema, topic, key, n, commit, 0, nil)
}

// inbox is the consuming side of a GoChannel topic: it acks and keeps
// every message, in the order they came.
type inbox struct {
	mu   sync.Mutex
	msgs []*message.Message
}

// subscribe reads topic of gc until the test ends.
func subscribe(t *testing.T, gc *adapters.GoChannel, topic string) *inbox {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	msgs, err := gc.Subscribe(ctx, topic)
	require.NoError(t, err)
	in := &inbox{}
	done := make(chan struct{})
	go func() {
		defer close(done)
		for m := range msgs {
			in.mu.Lock()
			in.msgs = append(in.msgs, m)
			in.mu.Unlock()
			m.Ack()
		}
	}()
	t.Cleanup(func() {
		cancel()
		<-done
	})
	return in
}

func (in *inbox) snapshot() []*message.Message {
	in.mu.Lock()
	defer in.mu.Unlock()
	return append([]*message.Message(nil), in.msgs...)
}

func (in *inbox) seqs(key string) []int {
	var out []int
	for _, m := range in.snapshot() {
		if m.Metadata.Get(delivery.PartitionKey) == key {
			n, _ := strconv.Atoi(m.Metadata.Get("seq"))
			out = append(out, n)
		}
	}
	return out
}

// orderedGoChannel is an in-process broker whose Publish returns once the
// subscriber acked, so that what the subscriber sees is the publish order.
func orderedGoChannel(t *testing.T) *adapters.GoChannel {
	t.Helper()
	gc := adapters.NewGoChannel(gochannel.Config{BlockPublishUntilSubscriberAck: true, Persistent: true}, nil)
	t.Cleanup(func() { require.NoError(t, gc.Close()) })
	return gc
}

// TestMySQLRelayDeliversCommittedOnceInKeyOrder: lock-ordered writers on
// MariaDB, many at once, some rolling back, while three relays run: every
// committed event is published once, in each key's sequence, and no
// rolled-back event is; in both order modes.
func TestMySQLRelayDeliversCommittedOnceInKeyOrder(t *testing.T) {
	t.Parallel()
	for _, lockOrdered := range []bool{false, true} {
		t.Run(fmt.Sprintf("LockOrderedWriters=%t", lockOrdered), func(t *testing.T) {
			t.Parallel()
			const writers, txPerWriter, keys, perTx = 6, 40, 12, 4
			b := setupMySQL(t, 16)
			ctx := context.Background()
			for k := 0; k < keys; k++ {
				_, err := b.db.ExecContext(ctx, "INSERT INTO `"+b.name+"`.orders (id) VALUES (?)", fmt.Sprintf("key-%d", k))
				require.NoError(t, err)
			}
			gc := orderedGoChannel(t)
			in := subscribe(t, gc, "orders")
			for i := 0; i < 3; i++ {
				// Small batches of few lanes: the relays take turns on
				// the keys' lanes.
				run(t, b.relay(t, gc, func(c *forwarder.RelayConfig) {
					c.BatchSize, c.LanesPerBatch, c.LockOrderedWriters = 7, 3, lockOrdered
					c.Logger = watermill.NewStdLogger(false, false)
				}))
			}

			var (
				mu         sync.Mutex
				committed  = map[string]bool{}
				rolledBack = map[string]bool{}
				wg         sync.WaitGroup
				errs       = make(chan error, writers)
			)
			for w := 0; w < writers; w++ {
				wg.Add(1)
				go func(w int) {
					defer wg.Done()
					rng := rand.New(rand.NewPCG(uint64(w), 7))
					for i := 0; i < txPerWriter; i++ {
						key := fmt.Sprintf("key-%d", rng.IntN(keys))
						commit := rng.IntN(5) != 0
						ids, err := b.writeOrdered(ctx, "orders", key, 1+rng.IntN(perTx), commit)
						if err != nil {
							errs <- fmt.Errorf("writer %d: %w", w, err)
							return
						}
						mu.Lock()
						for _, id := range ids {
							if commit {
								committed[id] = true
							} else {
								rolledBack[id] = true
							}
						}
						mu.Unlock()
					}
				}(w)
			}
			wg.Wait()
			close(errs)
			for err := range errs {
				require.NoError(t, err)
			}
			require.NotEmpty(t, rolledBack)
			require.Eventually(t, func() bool { return len(in.snapshot()) >= len(committed) && b.count(t, "outbox") == 0 },
				2*time.Minute, 20*time.Millisecond)

			got := in.snapshot()
			seen := map[string]int{}
			var twice, notCommitted int
			for _, m := range got {
				seen[m.UUID]++
				if seen[m.UUID] == 2 {
					twice++
				}
				if !committed[m.UUID] {
					notCommitted++
				}
			}
			require.Zero(t, twice, "events published twice")
			require.Zero(t, notCommitted, "events published and not committed (rolled back)")
			require.Len(t, got, len(committed), "every committed event published")
			var orders int
			for k := 0; k < keys; k++ {
				key := fmt.Sprintf("key-%d", k)
				require.NoError(t, b.db.QueryRow("SELECT seq FROM `"+b.name+"`.orders WHERE id = ?", key).Scan(&orders))
				want := make([]int, orders)
				for i := range want {
					want[i] = i + 1
				}
				require.Equal(t, want, in.seqs(key), "key %s: its events once each, in commit order", key)
			}
			lag, err := forwarder.SQLOutboxLag(ctx, b.db, sqlschema.MySQL, b.schema)
			require.NoError(t, err)
			require.Equal(t, forwarder.Lag{}, lag)
		})
	}
}

// keysInLanes returns n partition keys, each in a lane of its own (the
// outbox's lane is CRC32(partition_key) & 63).
func keysInLanes(n int) []string {
	lanes := map[uint32]bool{}
	var keys []string
	for i := 0; len(keys) < n; i++ {
		k := fmt.Sprintf("order-%d", i)
		if l := crc32.ChecksumIEEE([]byte(k)) & 63; !lanes[l] {
			lanes[l] = true
			keys = append(keys, k)
		}
	}
	return keys
}

// openWriter is a transaction on a connection of its own, with its
// connection id.
type openWriter struct {
	conn *sql.Conn
	tx   *sql.Tx
	id   int
}

func (b myBundle) begin(t *testing.T) openWriter {
	t.Helper()
	ctx := context.Background()
	conn, err := b.db.Conn(ctx)
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	var w openWriter
	w.conn = conn
	require.NoError(t, conn.QueryRowContext(ctx, "SELECT CONNECTION_ID()").Scan(&w.id))
	w.tx, err = conn.BeginTx(ctx, nil)
	require.NoError(t, err)
	t.Cleanup(func() { _ = w.tx.Rollback() })
	return w
}

func (b myBundle) publish(t *testing.T, tx *sql.Tx, events ...*message.Message) {
	t.Helper()
	pub, err := forwarder.NewSQLTxPublisher(context.Background(), tx, sqlschema.MySQL, b.schema)
	require.NoError(t, err)
	require.NoError(t, pub.Publish("orders", events...))
}

// relayAllMySQL runs r's batches until they have published want rows in
// all, and then one more, which must find none.
func relayAllMySQL(t *testing.T, r *forwarder.Relay, want int) {
	t.Helper()
	relayAll(t, r, want)
	n, err := r.RelayBatch(context.Background())
	require.NoError(t, err)
	require.Zero(t, n, "nothing more to publish")
}

// TestMySQLRelayWaitsForRowsInFlight: writers that nothing orders, on
// MariaDB. The first writer inserts a key's event and stays open; a later
// one inserts the key's next event, and another key's, and commits. The
// relay publishes the other key's event at once (its lane is free), and,
// unless LockOrderedWriters, holds the key's later event back until the
// first writer ends, naming its session; a first writer that rolls back
// lets it go. With LockOrderedWriters the later event goes at once, and
// the first writer's when it commits: late, never skipped.
func TestMySQLRelayWaitsForRowsInFlight(t *testing.T) {
	t.Parallel()
	keys := keysInLanes(2)
	key, other := keys[0], keys[1]
	for _, tc := range []struct {
		name         string
		lockOrdered  bool
		commitFirst  bool
		wantAtOnce   []int // the key's sequence numbers published while the first writer is open
		wantAtTheEnd []int
	}{
		{name: "waits", commitFirst: true, wantAtTheEnd: []int{1, 2}},
		{name: "waits for a rollback", commitFirst: false, wantAtTheEnd: []int{2}},
		{name: "lock-ordered", lockOrdered: true, commitFirst: true, wantAtOnce: []int{2}, wantAtTheEnd: []int{2, 1}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			b := setupMySQL(t, 6)
			gc := orderedGoChannel(t)
			in := subscribe(t, gc, "orders")
			r := b.relay(t, gc, func(c *forwarder.RelayConfig) { c.LockOrderedWriters = tc.lockOrdered })

			first := b.begin(t)
			b.publish(t, first.tx, event(key, 1))
			later := b.begin(t)
			b.publish(t, later.tx, event(key, 2), event(other, 1))
			require.NoError(t, later.tx.Commit())

			relayAllMySQL(t, r, 1+len(tc.wantAtOnce))
			require.Equal(t, []int{1}, in.seqs(other), "another lane's event goes at once")
			require.Equal(t, tc.wantAtOnce, in.seqs(key))
			lag, err := r.Lag(context.Background())
			require.NoError(t, err)
			if tc.lockOrdered {
				require.Equal(t, forwarder.Lag{}, lag, "the first writer's event is not committed; nothing waits")
			} else {
				require.Equal(t, 1, lag.Pending)
				require.Equal(t, 1, lag.Waiting)
				require.NotNil(t, lag.HeldBy)
				require.Equal(t, first.id, lag.HeldBy.PID, "the session that holds the row back")
				require.Positive(t, lag.HeldBy.Age)
				// InnoDB refreshes its view of the transactions only once
				// it has not been read for 100ms: the details come with
				// a read after a pause.
				require.Eventually(t, func() bool {
					lag, err = r.Lag(context.Background())
					require.NoError(t, err)
					return lag.HeldBy != nil && lag.HeldBy.State == "Sleep"
				}, 30*time.Second, 300*time.Millisecond, "idle in its transaction")
				require.Equal(t, first.id, lag.HeldBy.PID)
				require.Equal(t, b.name, lag.HeldBy.Database)
				require.Equal(t, mysqltest.Config(t, "").User, lag.HeldBy.User)
			}

			if tc.commitFirst {
				require.NoError(t, first.tx.Commit())
			} else {
				require.NoError(t, first.tx.Rollback())
			}
			relayAllMySQL(t, r, len(tc.wantAtTheEnd)-len(tc.wantAtOnce))
			require.Equal(t, tc.wantAtTheEnd, in.seqs(key))
			require.Equal(t, 0, b.count(t, "outbox"))
		})
	}
}

// TestMySQLTxPublisherRollsBack: the events commit and roll back with the
// business row, and keep their UUID, payload, metadata and topic.
func TestMySQLTxPublisherRollsBack(t *testing.T) {
	t.Parallel()
	b := setupMySQL(t, 4)
	ctx := context.Background()
	gc := orderedGoChannel(t)
	in := subscribe(t, gc, "orders")
	r := b.relay(t, gc, nil)

	kept, dropped := event("k", 1), event("k", 2)
	kept.Payload = []byte{0, 0xff, 'x'} // bytes, not text
	kept.Metadata.Set("note", "ünïcode ✓")
	for _, tc := range []struct {
		e      *message.Message
		commit bool
	}{{dropped, false}, {kept, true}} {
		tx, err := b.db.BeginTx(ctx, nil)
		require.NoError(t, err)
		_, err = tx.ExecContext(ctx, "INSERT INTO `"+b.name+"`.orders (id) VALUES (?)", tc.e.UUID)
		require.NoError(t, err)
		b.publish(t, tx, tc.e)
		if tc.commit {
			require.NoError(t, tx.Commit())
		} else {
			require.NoError(t, tx.Rollback())
		}
	}
	require.Equal(t, 1, b.count(t, "orders"))
	relayAllMySQL(t, r, 1)
	got := in.snapshot()
	require.Len(t, got, 1)
	require.Equal(t, kept.UUID, got[0].UUID)
	require.Equal(t, []byte(kept.Payload), []byte(got[0].Payload))
	require.Equal(t, "ünïcode ✓", got[0].Metadata.Get("note"))
	require.Equal(t, "k", got[0].Metadata.Get(delivery.PartitionKey))
}

// TestMySQLRelayKeepsRowsWhileBrokerRefuses: a publish that fails leaves
// the rows; they go once the topic can be routed.
func TestMySQLRelayKeepsRowsWhileBrokerRefuses(t *testing.T) {
	t.Parallel()
	b := setupMySQL(t, 4)
	ctx := context.Background()
	// A non-persistent GoChannel fails a publish nobody would receive, as
	// a broker that cannot route does; NewRelay refuses it as it is (it
	// keeps nothing once the process exits), not through a decorator.
	gc := adapters.NewGoChannel(gochannel.Config{BlockPublishUntilSubscriberAck: true}, nil)
	t.Cleanup(func() { require.NoError(t, gc.Close()) })
	r := b.relay(t, decorated{gc}, nil)
	tx, err := b.db.BeginTx(ctx, nil)
	require.NoError(t, err)
	b.publish(t, tx, event("a", 1), event("b", 1))
	require.NoError(t, tx.Commit())

	_, err = r.RelayBatch(ctx)
	require.ErrorIs(t, err, adapters.ErrNoSubscribers, "nothing subscribes: the broker cannot route")
	require.Equal(t, 2, b.count(t, "outbox"), "the rows stay")
	lag, err := r.Lag(ctx)
	require.NoError(t, err)
	require.Equal(t, 2, lag.Pending)
	require.Zero(t, lag.Waiting)

	in := subscribe(t, gc, "orders")
	relayAllMySQL(t, r, 2)
	require.Len(t, in.snapshot(), 2)
}

// TestMySQLRelayConfig: a database/sql relay needs a dialect it knows,
// and only one database.
func TestMySQLRelayConfig(t *testing.T) {
	t.Parallel()
	gc := orderedGoChannel(t)
	db := &sql.DB{}
	for _, tc := range []struct {
		cfg  forwarder.RelayConfig
		want string
	}{
		{forwarder.RelayConfig{Publisher: gc}, "RelayConfig.Pool (pgx, PostgreSQL) or RelayConfig.DB"},
		{forwarder.RelayConfig{DB: db, Publisher: gc}, "RelayConfig.Dialect must be sqlschema.Postgres, sqlschema.MySQL or sqlschema.SQLite"},
		{forwarder.RelayConfig{DB: db, Dialect: "oracle", Publisher: gc}, `got "oracle"`},
	} {
		_, err := forwarder.NewRelay(tc.cfg)
		require.ErrorContains(t, err, tc.want)
	}
	_, err := forwarder.NewSQLTxPublisher(context.Background(), &sql.Tx{}, "oracle", sqlschema.Config{})
	require.ErrorContains(t, err, `unknown dialect "oracle"`)
	_, err = forwarder.SQLOutboxLag(context.Background(), db, "oracle", sqlschema.Config{})
	require.ErrorContains(t, err, `unknown dialect "oracle"`)
}

// TestMySQLConsumerOutbox: with a MariaDB inbox, the messages a handler
// produces are outbox rows in the inbox's transaction: they commit with
// the effect, and a redelivery, a duplicate, writes none.
func TestMySQLConsumerOutbox(t *testing.T) {
	t.Parallel()
	b := setupMySQL(t, 6)
	store, err := sqlstore.New(b.db, sqlstore.Config{Dialect: sqlstore.MySQL, Schema: b.schema})
	require.NoError(t, err)
	inbox, err := middleware.NewInbox(middleware.InboxConfig{
		TxStore:  store,
		Consumer: "shipping",
		Outbox:   forwarder.SQLInboxOutbox("orders.shipped", sqlschema.MySQL, b.schema),
	})
	require.NoError(t, err)
	var produced []string
	handler := inbox.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		if _, err := sqlstore.Tx(msg.Context()).ExecContext(msg.Context(), "INSERT INTO `"+b.name+"`.orders (id) VALUES (?)",
			middleware.IdempotencyKey(msg.Context())); err != nil {
			return nil, err
		}
		out := []*message.Message{message.NewMessage(watermill.NewUUID(), []byte("label")), message.NewMessage(watermill.NewUUID(), []byte("mail"))}
		for _, m := range out {
			produced = append(produced, m.UUID)
		}
		return out, nil
	})
	msg := message.NewMessage(watermill.NewUUID(), nil)
	msg.Metadata.Set(delivery.IdempotencyKey, "order-9")
	again, err := handler(msg)
	require.NoError(t, err)
	require.Empty(t, again, "the produced messages are in the outbox, not returned to the router")
	again, err = handler(msg.Copy())
	require.NoError(t, err)
	require.Empty(t, again)
	require.Equal(t, 1, b.count(t, "orders"))
	require.Equal(t, 2, b.count(t, "outbox"), "the duplicate wrote nothing")

	gc := orderedGoChannel(t)
	in := subscribe(t, gc, "orders.shipped")
	relayAllMySQL(t, b.relay(t, gc, nil), 2)
	got := in.snapshot()
	require.Len(t, got, 2)
	require.Equal(t, produced, []string{got[0].UUID, got[1].UUID}, "every produced message, in order, by UUID")

	err = forwarder.SQLInboxOutbox("x", sqlschema.MySQL, b.schema)(context.Background(), nil)
	require.ErrorContains(t, err, "no database/sql transaction in the context")
}

// TestMySQLStallWarning: a writer that stays open after its outbox insert
// holds back the rows behind it in its lane; once it has been open for
// StallWarning, the relay logs it, naming its session.
func TestMySQLStallWarning(t *testing.T) {
	t.Parallel()
	b := setupMySQL(t, 6)
	gc := orderedGoChannel(t)
	in := subscribe(t, gc, "orders")
	logs := &lineLogger{}
	r := b.relay(t, gc, func(c *forwarder.RelayConfig) {
		c.StallWarning, c.PollInterval, c.Logger = 300*time.Millisecond, 20*time.Millisecond, logs
	})
	first := b.begin(t)
	b.publish(t, first.tx, event("k", 1))
	later := b.begin(t)
	b.publish(t, later.tx, event("k", 2))
	require.NoError(t, later.tx.Commit())
	run(t, r)

	require.Eventually(t, func() bool { return len(logs.stalls()) > 0 }, 30*time.Second, 20*time.Millisecond)
	line := logs.stalls()[0]
	require.Contains(t, line.msg, fmt.Sprintf("pid %d ", first.id))
	require.Equal(t, 1, line.fields["waiting_rows"])
	require.Equal(t, first.id, line.fields["holder_pid"])
	require.Empty(t, in.snapshot(), "the row behind it waits")

	require.NoError(t, first.tx.Commit())
	require.Eventually(t, func() bool { return len(in.seqs("k")) == 2 }, 30*time.Second, 10*time.Millisecond)
	require.Equal(t, []int{1, 2}, in.seqs("k"))
}
