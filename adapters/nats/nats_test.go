package nats_test

import (
	"context"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/nats-io/nats-server/v2/server"
	natsgo "github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/adapters/nats"
	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/internal/testing/msgtest"
)

// TestRoundTrip publishes a message with metadata and receives it with
// its UUID, payload and metadata, and the delivery facts of JetStream.
func TestRoundTrip(t *testing.T) {
	t.Parallel()
	a := newAdmin(t)
	topic := a.topic(".orders")
	pub := publisher(t, a.config())
	sub := subscriber(t, nats.SubscriberConfig{Config: a.config(), ConsumerGroup: "billing"})

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	msgs, err := sub.Subscribe(ctx, topic)
	require.NoError(t, err)

	sent := message.NewMessage(watermill.NewUUID(), []byte(`{"id":42}`))
	sent.Metadata.Set(delivery.IdempotencyKey, "order-42")
	sent.Metadata.Set("trace", "abc")
	sent.Metadata.Set(delivery.Attempts, "7") // a delivery fact: never sent
	require.NoError(t, pub.Publish(topic, sent))

	got := msgtest.Receive(t, msgs, 10*time.Second)
	require.Equal(t, sent.UUID, got.UUID)
	require.Equal(t, sent.Payload, got.Payload)
	require.Equal(t, "order-42", got.Metadata.Get(delivery.IdempotencyKey))
	require.Equal(t, "abc", got.Metadata.Get("trace"))
	require.Equal(t, topic, got.Metadata.Get(delivery.Topic))
	require.Equal(t, nats.Config{}.StreamName(topic), got.Metadata.Get(delivery.Stream))
	require.Equal(t, "1", got.Metadata.Get(delivery.StreamSequence))
	require.Equal(t, "1", got.Metadata.Get(delivery.Attempts))
	require.Equal(t, "false", got.Metadata.Get(delivery.Redelivered))
	require.Empty(t, delivery.DecodeErrorOf(got))
	require.True(t, got.Ack())

	require.Eventually(t, func() bool {
		ci := a.consumer(nats.Config{}.StreamName(topic), "billing")
		return ci.NumAckPending == 0 && ci.AckFloor.Stream == 1
	}, 10*time.Second, 20*time.Millisecond, "the ack reached JetStream")
}

// createStream makes topic's stream as an operator would, tracked for
// deletion.
func (a *admin) createStream(t *testing.T, name string, subjects ...string) jetstream.Stream {
	t.Helper()
	a.trackStream(name)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	s, err := a.js.CreateStream(ctx, jetstream.StreamConfig{Name: name, Subjects: subjects})
	require.NoError(t, err)
	return s
}

// TestConsumerMismatch: a group's durable consumer that exists with other
// settings than the subscriber's fails Subscribe and SubscribeInitialize,
// naming each field that differs with both values; one with the same
// settings, made by an operator with a description of their own, is used
// as it is.
func TestConsumerMismatch(t *testing.T) {
	t.Parallel()
	a := newAdmin(t)
	topic := a.topic("")
	stream := a.createStream(t, nats.Config{}.StreamName(topic), topic)
	ctx := context.Background()
	_, err := stream.CreateConsumer(ctx, jetstream.ConsumerConfig{
		Durable: "billing", AckPolicy: jetstream.AckExplicitPolicy, AckWait: 30 * time.Second, MaxDeliver: 5,
		MaxAckPending: 1000, FilterSubject: topic,
	})
	require.NoError(t, err)
	_, err = stream.CreateConsumer(ctx, jetstream.ConsumerConfig{
		Durable: "audit", AckPolicy: jetstream.AckExplicitPolicy, AckWait: 30 * time.Second,
		MaxAckPending: 1000, FilterSubject: topic, InactiveThreshold: time.Hour,
	})
	require.NoError(t, err)

	cfg := a.config()
	cfg.CreateStreams = false
	sub := subscriber(t, nats.SubscriberConfig{Config: cfg, ConsumerGroup: "billing", AckWait: 10 * time.Second})
	_, err = sub.Subscribe(ctx, topic)
	require.ErrorIs(t, err, nats.ErrConsumerMismatch)
	for _, want := range []string{`consumer "billing" of stream "` + stream.CachedInfo().Config.Name + `"`,
		"AckWait (ack_wait) 30s (want 10s)", "MaxDeliver (max_deliver) 5 (want -1)", "nats consumer rm"} {
		require.ErrorContains(t, err, want)
	}
	require.NotContains(t, err.Error(), "MaxAckPending", "only the fields that differ")
	err = sub.SubscribeInitialize(topic)
	require.ErrorIs(t, err, nats.ErrConsumerMismatch)
	require.ErrorContains(t, err, "AckWait (ack_wait) 30s (want 10s)")

	audit := subscriber(t, nats.SubscriberConfig{Config: cfg, ConsumerGroup: "audit"})
	err = audit.SubscribeInitialize(topic)
	require.ErrorIs(t, err, nats.ErrConsumerMismatch)
	require.ErrorContains(t, err, "InactiveThreshold (inactive_threshold) 1h0m0s (want 0s)")

	same := subscriber(t, nats.SubscriberConfig{Config: cfg, ConsumerGroup: "billing", AckWait: 30 * time.Second, MaxDeliver: 5})
	subCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	msgs, err := same.Subscribe(subCtx, topic)
	require.NoError(t, err, "a consumer with the subscriber's settings is used as it is")
	sent := message.NewMessage(watermill.NewUUID(), []byte("x"))
	require.NoError(t, publisher(t, cfg).Publish(topic, sent))
	got := msgtest.Receive(t, msgs, 10*time.Second)
	require.Equal(t, sent.UUID, got.UUID)
	got.Ack()
}

// TestMissingStream: without CreateStreams, a topic whose stream does not
// exist fails Publish, Subscribe and SubscribeInitialize with an error
// that names the stream and says how to create it; nothing is created.
func TestMissingStream(t *testing.T) {
	t.Parallel()
	a := newAdmin(t)
	topic := a.topic(".created")
	cfg := a.config()
	cfg.CreateStreams = false
	name := nats.Config{}.StreamName(topic)

	err := publisher(t, cfg).Publish(topic, message.NewMessage(watermill.NewUUID(), nil))
	require.ErrorIs(t, err, nats.ErrStreamNotFound)
	require.ErrorContains(t, err, `stream "`+name+`" for topic "`+topic+`"`)
	require.ErrorContains(t, err, "create=true")
	sub := subscriber(t, nats.SubscriberConfig{Config: cfg, ConsumerGroup: "billing"})
	_, err = sub.Subscribe(context.Background(), topic)
	require.ErrorIs(t, err, nats.ErrStreamNotFound)
	require.ErrorContains(t, err, `stream "`+name+`"`)
	require.ErrorIs(t, sub.SubscribeInitialize(topic), nats.ErrStreamNotFound)

	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_, err = a.js.Stream(ctx, name)
	require.ErrorIs(t, err, jetstream.ErrStreamNotFound, "nothing was created")
}

// TestSharedStream: with Config.Stream, every topic is a subject of one
// existing stream, each group has a consumer per topic, and each topic's
// subscription receives its own messages only; a topic outside the
// stream's subjects fails, naming them. A topic whose own stream name
// collides with another's fails the same way instead of sharing it.
func TestSharedStream(t *testing.T) {
	t.Parallel()
	a := newAdmin(t)
	prefix := a.topic("")
	name := "shared_" + prefix
	a.createStream(t, name, prefix+".>")
	cfg := a.config()
	cfg.CreateStreams = false
	cfg.Stream = name
	pub := publisher(t, cfg)
	sub := subscriber(t, nats.SubscriberConfig{Config: cfg, ConsumerGroup: "billing"})

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	created, paid := prefix+".created", prefix+".paid"
	createdMsgs, err := sub.Subscribe(ctx, created)
	require.NoError(t, err)
	paidMsgs, err := sub.Subscribe(ctx, paid)
	require.NoError(t, err)
	c, p := message.NewMessage(watermill.NewUUID(), []byte("c")), message.NewMessage(watermill.NewUUID(), []byte("p"))
	c.Metadata.Set(delivery.IdempotencyKey, "order-42")
	p.Metadata.Set(delivery.IdempotencyKey, "order-42") // the same key on another topic of the stream
	require.NoError(t, pub.Publish(created, c))
	require.NoError(t, pub.Publish(paid, p))

	got := msgtest.Receive(t, createdMsgs, 10*time.Second)
	require.Equal(t, c.UUID, got.UUID)
	require.Equal(t, name, got.Metadata.Get(delivery.Stream))
	require.Equal(t, created, got.Metadata.Get(delivery.Topic))
	got.Ack()
	got = msgtest.Receive(t, paidMsgs, 10*time.Second)
	require.Equal(t, p.UUID, got.UUID, "the shared duplicate window does not take one topic's key for another's")
	got.Ack()
	msgtest.Nothing(t, createdMsgs, 200*time.Millisecond)
	for _, topic := range []string{created, paid} {
		consumer := nats.SubscriberConfig{Config: cfg, ConsumerGroup: "billing"}.ConsumerName(topic)
		require.Equal(t, "billing__"+strings.ReplaceAll(topic, ".", "_"), consumer)
		require.Equal(t, topic, a.consumer(name, consumer).Config.FilterSubject)
	}

	_, err = sub.Subscribe(ctx, "elsewhere_"+prefix)
	require.ErrorIs(t, err, nats.ErrTopicNotInStream)
	require.ErrorContains(t, err, `stream "`+name+`" holds subjects `+prefix+`.>, not topic "elsewhere_`+prefix+`"`)

	// Topics "x.y" and "x_y" would both have stream x_y.
	dotted := "own_" + prefix + ".x"
	a.createStream(t, nats.Config{}.StreamName(dotted), dotted)
	err = publisher(t, a.config()).Publish(safe(dotted), message.NewMessage(watermill.NewUUID(), nil))
	require.ErrorIs(t, err, nats.ErrTopicNotInStream)
}

// TestNackRedeliversWithAttempts: a nacked message comes again, after the
// default backoff, with the same UUID and stream sequence and
// delivery.Attempts 2, delivery.Redelivered true.
func TestNackRedeliversWithAttempts(t *testing.T) {
	t.Parallel()
	a := newAdmin(t)
	topic := a.topic("")
	sub := subscriber(t, nats.SubscriberConfig{Config: a.config(), ConsumerGroup: "billing"})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	msgs, err := sub.Subscribe(ctx, topic)
	require.NoError(t, err)
	sent := message.NewMessage(watermill.NewUUID(), []byte("x"))
	require.NoError(t, publisher(t, a.config()).Publish(topic, sent))

	first := msgtest.Receive(t, msgs, 10*time.Second)
	require.Equal(t, "1", first.Metadata.Get(delivery.Attempts))
	require.True(t, first.Nack())
	again := msgtest.Receive(t, msgs, 30*time.Second)
	require.Equal(t, sent.UUID, again.UUID)
	require.Equal(t, first.Metadata.Get(delivery.StreamSequence), again.Metadata.Get(delivery.StreamSequence))
	require.Equal(t, "2", again.Metadata.Get(delivery.Attempts))
	require.Equal(t, "true", again.Metadata.Get(delivery.Redelivered))
	require.True(t, again.Ack())
	require.Eventually(t, func() bool {
		ci := a.consumer(nats.Config{}.StreamName(topic), "billing")
		return ci.NumAckPending == 0 && ci.NumRedelivered == 0 && ci.AckFloor.Stream == 1
	}, 10*time.Second, 20*time.Millisecond)
}

// TestDuplicatePublishDropped: a second publish with the same idempotency
// key, a producer's retry with a new UUID, is dropped by JetStream within
// its duplicate window and Publish succeeds; a replay from the
// dead-letter queue with that key, and a dead-lettered copy, are stored.
func TestDuplicatePublishDropped(t *testing.T) {
	t.Parallel()
	a := newAdmin(t)
	topic := a.topic("")
	pub := publisher(t, a.config())
	publish := func(md map[string]string) {
		msg := message.NewMessage(watermill.NewUUID(), []byte("x"))
		msg.Metadata.Set(delivery.IdempotencyKey, "order-42")
		for k, v := range md {
			msg.Metadata.Set(k, v)
		}
		require.NoError(t, pub.Publish(topic, msg))
	}
	stored := func() uint64 {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		s, err := a.js.Stream(ctx, nats.Config{}.StreamName(topic))
		require.NoError(t, err)
		return s.CachedInfo().State.Msgs
	}
	publish(nil)
	publish(nil)
	require.Equal(t, uint64(1), stored(), "the retry was dropped")
	publish(map[string]string{delivery.Replay: "grant-1"})
	publish(map[string]string{delivery.Replay: "grant-1"})
	require.Equal(t, uint64(2), stored(), "a replay is a publish of its own, its retry is not")
	publish(map[string]string{delivery.DeadConsumer: "billing", delivery.DeadLastFailedAt: "2026-11-01T10:00:00Z"})
	require.Equal(t, uint64(3), stored(), "a dead-lettered copy is a publish of its own")
}

// TestCloseDrains: Close while a handler holds a message hands out nothing
// more, and the handler's ack, which comes once the drain has begun,
// reaches JetStream before Close returns.
func TestCloseDrains(t *testing.T) {
	t.Parallel()
	a := newAdmin(t)
	topic := a.topic("")
	sub, err := nats.NewSubscriber(context.Background(), nats.SubscriberConfig{
		Config: a.config(), ConsumerGroup: "billing", AckWait: time.Minute, DrainTimeout: time.Minute,
	})
	require.NoError(t, err)
	msgs, err := sub.Subscribe(context.Background(), topic)
	require.NoError(t, err)
	pub := publisher(t, a.config())
	for i := range 2 {
		require.NoError(t, pub.Publish(topic, message.NewMessage(strconv.Itoa(i), nil)))
	}
	held := msgtest.Receive(t, msgs, 10*time.Second)
	require.Equal(t, "0", held.UUID)

	closed := make(chan error, 1)
	go func() { closed <- sub.Close() }()
	// One message in flight at a time: the second was not fetched, and
	// the channel closes once the drain begins.
	_, open := <-msgs
	require.False(t, open, "nothing more handed out")
	require.True(t, held.Ack())
	require.NoError(t, <-closed)

	ci := a.consumer(nats.Config{}.StreamName(topic), "billing")
	require.Equal(t, uint64(1), ci.AckFloor.Stream, "the ack made during the drain reached JetStream")
	require.Zero(t, ci.NumAckPending)
	require.Equal(t, uint64(1), ci.NumPending, "the second message waits for the next subscriber")
}

// TestCloseReleasesFetched: a message fetched and not yet handed out when
// the subscription ends is given back at once: another subscriber of the
// group receives it long before its ack wait, while the first message is
// still held.
func TestCloseReleasesFetched(t *testing.T) {
	t.Parallel()
	a := newAdmin(t)
	topic := a.topic("")
	cfg := nats.SubscriberConfig{Config: a.config(), ConsumerGroup: "billing", AckWait: 5 * time.Minute, MaxInFlight: 2}
	first := subscriber(t, cfg)
	ctx, cancel := context.WithCancel(context.Background())
	msgs, err := first.Subscribe(ctx, topic)
	require.NoError(t, err)
	pub := publisher(t, a.config())
	for i := range 2 {
		require.NoError(t, pub.Publish(topic, message.NewMessage(strconv.Itoa(i), nil)))
	}
	held := msgtest.Receive(t, msgs, 10*time.Second)
	require.Eventually(t, func() bool {
		return a.consumer(nats.Config{}.StreamName(topic), "billing").NumAckPending == 2
	}, 10*time.Second, 10*time.Millisecond, "both messages fetched")
	cancel() // the subscription ends; msgs is not read any more

	second := subscriber(t, cfg)
	other, err := second.Subscribe(context.Background(), topic)
	require.NoError(t, err)
	got := msgtest.Receive(t, other, 30*time.Second)
	require.NotEqual(t, held.UUID, got.UUID)
	require.Equal(t, "2", got.Metadata.Get(delivery.Attempts))
	require.True(t, got.Ack())
	require.True(t, held.Ack())
	require.Eventually(t, func() bool {
		ci := a.consumer(nats.Config{}.StreamName(topic), "billing")
		return ci.NumAckPending == 0 && ci.AckFloor.Stream == 2
	}, 10*time.Second, 20*time.Millisecond, "both acked")
}

// TestHeartbeatFailureCancelsContext: when JetStream stops confirming a
// held message's heartbeats (here its consumer was deleted), the
// message's context is cancelled with cause ErrHeartbeat, within the ack
// wait, while the handler still holds it.
func TestHeartbeatFailureCancelsContext(t *testing.T) {
	t.Parallel()
	a := newAdmin(t)
	topic := a.topic("")
	sub := subscriber(t, nats.SubscriberConfig{Config: a.config(), ConsumerGroup: "billing", AckWait: 3 * time.Second, DrainTimeout: time.Second})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	msgs, err := sub.Subscribe(ctx, topic)
	require.NoError(t, err)
	require.NoError(t, publisher(t, a.config()).Publish(topic, message.NewMessage(watermill.NewUUID(), nil)))
	held := msgtest.Receive(t, msgs, 10*time.Second)

	dctx, dcancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer dcancel()
	require.NoError(t, a.js.DeleteConsumer(dctx, nats.Config{}.StreamName(topic), "billing"))
	select {
	case <-held.Context().Done():
	case <-time.After(30 * time.Second):
		t.Fatal("the message's context outlived its heartbeats")
	}
	require.ErrorIs(t, context.Cause(held.Context()), nats.ErrHeartbeat)
	held.Nack()
}

// TestForeignMessages: messages of a producer that is not this package
// are delivered: headers become metadata (several values joined), the
// protocol's Nats-* headers do not, the UUID is the Nats-Msg-Id, else the
// stream and sequence; a message whose metadata header cannot be decoded
// is delivered with delivery.DecodeError and its raw data, not dropped or
// nacked in a loop.
func TestForeignMessages(t *testing.T) {
	t.Parallel()
	a := newAdmin(t)
	topic := a.topic("")
	stream := nats.Config{}.StreamName(topic)
	a.createStream(t, stream, topic)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	publish := func(h natsgo.Header, data string) {
		_, err := a.js.PublishMsg(ctx, &natsgo.Msg{Subject: topic, Header: h, Data: []byte(data)})
		require.NoError(t, err)
	}
	publish(natsgo.Header{"Nats-Msg-Id": {"ext-1"}, "tenant": {"acme"}, "tag": {"a", "b"}}, "with id")
	publish(nil, "bare")
	publish(natsgo.Header{nats.MetadataHeader: {"{not json"}, nats.UUIDHeader: {"uuid-3"}}, "corrupt")

	sub := subscriber(t, nats.SubscriberConfig{Config: a.config(), ConsumerGroup: "billing"})
	msgs, err := sub.Subscribe(ctx, topic)
	require.NoError(t, err)

	got := msgtest.Receive(t, msgs, 10*time.Second)
	require.Equal(t, "ext-1", got.UUID)
	require.Equal(t, "with id", string(got.Payload))
	require.Equal(t, "acme", got.Metadata.Get("tenant"))
	require.Equal(t, "a, b", got.Metadata.Get("tag"))
	require.Empty(t, got.Metadata.Get("Nats-Msg-Id"))
	require.Empty(t, delivery.DecodeErrorOf(got))
	got.Ack()

	got = msgtest.Receive(t, msgs, 10*time.Second)
	require.Equal(t, stream+":2", got.UUID)
	require.Equal(t, "bare", string(got.Payload))
	got.Ack()

	got = msgtest.Receive(t, msgs, 10*time.Second)
	require.Equal(t, "uuid-3", got.UUID)
	require.Equal(t, "corrupt", string(got.Payload))
	require.Contains(t, delivery.DecodeErrorOf(got), "header oncemill_metadata is not a JSON object of strings")
	require.Equal(t, "1", got.Metadata.Get(delivery.Attempts), "delivery facts are set all the same")
	got.Ack()
}

// TestNoJetStream: a server without JetStream fails the constructors with
// ErrNoJetStream and a hint.
func TestNoJetStream(t *testing.T) {
	t.Parallel()
	ns, err := server.NewServer(&server.Options{Host: "127.0.0.1", Port: server.RANDOM_PORT, NoSigs: true, NoLog: true})
	require.NoError(t, err)
	ns.Start()
	defer func() {
		ns.Shutdown()
		ns.WaitForShutdown()
	}()
	require.True(t, ns.ReadyForConnections(10*time.Second))
	_, err = nats.NewPublisher(context.Background(), nats.PublisherConfig{Config: nats.Config{URL: ns.ClientURL()}})
	require.ErrorIs(t, err, nats.ErrNoJetStream)
	require.ErrorContains(t, err, "-js")
	_, err = nats.NewSubscriber(context.Background(), nats.SubscriberConfig{Config: nats.Config{URL: ns.ClientURL()}, ConsumerGroup: "g"})
	require.ErrorIs(t, err, nats.ErrNoJetStream)
}

// TestLongHandlerNoRedelivery is the adapter's reason to be: a handler
// that runs 45s, with an ack wait of 10s and a second subscriber of the
// group waiting for work, is run once and its message delivered once.
// watermill-nats would have JetStream deliver it again after 10s, to the
// other subscriber, while the first handler still runs.
func TestLongHandlerNoRedelivery(t *testing.T) {
	t.Parallel()
	const handlerTime = 45 * time.Second
	a := newAdmin(t)
	topic := a.topic("")
	cfg := nats.SubscriberConfig{Config: a.config(), ConsumerGroup: "billing", AckWait: 10 * time.Second}
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: time.Minute}, testLogger())
	require.NoError(t, err)
	var (
		runs, effects atomic.Int32
		attempts      = make(chan string, 4)
	)
	handler := func(msg *message.Message) error {
		runs.Add(1)
		attempts <- msg.Metadata.Get(delivery.Attempts)
		select {
		case <-time.After(handlerTime):
		case <-msg.Context().Done():
			return context.Cause(msg.Context())
		}
		effects.Add(1)
		return nil
	}
	for i := range 2 { // two processes of the group
		router.AddConsumerHandler("bill_"+strconv.Itoa(i), topic, subscriber(t, cfg), handler)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- router.Run(ctx) }()
	<-router.Running()
	require.NoError(t, publisher(t, a.config()).Publish(topic, message.NewMessage(watermill.NewUUID(), []byte("slow"))))

	stream := nats.Config{}.StreamName(topic)
	require.Eventually(t, func() bool {
		ci := a.consumer(stream, "billing")
		return ci.AckFloor.Stream == 1 && ci.NumAckPending == 0
	}, handlerTime+time.Minute, 100*time.Millisecond, "the message is acked once its handler is done")
	cancel()
	require.NoError(t, <-done)

	ci := a.consumer(stream, "billing")
	require.Equal(t, uint64(1), ci.Delivered.Consumer, "one delivery in all")
	require.Zero(t, ci.NumRedelivered)
	require.Zero(t, ci.NumPending)
	require.Equal(t, int32(1), runs.Load(), "the handler ran once")
	require.Equal(t, int32(1), effects.Load(), "its effect applied once")
	require.Equal(t, "1", <-attempts)
	t.Logf("a %s handler with a %s ack wait: %d run, %d delivery, %d redeliveries", handlerTime, cfg.AckWait, runs.Load(), ci.Delivered.Consumer, ci.NumRedelivered)
}
