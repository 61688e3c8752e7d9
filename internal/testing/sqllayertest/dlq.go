package sqllayertest

import (
	"context"
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

// reopen: a reopened dead key lets its next copy run once, whatever its
// payload (the producer's corrected message, under a new UUID), and the
// entry is gone; the copy after it is a duplicate. An entry with no key,
// or whose key is no longer dead, is refused and stays.
func reopen(t *testing.T, e *env) {
	broker := e.broker(false)
	var broken atomic.Bool
	broken.Store(true)
	c, msg, en := e.deadLettered(&broken, broker, broker, "pay-1")
	broken.Store(false)
	store := e.dlqStore()

	got, err := store.Reopen(e.ctx(), en.ID)
	require.NoError(t, err)
	require.Equal(t, en.UUID, got.UUID)
	require.Zero(t, e.count(store, dlq.Filter{}), "the reopened entry is gone")
	require.Equal(t, dedup.StateNew, e.state(c.store, c.key("pay-1")), "the key is claimable again")

	corrected := order("pay-1")
	corrected.Payload = []byte(`{"order":"pay-1","amount":"12.50"}`)
	require.NotEqual(t, msg.UUID, corrected.UUID)
	require.NoError(t, broker.Publish("orders", corrected))
	e.eventually("the corrected copy applied and its key done", func() bool {
		return c.effectsOf("pay-1") == 1 && e.state(c.store, c.key("pay-1")) == dedup.StateDone
	})
	require.Equal(t, string(corrected.Payload), c.appliedOf("pay-1"), "the corrected payload ran")

	again := order("pay-1")
	again.Payload = []byte(`{"order":"pay-1","amount":"99.00"}`)
	require.NoError(t, broker.Publish("orders", again, msg.Copy()))
	time.Sleep(200 * time.Millisecond)
	require.Equal(t, 1, c.effectsOf("pay-1"), "the copies after it are duplicates")
	require.Equal(t, string(corrected.Payload), c.appliedOf("pay-1"))
	require.Zero(t, e.count(store, dlq.Filter{}), "no new entry")

	_, err = store.Reopen(e.ctx(), en.ID)
	require.ErrorIs(t, err, dlq.ErrNotFound)

	// An entry without a key, and one whose key has no dead record.
	pub := e.dlqPublisher()
	nokey := dead("orders", "charge", "no key")
	nokey.Metadata.Set(delivery.DeadKey, "")
	live := dead("orders", "charge", "handled since")
	require.NoError(t, pub.Publish("orders.dlq", nokey, live))
	entries := e.list(store, dlq.Filter{})
	require.Len(t, entries, 2)
	_, err = store.Reopen(e.ctx(), entries[0].ID)
	require.ErrorIs(t, err, dlq.ErrNoKey)
	_, err = store.Reopen(e.ctx(), entries[1].ID)
	require.ErrorIs(t, err, dlq.ErrNoDeadKey)
	require.ErrorContains(t, err, `consumer "charge" key "key-`+live.UUID+`" is not dead`)
	require.Equal(t, 2, e.count(store, dlq.Filter{}), "refused entries stay")
}

// replayLineage: a replayed message that dies again says, in its new
// entry, which entry it came from; a first death says nothing. An entry
// whose replay would die again says why.
func replayLineage(t *testing.T, e *env) {
	broker := e.broker(false)
	var broken atomic.Bool
	broken.Store(true)
	_, _, first := e.deadLettered(&broken, broker, broker, "pay-1")
	_, ok := first.ReplayedFrom()
	require.False(t, ok, "a first death was replayed from nothing")
	require.Contains(t, first.Hopeless(), "permanent", "a permanent error's replay fails the same way")

	store := e.dlqStore()
	n, err := store.Replay(e.ctx(), broker, dlq.Filter{IDs: []int64{first.ID}}, nil)
	require.NoError(t, err)
	require.Equal(t, 1, n)
	var again dlq.Entry
	e.eventually("the replay dead-lettered again", func() bool {
		entries := e.list(store, dlq.Filter{})
		if len(entries) != 1 {
			return false
		}
		again = entries[0]
		return true
	})
	require.NotEqual(t, first.ID, again.ID)
	from, ok := again.ReplayedFrom()
	require.True(t, ok, "the new entry says where it came from")
	require.Equal(t, first.ID, from)

	nokey := dead("orders", "charge", "no key")
	nokey.Metadata.Set(delivery.DeadKey, "")
	nokey.Metadata.Set(delivery.DeadPermanent, "false")
	require.NoError(t, e.dlqPublisher().Publish("orders.dlq", nokey))
	en := e.list(store, dlq.Filter{ErrorContains: "no key"})
	require.Len(t, en, 1)
	require.Contains(t, en[0].Hopeless(), "no key")
	transient := dead("orders", "charge", "timeout")
	require.NoError(t, e.dlqPublisher().Publish("orders.dlq", transient))
	en = e.list(store, dlq.Filter{ErrorContains: "timeout"})
	require.Len(t, en, 1)
	require.Empty(t, en[0].Hopeless(), "a transient failure may succeed")
}

// replayerBeat: a running replay subscriber announces its consumer, and
// a consumer whose subscriber stopped beating counts as having none; the
// requested replays that nobody delivered are counted.
func replayerBeat(t *testing.T, e *env) {
	store := e.dlqStore()
	_, ok, err := store.Replayer(e.ctx(), "charge")
	require.NoError(t, err)
	require.False(t, ok, "no subscriber ever ran")

	const beat = 100 * time.Millisecond
	r := e.replaySubscriberBeating("charge", beat)
	ctx, cancel := context.WithCancel(e.ctx())
	_, err = r.Subscribe(ctx, "orders")
	require.NoError(t, err)
	var p dlq.Replayer
	e.eventually("the subscriber announced", func() bool {
		p, ok, err = store.Replayer(e.ctx(), "charge")
		require.NoError(t, err)
		return ok && p.Alive
	})
	require.Equal(t, "charge", p.Consumer)
	require.Equal(t, beat, p.BeatEvery)
	all, err := store.Replayers(e.ctx())
	require.NoError(t, err)
	require.Len(t, all, 1)
	cancel()
	e.eventually("the stopped subscriber counts as gone", func() bool {
		p, ok, err = store.Replayer(e.ctx(), "charge")
		require.NoError(t, err)
		return ok && !p.Alive
	})
	require.WithinDuration(t, time.Now(), p.SeenAt, time.Minute)
	require.ErrorIs(t, dlq.NoReplayerError("charge", p, ok), dlq.ErrNoReplayer)

	pub := e.dlqPublisher()
	a, b := dead("orders", "charge", "one"), dead("orders", "charge", "two")
	require.NoError(t, pub.Publish("orders.dlq", a, b, dead("refunds", "ship", "three")))
	pending, err := store.PendingReplays(e.ctx())
	require.NoError(t, err)
	require.Empty(t, pending)
	n, err := store.RequestReplay(e.ctx(), dlq.Filter{Consumer: "charge"})
	require.NoError(t, err)
	require.Equal(t, 2, n)
	pending, err = store.PendingReplays(e.ctx())
	require.NoError(t, err)
	require.Len(t, pending, 1)
	require.Equal(t, "charge", pending[0].Consumer)
	require.Equal(t, "orders", pending[0].Topic)
	require.Equal(t, 2, pending[0].Entries)
	require.WithinDuration(t, time.Now(), pending[0].Since, time.Minute)
}
