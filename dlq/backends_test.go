package dlq_test

import (
	"context"
	"errors"
	"fmt"
	"strconv"
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
	"github.com/oncemill/oncemill/dedup/dedupdriver"
	"github.com/oncemill/oncemill/dedup/postgres"
	"github.com/oncemill/oncemill/dedup/sqlite"
	"github.com/oncemill/oncemill/dedup/sqlstore"
	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/dlq"
	"github.com/oncemill/oncemill/internal/inboxtx"
	"github.com/oncemill/oncemill/internal/sqldb"
	"github.com/oncemill/oncemill/internal/testing/msgtest"
	"github.com/oncemill/oncemill/internal/testing/sqltest"
	"github.com/oncemill/oncemill/middleware"
	"github.com/oncemill/oncemill/sqlschema"
)

// inboxStore is what the tests ask of a backend's inbox store.
type inboxStore interface {
	dedup.TxStore
	dedupdriver.Peeker
}

// backend is a dead-letter table, with the inbox table beside it, on one
// of the databases the package speaks, and its inbox store.
type backend struct {
	db    sqltest.Database
	store *dlq.Store
	pub   *dlq.Publisher
	inbox inboxStore
	// replays opens a replay subscriber on the table.
	replays func(cfg dlq.ReplaySubscriberConfig) (*dlq.ReplaySubscriber, error)
	// bare opens a store and a publisher on a database where nothing was
	// migrated.
	bare func(t *testing.T) (*dlq.Store, *dlq.Publisher)
}

// open opens the table on one of the four ways to it (sqltest.Backends),
// with the inbox store of that database beside it.
func open(t *testing.T, b sqltest.Backend) backend {
	db := b.Open(t, 12)
	store, pub := stores(t, db)
	be := backend{db: db, store: store, pub: pub,
		replays: func(c dlq.ReplaySubscriberConfig) (*dlq.ReplaySubscriber, error) {
			if db.Pool != nil {
				return dlq.NewReplaySubscriber(db.Pool, db.Schema, c)
			}
			return dlq.NewSQLReplaySubscriber(db.DB, db.Dialect, db.Schema, c)
		},
		bare: func(t *testing.T) (*dlq.Store, *dlq.Publisher) { return stores(t, db.Bare(t)) }}
	var err error
	switch {
	case db.Pool != nil:
		be.inbox, err = postgres.New(db.Pool, postgres.Config{Schema: db.Schema.Schema})
	case db.Dialect == sqlschema.SQLite:
		be.inbox, err = sqlite.New(context.Background(), db.DB, sqlite.Config{})
	default:
		d := sqlstore.MySQL
		if db.Dialect == sqlschema.Postgres {
			d = sqlstore.Postgres
		}
		be.inbox, err = sqlstore.New(db.DB, sqlstore.Config{Dialect: d, Schema: db.Schema})
	}
	require.NoError(t, err)
	return be
}

// stores opens a store and a publisher on db.
func stores(t *testing.T, db sqltest.Database) (*dlq.Store, *dlq.Publisher) {
	t.Helper()
	open, publisher := func() (*dlq.Store, error) { return dlq.NewStore(db.Pool, db.Schema) },
		func() (*dlq.Publisher, error) { return dlq.NewPublisher(db.Pool, db.Schema) }
	if db.DB != nil {
		open, publisher = func() (*dlq.Store, error) { return dlq.NewSQLStore(db.DB, db.Dialect, db.Schema) },
			func() (*dlq.Publisher, error) { return dlq.NewSQLPublisher(db.DB, db.Dialect, db.Schema) }
	}
	store, err := open()
	require.NoError(t, err)
	pub, err := publisher()
	require.NoError(t, err)
	return store, pub
}

// list returns the ids of the entries f selects.
func (b backend) list(t *testing.T, f dlq.Filter) []int64 {
	t.Helper()
	entries, err := b.store.List(context.Background(), f)
	require.NoError(t, err)
	return entryIDs(entries)
}

// bury marks key dead for consumer in the inbox table, as the inbox does
// when it gives up on a message.
func (b backend) bury(t *testing.T, consumer, key string) {
	t.Helper()
	ctx := context.Background()
	tx, err := b.inbox.InboxBegin(ctx)
	require.NoError(t, err)
	k := dedup.Key{Consumer: consumer, Key: key}
	c, err := tx.InboxClaim(ctx, k, time.Hour)
	require.NoError(t, err)
	require.Equal(t, dedup.StateNew, c.State)
	require.NoError(t, tx.InboxBury(ctx, k, dedup.Failure{Err: "seeded", At: time.Now()}))
	require.NoError(t, tx.Commit(ctx))
}

// exec runs q, written with '?', on the backend's database; {schema}
// stands for the qualifier of the tables' schema or database, if any.
func (b backend) exec(t *testing.T, ctx context.Context, e sqldb.Executor, q string, args ...any) {
	t.Helper()
	_, err := e.Exec(ctx, b.sql(q), args...)
	require.NoError(t, err)
}

// count returns the count q, written with '?', selects through e.
func (b backend) count(t *testing.T, ctx context.Context, e sqldb.Executor, q string, args ...any) (n int) {
	t.Helper()
	require.NoError(t, e.QueryRow(ctx, b.sql(q), args...).Scan(&n))
	return n
}

// sql spells q for the backend's database: '?' placeholders rebound,
// {schema}. qualifying a table by the tables' schema or database, {dlq}
// the dead-letter table.
func (b backend) sql(q string) string {
	d := b.db.SQL().Dialect()
	names := d.Names(b.db.Schema)
	schema := ""
	if names.Schema != "" {
		schema = names.Schema + "."
	}
	return d.Rebind(strings.NewReplacer("{schema}.", schema, "{dlq}", names.DLQ).Replace(q))
}

// seed dead-letters msgs as a consumer's inbox and poison middleware do,
// and returns their entries' ids.
func (b backend) seed(t *testing.T, msgs ...*message.Message) []int64 {
	t.Helper()
	before := len(b.list(t, dlq.Filter{}))
	for _, m := range msgs {
		b.bury(t, m.Metadata.Get(delivery.DeadConsumer), m.Metadata.Get(delivery.DeadKey))
	}
	require.NoError(t, b.pub.Publish("orders.dlq", msgs...))
	ids := b.list(t, dlq.Filter{})
	require.Len(t, ids, before+len(msgs))
	return ids[before:]
}

// TestOnEveryBackend: what an operator and a consumer see of the
// dead-letter table is the same on PostgreSQL (through pgx and through
// database/sql), MariaDB and SQLite.
func TestOnEveryBackend(t *testing.T) {
	t.Parallel()
	checks := []struct {
		name string
		run  func(t *testing.T, b backend)
	}{
		{"written once", checkWrittenOnce},
		{"one UUID, two messages", checkSharedUUID},
		{"list, filter, count, show", checkList},
		{"replay to the topic", checkReplay},
		{"replay to the consumer", checkReplayToConsumer},
		{"purge", checkPurge},
		{"not migrated", checkNotMigrated},
		{"in the inbox's transaction", checkInboxTransaction},
		{"poison middleware", checkPoison},
	}
	for _, be := range sqltest.Backends {
		t.Run(be.Name, func(t *testing.T) {
			t.Parallel()
			for _, c := range checks {
				t.Run(c.name, func(t *testing.T) {
					t.Parallel()
					c.run(t, open(t, be))
				})
			}
		})
	}
}

// checkSharedUUID: a UUID is not a message's identity. Two messages of
// one UUID with different keys are two entries, and a copy of either is
// still none more; two UUIDs that differ only in bytes that are not text
// are two entries; PublishDistinct (what an operator's cancel writes
// through) files a message whose entry is there already as an entry of
// its own, whose replay carries the message's UUID and payload.
func checkSharedUUID(t *testing.T, b backend) {
	ctx := context.Background()
	first := dead("orders", "charge", "card declined")
	second := dead("orders", "charge", "card expired")
	second.UUID = first.UUID
	second.Payload = []byte(`{"order":"second"}`)
	second.Metadata.Set(delivery.DeadKey, "key-second")
	require.NoError(t, b.pub.Publish("orders.dlq", first, second))
	require.NoError(t, b.pub.Publish("orders.dlq", first.Copy()))
	entries, err := b.store.List(ctx, dlq.Filter{})
	require.NoError(t, err)
	require.Len(t, entries, 2, "two messages of one UUID, each dead-lettered once")
	require.Equal(t, []string{first.UUID, first.UUID}, uuidsOf(entries))
	require.ElementsMatch(t, []string{"key-" + first.UUID, "key-second"}, []string{entries[0].Key, entries[1].Key})

	nul, ff := dead("orders", "charge", "x"), dead("orders", "charge", "y")
	nul.UUID, ff.UUID = "u-\x00", "u-\xff"
	nul.Metadata.Set(delivery.DeadKey, "same-key")
	ff.Metadata.Set(delivery.DeadKey, "same-key")
	require.NoError(t, b.pub.Publish("orders.dlq", nul, ff))
	require.Len(t, b.list(t, dlq.Filter{}), 4, "UUIDs that differ only in bytes that are not text stay two")

	cancelled := first.Copy()
	cancelled.Payload = []byte(`{"order":"cancelled copy"}`)
	require.NoError(t, b.pub.PublishDistinct("orders.dlq", cancelled))
	entries, err = b.store.List(ctx, dlq.Filter{})
	require.NoError(t, err)
	require.Len(t, entries, 5, "PublishDistinct merges nothing into the entry that is there")
	apart := entries[4]
	require.True(t, strings.HasPrefix(apart.UUID, first.UUID+"#dead-letter-"), apart.UUID)
	require.Equal(t, []byte(`{"order":"cancelled copy"}`), apart.Payload)
	require.Equal(t, first.UUID, apart.Message("").UUID, "a replay publishes the message's own UUID")
}

// checkWrittenOnce: a dead letter's fields survive the table, the payload
// byte for byte, a long metadata value whole, the Kafka partition and
// offset as numbers; invalid UTF-8 in text is stored as U+FFFD. The same
// message dead-lettered again, or by writers at the same instant, is one
// entry, unless the first is on its way back to its consumer; another
// consumer's or another topic's dead letter of it is its own.
func checkWrittenOnce(t *testing.T, b backend) {
	ctx := context.Background()
	m := dead("orders", "charge", "card declined \xff")
	m.Payload = []byte{0, 0xfe, 'x'}
	m.Metadata.Set(delivery.DeadPermanent, "true")
	m.Metadata.Set(delivery.DeadPartition, "3")
	m.Metadata.Set(delivery.DeadOffset, "9000000000")
	long := strings.Repeat("t", 300)
	m.Metadata.Set("long", long)
	want := map[string]string{}
	for k, v := range m.Metadata {
		want[k] = v
	}
	want[delivery.DeadError] = "card declined \uFFFD"
	require.NoError(t, b.pub.Publish("orders.dlq", m))
	require.NoError(t, b.pub.Publish("orders.dlq", m.Copy()))
	ids := b.list(t, dlq.Filter{})
	require.Len(t, ids, 1, "dead-lettered twice: one entry")

	got, err := b.store.Get(ctx, ids[0])
	require.NoError(t, err)
	require.Equal(t, ids[0], got.ID)
	require.Equal(t, m.UUID, got.UUID)
	require.Equal(t, "orders", got.Topic)
	require.Equal(t, "orders.dlq", got.DLQTopic)
	require.Equal(t, "charge", got.Consumer)
	require.Equal(t, "key-"+m.UUID, got.Key)
	require.Equal(t, 5, got.Attempts)
	require.Equal(t, "card declined \uFFFD", got.Error, "invalid UTF-8 stored as U+FFFD")
	require.True(t, got.Permanent)
	require.True(t, got.FirstFailedAt.Equal(time.Date(2026, 3, 1, 10, 0, 0, 123456000, time.UTC)), "%s", got.FirstFailedAt)
	require.True(t, got.LastFailedAt.Equal(time.Date(2026, 3, 1, 10, 5, 0, 0, time.UTC)), "%s", got.LastFailedAt)
	require.NotNil(t, got.Partition)
	require.Equal(t, int32(3), *got.Partition)
	require.NotNil(t, got.Offset)
	require.Equal(t, int64(9000000000), *got.Offset)
	require.Equal(t, []byte{0, 0xfe, 'x'}, got.Payload)
	require.Equal(t, long, got.Metadata["long"], "a long metadata value whole")
	require.Equal(t, want, got.Metadata, "the full metadata, Dead* keys included")
	require.WithinDuration(t, time.Now(), got.DeadAt, time.Hour)

	replay := got.Message("grant-1")
	require.Equal(t, m.UUID, replay.UUID)
	require.Equal(t, []byte(m.Payload), []byte(replay.Payload))
	require.Equal(t, map[string]string{
		delivery.IdempotencyKey: "key-" + m.UUID, "trace_id": "tr-1", "long": long,
		delivery.Replay: "grant-1", delivery.ReplayConsumer: "charge", dlq.ReplayedFrom: strconv.FormatInt(got.ID, 10),
	}, map[string]string(replay.Metadata), "the original metadata, marked as the replay granted for its consumer, from this entry")
	require.Equal(t, map[string]string{delivery.IdempotencyKey: "key-" + m.UUID, "trace_id": "tr-1", "long": long},
		map[string]string(got.Message("").Metadata), "no grant, no replay marker")

	// Writers at the same instant, each retrying what the database
	// refused (a deadlock between the inserts of one key is the
	// infrastructure's: the poison middleware nacks and retries).
	again := dead("orders", "charge", "timeout")
	var wg sync.WaitGroup
	errs := make(chan error, 8)
	for range 8 {
		wg.Go(func() {
			var err error
			for range 20 {
				if err = b.pub.Publish("orders.dlq", again.Copy()); err == nil {
					break
				}
			}
			errs <- err
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
	require.Len(t, b.list(t, dlq.Filter{}), 2, "concurrent writers of one message: one entry")

	other := m.Copy()
	other.Metadata.Set(delivery.DeadConsumer, "audit")
	require.NoError(t, b.pub.Publish("orders.dlq", other))
	require.Len(t, b.list(t, dlq.Filter{}), 3, "another consumer's dead letter of the message is its own")
	moved := m.Copy()
	moved.Metadata.Set(delivery.DeadTopic, "orders.v2")
	require.NoError(t, b.pub.Publish("orders.dlq", moved))
	require.Len(t, b.list(t, dlq.Filter{}), 4, "another topic's dead letter of the message is its own")
	empty := dead("", "", "")
	empty.Payload = nil
	require.NoError(t, b.pub.Publish("", empty))
	require.Len(t, b.list(t, dlq.Filter{}), 5, "a message without dead-letter fields is kept too")

	n, err := b.store.RequestReplay(ctx, dlq.Filter{IDs: ids})
	require.NoError(t, err)
	require.Equal(t, 1, n)
	require.NoError(t, b.pub.Publish("orders.dlq", m.Copy()), "failed again during its replay")
	require.Len(t, b.list(t, dlq.Filter{}), 6, "written again: the first goes once its replay is handled")
}

// checkList: list, count, show, missing and counts select what the filter
// says.
func checkList(t *testing.T, b backend) {
	ctx := context.Background()
	ids := b.seed(t,
		dead("orders", "charge", "Card DECLINED"),
		dead("orders", "ship", "timeout"),
		dead("payments", "charge", "card declined again: 100% sure"))
	list := func(f dlq.Filter) []int64 { return b.list(t, f) }
	require.Equal(t, ids, list(dlq.Filter{}))
	require.Equal(t, ids[:2], list(dlq.Filter{Topic: "orders"}))
	require.Equal(t, []int64{ids[0], ids[2]}, list(dlq.Filter{Consumer: "charge"}))
	require.Equal(t, []int64{ids[0], ids[2]}, list(dlq.Filter{ErrorContains: "card declined"}), "ignoring case")
	require.Equal(t, []int64{ids[2]}, list(dlq.Filter{ErrorContains: "100%"}), "% is a character")
	require.Empty(t, list(dlq.Filter{ErrorContains: "c_rd"}), "_ is a character")
	require.Equal(t, []int64{ids[2]}, list(dlq.Filter{Topic: "payments", Consumer: "charge"}))
	require.Empty(t, list(dlq.Filter{Topic: "ORDERS"}), "topics compared byte for byte")
	require.Equal(t, ids[:1], list(dlq.Filter{Limit: 1}))
	require.Equal(t, []int64{ids[1]}, list(dlq.Filter{IDs: []int64{ids[1]}}))
	require.Equal(t, []int64{ids[2]}, list(dlq.Filter{IDs: []int64{ids[2], ids[0]}, Topic: "payments"}))

	first, err := b.store.Get(ctx, ids[0])
	require.NoError(t, err)
	last, err := b.store.Get(ctx, ids[2])
	require.NoError(t, err)
	require.Equal(t, "card declined again: 100% sure", last.Error)
	require.Equal(t, ids, list(dlq.Filter{Since: first.DeadAt, Until: last.DeadAt}), "to the microsecond, bounds included")
	require.Empty(t, list(dlq.Filter{Until: first.DeadAt.Add(-time.Microsecond)}))
	require.Empty(t, list(dlq.Filter{Since: last.DeadAt.Add(time.Microsecond)}))
	_, err = b.store.Get(ctx, ids[2]+100)
	require.ErrorIs(t, err, dlq.ErrNotFound)
	require.ErrorContains(t, err, fmt.Sprintf("dlq: no such entry: %d", ids[2]+100))

	n, err := b.store.Count(ctx, dlq.Filter{Consumer: "charge"})
	require.NoError(t, err)
	require.Equal(t, 2, n)
	n, err = b.store.Count(ctx, dlq.Filter{Limit: 1})
	require.NoError(t, err)
	require.Equal(t, 1, n)
	missing, err := b.store.Missing(ctx, []int64{ids[2] + 10, ids[0], ids[2] + 5, ids[2] + 10})
	require.NoError(t, err)
	require.Equal(t, []int64{ids[2] + 5, ids[2] + 10}, missing)
	missing, err = b.store.Missing(ctx, ids)
	require.NoError(t, err)
	require.Empty(t, missing)

	counts, err := b.store.Counts(ctx)
	require.NoError(t, err)
	require.Equal(t, []dlq.Count{
		{Consumer: "charge", Topic: "orders", Entries: 1, Oldest: first.DeadAt},
		{Consumer: "charge", Topic: "payments", Entries: 1, Oldest: last.DeadAt},
		{Consumer: "ship", Topic: "orders", Entries: 1, Oldest: counts[2].Oldest},
	}, counts)

	copies, ok, err := b.store.CopiesSince(ctx, first)
	require.NoError(t, err)
	require.True(t, ok, "the key is dead in the inbox table beside")
	require.Zero(t, copies)
	require.NoError(t, b.inbox.InboxDeadCopy(ctx, dedup.Key{Consumer: first.Consumer, Key: first.Key}))
	copies, ok, err = b.store.CopiesSince(ctx, first)
	require.NoError(t, err)
	require.True(t, ok)
	require.Equal(t, 1, copies)
	copies, ok, err = b.store.CopiesSince(ctx, dlq.Entry{Consumer: "charge", Key: "nope"})
	require.NoError(t, err)
	require.False(t, ok)
	require.Zero(t, copies)
}

// checkReplay: a replay publishes the original message once to its topic,
// with a grant that reopens the dead key, and removes the entry; an entry
// whose key has no record stays, and nothing is published for it.
func checkReplay(t *testing.T, b backend) {
	ctx := context.Background()
	m := dead("orders", "charge", "declined")
	ids := b.seed(t, m, dead("orders", "ship", "timeout"))
	broker := adapters.NewGoChannel(gochannel.Config{Persistent: true, OutputChannelBuffer: 16}, nil)
	t.Cleanup(func() { require.NoError(t, broker.Close()) })
	msgs, err := broker.Subscribe(ctx, "orders")
	require.NoError(t, err)

	n, err := b.store.Replay(ctx, broker, dlq.Filter{IDs: ids[:1]}, nil)
	require.NoError(t, err)
	require.Equal(t, 1, n)
	got := msgtest.Receive(t, msgs, 10*time.Second)
	got.Ack()
	require.Equal(t, m.UUID, got.UUID)
	require.Equal(t, []byte(m.Payload), []byte(got.Payload))
	require.Equal(t, "tr-1", got.Metadata.Get("trace_id"))
	require.Equal(t, "charge", got.Metadata.Get(delivery.ReplayConsumer))
	require.Empty(t, got.Metadata.Get(delivery.DeadError), "the failed delivery's facts are left behind")
	msgtest.Nothing(t, msgs, 100*time.Millisecond)
	require.Equal(t, ids[1:], b.list(t, dlq.Filter{}), "the replayed entry is gone")

	key := dedup.Key{Consumer: "charge", Key: m.Metadata.Get(delivery.DeadKey)}
	grant := got.Metadata.Get(delivery.Replay)
	require.NotEmpty(t, grant)
	reopened, err := b.inbox.InboxReopen(ctx, key, grant)
	require.NoError(t, err)
	require.True(t, reopened, "the grant written on the inbox reopens the dead key")
	c, err := b.inbox.InboxPeek(ctx, key)
	require.NoError(t, err)
	require.NotEqual(t, dedup.StateDead, c.State)

	orphan := dead("orders", "charge", "no record")
	require.NoError(t, b.pub.Publish("orders.dlq", orphan))
	n, err = b.store.Replay(ctx, broker, dlq.Filter{Consumer: "charge"}, nil)
	require.ErrorIs(t, err, dlq.ErrNoDeadKey)
	require.Zero(t, n)
	msgtest.Nothing(t, msgs, 100*time.Millisecond)
	require.Len(t, b.list(t, dlq.Filter{}), 2, "the entry without a record stays")
}

// checkReplayToConsumer: requested replays go to their consumer's replay
// subscriber only, for its topic only, in order, each once, with a fresh
// grant on every delivery; nothing is deleted before the ack, an acked one
// is; one whose key has no record is withdrawn and stays. A requested
// entry is outside the one-entry rule: the message dead-lettered again
// meanwhile is written, and stays.
func checkReplayToConsumer(t *testing.T, b backend) {
	ctx := context.Background()
	m, m2 := dead("orders", "charge", "declined"), dead("orders", "charge", "declined too")
	ids := b.seed(t, m, m2, dead("orders", "ship", "timeout"), dead("refunds", "charge", "another topic"))
	orphan := dead("orders", "charge", "no record")
	require.NoError(t, b.pub.Publish("orders.dlq", orphan))
	all := b.list(t, dlq.Filter{})
	require.Len(t, all, 5)

	n, err := b.store.RequestReplay(ctx, dlq.Filter{Consumer: "charge", Topic: "orders"})
	require.NoError(t, err)
	require.Equal(t, 3, n)
	n, err = b.store.RequestReplay(ctx, dlq.Filter{IDs: ids[2:4]})
	require.NoError(t, err)
	require.Equal(t, 2, n, "another consumer's, and the consumer's of another topic")
	n, err = b.store.RequestReplay(ctx, dlq.Filter{IDs: ids[:1]})
	require.NoError(t, err)
	require.Zero(t, n, "already requested")
	_, err = b.store.RequestReplay(ctx, dlq.Filter{})
	require.ErrorIs(t, err, dlq.ErrNoSelection)

	// The first message dead-lettered again while on its way back: not
	// requested, it is not delivered.
	first, err := b.store.Get(ctx, ids[0])
	require.NoError(t, err)
	redead := first.Message("")
	for k, v := range first.Metadata {
		redead.Metadata.Set(k, v)
	}
	require.NoError(t, b.pub.Publish("orders.dlq", redead))
	all = b.list(t, dlq.Filter{})
	require.Len(t, all, 6, "a requested entry is outside the one-entry rule")

	_, err = b.replays(dlq.ReplaySubscriberConfig{})
	require.ErrorContains(t, err, "ReplaySubscriberConfig.Consumer")
	_, err = b.replays(dlq.ReplaySubscriberConfig{Consumer: "charge", BeatEvery: -time.Second})
	require.EqualError(t, err, "dlq: ReplaySubscriberConfig.BeatEvery must not be negative, got -1s")
	sub, err := b.replays(dlq.ReplaySubscriberConfig{Consumer: "charge", PollInterval: 10 * time.Millisecond})
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, sub.Close()) })
	msgs, err := sub.Subscribe(ctx, "orders")
	require.NoError(t, err)

	got := msgtest.Receive(t, msgs, 10*time.Second)
	require.Equal(t, m.UUID, got.UUID)
	require.NotEmpty(t, got.Metadata.Get(delivery.Replay), "marked as a replay")
	require.Equal(t, "charge", got.Metadata.Get(delivery.ReplayConsumer))
	require.Equal(t, all, b.list(t, dlq.Filter{}), "nothing deleted before the ack")
	got.Nack()
	again := msgtest.Receive(t, msgs, 10*time.Second)
	require.Equal(t, m.UUID, again.UUID, "a nacked replay comes back")
	require.NotEqual(t, got.Metadata.Get(delivery.Replay), again.Metadata.Get(delivery.Replay), "with a fresh grant")
	granted, err := b.inbox.InboxReplayGranted(ctx, dedup.Key{Consumer: "charge", Key: m.Metadata.Get(delivery.DeadKey)}, again.Metadata.Get(delivery.Replay))
	require.NoError(t, err)
	require.True(t, granted, "the grant is on the dead key")
	again.Ack()
	second := msgtest.Receive(t, msgs, 10*time.Second)
	require.Equal(t, m2.UUID, second.UUID)
	second.Ack()
	msgtest.Nothing(t, msgs, 200*time.Millisecond)
	msgtest.WaitFor(t, "the acked entries deleted", func() bool { return len(b.list(t, dlq.Filter{})) == 4 })
	require.Equal(t, []int64{ids[2], ids[3], all[4], all[5]}, b.list(t, dlq.Filter{}),
		"the other consumer's, the other topic's, the orphan and the copy dead-lettered again stay")
	msgtest.WaitFor(t, "the orphan's request withdrawn", func() bool {
		n, err := b.store.RequestReplay(ctx, dlq.Filter{IDs: all[4:5]})
		require.NoError(t, err)
		return n == 1
	})
}

// checkPurge: purge deletes what the filter selects, and only with a
// selection.
func checkPurge(t *testing.T, b backend) {
	ctx := context.Background()
	ids := b.seed(t, dead("orders", "charge", "a"), dead("payments", "charge", "b"), dead("orders", "ship", "c"))
	_, err := b.store.Purge(ctx, dlq.Filter{})
	require.ErrorIs(t, err, dlq.ErrNoSelection)
	n, err := b.store.Purge(ctx, dlq.Filter{Topic: "orders"})
	require.NoError(t, err)
	require.Equal(t, 2, n)
	require.Equal(t, []int64{ids[1]}, b.list(t, dlq.Filter{}))
	n, err = b.store.Purge(ctx, dlq.Filter{All: true})
	require.NoError(t, err)
	require.Equal(t, 1, n)
	require.Empty(t, b.list(t, dlq.Filter{}))
}

// checkNotMigrated: on a database without the table, every operation
// says so.
func checkNotMigrated(t *testing.T, b backend) {
	ctx := context.Background()
	store, pub := b.bare(t)
	require.ErrorIs(t, pub.Publish("orders.dlq", dead("orders", "charge", "e")), dlq.ErrNotMigrated)
	_, err := store.List(ctx, dlq.Filter{})
	require.ErrorIs(t, err, dlq.ErrNotMigrated)
	_, err = store.Count(ctx, dlq.Filter{})
	require.ErrorIs(t, err, dlq.ErrNotMigrated)
	_, err = store.Counts(ctx)
	require.ErrorIs(t, err, dlq.ErrNotMigrated)
	_, err = store.Get(ctx, 1)
	require.ErrorIs(t, err, dlq.ErrNotMigrated)
	_, err = store.RequestReplay(ctx, dlq.Filter{All: true})
	require.ErrorIs(t, err, dlq.ErrNotMigrated)
}

// checkInboxTransaction: a dead letter published under an inbox
// transaction on the table's database is written in that transaction: the
// transaction sees it, and it rolls back or commits with it.
func checkInboxTransaction(t *testing.T, b backend) {
	ctx := context.Background()
	for _, commit := range []bool{false, true} {
		tx, err := b.inbox.InboxBegin(ctx)
		require.NoError(t, err)
		txCtx := tx.WithTx(ctx)
		m := dead("orders", "billing", "card declined")
		m.SetContext(txCtx)
		require.NoError(t, b.pub.Publish("orders.dlq", m))
		require.Equal(t, 1, b.count(t, ctx, inboxtx.Executor(txCtx), `SELECT COUNT(*) FROM {dlq}`), "the inbox's transaction holds the dead letter")
		if commit {
			require.NoError(t, tx.Commit(ctx))
			require.Len(t, b.list(t, dlq.Filter{}), 1, "committed with the inbox's transaction")
		} else {
			require.NoError(t, tx.Rollback(ctx))
			require.Empty(t, b.list(t, dlq.Filter{}), "rolled back with the inbox's transaction")
		}
	}
}

// checkPoison: a consumer whose inbox is on the backend gives up on a
// message; the poison middleware's dead letter is written in the inbox's
// transaction, once, with the key dead, and a later copy of the message is
// acked without running and counted. The operator's replay publishes it
// to its topic with a grant; the consumer runs it once, its effect
// committed with the inbox's transaction; the entry is gone.
func checkPoison(t *testing.T, b backend) {
	ctx := context.Background()
	b.exec(t, ctx, b.db.SQL(), `CREATE TABLE {schema}.effects (k VARCHAR(64) NOT NULL)`)
	effects := func() int { return b.count(t, ctx, b.db.SQL(), `SELECT COUNT(*) FROM {schema}.effects`) }
	inbox, err := middleware.NewInbox(middleware.InboxConfig{TxStore: b.inbox, Consumer: "charge"})
	require.NoError(t, err)
	poison, err := middleware.NewPoison(middleware.PoisonConfig{
		Publisher: b.pub, Topic: "orders.dlq", MaxAttempts: 2, Consumer: "charge",
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
		_, err := inboxtx.Executor(msg.Context()).Exec(msg.Context(), b.sql(`INSERT INTO {schema}.effects (k) VALUES (?)`),
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
	state := func() dedup.State {
		c, err := b.inbox.InboxPeek(ctx, key)
		require.NoError(t, err)
		return c.State
	}

	msg := message.NewMessage(watermill.NewUUID(), []byte("charge pay-1"))
	msg.Metadata.Set(delivery.IdempotencyKey, "pay-1")
	require.NoError(t, broker.Publish("orders", msg))
	msgtest.WaitFor(t, "dead-lettered, the key dead", func() bool {
		return len(b.list(t, dlq.Filter{})) == 1 && state() == dedup.StateDead
	})
	require.Equal(t, int32(2), calls.Load(), "two attempts")

	require.NoError(t, broker.Publish("orders", msg.Copy()))
	entries, err := b.store.List(ctx, dlq.Filter{})
	require.NoError(t, err)
	require.Len(t, entries, 1)
	msgtest.WaitFor(t, "the copy counted on the dead key", func() bool {
		n, ok, err := b.store.CopiesSince(ctx, entries[0])
		require.NoError(t, err)
		return ok && n == 1
	})
	require.Equal(t, int32(2), calls.Load(), "the copy did not run")
	require.Len(t, b.list(t, dlq.Filter{}), 1, "one entry")
	require.Equal(t, msg.UUID, entries[0].UUID)
	require.Equal(t, "orders", entries[0].Topic)
	require.Equal(t, "charge", entries[0].Consumer)
	require.Equal(t, "pay-1", entries[0].Key)
	require.Equal(t, 2, entries[0].Attempts)
	require.Contains(t, entries[0].Error, "ledger refuses the order")

	broken.Store(false)
	n, err := b.store.Replay(ctx, broker, dlq.Filter{IDs: []int64{entries[0].ID}}, nil)
	require.NoError(t, err)
	require.Equal(t, 1, n)
	msgtest.WaitFor(t, "the replay applied", func() bool { return effects() == 1 })
	require.Equal(t, dedup.StateDone, state())
	require.Empty(t, b.list(t, dlq.Filter{}), "the entry is gone")
	require.Equal(t, int32(3), calls.Load(), "the replay ran once")
}

func uuidsOf(entries []dlq.Entry) []string {
	out := []string{}
	for _, e := range entries {
		out = append(out, e.UUID)
	}
	return out
}
