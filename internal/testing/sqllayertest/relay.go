package sqllayertest

import (
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/dlq"
	"github.com/oncemill/oncemill/forwarder"
)

// event is the seq-th event of partition key key, its idempotency key
// naming both.
func event(key string, seq int) *message.Message {
	m := message.NewMessage(watermill.NewUUID(), []byte(key+"#"+strconv.Itoa(seq)))
	m.Metadata.Set(delivery.PartitionKey, key)
	m.Metadata.Set(delivery.IdempotencyKey, key+"#"+strconv.Itoa(seq))
	m.Metadata.Set("seq", strconv.Itoa(seq))
	return m
}

// received is what one subscriber of a topic received, read and acked in
// one goroutine, in the order it received them.
type received struct {
	mu   sync.Mutex
	msgs []*message.Message
}

// receive subscribes to topic on sub until the subtest ends.
func (e *env) receive(sub message.Subscriber, topic string) *received {
	e.t.Helper()
	ch, err := sub.Subscribe(e.ctx(), topic)
	require.NoError(e.t, err)
	r := &received{}
	go func() {
		for m := range ch {
			r.mu.Lock()
			r.msgs = append(r.msgs, m)
			r.mu.Unlock()
			m.Ack()
		}
	}()
	return r
}

// all returns what was received so far.
func (r *received) all() []*message.Message {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]*message.Message(nil), r.msgs...)
}

// wait waits until n messages were received, then a little longer, and
// requires that no more came: it returns them.
func (r *received) wait(e *env, n int) []*message.Message {
	e.t.Helper()
	e.eventually(fmt.Sprintf("%d messages", n), func() bool { return len(r.all()) >= n })
	time.Sleep(100 * time.Millisecond)
	got := r.all()
	require.Len(e.t, got, n, "no message is received twice")
	return got
}

// relayOnceInOrder: rows of several keys, written over several
// transactions, go out in batches of at most BatchSize, every row once,
// each key's rows in the order they were written, with their UUID,
// payload and metadata; the relay deletes them.
func relayOnceInOrder(t *testing.T, e *env) {
	broker := e.broker(true)
	got := e.receive(broker, "orders")
	const keys, perKey, batchSize = 4, 5, 3
	var written []*message.Message
	for seq := 1; seq <= perKey; seq++ {
		var tx []*message.Message
		for k := range keys {
			tx = append(tx, event("key-"+strconv.Itoa(k), seq))
		}
		e.write("orders", tx...)
		written = append(written, tx...)
	}
	require.Equal(t, len(written), e.lag().Pending, "every row waits in the outbox")

	r := e.relay(broker, func(c *forwarder.RelayConfig) { c.BatchSize = batchSize })
	batches := e.relayAll(r, len(written), batchSize)
	require.GreaterOrEqual(t, batches, (len(written)+batchSize-1)/batchSize)

	msgs := got.wait(e, len(written))
	byUUID := map[string]*message.Message{}
	for _, m := range written {
		byUUID[m.UUID] = m
	}
	order := map[string][]int{}
	for _, m := range msgs {
		w, ok := byUUID[m.UUID]
		require.True(t, ok, "%s was written", m.UUID)
		delete(byUUID, m.UUID)
		require.Equal(t, string(w.Payload), string(m.Payload), "the payload is kept")
		for _, k := range []string{delivery.PartitionKey, delivery.IdempotencyKey, "seq"} {
			require.Equal(t, w.Metadata.Get(k), m.Metadata.Get(k), "metadata %s is kept", k)
		}
		seq, err := strconv.Atoi(m.Metadata.Get("seq"))
		require.NoError(t, err)
		key := m.Metadata.Get(delivery.PartitionKey)
		order[key] = append(order[key], seq)
	}
	require.Empty(t, byUUID, "every row was published")
	for k := range keys {
		require.Equal(t, []int{1, 2, 3, 4, 5}, order["key-"+strconv.Itoa(k)], "key-%d's rows in the order they were written", k)
	}

	require.Zero(t, e.lag().Pending, "the published rows are deleted")
	n, err := r.RelayBatch(e.ctx())
	require.NoError(t, err)
	require.Zero(t, n, "nothing is left to publish")
	require.Len(t, got.all(), len(written), "nothing is published again")
}

// topicChecker is a broker that refuses the topics under "refused.", as a
// broker's naming rules refuse some (forwarder.TopicValidator).
type topicChecker struct{ *gochannel.GoChannel }

var errTopicRefused = errors.New("no topic under refused. here")

func (topicChecker) ValidateTopic(topic string) error {
	if strings.HasPrefix(topic, "refused.") {
		return errTopicRefused
	}
	return nil
}

// refusedRowDeadLettered: a row whose topic the broker refuses is
// dead-lettered once, as a permanent failure of the relay, and never
// published; the rows of its key behind it go on.
func refusedRowDeadLettered(t *testing.T, e *env) {
	broker := e.broker(true)
	good := e.receive(broker, "orders")
	bad := e.receive(broker, "refused.orders")
	first, refused, second := event("k", 1), event("k", 2), event("k", 3)
	e.write("orders", first)
	e.write("refused.orders", refused)
	e.write("orders", second)

	r := e.relay(topicChecker{broker}, nil)
	e.relayAll(r, 2, 0)
	e.eventually("the refused row to leave the outbox", func() bool {
		_, err := r.RelayBatch(e.ctx())
		require.NoError(t, err)
		return e.lag().Pending == 0
	})
	msgs := good.wait(e, 2)
	require.Equal(t, []string{first.UUID, second.UUID}, []string{msgs[0].UUID, msgs[1].UUID}, "the rows behind the refused one go on, in order")
	require.Empty(t, bad.all(), "the refused row is not published")

	store := e.dlqStore()
	entries, err := store.List(e.ctx(), dlq.Filter{})
	require.NoError(t, err)
	require.Len(t, entries, 1, "the refused row is dead-lettered")
	en := entries[0]
	require.Equal(t, refused.UUID, en.UUID)
	require.Equal(t, "refused.orders", en.Topic)
	require.Equal(t, []byte(refused.Payload), en.Payload)
	require.True(t, strings.HasPrefix(en.Consumer, "relay:"), "filed under the relay: %q", en.Consumer)
	require.True(t, en.Permanent, "a refused row cannot become valid by waiting")
	require.Contains(t, en.Error, errTopicRefused.Error(), "the broker's reason")

	// More rows later: the refused one is not dead-lettered again.
	third := event("k", 4)
	e.write("orders", third)
	e.relayAll(r, 1, 0)
	msgs = good.wait(e, 3)
	require.Equal(t, third.UUID, msgs[2].UUID)
	n, err := store.Count(e.ctx(), dlq.Filter{})
	require.NoError(t, err)
	require.Equal(t, 1, n, "one dead letter for the refused row")
	require.Empty(t, bad.all())
}
