package retry_test

import (
	"context"
	"errors"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/dlq"
	"github.com/oncemill/oncemill/internal/testing/msgtest"
	"github.com/oncemill/oncemill/internal/testing/sqltest"
	"github.com/oncemill/oncemill/retry"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// env is the table of parked messages on one database, with the
// dead-letter table beside it.
type env struct {
	db    sqltest.Database
	store *retry.Store
	dead  *dlq.Publisher
	dlq   *dlq.Store
}

func open(t *testing.T, b sqltest.Backend) env {
	t.Helper()
	db := b.Open(t, 8)
	e := env{db: db}
	var err error
	if db.Pool != nil {
		e.store, err = retry.NewStore(db.Pool, db.Schema)
		require.NoError(t, err)
		e.dead, err = dlq.NewPublisher(db.Pool, db.Schema)
		require.NoError(t, err)
		e.dlq, err = dlq.NewStore(db.Pool, db.Schema)
	} else {
		e.store, err = retry.NewSQLStore(db.DB, db.Dialect, db.Schema)
		require.NoError(t, err)
		e.dead, err = dlq.NewSQLPublisher(db.DB, db.Dialect, db.Schema)
		require.NoError(t, err)
		e.dlq, err = dlq.NewSQLStore(db.DB, db.Dialect, db.Schema)
	}
	require.NoError(t, err)
	return e
}

// parked is a message of consumer on topic as the poison middleware
// parks it after attempts failed attempts, due at due.
func parked(consumer, topic, order string, attempts int, due time.Time) retry.Message {
	uuid := watermill.NewUUID()
	first := time.Date(2026, 3, 1, 10, 0, 0, 0, time.UTC)
	return retry.Message{
		Consumer: consumer, Topic: topic, UUID: uuid, Key: "key-" + uuid, OrderKey: order,
		Attempts: attempts, Error: "gateway 503 for " + uuid, FirstFailedAt: first, LastFailedAt: first.Add(time.Minute),
		DueAt: due, Payload: []byte(`{"order":"` + uuid + `"}`),
		Metadata: map[string]string{delivery.IdempotencyKey: "key-" + uuid, delivery.PartitionKey: order, "trace_id": "t-" + uuid},
	}
}

// behind is a message that waits behind a parked one of its ordering key.
func behind(consumer, topic, order string) retry.Message {
	uuid := watermill.NewUUID()
	return retry.Message{Consumer: consumer, Topic: topic, UUID: uuid, OrderKey: order, Behind: true, DueAt: time.Now(),
		Payload: []byte(uuid), Metadata: map[string]string{delivery.PartitionKey: order}}
}

// park parks ms in order and returns their ids.
func (e env) park(t *testing.T, ms ...retry.Message) []int64 {
	t.Helper()
	ids := make([]int64, len(ms))
	for i, m := range ms {
		wrote, err := e.store.Park(context.Background(), m)
		require.NoError(t, err)
		require.True(t, wrote, "parked %s", m.UUID)
		listed, err := e.store.List(context.Background(), retry.Filter{UUID: m.UUID, Consumer: m.Consumer})
		require.NoError(t, err)
		require.Len(t, listed, 1)
		ids[i] = listed[0].ID
	}
	return ids
}

// ids are the ids of the messages f lists, in the order they go out.
func (e env) ids(t *testing.T, f retry.Filter) []int64 {
	t.Helper()
	ms, err := e.store.List(context.Background(), f)
	require.NoError(t, err)
	out := []int64{}
	for _, m := range ms {
		out = append(out, m.ID)
	}
	return out
}

// gone reports whether the parked message id was deleted.
func (e env) gone(t *testing.T, id int64) bool {
	t.Helper()
	_, err := e.store.Get(context.Background(), id)
	if errors.Is(err, retry.ErrNotFound) {
		return true
	}
	require.NoError(t, err)
	return false
}

// subscribe starts a subscriber of consumer's parked messages of topic,
// closed when the test ends.
func (e env) subscribe(t *testing.T, consumer, topic string) <-chan *message.Message {
	t.Helper()
	sub, err := e.store.Subscriber(retry.SubscriberConfig{Consumer: consumer, PollInterval: 10 * time.Millisecond})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	msgs, err := sub.Subscribe(ctx, topic)
	require.NoError(t, err)
	t.Cleanup(func() {
		cancel()
		require.NoError(t, sub.Close())
	})
	return msgs
}

func receive(t *testing.T, msgs <-chan *message.Message) *message.Message {
	t.Helper()
	return msgtest.Receive(t, msgs, 30*time.Second)
}

// TestStoreOnEveryDatabase: the table of parked messages keeps its
// promises on every database: a message is parked once per consumer,
// topic and UUID; the subscriber hands back, in due order, only what is
// due and first of its ordering key; an ack deletes only the version it
// was handed, a nack puts it back, and a stale lease cannot park it
// again.
func TestStoreOnEveryDatabase(t *testing.T) {
	t.Parallel()
	for _, b := range sqltest.Backends {
		t.Run(b.Name, func(t *testing.T) {
			t.Parallel()
			e := open(t, b)
			ctx := context.Background()
			const consumer, topic = "charge", "orders"
			now := time.Now()

			first := parked(consumer, topic, "acct-1", 5, now.Add(-3*time.Second))
			wrote, err := e.store.Park(ctx, first)
			require.NoError(t, err)
			require.True(t, wrote)
			again := first
			again.Attempts, again.Error = 9, "another copy"
			wrote, err = e.store.Park(ctx, again)
			require.NoError(t, err)
			require.False(t, wrote, "the same message of the same consumer and topic is parked once")
			other := first
			other.Consumer = "ship"
			wrote, err = e.store.Park(ctx, other)
			require.NoError(t, err)
			require.True(t, wrote, "another consumer's copy is its own")
			stored, err := e.store.List(ctx, retry.Filter{Consumer: consumer})
			require.NoError(t, err)
			require.Len(t, stored, 1)
			a := stored[0]
			require.Equal(t, 5, a.Attempts, "the first park's row is kept")
			require.Equal(t, first.Payload, a.Payload)
			require.Equal(t, first.Metadata, a.Metadata)
			require.Equal(t, first.FirstFailedAt, a.FirstFailedAt.UTC())

			for _, tc := range []struct {
				consumer, topic, order string
				want                   bool
			}{{consumer, topic, "acct-1", true}, {consumer, topic, "acct-2", false}, {consumer, "refunds", "acct-1", false}, {"bill", topic, "acct-1", false}} {
				waiting, err := e.store.Waiting(ctx, tc.consumer, tc.topic, tc.order)
				require.NoError(t, err)
				require.Equal(t, tc.want, waiting, tc)
			}

			// b waits behind a, due earlier; c is unordered; d is first
			// of its key and due first; f is not due for an hour.
			ids := e.park(t,
				behind(consumer, topic, "acct-1"),
				parked(consumer, topic, "", 5, now.Add(-2*time.Second)),
				parked(consumer, topic, "acct-2", 6, now.Add(-5*time.Second)),
				parked(consumer, topic, "acct-3", 5, now.Add(time.Hour)),
			)
			b, c, d, f := ids[0], ids[1], ids[2], ids[3]
			require.Equal(t, []int64{d, a.ID, c, b, f}, e.ids(t, retry.Filter{Consumer: consumer}), "listed by due time, then id")
			listed, err := e.store.List(ctx, retry.Filter{IDs: []int64{b}})
			require.NoError(t, err)
			require.Equal(t, a.ID, listed[0].WaitsFor, "b waits for a")
			require.True(t, listed[0].Behind)
			require.False(t, listed[0].Due(time.Now()), "a message behind another is not due, whatever its due time")

			msgs := e.subscribe(t, consumer, topic)
			got := []*message.Message{receive(t, msgs), receive(t, msgs), receive(t, msgs)}
			var order []string
			leases := map[string]retry.Lease{}
			for _, m := range got {
				order = append(order, m.Metadata.Get(delivery.RetryID))
				l, ok := retry.LeaseOf(m.Context())
				require.True(t, ok)
				leases[m.Metadata.Get(delivery.RetryID)] = l
			}
			idText := func(id int64) string { return strconv.FormatInt(id, 10) }
			require.Equal(t, []string{idText(d), idText(a.ID), idText(c)}, order, "the due heads, by due time; b waits behind a, f is not due")
			require.Equal(t, "5", got[1].Metadata.Get(delivery.RetryAttempts))
			require.Equal(t, first.UUID, got[1].UUID)
			require.Equal(t, string(first.Payload), string(got[1].Payload))
			require.Equal(t, "t-"+first.UUID, got[1].Metadata.Get("trace_id"))

			// Out: not due, not retried now, not cancelled.
			out, err := e.store.List(ctx, retry.Filter{IDs: []int64{c}})
			require.NoError(t, err)
			require.True(t, out[0].Out(time.Now()))
			require.False(t, out[0].Due(time.Now()))
			n, err := e.store.RetryNow(ctx, retry.Filter{IDs: []int64{c}})
			require.NoError(t, err)
			require.Zero(t, n, "a message out to its consumer is left alone")
			n, err = e.store.Cancel(ctx, retry.Filter{IDs: []int64{c}}, e.dead, "")
			require.NoError(t, err)
			require.Zero(t, n, "a message out to its consumer is not cancelled")
			require.False(t, e.gone(t, c))

			// d is acked: deleted. c is nacked: back, and out again next.
			// a fails again: parked again for an hour, and its ack then
			// deletes nothing.
			got[0].Ack()
			msgtest.WaitFor(t, "d deleted after its ack", func() bool { return e.gone(t, d) })
			got[2].Nack()
			la := leases[idText(a.ID)]
			kept, err := e.store.Repark(ctx, la, retry.Message{Attempts: 6, Error: "gateway 503 again", LastFailedAt: time.Now(), DueAt: time.Now().Add(time.Hour)})
			require.NoError(t, err)
			require.True(t, kept)
			got[1].Ack()
			// a's ack, of the version it was handed, which the re-park
			// replaced, deletes nothing (the subscriber's runs on its
			// own time; this one now).
			require.NoError(t, retry.AckLease(ctx, e.store, la))

			again2 := receive(t, msgs)
			require.Equal(t, idText(c), again2.Metadata.Get(delivery.RetryID), "the nacked message goes out again; b still waits behind a")
			ra, err := e.store.Get(ctx, a.ID)
			require.NoError(t, err, "the ack of a's old version deleted nothing")
			require.Equal(t, 6, ra.Attempts)
			require.Equal(t, "gateway 503 again", ra.Error)
			require.Nil(t, ra.LeasedUntil)
			require.Equal(t, first.FirstFailedAt, ra.FirstFailedAt.UTC(), "the first failure is kept")
			kept, err = e.store.Repark(ctx, la, retry.Message{Attempts: 7, DueAt: time.Now()})
			require.NoError(t, err)
			require.False(t, kept, "a stale lease parks nothing")
			again2.Ack()
			msgtest.WaitFor(t, "c deleted after its ack", func() bool { return e.gone(t, c) })

			// f, due in an hour, retried now: it goes out next. b is due
			// already (it waits for a), and is left alone.
			n, err = e.store.RetryNow(ctx, retry.Filter{IDs: []int64{f, b}})
			require.NoError(t, err)
			require.Equal(t, 1, n, "f made due; b was due already")
			mf := receive(t, msgs)
			require.Equal(t, idText(f), mf.Metadata.Get(delivery.RetryID))
			mf.Ack()
			msgtest.WaitFor(t, "f deleted after its ack", func() bool { return e.gone(t, f) })

			// a cancelled: one dead letter, and b, behind it, goes out.
			n, err = e.store.Cancel(ctx, retry.Filter{IDs: []int64{a.ID}}, e.dead, "")
			require.NoError(t, err)
			require.Equal(t, 1, n)
			require.True(t, e.gone(t, a.ID))
			mb := receive(t, msgs)
			require.Equal(t, idText(b), mb.Metadata.Get(delivery.RetryID), "the message behind a cancelled one is handed back next")
			mb.Ack()
			msgtest.WaitFor(t, "b deleted after its ack", func() bool { return e.gone(t, b) })
			require.Empty(t, e.ids(t, retry.Filter{Consumer: consumer}))
			require.Equal(t, []int64{}, e.ids(t, retry.Filter{Consumer: consumer}))

			entries, err := e.dlq.List(ctx, dlq.Filter{Consumer: consumer})
			require.NoError(t, err)
			require.Len(t, entries, 1)
			dead := entries[0]
			require.Equal(t, first.UUID, dead.UUID)
			require.Equal(t, topic, dead.Topic)
			require.Equal(t, dlq.DefaultTopic, dead.DLQTopic)
			require.Equal(t, first.Key, dead.Key)
			require.Equal(t, 6, dead.Attempts)
			require.Equal(t, retry.CancelReason+" while parked for a delayed retry after 6 failed attempts; last error: gateway 503 again", dead.Error)
			require.Equal(t, first.FirstFailedAt, dead.FirstFailedAt.UTC())
			require.Equal(t, first.Payload, dead.Payload)
			require.Equal(t, "t-"+first.UUID, dead.Metadata["trace_id"])
			require.Equal(t, "key-"+first.UUID, dead.Metadata[delivery.IdempotencyKey])
		})
	}
}

// TestOperatorsOnEveryDatabase: List filters and limits in the order
// messages go out; RetryNow and Cancel refuse an empty selection; a
// cancel that fails leaves every message parked and no dead letter;
// cancels at once move each message into the dead-letter table exactly
// once; Counts counts what is parked, due and overdue, the messages
// behind another and those out left out of due.
func TestOperatorsOnEveryDatabase(t *testing.T) {
	t.Parallel()
	for _, b := range sqltest.Backends {
		t.Run(b.Name, func(t *testing.T) {
			t.Parallel()
			e := open(t, b)
			ctx := context.Background()
			now := time.Now()
			ids := e.park(t,
				parked("charge", "orders", "acct-1", 5, now.Add(-2*time.Minute)),  // overdue
				behind("charge", "orders", "acct-1"),                              // waits: neither due nor overdue
				parked("charge", "orders", "acct-2", 5, now.Add(-10*time.Second)), // due
				parked("charge", "orders", "", 5, now.Add(time.Hour)),             // not due
				parked("charge", "refunds", "acct-1", 5, now.Add(-5*time.Minute)), // overdue: another topic's key
				parked("ship", "orders", "acct-1", 5, now.Add(-3*time.Minute)),    // overdue: another consumer's key
			)

			counts, err := e.store.Counts(ctx, retry.DefaultOverdue)
			require.NoError(t, err)
			require.Len(t, counts, 3)
			type c struct{ parked, due, overdue int64 }
			byPair := map[string]c{}
			for _, n := range counts {
				byPair[n.Consumer+"/"+n.Topic] = c{n.Parked, n.Due, n.Overdue}
			}
			require.Equal(t, map[string]c{"charge/orders": {4, 2, 1}, "charge/refunds": {1, 1, 1}, "ship/orders": {1, 1, 1}}, byPair)
			listed, err := e.store.List(ctx, retry.Filter{Consumer: "charge", Topic: "orders"})
			require.NoError(t, err)
			var due, overdue []int64
			for _, m := range listed {
				if m.Due(time.Now()) {
					due = append(due, m.ID)
				}
				if m.Overdue(time.Now(), retry.DefaultOverdue) {
					overdue = append(overdue, m.ID)
				}
			}
			require.Equal(t, []int64{ids[0], ids[2]}, due, "Message.Due agrees with Counts")
			require.Equal(t, []int64{ids[0]}, overdue)

			for _, tc := range []struct {
				f    retry.Filter
				want []int64
			}{
				{retry.Filter{}, []int64{ids[4], ids[5], ids[0], ids[2], ids[1], ids[3]}},
				{retry.Filter{Consumer: "charge"}, []int64{ids[4], ids[0], ids[2], ids[1], ids[3]}},
				{retry.Filter{Topic: "refunds"}, []int64{ids[4]}},
				{retry.Filter{OrderKey: "acct-1", Consumer: "charge", Topic: "orders"}, []int64{ids[0], ids[1]}},
				{retry.Filter{IDs: []int64{ids[3], ids[1], 999999999}}, []int64{ids[1], ids[3]}},
				{retry.Filter{Consumer: "charge", Limit: 2}, []int64{ids[4], ids[0]}},
			} {
				require.Equal(t, tc.want, e.ids(t, tc.f), "%+v", tc.f)
			}
			listed, err = e.store.List(ctx, retry.Filter{IDs: []int64{ids[2]}})
			require.NoError(t, err)
			require.Equal(t, []int64{ids[2]}, e.ids(t, retry.Filter{UUID: listed[0].UUID}))
			require.Equal(t, []int64{ids[2]}, e.ids(t, retry.Filter{Key: listed[0].Key}))
			for _, tc := range []struct {
				f    retry.Filter
				want int
			}{{retry.Filter{}, len(ids)}, {retry.Filter{Consumer: "charge"}, 5}, {retry.Filter{Consumer: "charge", Limit: 2}, 2}, {retry.Filter{Topic: "none"}, 0}} {
				n, err := e.store.Count(ctx, tc.f)
				require.NoError(t, err)
				require.Equal(t, tc.want, n, "%+v", tc.f)
			}
			missing, err := e.store.Missing(ctx, []int64{ids[2], 999999999, 999999998, 999999999})
			require.NoError(t, err)
			require.Equal(t, []int64{999999998, 999999999}, missing)

			_, err = e.store.List(ctx, retry.Filter{Limit: -1})
			require.ErrorIs(t, err, retry.ErrInvalidFilter)
			_, err = e.store.RetryNow(ctx, retry.Filter{Limit: 3})
			require.ErrorIs(t, err, retry.ErrNoSelection)
			_, err = e.store.Cancel(ctx, retry.Filter{}, e.dead, "")
			require.ErrorIs(t, err, retry.ErrNoSelection)
			_, err = e.store.Cancel(ctx, retry.Filter{IDs: []int64{0}}, e.dead, "")
			require.ErrorIs(t, err, retry.ErrInvalidFilter)

			// RetryNow with All: everything not due yet is due now.
			n, err := e.store.RetryNow(ctx, retry.Filter{All: true})
			require.NoError(t, err)
			require.Equal(t, 1, n, "only the message due in an hour moves")
			m, err := e.store.Get(ctx, ids[3])
			require.NoError(t, err)
			require.False(t, m.DueAt.After(time.Now()), "due now")

			// A publisher that writes the dead letters, then fails: the
			// transaction rolls back, the rows and no dead letter stay.
			failing := failingPublisher{next: e.dead}
			n, err = e.store.Cancel(ctx, retry.Filter{Consumer: "charge", Topic: "orders"}, failing, "orders.dlq")
			require.ErrorContains(t, err, "broker said no")
			require.Zero(t, n)
			require.Len(t, e.ids(t, retry.Filter{Consumer: "charge", Topic: "orders"}), 4)
			entries, err := e.dlq.List(ctx, dlq.Filter{})
			require.NoError(t, err)
			require.Empty(t, entries, "the dead letters were written in the cancel's transaction, and rolled back with it")

			// Three cancels of the same messages at once: each message
			// lands in the dead-letter table once.
			const cancellers = 3
			var (
				wg    sync.WaitGroup
				moved [cancellers]int
				errs  [cancellers]error
			)
			for i := range cancellers {
				wg.Add(1)
				go func() {
					defer wg.Done()
					moved[i], errs[i] = e.store.Cancel(ctx, retry.Filter{All: true}, e.dead, "")
				}()
			}
			wg.Wait()
			total := 0
			for i := range cancellers {
				require.NoError(t, errs[i])
				total += moved[i]
			}
			require.Equal(t, len(ids), total, "each message moved by one of the cancels")
			require.Empty(t, e.ids(t, retry.Filter{}))
			entries, err = e.dlq.List(ctx, dlq.Filter{})
			require.NoError(t, err)
			require.Len(t, entries, len(ids), "one dead letter each")
			seen := map[string]int{}
			for _, en := range entries {
				seen[en.Consumer+"/"+en.Topic+"/"+en.UUID]++
				require.True(t, strings.HasPrefix(en.Error, retry.CancelReason), en.Error)
			}
			require.Len(t, seen, len(ids))
			behindEntries, err := e.dlq.List(ctx, dlq.Filter{ErrorContains: "waited behind"})
			require.NoError(t, err)
			require.Len(t, behindEntries, 1, "the message behind another says so")
			require.Empty(t, behindEntries[0].Key)
			require.True(t, behindEntries[0].FirstFailedAt.IsZero(), "it never failed")

			counts, err = e.store.Counts(ctx, retry.DefaultOverdue)
			require.NoError(t, err)
			require.Empty(t, counts)
		})
	}
}

// failingPublisher publishes through next, then fails.
type failingPublisher struct{ next message.Publisher }

func (p failingPublisher) Publish(topic string, msgs ...*message.Message) error {
	if err := p.next.Publish(topic, msgs...); err != nil {
		return err
	}
	return errors.New("broker said no")
}

func (p failingPublisher) Close() error { return nil }

// TestCancelNeedsATopic: a publisher that names no topic of its own needs
// one, and a nil publisher is refused, before anything is touched.
func TestCancelNeedsATopic(t *testing.T) {
	t.Parallel()
	e := open(t, sqltest.Backends[len(sqltest.Backends)-1])
	ids := e.park(t, parked("charge", "orders", "", 1, time.Now()))
	_, err := e.store.Cancel(context.Background(), retry.Filter{All: true}, failingPublisher{}, "")
	require.ErrorContains(t, err, "the dead-letter topic is empty")
	_, err = e.store.Cancel(context.Background(), retry.Filter{All: true}, nil, "dlq")
	require.ErrorContains(t, err, "the dead-letter publisher is nil")
	require.Equal(t, ids, e.ids(t, retry.Filter{}))
}
