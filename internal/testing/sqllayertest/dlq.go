package sqllayertest

import (
	"errors"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/dedup"
	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/dlq"
	"github.com/oncemill/oncemill/middleware"
)

// order is an order message whose idempotency key is key.
func order(key string) *message.Message {
	m := message.NewMessage(watermill.NewUUID(), []byte(`{"order":"`+key+`"}`))
	m.Metadata.Set(delivery.IdempotencyKey, key)
	m.Metadata.Set(delivery.PartitionKey, key)
	return m
}

// dead is a message as the poison middleware dead-letters it: the
// original's metadata plus the delivery.Dead* keys.
func dead(topic, consumer, errText string) *message.Message {
	m := message.NewMessage(watermill.NewUUID(), []byte(`{"from":"`+topic+`"}`))
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

// count is how many entries f selects.
func (e *env) count(store *dlq.Store, f dlq.Filter) int {
	e.t.Helper()
	n, err := store.Count(e.ctx(), f)
	require.NoError(e.t, err)
	return n
}

// list is the entries f selects.
func (e *env) list(store *dlq.Store, f dlq.Filter) []dlq.Entry {
	e.t.Helper()
	entries, err := store.List(e.ctx(), f)
	require.NoError(e.t, err)
	return entries
}

func uuidsOf(entries []dlq.Entry) []string {
	out := []string{}
	for _, en := range entries {
		out = append(out, en.UUID)
	}
	return out
}

// refuse is a handler's failure that no retry mends.
var refuse = middleware.Permanent(errors.New("ledger refuses the order"))

// deadLettered runs a consumer "charge" on orders whose handler fails
// permanently while broken, sends it the order key, and waits until the
// order is dead-lettered and its key dead. It returns the consumer, the
// order and its entry.
func (e *env) deadLettered(broken *atomic.Bool, sub message.Subscriber, pub message.Publisher, key string) (*consumer, *message.Message, dlq.Entry) {
	e.t.Helper()
	c := e.newConsumer("charge", func(string) error {
		if broken.Load() {
			return refuse
		}
		return nil
	})
	c.run("orders", sub)
	msg := order(key)
	require.NoError(e.t, pub.Publish("orders", msg))
	store := e.dlqStore()
	e.eventually("the order dead-lettered and its key dead", func() bool {
		return e.count(store, dlq.Filter{}) == 1 && e.state(c.store, c.key(key)) == dedup.StateDead
	})
	entries := e.list(store, dlq.Filter{})
	require.Len(e.t, entries, 1)
	return c, msg, entries[0]
}

// copyCounted sends a copy of msg, as a broker redelivers it, and waits
// until the inbox counted it on the dead key of entry.
func (e *env) copyCounted(pub message.Publisher, msg *message.Message, entry dlq.Entry, want int) {
	e.t.Helper()
	require.NoError(e.t, pub.Publish("orders", msg.Copy()))
	store := e.dlqStore()
	e.eventually("the copy counted on the dead key", func() bool {
		n, ok, err := store.CopiesSince(e.ctx(), entry)
		require.NoError(e.t, err)
		return ok && n == want
	})
}

// deadLetterOnce: a message the handler refuses is dead-lettered once,
// with its key dead in the inbox; a copy of it is acked without running,
// and the same message dead-lettered again (its ack lost) is no second
// entry.
func deadLetterOnce(t *testing.T, e *env) {
	broker := e.broker(false)
	var broken atomic.Bool
	broken.Store(true)
	c, msg, en := e.deadLettered(&broken, broker, broker, "pay-1")
	require.Equal(t, msg.UUID, en.UUID)
	require.Equal(t, "orders", en.Topic)
	require.Equal(t, "charge", en.Consumer)
	require.Equal(t, "pay-1", en.Key)
	require.True(t, en.Permanent)
	require.Contains(t, en.Error, "ledger refuses the order")
	require.Equal(t, []byte(msg.Payload), en.Payload)
	require.Equal(t, 1, c.callsOf("pay-1"), "a permanent failure is not retried")

	e.copyCounted(broker, msg, en, 1)
	require.Equal(t, 1, c.callsOf("pay-1"), "a copy of a dead key does not run")

	// The poison middleware's dead letter once more, as after a lost ack.
	again := en.Message("")
	for k, v := range en.Metadata {
		again.Metadata.Set(k, v)
	}
	pub := e.dlqPublisher()
	require.NoError(t, pub.Publish("dlq", again))
	require.NoError(t, pub.Publish("dlq", again.Copy(), again.Copy()))
	store := e.dlqStore()
	require.Equal(t, 1, e.count(store, dlq.Filter{}), "one entry per message and consumer")
	require.Zero(t, c.effectsOf("pay-1"))
}

// listCountGet: the store lists entries in id order, counts and filters
// them, shows one with every field, and says when there is none.
func listCountGet(t *testing.T, e *env) {
	pub, store := e.dlqPublisher(), e.dlqStore()
	a := dead("orders", "charge", "card declined")
	b := dead("orders", "charge", "Gateway TIMEOUT")
	c := dead("refunds", "ship", "address unknown")
	for _, m := range []*message.Message{a, b, c} {
		require.NoError(t, pub.Publish("orders.dlq", m))
	}
	all := e.list(store, dlq.Filter{})
	require.Equal(t, []string{a.UUID, b.UUID, c.UUID}, uuidsOf(all), "in the order they were written")
	require.True(t, slices.IsSortedFunc(all, func(x, y dlq.Entry) int { return int(x.ID - y.ID) }))
	require.Equal(t, 3, e.count(store, dlq.Filter{}))
	require.Equal(t, 2, e.count(store, dlq.Filter{Consumer: "charge"}))
	require.Equal(t, []string{c.UUID}, uuidsOf(e.list(store, dlq.Filter{Topic: "refunds"})))
	require.Equal(t, []string{b.UUID}, uuidsOf(e.list(store, dlq.Filter{ErrorContains: "timeout"})), "the error, ignoring case")
	require.Equal(t, []string{a.UUID, b.UUID}, uuidsOf(e.list(store, dlq.Filter{Limit: 2})))
	require.Equal(t, []string{c.UUID}, uuidsOf(e.list(store, dlq.Filter{IDs: []int64{all[2].ID}})))
	require.Equal(t, 1, e.count(store, dlq.Filter{Consumer: "charge", ErrorContains: "card"}))
	require.Zero(t, e.count(store, dlq.Filter{Since: time.Now().Add(time.Hour)}), "none dead-lettered in the future")

	en, err := store.Get(e.ctx(), all[0].ID)
	require.NoError(t, err)
	require.Equal(t, a.UUID, en.UUID)
	require.Equal(t, "orders", en.Topic)
	require.Equal(t, "orders.dlq", en.DLQTopic)
	require.Equal(t, "charge", en.Consumer)
	require.Equal(t, "key-"+a.UUID, en.Key)
	require.Equal(t, 5, en.Attempts)
	require.Equal(t, "card declined", en.Error)
	require.False(t, en.Permanent)
	require.Equal(t, []byte(a.Payload), en.Payload)
	require.Equal(t, "tr-1", en.Metadata["trace_id"])
	require.True(t, time.Date(2026, 3, 1, 10, 0, 0, 123456000, time.UTC).Equal(en.FirstFailedAt), "first failed at %s", en.FirstFailedAt)
	require.True(t, time.Date(2026, 3, 1, 10, 5, 0, 0, time.UTC).Equal(en.LastFailedAt), "last failed at %s", en.LastFailedAt)
	require.WithinDuration(t, time.Now(), en.DeadAt, time.Hour, "written now")

	_, err = store.Get(e.ctx(), all[2].ID+1000)
	require.ErrorIs(t, err, dlq.ErrNotFound)

	counts, err := store.Counts(e.ctx())
	require.NoError(t, err)
	require.Len(t, counts, 2)
	require.Equal(t, []string{"charge/orders/2", "ship/refunds/1"}, []string{
		counts[0].Consumer + "/" + counts[0].Topic + "/" + itoa(counts[0].Entries),
		counts[1].Consumer + "/" + counts[1].Topic + "/" + itoa(counts[1].Entries),
	})
}

// replayOnce: a replay to the topic writes a grant on the dead key, the
// consumer's inbox reopens the key for that copy only, applies it once,
// and the entry is gone; a copy without the grant does not run.
func replayOnce(t *testing.T, e *env) {
	broker := e.broker(false)
	var broken atomic.Bool
	broken.Store(true)
	c, msg, en := e.deadLettered(&broken, broker, broker, "pay-1")
	broken.Store(false)
	e.copyCounted(broker, msg, en, 1)
	require.Equal(t, 1, c.callsOf("pay-1"), "a copy without a grant does not reopen the key")
	require.Equal(t, dedup.StateDead, e.state(c.store, c.key("pay-1")))

	store := e.dlqStore()
	n, err := store.Replay(e.ctx(), broker, dlq.Filter{IDs: []int64{en.ID}}, nil)
	require.NoError(t, err)
	require.Equal(t, 1, n)
	// The grant reopened the key and the replay completed it.
	e.eventually("the replay applied and its key done", func() bool {
		return c.effectsOf("pay-1") == 1 && e.state(c.store, c.key("pay-1")) == dedup.StateDone
	})
	require.Zero(t, e.count(store, dlq.Filter{}), "the replayed entry is gone")

	n, err = store.Replay(e.ctx(), broker, dlq.Filter{IDs: []int64{en.ID}}, nil)
	require.NoError(t, err)
	require.Zero(t, n, "nothing is left to replay")
	require.NoError(t, broker.Publish("orders", msg.Copy()))
	time.Sleep(200 * time.Millisecond)
	require.Equal(t, 1, c.effectsOf("pay-1"), "applied once")
	require.Equal(t, 2, c.callsOf("pay-1"), "the failure and the replay")
}

// requestReplay: a replay requested for the consumer is delivered by its
// ReplaySubscriber, merged into its subscription, once; it is applied
// once and the entry is deleted once acked.
func requestReplay(t *testing.T, e *env) {
	broker := e.broker(false)
	replays := e.replaySubscriber("charge")
	var broken atomic.Bool
	broken.Store(true)
	c, _, en := e.deadLettered(&broken, dlq.WithReplays(broker, replays), broker, "pay-1")
	broken.Store(false)

	store := e.dlqStore()
	n, err := store.RequestReplay(e.ctx(), dlq.Filter{Consumer: "charge"})
	require.NoError(t, err)
	require.Equal(t, 1, n)
	n, err = store.RequestReplay(e.ctx(), dlq.Filter{IDs: []int64{en.ID}})
	require.NoError(t, err)
	require.Zero(t, n, "already requested")

	e.eventually("the requested replay applied and its entry deleted", func() bool {
		return c.effectsOf("pay-1") == 1 && e.count(store, dlq.Filter{}) == 0
	})
	require.Equal(t, dedup.StateDone, e.state(c.store, c.key("pay-1")))
	time.Sleep(200 * time.Millisecond)
	require.Equal(t, 1, c.effectsOf("pay-1"), "delivered once")
	require.Equal(t, 2, c.callsOf("pay-1"), "the failure and the replay")
}

// purge: purging every entry must be asked for; a selection deletes what
// it selects and nothing else.
func purge(t *testing.T, e *env) {
	pub, store := e.dlqPublisher(), e.dlqStore()
	a, b, c := dead("orders", "charge", "one"), dead("orders", "charge", "two"), dead("refunds", "ship", "three")
	require.NoError(t, pub.Publish("orders.dlq", a, b, c))
	all := e.list(store, dlq.Filter{})
	require.Len(t, all, 3)

	_, err := store.Purge(e.ctx(), dlq.Filter{})
	require.ErrorIs(t, err, dlq.ErrNoSelection)
	require.Equal(t, 3, e.count(store, dlq.Filter{}), "an empty filter purges nothing")

	n, err := store.Purge(e.ctx(), dlq.Filter{IDs: []int64{all[0].ID}})
	require.NoError(t, err)
	require.Equal(t, 1, n)
	require.Equal(t, []string{b.UUID, c.UUID}, uuidsOf(e.list(store, dlq.Filter{})))
	n, err = store.Purge(e.ctx(), dlq.Filter{Consumer: "ship"})
	require.NoError(t, err)
	require.Equal(t, 1, n)
	require.Equal(t, []string{b.UUID}, uuidsOf(e.list(store, dlq.Filter{})))
	n, err = store.Purge(e.ctx(), dlq.Filter{IDs: []int64{all[0].ID}})
	require.NoError(t, err)
	require.Zero(t, n, "a purged entry is gone")
	n, err = store.Purge(e.ctx(), dlq.Filter{All: true})
	require.NoError(t, err)
	require.Equal(t, 1, n)
	require.Zero(t, e.count(store, dlq.Filter{}))
}
