package dlq_test

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"sort"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/oncemill/oncemill/dedup"
	"github.com/oncemill/oncemill/dedup/postgres"
	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/dlq"
	"github.com/oncemill/oncemill/internal/testing/msgtest"
	"github.com/oncemill/oncemill/internal/testing/pgtest"
	"github.com/oncemill/oncemill/sqlschema"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

type env struct {
	pool  *pgxpool.Pool
	cfg   sqlschema.Config
	pub   *dlq.Publisher
	store *dlq.Store
}

func setup(t *testing.T) env {
	t.Helper()
	pool := pgtest.Pool(t, 8)
	cfg := sqlschema.Config{Schema: pgtest.Schema(t, pool)}
	pub, err := dlq.NewPublisher(pool, cfg)
	require.NoError(t, err)
	store, err := dlq.NewStore(pool, cfg)
	require.NoError(t, err)
	return env{pool: pool, cfg: cfg, pub: pub, store: store}
}

func (e env) table() string { return pgx.Identifier{e.cfg.Schema, "dlq"}.Sanitize() }

func (e env) ids(t *testing.T) []int64 {
	t.Helper()
	rows, err := e.pool.Query(context.Background(), `SELECT id FROM `+e.table()+` ORDER BY id`)
	require.NoError(t, err)
	ids, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	require.NoError(t, err)
	return ids
}

// dead is a message as the poison middleware dead-letters it: the
// original's metadata plus the delivery.Dead* keys.
func dead(topic, consumer, errText string) *message.Message {
	m := message.NewMessage(watermill.NewUUID(), []byte(`{"order":"`+topic+`"}`))
	m.Metadata.Set(delivery.IdempotencyKey, "key-"+m.UUID)
	m.Metadata.Set("trace_id", "tr-1")
	m.Metadata.Set(delivery.DeadTopic, topic)
	m.Metadata.Set(delivery.DeadConsumer, consumer)
	m.Metadata.Set(delivery.DeadKey, "key-"+m.UUID)
	m.Metadata.Set(delivery.DeadAttempts, "5")
	m.Metadata.Set(delivery.DeadError, errText)
	m.Metadata.Set(delivery.DeadPermanent, "false")
	m.Metadata.Set(delivery.DeadFirstFailedAt, "2026-03-01T10:00:00.123456Z")
	m.Metadata.Set(delivery.DeadLastFailedAt, "2026-03-01T10:05:00Z")
	return m
}

// seed dead-letters msgs as a consumer's inbox and poison middleware do:
// the key of each message that names one is dead in the inbox table
// beside the dead-letter table, and the message is in the table.
func (e env) seed(t *testing.T, msgs ...*message.Message) []int64 {
	t.Helper()
	before := len(e.ids(t))
	for _, m := range msgs {
		bury(t, e.pool, e.cfg.Schema, m.Metadata.Get(delivery.DeadConsumer), m.Metadata.Get(delivery.DeadKey))
	}
	require.NoError(t, e.pub.Publish("orders.dlq", msgs...))
	ids := e.ids(t)
	require.Len(t, ids, before+len(msgs))
	return ids[before:]
}

// bury marks key dead for consumer in the PostgreSQL inbox table of
// schema, as the inbox does when it gives up on a message; it does
// nothing without a consumer or key.
func bury(t *testing.T, pool *pgxpool.Pool, schema, consumer, key string) {
	t.Helper()
	if consumer == "" || key == "" {
		return
	}
	ctx := context.Background()
	store, err := postgres.New(pool, postgres.Config{Schema: schema})
	require.NoError(t, err)
	k := dedup.Key{Consumer: consumer, Key: key}
	c, err := store.LeaseClaim(ctx, k, time.Minute, time.Hour)
	require.NoError(t, err)
	require.Equal(t, dedup.StateNew, c.State)
	require.NoError(t, store.LeaseBury(ctx, k, c.Token, dedup.Failure{Err: "seeded", At: time.Now()}))
}

// TestPublisherAcceptsAnything stores messages whose dead-letter metadata is
// missing or garbled: a dead-letter queue that refuses a message loses it.
func TestPublisherAcceptsAnything(t *testing.T) {
	t.Parallel()
	e := setup(t)
	ctx := context.Background()

	garbled := message.NewMessage("not-a-uuid", []byte{0xff, 0x00, 0xfe, 'x'})
	for k, v := range map[string]string{
		delivery.DeadTopic:         "orders",
		delivery.DeadAttempts:      "many",
		delivery.DeadPermanent:     "perhaps",
		delivery.DeadFirstFailedAt: "yesterday",
		delivery.DeadLastFailedAt:  "2026-13-45T99:00:00Z",
		delivery.DeadPartition:     "-1",
		delivery.DeadOffset:        "0x10",
		delivery.DeadError:         "bad \x00 byte \xc3\x28 here",
		"bin\xffkey":               "nul\x00value",
	} {
		garbled.Metadata.Set(k, v)
	}
	bare := message.NewMessage("", nil) // no metadata at all, no payload
	huge := message.NewMessage(watermill.NewUUID(), []byte("x"))
	huge.Metadata.Set(delivery.DeadAttempts, "99999999999") // over int32
	huge.Metadata.Set(delivery.DeadPartition, "99999999999")
	huge.Metadata.Set(delivery.DeadOffset, "99999999999999999999") // over int64
	ids := e.seed(t, garbled, bare, huge)

	g, err := e.store.Get(ctx, ids[0])
	require.NoError(t, err)
	require.Equal(t, "not-a-uuid", g.UUID)
	require.Equal(t, "orders", g.Topic)
	require.Zero(t, g.Attempts)
	require.False(t, g.Permanent)
	require.True(t, g.FirstFailedAt.IsZero())
	require.True(t, g.LastFailedAt.IsZero())
	require.Nil(t, g.Partition)
	require.Nil(t, g.Offset)
	require.Equal(t, "bad \uFFFD byte \uFFFD( here", g.Error)
	require.Equal(t, []byte{0xff, 0x00, 0xfe, 'x'}, g.Payload, "the payload is kept byte for byte")
	require.Equal(t, "nul\uFFFDvalue", g.Metadata["bin\uFFFDkey"])
	require.Equal(t, "many", g.Metadata[delivery.DeadAttempts], "garbled values stay in the metadata as they were")

	b, err := e.store.Get(ctx, ids[1])
	require.NoError(t, err)
	require.Equal(t, dlq.Entry{ID: ids[1], DLQTopic: "orders.dlq", Payload: []byte{}, Metadata: map[string]string{}, DeadAt: b.DeadAt}, b)

	h, err := e.store.Get(ctx, ids[2])
	require.NoError(t, err)
	require.Zero(t, h.Attempts)
	require.Nil(t, h.Partition)
	require.Nil(t, h.Offset)
}

// TestPublishIsAllOrNothing makes the database refuse the second of three
// rows and checks that none is kept.
func TestPublishIsAllOrNothing(t *testing.T) {
	t.Parallel()
	e := setup(t)
	_, err := e.pool.Exec(context.Background(), `ALTER TABLE `+e.table()+` ADD CONSTRAINT no_boom CHECK (uuid <> 'boom')`)
	require.NoError(t, err)
	err = e.pub.Publish("orders.dlq", dead("orders", "c", "e"), message.NewMessage("boom", nil), dead("orders", "c", "e"))
	require.ErrorContains(t, err, "no_boom")
	require.ErrorContains(t, err, `dlq: publish 3 messages to "orders.dlq"`)
	require.Empty(t, e.ids(t))

	require.NoError(t, e.pub.Publish("orders.dlq"), "nothing to publish")
	require.ErrorContains(t, e.pub.Publish("orders.dlq", nil), "message 0 is nil")
	require.NoError(t, e.pub.Close())
	require.Empty(t, e.ids(t))
}

func TestNewRejectsBadArguments(t *testing.T) {
	t.Parallel()
	_, err := dlq.NewPublisher(nil, sqlschema.Config{})
	require.ErrorContains(t, err, "dlq: pool is nil")
	_, err = dlq.NewStore(nil, sqlschema.Config{})
	require.ErrorContains(t, err, "dlq: pool is nil")

	pool := pgtest.Pool(t, 1)
	_, err = dlq.NewPublisher(pool, sqlschema.Config{DLQTable: "Dead Letters"})
	require.ErrorContains(t, err, "DLQTable")
	_, err = dlq.NewStore(pool, sqlschema.Config{Schema: "x;y"})
	require.ErrorContains(t, err, "Schema")

	db := stdlib.OpenDBFromPool(pool)
	t.Cleanup(func() { require.NoError(t, db.Close()) })
	_, err = dlq.NewSQLStore(db, sqlschema.Dialect("oracle"), sqlschema.Config{})
	require.ErrorContains(t, err, `unknown dialect "oracle"`)
	_, err = dlq.NewSQLStore(nil, sqlschema.MySQL, sqlschema.Config{})
	require.ErrorContains(t, err, "db is nil")
}

// seedFilterable writes six entries over two topics and three consumers,
// and sets their dead_at one hour apart from 2026-01-01T00:00Z.
func seedFilterable(t *testing.T, e env) []int64 {
	t.Helper()
	ids := e.seed(t,
		dead("orders", "charge", "Card DECLINED by issuer"),
		dead("orders", "charge", "timeout"),
		dead("orders", "ship", "address invalid"),
		dead("refunds", "refund", "card declined"),
		dead("refunds", "charge", "timeout"),
		dead("orders", "ship", "timeout"),
	)
	for i, id := range ids {
		_, err := e.pool.Exec(context.Background(), `UPDATE `+e.table()+` SET dead_at = $1 WHERE id = $2`, hour(i), id)
		require.NoError(t, err)
	}
	return ids
}

func hour(i int) time.Time { return time.Date(2026, 1, 1, i, 0, 0, 0, time.UTC) }

func entryIDs(entries []dlq.Entry) []int64 {
	ids := make([]int64, len(entries))
	for i, e := range entries {
		ids[i] = e.ID
	}
	return ids
}

func TestListFilters(t *testing.T) {
	t.Parallel()
	e := setup(t)
	ctx := context.Background()
	ids := seedFilterable(t, e)
	pick := func(is ...int) []int64 {
		out := []int64{}
		for _, i := range is {
			out = append(out, ids[i])
		}
		return out
	}
	for name, tc := range map[string]struct {
		f    dlq.Filter
		want []int64
	}{
		"all":                {dlq.Filter{}, pick(0, 1, 2, 3, 4, 5)},
		"ids":                {dlq.Filter{IDs: pick(4, 1, 1)}, pick(1, 4)},
		"topic":              {dlq.Filter{Topic: "refunds"}, pick(3, 4)},
		"consumer":           {dlq.Filter{Consumer: "ship"}, pick(2, 5)},
		"error ignores case": {dlq.Filter{ErrorContains: "card declined"}, pick(0, 3)},
		"error substring":    {dlq.Filter{ErrorContains: "OUT"}, pick(1, 4, 5)},
		"since":              {dlq.Filter{Since: hour(4)}, pick(4, 5)},
		"until":              {dlq.Filter{Until: hour(1)}, pick(0, 1)},
		"since and until":    {dlq.Filter{Since: hour(2), Until: hour(3)}, pick(2, 3)},
		"one instant":        {dlq.Filter{Since: hour(2), Until: hour(2)}, pick(2)},
		"limit":              {dlq.Filter{Limit: 2}, pick(0, 1)},
		"combined":           {dlq.Filter{Topic: "orders", Consumer: "charge", ErrorContains: "time"}, pick(1)},
		"ids and topic":      {dlq.Filter{IDs: pick(0, 3), Topic: "refunds"}, pick(3)},
		"topic and limit":    {dlq.Filter{Topic: "orders", Limit: 3}, pick(0, 1, 2)},
		"nothing":            {dlq.Filter{Topic: "payments"}, pick()},
		"unknown id":         {dlq.Filter{IDs: []int64{ids[5] + 100}}, pick()},
	} {
		got, err := e.store.List(ctx, tc.f)
		require.NoError(t, err, name)
		require.Equal(t, tc.want, entryIDs(got), name)
		n, err := e.store.Count(ctx, tc.f)
		require.NoError(t, err, name)
		require.Equal(t, len(tc.want), n, name)
	}
}

func TestFilterValidation(t *testing.T) {
	t.Parallel()
	e := setup(t)
	ctx := context.Background()
	ids := e.seed(t, dead("orders", "c", "e"))
	for want, f := range map[string]dlq.Filter{
		"Limit must be 0 (no limit) or more, got -1":                         {Limit: -1},
		"Since (2026-01-01T02:00:00Z) is after Until (2026-01-01T01:00:00Z)": {Since: hour(2), Until: hour(1)},
		"IDs[1] must be positive, got 0":                                     {IDs: []int64{1, 0}},
		"IDs[0] must be positive, got -4":                                    {IDs: []int64{-4}},
	} {
		require.ErrorContains(t, f.Validate(), want)
		require.ErrorIs(t, f.Validate(), dlq.ErrInvalidFilter)
		_, err := e.store.List(ctx, f)
		require.ErrorIs(t, err, dlq.ErrInvalidFilter, want)
		_, err = e.store.Count(ctx, f)
		require.ErrorIs(t, err, dlq.ErrInvalidFilter, want)
		f.All = true
		_, err = e.store.Purge(ctx, f)
		require.ErrorIs(t, err, dlq.ErrInvalidFilter, want)
		_, err = e.store.Replay(ctx, &recorder{}, f, nil)
		require.ErrorIs(t, err, dlq.ErrInvalidFilter, want)
	}
	require.Equal(t, ids, e.ids(t), "nothing deleted")
	require.True(t, dlq.Filter{Limit: 5, All: true}.IsEmpty())
	require.False(t, dlq.Filter{Until: hour(1)}.IsEmpty())
}

// recorder is a publisher that keeps what it is given and fails the calls
// fail says it should fail.
type recorder struct {
	mu    sync.Mutex
	calls int
	fail  func(call int) bool
	got   []published
}

type published struct {
	topic string
	msg   *message.Message
}

func (r *recorder) Publish(topic string, msgs ...*message.Message) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.calls++
	if r.fail != nil && r.fail(r.calls) {
		return errors.New("broker unavailable")
	}
	for _, m := range msgs {
		r.got = append(r.got, published{topic: topic, msg: m})
	}
	return nil
}

func (r *recorder) Close() error { return nil }

func (r *recorder) uuids() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := make([]string, len(r.got))
	for i, p := range r.got {
		out[i] = p.msg.UUID
	}
	return out
}

func TestReplayToGoChannel(t *testing.T) {
	t.Parallel()
	e := setup(t)
	ctx := context.Background()
	ids := seedFilterable(t, e)
	entries, err := e.store.List(ctx, dlq.Filter{})
	require.NoError(t, err)

	gc := gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 16, Persistent: true}, watermill.NopLogger{})
	defer func() { require.NoError(t, gc.Close()) }()
	subCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	orders, err := gc.Subscribe(subCtx, "orders")
	require.NoError(t, err)

	var progress [][2]int
	n, err := e.store.Replay(ctx, gc, dlq.Filter{Topic: "orders", Consumer: "charge"}, func(done, total int) {
		progress = append(progress, [2]int{done, total})
	})
	require.NoError(t, err)
	require.Equal(t, 2, n)
	require.Equal(t, [][2]int{{0, 2}, {1, 2}, {2, 2}}, progress)

	for _, want := range entries[:2] {
		got := msgtest.Receive(t, orders, 10*time.Second)
		got.Ack()
		require.Equal(t, want.UUID, got.UUID)
		require.Equal(t, want.Payload, []byte(got.Payload))
		md := maps.Clone(map[string]string(got.Metadata))
		require.Len(t, md[delivery.Replay], 32, "a fresh 128-bit grant, hex")
		delete(md, delivery.Replay)
		require.Equal(t, map[string]string{
			delivery.IdempotencyKey: want.Key, "trace_id": "tr-1", delivery.ReplayConsumer: "charge",
			dlq.ReplayedFrom: strconv.FormatInt(want.ID, 10),
		}, md)
	}
	require.Equal(t, []int64{ids[2], ids[3], ids[4], ids[5]}, e.ids(t), "replayed rows deleted, the others kept")

	n, err = e.store.Replay(ctx, gc, dlq.Filter{Topic: "payments"}, nil)
	require.NoError(t, err)
	require.Zero(t, n)
	require.Len(t, e.ids(t), 4)
}

// TestReplayStopsAtFailure: the broker takes two messages and refuses the
// third; the two are deleted, the rest stay.
func TestReplayStopsAtFailure(t *testing.T) {
	t.Parallel()
	e := setup(t)
	ctx := context.Background()
	var msgs []*message.Message
	for i := 0; i < 5; i++ {
		msgs = append(msgs, dead("orders", "c", "e"+strconv.Itoa(i)))
	}
	ids := e.seed(t, msgs...)
	pub := &recorder{fail: func(call int) bool { return call == 3 }}
	n, err := e.store.Replay(ctx, pub, dlq.Filter{All: true}, nil)
	require.Equal(t, 2, n)
	require.ErrorContains(t, err, "broker unavailable")
	require.ErrorContains(t, err, fmt.Sprintf(`dlq: replay entry %d (uuid %s) to "orders"`, ids[2], msgs[2].UUID))
	require.Equal(t, []string{msgs[0].UUID, msgs[1].UUID}, pub.uuids())
	require.Equal(t, ids[2:], e.ids(t))

	// The broker is back: the rest go out, each once.
	pub.fail = nil
	n, err = e.store.Replay(ctx, pub, dlq.Filter{All: true}, nil)
	require.NoError(t, err)
	require.Equal(t, 3, n)
	require.Equal(t, []string{msgs[0].UUID, msgs[1].UUID, msgs[2].UUID, msgs[3].UUID, msgs[4].UUID}, pub.uuids())
	require.Empty(t, e.ids(t))
}

func TestReplayWithoutTopic(t *testing.T) {
	t.Parallel()
	e := setup(t)
	ctx := context.Background()
	noTopic := dead("", "c", "e")
	ids := e.seed(t, dead("orders", "c", "e"), noTopic, dead("orders", "c", "e"))
	pub := &recorder{}
	n, err := e.store.Replay(ctx, pub, dlq.Filter{Consumer: "c"}, nil)
	require.Equal(t, 1, n)
	require.ErrorIs(t, err, dlq.ErrNoTopic)
	require.ErrorContains(t, err, fmt.Sprintf("dlq: replay entry %d (uuid %s): dlq: cannot replay without a topic", ids[1], noTopic.UUID))
	require.Equal(t, ids[1:], e.ids(t))
	require.Len(t, pub.uuids(), 1)
}

func TestReplayAndPurgeNeedASelection(t *testing.T) {
	t.Parallel()
	e := setup(t)
	ctx := context.Background()
	ids := e.seed(t, dead("orders", "c", "e"), dead("orders", "c", "e"), dead("orders", "c", "e"))

	pub := &recorder{}
	_, err := e.store.Replay(ctx, pub, dlq.Filter{}, nil)
	require.ErrorIs(t, err, dlq.ErrNoSelection)
	_, err = e.store.Replay(ctx, pub, dlq.Filter{Limit: 1}, nil)
	require.ErrorIs(t, err, dlq.ErrNoSelection, "a limit alone selects nothing in particular")
	_, err = e.store.Purge(ctx, dlq.Filter{})
	require.ErrorIs(t, err, dlq.ErrNoSelection)
	require.Equal(t, ids, e.ids(t))
	require.Empty(t, pub.uuids())
	_, err = e.store.Replay(ctx, nil, dlq.Filter{All: true}, nil)
	require.ErrorContains(t, err, "publisher is nil")

	n, err := e.store.Replay(ctx, pub, dlq.Filter{All: true, Limit: 1}, nil)
	require.NoError(t, err)
	require.Equal(t, 1, n)
	require.Equal(t, ids[1:], e.ids(t))
	n, err = e.store.Purge(ctx, dlq.Filter{All: true})
	require.NoError(t, err)
	require.Equal(t, 2, n)
	require.Empty(t, e.ids(t))
}

func TestPurge(t *testing.T) {
	t.Parallel()
	e := setup(t)
	ctx := context.Background()
	ids := seedFilterable(t, e)

	n, err := e.store.Purge(ctx, dlq.Filter{IDs: []int64{ids[0], ids[5] + 10}})
	require.NoError(t, err)
	require.Equal(t, 1, n)
	n, err = e.store.Purge(ctx, dlq.Filter{Topic: "refunds"})
	require.NoError(t, err)
	require.Equal(t, 2, n)
	n, err = e.store.Purge(ctx, dlq.Filter{Consumer: "ship", Limit: 1})
	require.NoError(t, err)
	require.Equal(t, 1, n)
	require.Equal(t, []int64{ids[1], ids[5]}, e.ids(t))
	n, err = e.store.Purge(ctx, dlq.Filter{Topic: "payments"})
	require.NoError(t, err)
	require.Zero(t, n)
	require.Equal(t, []int64{ids[1], ids[5]}, e.ids(t))
}

// TestConcurrentReplay runs two replays of every entry at once: each entry
// is published exactly once, by one of them.
func TestConcurrentReplay(t *testing.T) {
	t.Parallel()
	e := setup(t)
	ctx := context.Background()
	const entries = 200
	var msgs []*message.Message
	for i := 0; i < entries; i++ {
		msgs = append(msgs, dead("orders", "c", "e"))
	}
	e.seed(t, msgs...)

	pub := &recorder{}
	var (
		wg     sync.WaitGroup
		counts [2]int
		errs   [2]error
	)
	for i := range counts {
		wg.Add(1)
		go func() {
			defer wg.Done()
			counts[i], errs[i] = e.store.Replay(ctx, pub, dlq.Filter{All: true}, nil)
		}()
	}
	wg.Wait()
	require.NoError(t, errs[0])
	require.NoError(t, errs[1])
	require.Equal(t, entries, counts[0]+counts[1])
	t.Logf("replayed by each: %v", counts)

	got := pub.uuids()
	want := make([]string, entries)
	for i, m := range msgs {
		want[i] = m.UUID
	}
	sort.Strings(got)
	sort.Strings(want)
	require.Equal(t, want, got, "every entry published exactly once")
	require.Empty(t, e.ids(t))
}
