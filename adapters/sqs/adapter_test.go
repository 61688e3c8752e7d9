package sqs_test

import (
	"context"
	"encoding/base64"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/aws/aws-sdk-go-v2/aws"
	awssqs "github.com/aws/aws-sdk-go-v2/service/sqs"
	"github.com/aws/aws-sdk-go-v2/service/sqs/types"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/adapters/sqs"
	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/internal/testing/msgtest"
)

// expectedMetadata returns what a subscriber of topic should see for a
// message published with md, on the given attempt.
func expectedMetadata(md message.Metadata, topic string, attempt int) message.Metadata {
	want := message.Metadata{}
	for k, v := range md {
		switch k {
		case delivery.Topic, delivery.Attempts, delivery.DecodeError, delivery.Partition, delivery.Offset, delivery.Redelivered:
			continue // delivery facts are the subscriber's own
		}
		want[k] = v
	}
	want[delivery.Topic] = topic
	want[delivery.Attempts] = fmt.Sprint(attempt)
	return want
}

func stringValue(m types.Message, name string) string {
	return aws.ToString(m.MessageAttributes[name].StringValue)
}

// rawByUUID receives n raw messages from queue and indexes them by their
// UUID attribute.
func rawByUUID(t *testing.T, a *admin, queue string, n int) map[string]types.Message {
	t.Helper()
	got := map[string]types.Message{}
	deadline := time.Now().Add(10 * time.Second)
	for len(got) < n && time.Now().Before(deadline) {
		for _, m := range a.receiveRaw(queue, 10, 30*time.Second) {
			got[stringValue(m, sqs.UUIDAttribute)] = m
		}
	}
	require.Len(t, got, n)
	return got
}

// TestAttributesRoundtrip publishes messages whose metadata fits in
// message attributes and messages whose metadata does not (more than ten
// keys, names or values SQS rejects), with text, binary and empty
// payloads, checks what goes over the wire, then checks that the
// subscriber restores every key, value and payload byte.
func TestAttributesRoundtrip(t *testing.T) {
	t.Parallel()
	a := newAdmin(t)
	topic := uniqueName("roundtrip")
	queue := sqs.DefaultQueueName(topic)
	a.track(queue)
	pub := newPublisher(t, sqs.PublisherConfig{Config: testConfig()})

	few := message.NewMessage(watermill.NewUUID(), []byte(`{"text":"héllo ✓"}`))
	few.Metadata.Set("trace_id", "abc")
	few.Metadata.Set(delivery.IdempotencyKey, "key-1")
	few.Metadata.Set("unicode", "ünï ✓")
	few.Metadata.Set(delivery.Topic, "where-it-came-from") // a stale delivery fact
	few.Metadata.Set(delivery.DecodeError, "stale")

	many := message.NewMessage(watermill.NewUUID(), []byte{0xff, 0x00, 0xfe, 'x', 0x01})
	for i := range 12 {
		many.Metadata.Set(fmt.Sprintf("key_%02d", i), fmt.Sprintf("value %d", i))
	}
	many.Metadata.Set("has space", "x")
	many.Metadata.Set("AWS.reserved", "y")
	many.Metadata.Set("empty", "")
	many.Metadata.Set("control", "a\x00b\uffff\x7f")
	many.Metadata.Set(sqs.UUIDAttribute, "not-the-uuid")

	invalidName := message.NewMessage(watermill.NewUUID(), []byte("text with a tab\tand newline\n"))
	invalidName.Metadata.Set("a:b", "colon in the name")

	empty := message.NewMessage(watermill.NewUUID(), nil)
	empty.Metadata.Set("k", "v")

	// AWS accepts characters outside the BMP, fauxqs does not: they travel
	// encoded.
	emoji := message.NewMessage(watermill.NewUUID(), []byte(`{"note":"🚀 launch"}`))
	emoji.Metadata.Set("note", "🎉")

	published := []*message.Message{few, many, invalidName, empty, emoji}
	require.NoError(t, pub.Publish(topic, published...))

	// The wire format.
	raw := rawByUUID(t, a, queue, len(published))
	m := raw[few.UUID]
	assert.Equal(t, string(few.Payload), aws.ToString(m.Body))
	assert.Len(t, m.MessageAttributes, 4, "UUID and one attribute per key, without delivery facts")
	assert.Equal(t, "abc", stringValue(m, "trace_id"))
	assert.Equal(t, "key-1", stringValue(m, delivery.IdempotencyKey))
	assert.Equal(t, "String", aws.ToString(m.MessageAttributes["trace_id"].DataType))
	assert.NotContains(t, m.MessageAttributes, sqs.MetadataAttribute)

	m = raw[many.UUID]
	assert.Equal(t, base64.StdEncoding.EncodeToString(many.Payload), aws.ToString(m.Body))
	assert.Equal(t, sqs.BodyEncodingBase64, stringValue(m, sqs.BodyEncodingAttribute))
	assert.Contains(t, m.MessageAttributes, sqs.MetadataAttribute)
	assert.Len(t, m.MessageAttributes, 3, "UUID, body encoding and the metadata JSON")

	m = raw[invalidName.UUID]
	assert.Equal(t, string(invalidName.Payload), aws.ToString(m.Body))
	assert.Contains(t, m.MessageAttributes, sqs.MetadataAttribute)

	m = raw[empty.UUID]
	assert.Equal(t, sqs.BodyEncodingEmpty, stringValue(m, sqs.BodyEncodingAttribute))
	assert.Equal(t, "v", stringValue(m, "k"))

	m = raw[emoji.UUID]
	assert.Equal(t, sqs.BodyEncodingBase64, stringValue(m, sqs.BodyEncodingAttribute))
	assert.Contains(t, m.MessageAttributes, sqs.MetadataAttribute)

	for _, m := range raw {
		a.release(queue, m)
	}

	// The roundtrip: the raw receive above was the first attempt.
	sub := newSubscriber(t, testSubscriberConfig())
	msgs, err := sub.Subscribe(context.Background(), topic)
	require.NoError(t, err)
	got := map[string]*message.Message{}
	for range published {
		msg := msgtest.Receive(t, msgs, 10*time.Second)
		got[msg.UUID] = msg
		msg.Ack()
	}
	for _, p := range published {
		msg := got[p.UUID]
		require.NotNil(t, msg, "message %s not received", p.UUID)
		assert.Equal(t, len(p.Payload), len(msg.Payload), "payload length of %s", p.UUID)
		assert.Equal(t, string(p.Payload), string(msg.Payload), "payload of %s", p.UUID)
		assert.Equal(t, expectedMetadata(p.Metadata, topic, 2), msg.Metadata, "metadata of %s", p.UUID)
	}
	require.Eventually(t, func() bool {
		v, f := a.counts(queue)
		return v == 0 && f == 0
	}, 10*time.Second, 50*time.Millisecond, "acked messages are deleted")
}

// TestFIFO publishes to a FIFO queue and checks the mapping to message
// groups (partition key, else idempotency key, else UUID; hashed when SQS
// would reject it) and deduplication IDs (idempotency key, else UUID), that
// a second publish with the same idempotency key is dropped by SQS, and
// that the order within each group holds.
func TestFIFO(t *testing.T) {
	t.Parallel()
	a := newAdmin(t)
	topic := uniqueName("fifo") + ".fifo"
	queue := sqs.DefaultQueueName(topic)
	require.Equal(t, topic, queue)
	a.track(queue)
	pub := newPublisher(t, sqs.PublisherConfig{Config: testConfig()})

	var batch []*message.Message
	order := map[string][]string{} // group → payloads in publish order
	for i := range 4 {
		for _, g := range []string{"a", "b"} {
			msg := message.NewMessage(watermill.NewUUID(), fmt.Appendf(nil, "%s-%d", g, i))
			msg.Metadata.Set(delivery.PartitionKey, g)
			batch = append(batch, msg)
			order[g] = append(order[g], string(msg.Payload))
		}
	}
	require.NoError(t, pub.Publish(topic, batch[:6]...)) // one batch
	for _, msg := range batch[6:] {
		require.NoError(t, pub.Publish(topic, msg)) // one by one
	}

	once1 := message.NewMessage(watermill.NewUUID(), []byte("once"))
	once1.Metadata.Set(delivery.IdempotencyKey, "pay-42")
	once2 := message.NewMessage(watermill.NewUUID(), []byte("once again"))
	once2.Metadata.Set(delivery.IdempotencyKey, "pay-42")
	require.NoError(t, pub.Publish(topic, once1))
	require.NoError(t, pub.Publish(topic, once2)) // within the 5-minute window: dropped

	longKey := strings.Repeat("k", 200)
	long := message.NewMessage(watermill.NewUUID(), []byte("long"))
	long.Metadata.Set(delivery.PartitionKey, longKey)
	long.Metadata.Set(delivery.IdempotencyKey, "has a space")
	noKeys := message.NewMessage(watermill.NewUUID(), []byte("no keys"))
	require.NoError(t, pub.Publish(topic, long, noKeys))

	// The head of each group, with its group and deduplication IDs. The
	// emulator, like SQS, hands out one message of a group at a time.
	raw := rawByUUID(t, a, queue, 5)
	attr := func(msg *message.Message, name types.MessageSystemAttributeName) string {
		return raw[msg.UUID].Attributes[string(name)]
	}
	group, dedup := types.MessageSystemAttributeNameMessageGroupId, types.MessageSystemAttributeNameMessageDeduplicationId
	assert.Equal(t, "a", attr(batch[0], group))
	assert.Equal(t, batch[0].UUID, attr(batch[0], dedup))
	assert.Equal(t, "b", attr(batch[1], group))
	assert.Equal(t, "pay-42", attr(once1, group), "no partition key: the idempotency key groups")
	assert.Equal(t, "pay-42", attr(once1, dedup))
	assert.Len(t, attr(long, group), 64, "a 200-character key is hashed")
	assert.NotEqual(t, longKey[:64], attr(long, group))
	assert.Len(t, attr(long, dedup), 64, "a key with a space is hashed")
	assert.Equal(t, noKeys.UUID, attr(noKeys, group))
	assert.Equal(t, noKeys.UUID, attr(noKeys, dedup))
	for _, m := range raw {
		a.release(queue, m)
	}

	sub := newSubscriber(t, testSubscriberConfig())
	msgs, err := sub.Subscribe(context.Background(), topic)
	require.NoError(t, err)
	got := map[string][]string{}
	for range len(batch) + 3 {
		msg := msgtest.Receive(t, msgs, 10*time.Second)
		g := msg.Metadata.Get(delivery.PartitionKey)
		if g == "" {
			g = msg.Metadata.Get(delivery.IdempotencyKey)
		}
		got[g] = append(got[g], string(msg.Payload))
		msg.Ack()
	}
	msgtest.Nothing(t, msgs, 2*time.Second)
	assert.Equal(t, order["a"], got["a"], "order within group a")
	assert.Equal(t, order["b"], got["b"], "order within group b")
	assert.Equal(t, []string{"once"}, got["pay-42"], "the second publish with the same idempotency key is deduplicated")
	assert.Equal(t, []string{"long"}, got[longKey])
	assert.Equal(t, []string{"no keys"}, got[""])
}

// TestNackRedeliversWithAttempts nacks a message, which comes back after
// the default backoff (1s for a first attempt) with delivery.Attempts 2,
// then acks it, which deletes it from the queue.
func TestNackRedeliversWithAttempts(t *testing.T) {
	t.Parallel()
	a := newAdmin(t)
	topic := uniqueName("nack")
	a.trackTopic(topic)
	pub := newPublisher(t, sqs.PublisherConfig{Config: testConfig()})
	sub := newSubscriber(t, testSubscriberConfig()) // default NackBackoff
	msgs, err := sub.Subscribe(context.Background(), topic)
	require.NoError(t, err)

	sent := message.NewMessage(watermill.NewUUID(), []byte("retry me"))
	require.NoError(t, pub.Publish(topic, sent))

	first := msgtest.Receive(t, msgs, 10*time.Second)
	assert.Equal(t, sent.UUID, first.UUID)
	assert.Equal(t, "1", first.Metadata.Get(delivery.Attempts))
	assert.Equal(t, topic, first.Metadata.Get(delivery.Topic))
	nacked := time.Now()
	require.True(t, first.Nack())
	select {
	case <-first.Context().Done():
	case <-time.After(5 * time.Second):
		t.Fatal("message context not cancelled after Nack")
	}

	second := msgtest.Receive(t, msgs, 10*time.Second)
	assert.GreaterOrEqual(t, time.Since(nacked), 900*time.Millisecond, "redelivered before the backoff")
	assert.Equal(t, sent.UUID, second.UUID)
	assert.Equal(t, "2", second.Metadata.Get(delivery.Attempts))
	n, ok := delivery.AttemptsOf(second)
	assert.True(t, ok)
	assert.Equal(t, 2, n)
	require.True(t, second.Ack())

	queue := sqs.DefaultQueueName(topic)
	require.Eventually(t, func() bool {
		v, f := a.counts(queue)
		return v == 0 && f == 0
	}, 10*time.Second, 50*time.Millisecond, "the acked message is deleted")
	msgtest.Nothing(t, msgs, 1500*time.Millisecond)
}

// TestHeartbeat holds a message for longer than twice the visibility
// timeout: the heartbeat keeps it invisible, so a second subscriber on the
// queue gets nothing, and the ack then deletes it.
func TestHeartbeat(t *testing.T) {
	t.Parallel()
	a := newAdmin(t)
	topic := uniqueName("heartbeat")
	queue := sqs.DefaultQueueName(topic)
	a.track(queue)
	cfg := testSubscriberConfig()
	cfg.VisibilityTimeout = 2 * time.Second
	pub := newPublisher(t, sqs.PublisherConfig{Config: testConfig()})
	sub := newSubscriber(t, cfg)
	msgs, err := sub.Subscribe(context.Background(), topic)
	require.NoError(t, err)

	sent := message.NewMessage(watermill.NewUUID(), []byte("slow"))
	require.NoError(t, pub.Publish(topic, sent))
	msg := msgtest.Receive(t, msgs, 10*time.Second)
	require.Equal(t, sent.UUID, msg.UUID)

	other := newSubscriber(t, cfg)
	otherMsgs, err := other.Subscribe(context.Background(), topic)
	require.NoError(t, err)
	msgtest.Nothing(t, otherMsgs, 5*time.Second) // the handler holds the message 5s
	v, f := a.counts(queue)
	assert.Equal(t, 0, v)
	assert.Equal(t, 1, f)

	require.True(t, msg.Ack())
	require.Eventually(t, func() bool {
		v, f := a.counts(queue)
		return v == 0 && f == 0
	}, 10*time.Second, 50*time.Millisecond, "the acked message is deleted")
	msgtest.Nothing(t, otherMsgs, 2500*time.Millisecond)
}

// TestForeignMessages sends messages with the SDK directly: one without
// any attribute, one with typed attributes, one with a corrupt metadata
// attribute and one whose body is not the base64 its attribute claims. The
// first two decode; the last two arrive with delivery.DecodeError and the
// raw body. None blocks the message published after them.
func TestForeignMessages(t *testing.T) {
	t.Parallel()
	a := newAdmin(t)
	topic := uniqueName("foreign")
	queue := sqs.DefaultQueueName(topic)
	a.createQueue(queue, nil)

	// SQS, and the emulator, reject an empty body, so no foreign message
	// can have one; the adapter publishes empty payloads with a
	// placeholder body (see TestAttributesRoundtrip).
	_, err := a.api.SendMessage(context.Background(), &awssqs.SendMessageInput{
		QueueUrl:    aws.String(a.url(queue)),
		MessageBody: aws.String(""),
	})
	require.Error(t, err, "SQS rejects an empty body")

	plain := a.send(queue, "plain text", nil)
	typed := a.send(queue, "typed", map[string]types.MessageAttributeValue{
		"count": {DataType: aws.String("Number"), StringValue: aws.String("42")},
		"blob":  {DataType: aws.String("Binary"), BinaryValue: []byte{1, 2, 0xff}},
		"label": {DataType: aws.String("String.custom"), StringValue: aws.String("x")},
	})
	corrupt := a.send(queue, "body of corrupt", map[string]types.MessageAttributeValue{
		sqs.MetadataAttribute: {DataType: aws.String("String"), StringValue: aws.String(`{"not": json`)},
		"kept":                {DataType: aws.String("String"), StringValue: aws.String("yes")},
	})
	badBase64 := a.send(queue, "!!! not base64", map[string]types.MessageAttributeValue{
		sqs.BodyEncodingAttribute: {DataType: aws.String("String"), StringValue: aws.String(sqs.BodyEncodingBase64)},
		sqs.UUIDAttribute:         {DataType: aws.String("String"), StringValue: aws.String("uuid-of-bad-base64")},
	})
	pub := newPublisher(t, sqs.PublisherConfig{Config: testConfig()})
	next := message.NewMessage(watermill.NewUUID(), []byte("next"))
	require.NoError(t, pub.Publish(topic, next))

	sub := newSubscriber(t, testSubscriberConfig())
	msgs, err := sub.Subscribe(context.Background(), topic)
	require.NoError(t, err)
	got := map[string]*message.Message{}
	for range 5 {
		msg := msgtest.Receive(t, msgs, 10*time.Second)
		got[msg.UUID] = msg
		msg.Ack() // a handler chain dead-letters the undecodable ones, then acks
	}

	msg := got[plain]
	require.NotNil(t, msg, "no UUID attribute: the SQS MessageId is the UUID")
	assert.Equal(t, "plain text", string(msg.Payload))
	assert.Empty(t, delivery.DecodeErrorOf(msg))
	assert.Equal(t, message.Metadata{delivery.Topic: topic, delivery.Attempts: "1"}, msg.Metadata)

	msg = got[typed]
	require.NotNil(t, msg)
	assert.Empty(t, delivery.DecodeErrorOf(msg))
	assert.Equal(t, "42", msg.Metadata.Get("count"))
	assert.Equal(t, "\x01\x02\xff", msg.Metadata.Get("blob"))
	assert.Equal(t, "x", msg.Metadata.Get("label"))

	msg = got[corrupt]
	require.NotNil(t, msg)
	assert.Contains(t, delivery.DecodeErrorOf(msg), sqs.MetadataAttribute)
	assert.Equal(t, "body of corrupt", string(msg.Payload))
	assert.Equal(t, "yes", msg.Metadata.Get("kept"))
	assert.Equal(t, topic, msg.Metadata.Get(delivery.Topic))

	msg = got["uuid-of-bad-base64"]
	require.NotNil(t, msg)
	assert.Contains(t, delivery.DecodeErrorOf(msg), "base64")
	assert.Contains(t, delivery.DecodeErrorOf(msg), badBase64, "the error names the SQS message")
	assert.Equal(t, "!!! not base64", string(msg.Payload))

	msg = got[next.UUID]
	require.NotNil(t, msg, "the message after the undecodable ones arrives")
	assert.Equal(t, "next", string(msg.Payload))

	require.Eventually(t, func() bool {
		v, f := a.counts(queue)
		return v == 0 && f == 0
	}, 10*time.Second, 50*time.Millisecond, "acked messages are deleted, undecodable ones included")
}

// TestCloseWithMessageInFlight closes a subscriber while the handler holds
// a message: the message is not deleted (not even by an ack after Close)
// and a new subscriber receives it after the visibility timeout, while the
// messages received with it but never handed out are visible at once.
func TestCloseWithMessageInFlight(t *testing.T) {
	t.Parallel()
	a := newAdmin(t)
	topic := uniqueName("close")
	queue := sqs.DefaultQueueName(topic)
	a.track(queue)
	cfg := testSubscriberConfig()
	cfg.VisibilityTimeout = 2 * time.Second
	pub := newPublisher(t, sqs.PublisherConfig{Config: testConfig()})
	sent := []*message.Message{
		message.NewMessage(watermill.NewUUID(), []byte("1")),
		message.NewMessage(watermill.NewUUID(), []byte("2")),
		message.NewMessage(watermill.NewUUID(), []byte("3")),
	}
	require.NoError(t, pub.Publish(topic, sent...))

	sub, err := sqs.NewSubscriber(cfg)
	require.NoError(t, err)
	// The visibility timeout runs from the queue's receive, which is after
	// this instant and before the handler gets the message: the held copy
	// cannot come back before subscribed+VisibilityTimeout (Close's time is
	// no bound: under load the receive can be long before it).
	subscribed := time.Now()
	msgs, err := sub.Subscribe(context.Background(), topic)
	require.NoError(t, err)
	held := msgtest.Receive(t, msgs, 10*time.Second)
	require.NoError(t, sub.Close())
	_, open := <-msgs
	assert.False(t, open, "channel closed by Close")
	select {
	case <-held.Context().Done():
	default:
		t.Error("the held message's context is not cancelled by Close")
	}
	held.Ack() // too late: the subscription is gone

	v, f := a.counts(queue)
	assert.Equal(t, 1, f, "the held message is still in flight, not deleted")
	assert.Equal(t, 2, v, "the messages never handed out are visible again")

	sub2 := newSubscriber(t, cfg)
	msgs2, err := sub2.Subscribe(context.Background(), topic)
	require.NoError(t, err)
	var again *message.Message
	for range 3 {
		msg := msgtest.Receive(t, msgs2, 10*time.Second)
		if msg.UUID == held.UUID {
			again = msg
			// 100 ms of slack for the queue's timer granularity.
			assert.GreaterOrEqual(t, time.Since(subscribed), cfg.VisibilityTimeout-100*time.Millisecond, "the held message came back before its visibility timeout")
		}
		msg.Ack()
	}
	require.NotNil(t, again, "the held message is delivered again")
	assert.Equal(t, "2", again.Metadata.Get(delivery.Attempts))
	require.Eventually(t, func() bool {
		v, f := a.counts(queue)
		return v == 0 && f == 0
	}, 10*time.Second, 50*time.Millisecond)
}

// TestQueueNotFound checks that without CreateQueueIfMissing a missing
// queue is an error that wraps ErrQueueNotFound, and that
// SubscribeInitialize creates it.
func TestQueueNotFound(t *testing.T) {
	t.Parallel()
	a := newAdmin(t)
	topic := uniqueName("missing")
	a.trackTopic(topic)
	cfg := testConfig()
	cfg.CreateQueueIfMissing = false
	pub := newPublisher(t, sqs.PublisherConfig{Config: cfg})
	scfg := testSubscriberConfig()
	scfg.Config = cfg
	sub := newSubscriber(t, scfg)

	err := pub.Publish(topic, message.NewMessage(watermill.NewUUID(), []byte("x")))
	require.ErrorIs(t, err, sqs.ErrQueueNotFound)
	_, err = sub.Subscribe(context.Background(), topic)
	require.ErrorIs(t, err, sqs.ErrQueueNotFound)

	require.NoError(t, sub.SubscribeInitialize(topic))
	require.NoError(t, pub.Publish(topic, message.NewMessage(watermill.NewUUID(), []byte("x"))))
	msgs, err := sub.Subscribe(context.Background(), topic)
	require.NoError(t, err)
	msgtest.Receive(t, msgs, 10*time.Second).Ack()

	err = pub.Publish("", message.NewMessage(watermill.NewUUID(), nil))
	require.ErrorIs(t, err, sqs.ErrInvalidTopic)

	require.NoError(t, pub.Close())
	require.ErrorIs(t, pub.Publish(topic, message.NewMessage(watermill.NewUUID(), nil)), sqs.ErrClosed)
	require.NoError(t, sub.Close())
	_, err = sub.Subscribe(context.Background(), topic)
	require.ErrorIs(t, err, sqs.ErrClosed)
}

// TestRedrivePolicy creates a queue whose RedrivePolicy sends a message
// received more than once to a dead-letter queue, nacks a message once, and
// finds it in the dead-letter queue.
func TestRedrivePolicy(t *testing.T) {
	t.Parallel()
	a := newAdmin(t)
	dlq := uniqueName("dlq")
	a.createQueue(dlq, nil)
	policy, err := sqs.RedrivePolicy(a.arn(dlq), 1)
	require.NoError(t, err)

	topic := uniqueName("redrive")
	a.trackTopic(topic)
	cfg := testSubscriberConfig()
	cfg.QueueAttributes = map[string]string{"RedrivePolicy": policy}
	cfg.NackBackoff = func(int) time.Duration { return 0 }
	sub := newSubscriber(t, cfg)
	msgs, err := sub.Subscribe(context.Background(), topic)
	require.NoError(t, err)
	pub := newPublisher(t, sqs.PublisherConfig{Config: testConfig()})
	sent := message.NewMessage(watermill.NewUUID(), []byte("poison"))
	require.NoError(t, pub.Publish(topic, sent))

	require.True(t, msgtest.Receive(t, msgs, 10*time.Second).Nack())
	msgtest.Nothing(t, msgs, 2*time.Second) // the second receive moves it

	dead, err := sub.Subscribe(context.Background(), dlq)
	require.NoError(t, err)
	msg := msgtest.Receive(t, dead, 10*time.Second)
	assert.Equal(t, sent.UUID, msg.UUID)
	assert.Equal(t, "poison", string(msg.Payload))
	assert.Equal(t, dlq, msg.Metadata.Get(delivery.Topic))
	msg.Ack()
}

// TestFIFONackKeepsGroupOrder nacks the head of a FIFO message group: the
// group waits for the nacked message, which comes back (after the 1s
// default backoff) before the messages behind it.
func TestFIFONackKeepsGroupOrder(t *testing.T) {
	t.Parallel()
	a := newAdmin(t)
	topic := uniqueName("fifo-nack") + ".fifo"
	a.trackTopic(topic)
	pub := newPublisher(t, sqs.PublisherConfig{Config: testConfig()})
	var sent []*message.Message
	for i := range 3 {
		msg := message.NewMessage(watermill.NewUUID(), fmt.Appendf(nil, "a-%d", i))
		msg.Metadata.Set(delivery.PartitionKey, "a")
		sent = append(sent, msg)
	}
	require.NoError(t, pub.Publish(topic, sent...))

	sub := newSubscriber(t, testSubscriberConfig())
	msgs, err := sub.Subscribe(context.Background(), topic)
	require.NoError(t, err)
	first := msgtest.Receive(t, msgs, 10*time.Second)
	require.Equal(t, "a-0", string(first.Payload))
	require.True(t, first.Nack())
	msgtest.Nothing(t, msgs, 800*time.Millisecond)

	var got []string
	for range 3 {
		msg := msgtest.Receive(t, msgs, 10*time.Second)
		got = append(got, string(msg.Payload)+"#"+msg.Metadata.Get(delivery.Attempts))
		msg.Ack()
	}
	assert.Equal(t, []string{"a-0#2", "a-1#1", "a-2#1"}, got)
}
