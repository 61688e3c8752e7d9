package retry_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/dlq"
	"github.com/oncemill/oncemill/internal/sqldb"
	"github.com/oncemill/oncemill/internal/testing/msgtest"
	"github.com/oncemill/oncemill/internal/testing/sqltest"
	"github.com/oncemill/oncemill/retry"
)

// kafkaKey is a Kafka record key from Java's LongSerializer (42), as an
// adapter copies it into partition_key: valid UTF-8 with seven NULs.
const kafkaKey = "\x00\x00\x00\x00\x00\x00\x00\x2a"

// TestParkTakesAnyBytes: on every database, messages whose ordering key is
// a binary Kafka key or holds NUL or a byte that is not UTF-8, whose key
// or UUID is longer than an index row, whose header holds NUL or 1 MB, and
// whose error holds NUL and \xff, are parked; Waiting finds each ordering
// key by its bytes (and not another key's); the subscriber hands each
// back with its UUID, payload and metadata byte for byte, the message
// behind a binary key after the one it waits for; the list finds them by
// the values given.
func TestParkTakesAnyBytes(t *testing.T) {
	t.Parallel()
	for _, b := range sqltest.Backends {
		t.Run(b.Name, func(t *testing.T) {
			t.Parallel()
			e := open(t, b)
			ctx := context.Background()
			const consumer, topic = "charge", "orders"
			past := time.Now().Add(-time.Minute)
			longUUID := strings.Repeat("u", 9000)
			msgs := []retry.Message{
				parked(consumer, topic, kafkaKey, 3, past),
				parked(consumer, topic, "acct-\x00", 3, past),
				parked(consumer, topic, "acct-\xff", 3, past),
				parked(consumer, topic, strings.Repeat("o", 3000), 3, past),
				parked(consumer, topic, "", 3, past),
				parked(consumer, topic, "", 3, past),
			}
			msgs[0].Key = "key-\x00\xff"
			msgs[1].Metadata["header"] = "a\x00b"
			msgs[1].Metadata["bin\xff"] = "\xff\xfe"
			msgs[2].Error = "gateway \x00 said \xff"
			msgs[3].Key = strings.Repeat("k", 3000)
			msgs[4].UUID = longUUID
			msgs[5].Metadata["big"] = strings.Repeat("\x00é", 1<<19)
			msgs[5].UUID = "uuid-\x00-\xff"
			for _, m := range msgs {
				wrote, err := e.store.Park(ctx, m)
				require.NoError(t, err, "park %q", m.OrderKey)
				require.True(t, wrote)
			}
			waiter := behind(consumer, topic, kafkaKey)
			wrote, err := e.store.Park(ctx, waiter)
			require.NoError(t, err)
			require.True(t, wrote)

			for order, want := range map[string]bool{kafkaKey: true, "acct-\x00": true, "acct-\xff": true, strings.Repeat("o", 3000): true,
				"\x00\x00\x00\x00\x00\x00\x00\x2b": false, "acct-\uFFFD": false, "acct-": false} {
				waiting, err := e.store.Waiting(ctx, consumer, topic, order)
				require.NoError(t, err, "%q", order)
				require.Equal(t, want, waiting, "Waiting(%q)", order)
			}
			for _, f := range []retry.Filter{{OrderKey: kafkaKey}, {UUID: longUUID}, {Key: strings.Repeat("k", 3000)}, {UUID: "uuid-\x00-\xff"}} {
				n, err := e.store.Count(ctx, f)
				require.NoError(t, err)
				require.Positive(t, n, "%+v", f)
			}
			listed, err := e.store.List(ctx, retry.Filter{OrderKey: "acct-\xff"})
			require.NoError(t, err)
			require.Len(t, listed, 1)
			require.Equal(t, "gateway \uFFFD said \uFFFD", listed[0].Error, "the error as text")
			require.Equal(t, sqldb.Ident("acct-\xff"), listed[0].OrderKey, "the ordering key in its stored form")

			sub := e.subscribe(t, consumer, topic)
			byUUID := map[string]*message.Message{}
			for range msgs {
				m := receive(t, sub)
				byUUID[m.UUID] = m
			}
			for _, want := range msgs {
				got, ok := byUUID[want.UUID]
				require.True(t, ok, "handed back with its UUID (%d bytes)", len(want.UUID))
				require.Equal(t, want.Payload, []byte(got.Payload))
				for k, v := range want.Metadata {
					require.Equal(t, v, got.Metadata.Get(k), "metadata %q byte for byte", k)
				}
			}
			byUUID[msgs[0].UUID].Ack()
			next := receive(t, sub)
			require.Equal(t, waiter.UUID, next.UUID, "the message behind the binary key, once the one it waits for is acked")
			require.Equal(t, kafkaKey, next.Metadata.Get(delivery.PartitionKey))
			next.Ack()
			for _, m := range msgs[1:] {
				byUUID[m.UUID].Ack()
			}
			msgtest.WaitFor(t, "every parked message deleted after its ack", func() bool {
				n, err := e.store.Count(ctx, retry.Filter{})
				require.NoError(t, err)
				return n == 0
			})
		})
	}
}

// TestParkOneUUIDTwoMessages: on every database, two messages of one UUID
// with different keys are both parked, a copy of one is not; both are
// handed back; cancelling a message whose dead letter is there already
// (another copy dead-lettered by its consumer) writes its own dead letter,
// with its payload, instead of deleting it unseen.
func TestParkOneUUIDTwoMessages(t *testing.T) {
	t.Parallel()
	for _, b := range sqltest.Backends {
		t.Run(b.Name, func(t *testing.T) {
			t.Parallel()
			e := open(t, b)
			ctx := context.Background()
			first := parked("charge", "orders", "", 3, time.Now().Add(time.Hour))
			second := first
			second.Key, second.Payload = "another-key", []byte(`{"order":"second"}`)
			for _, m := range []retry.Message{first, second} {
				wrote, err := e.store.Park(ctx, m)
				require.NoError(t, err)
				require.True(t, wrote, "key %s parked", m.Key)
			}
			wrote, err := e.store.Park(ctx, first)
			require.NoError(t, err)
			require.False(t, wrote, "a copy of the first is parked once")
			require.Len(t, e.ids(t, retry.Filter{UUID: first.UUID}), 2, "two messages of one UUID, both parked")

			// The first's consumer dead-lettered another copy of it.
			copyOf := message.NewMessage(first.UUID, []byte(`{"order":"the copy dead-lettered"}`))
			copyOf.Metadata.Set(delivery.DeadTopic, first.Topic)
			copyOf.Metadata.Set(delivery.DeadConsumer, first.Consumer)
			copyOf.Metadata.Set(delivery.DeadKey, first.Key)
			require.NoError(t, e.dead.Publish("dlq", copyOf))

			n, err := e.store.Cancel(ctx, retry.Filter{UUID: first.UUID}, e.dead, "")
			require.NoError(t, err)
			require.Equal(t, 2, n)
			require.Empty(t, e.ids(t, retry.Filter{}))
			entries, err := e.dlq.List(ctx, dlq.Filter{})
			require.NoError(t, err)
			require.Len(t, entries, 3, "the copy dead-lettered before, and a dead letter for each cancelled message")
			payloads := map[string]string{}
			for _, en := range entries {
				require.Equal(t, first.UUID, en.Message("").UUID, "each replays the message's UUID")
				payloads[string(en.Payload)] = en.Key
			}
			require.Equal(t, map[string]string{
				`{"order":"the copy dead-lettered"}`: first.Key,
				string(first.Payload):                first.Key,
				`{"order":"second"}`:                 "another-key",
			}, payloads, "no payload deleted unseen")
		})
	}
}

// TestParkRefusesMessagesWithoutIdentity: a message without a consumer,
// topic or UUID is refused with ErrNotParkable, naming the field, and
// nothing is written; a nil *Store or a Store{} answers ErrNoStore, never
// a panic.
func TestParkRefusesMessagesWithoutIdentity(t *testing.T) {
	t.Parallel()
	e := open(t, sqltest.Backends[len(sqltest.Backends)-1])
	ctx := context.Background()
	for field, m := range map[string]retry.Message{
		"Consumer": {Topic: "orders", UUID: "u"},
		"Topic":    {Consumer: "charge", UUID: "u"},
		"UUID":     {Consumer: "charge", Topic: "orders"},
	} {
		_, err := e.store.Park(ctx, m)
		require.ErrorIs(t, err, retry.ErrNotParkable)
		require.ErrorContains(t, err, "Message."+field+" is empty")
	}
	require.Empty(t, e.ids(t, retry.Filter{}))

	require.NoError(t, e.store.Ready())
	for _, s := range []*retry.Store{nil, {}} {
		require.ErrorIs(t, s.Ready(), retry.ErrNoStore)
		_, err := s.Park(ctx, parked("charge", "orders", "", 1, time.Now()))
		require.ErrorIs(t, err, retry.ErrNoStore)
		_, err = s.Waiting(ctx, "charge", "orders", "k")
		require.ErrorIs(t, err, retry.ErrNoStore)
		_, err = s.List(ctx, retry.Filter{})
		require.ErrorIs(t, err, retry.ErrNoStore)
		_, err = s.Cancel(ctx, retry.Filter{All: true}, e.dead, "")
		require.ErrorIs(t, err, retry.ErrNoStore)
		_, err = s.Subscriber(retry.SubscriberConfig{Consumer: "charge"})
		require.ErrorIs(t, err, retry.ErrNoStore)
	}
}

// TestSubscriberConfigPollInterval: a poll interval under 10ms is refused,
// naming the field and the minimum.
func TestSubscriberConfigPollInterval(t *testing.T) {
	t.Parallel()
	for _, d := range []time.Duration{time.Nanosecond, time.Millisecond, -time.Second} {
		err := retry.SubscriberConfig{Consumer: "charge", PollInterval: d}.Validate()
		require.ErrorContains(t, err, "retry: SubscriberConfig.PollInterval must be at least 10ms")
	}
	require.NoError(t, retry.SubscriberConfig{Consumer: "charge"}.Validate(), "0 is the default 1s")
	require.NoError(t, retry.SubscriberConfig{Consumer: "charge", PollInterval: retry.MinPollInterval}.Validate())
}

// TestSlowMessageHoldsOnlyItsKey: one parked message whose handler is slow
// (not acked) holds its own key and one slot: a message of another key
// that comes due meanwhile goes out, and the one behind an acked key
// follows at once; with every slot (Batch) taken, nothing more goes out
// until one frees.
func TestSlowMessageHoldsOnlyItsKey(t *testing.T) {
	t.Parallel()
	for _, b := range sqltest.Backends {
		t.Run(b.Name, func(t *testing.T) {
			t.Parallel()
			e := open(t, b)
			ctx := context.Background()
			const consumer, topic = "charge", "orders"
			past := time.Now().Add(-time.Minute)
			e.park(t, parked(consumer, topic, "slow", 1, past), parked(consumer, topic, "fast", 1, past.Add(time.Second)))
			sub, err := e.store.Subscriber(retry.SubscriberConfig{Consumer: consumer, PollInterval: 20 * time.Millisecond, Batch: 3})
			require.NoError(t, err)
			subCtx, cancel := context.WithCancel(ctx)
			msgs, err := sub.Subscribe(subCtx, topic)
			require.NoError(t, err)
			t.Cleanup(func() {
				cancel()
				require.NoError(t, sub.Close())
			})
			slow := receive(t, msgs)
			require.Equal(t, "slow", slow.Metadata.Get(delivery.PartitionKey))
			fast := receive(t, msgs)
			require.Equal(t, "fast", fast.Metadata.Get(delivery.PartitionKey))

			// slow's handler runs on; another key comes due, and one
			// waits behind fast.
			e.park(t, behind(consumer, topic, "fast"), parked(consumer, topic, "other", 1, time.Now()))
			other := receive(t, msgs)
			require.Equal(t, "other", other.Metadata.Get(delivery.PartitionKey), "a due message of another key goes out while one is slow")
			fast.Ack()
			next := receive(t, msgs)
			require.Equal(t, "fast", next.Metadata.Get(delivery.PartitionKey), "the message behind an acked key follows")
			require.True(t, next.Metadata.Get(delivery.RetryID) != fast.Metadata.Get(delivery.RetryID))

			// Three out (slow, other, next): every slot taken.
			e.park(t, parked(consumer, topic, "waits-for-a-slot", 1, time.Now()))
			select {
			case m := <-msgs:
				t.Fatalf("%s went out with every slot taken", m.Metadata.Get(delivery.PartitionKey))
			case <-time.After(200 * time.Millisecond): // ten polls
			}
			other.Ack()
			m := receive(t, msgs)
			require.Equal(t, "waits-for-a-slot", m.Metadata.Get(delivery.PartitionKey), "a freed slot is filled")
			for _, m := range []*message.Message{slow, next, m} {
				m.Ack()
			}
		})
	}
}
