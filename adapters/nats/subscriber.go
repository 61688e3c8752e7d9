package nats

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/oncemill/oncemill/adapters/internal/keygate"
	"github.com/oncemill/oncemill/adapters/internal/lifecycle"
	"github.com/oncemill/oncemill/delivery"
)

const (
	// fetchWait is how long one pull request waits for messages. Close
	// does not wait for it: it cancels it.
	fetchWait = 30 * time.Second
	// fetchRetryMin and fetchRetryMax bound the pause after a failed
	// pull, which doubles while the failures go on.
	fetchRetryMin = 250 * time.Millisecond
	fetchRetryMax = 10 * time.Second
)

// Acknowledgement bodies of the JetStream protocol, sent as requests to a
// message's reply subject: the server answers each, which confirms that
// it has it.
var (
	ackAck      = []byte("+ACK")
	ackProgress = []byte("+WPI")
	ackNak      = []byte("-NAK")
)

// Subscriber consumes Watermill messages from JetStream through one
// durable pull consumer per topic and consumer group. It is safe for
// concurrent use.
//
// NewSubscriber opens a connection. Each Subscribe call starts goroutines,
// owned by the Subscriber and stopped by Close or by the cancellation of
// Subscribe's context: one that pulls messages, a per-key gate that hands
// them to the output channel (with a goroutine per message handed out,
// which waits for its ack or nack), and one per message held, which sends
// its heartbeats and its ack or nack.
type Subscriber struct {
	cfg    SubscriberConfig
	client *client
	logger watermill.LoggerAdapter

	// life is Close and the subscriptions it waits for; its context
	// ends every subscription's.
	life *lifecycle.Closer
}

var (
	_ message.Subscriber           = (*Subscriber)(nil)
	_ message.SubscribeInitializer = (*Subscriber)(nil)
)

// NewSubscriber validates a copy of cfg with its defaults applied, connects
// to NATS within ctx and [Config.ConnectTimeout], and checks that the
// account has JetStream. It makes no consumer: Subscribe and
// SubscribeInitialize do, once they know the topic.
func NewSubscriber(ctx context.Context, cfg SubscriberConfig) (*Subscriber, error) {
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	c, err := connect(ctx, cfg.Config, "oncemill subscriber "+cfg.ConsumerGroup)
	if err != nil {
		return nil, err
	}
	return &Subscriber{
		cfg:    cfg,
		client: c,
		logger: cfg.Logger.With(watermill.LogFields{"consumer_group": cfg.ConsumerGroup}),
		life:   lifecycle.New(),
	}, nil
}

// Subscribe makes sure topic's stream and the group's durable consumer
// exist with the subscriber's settings, starts pulling from the consumer
// and returns the channel of its messages. A stream that does not exist
// fails with [ErrStreamNotFound] unless [Config.CreateStreams] is set; a
// consumer that exists with other settings fails with
// [ErrConsumerMismatch], naming each field that differs. The channel is
// closed when ctx is cancelled or the subscriber closes.
//
// The subscription holds at most [SubscriberConfig.MaxInFlight] messages
// (handed out, or fetched and about to be) and asks JetStream for more
// only when it holds fewer. It hands them out concurrently, keeping the
// order of each ordering key ([delivery.PartitionKeyOf], the partition_key
// header; a message without one is its own key): messages of different
// keys are in flight at once, up to MaxInFlight, a key's one at a time,
// in the order JetStream delivered them, the next once the previous is
// acked or nacked. A nacked message comes back after its backoff, behind
// the key's later messages: JetStream redelivers it out of its original
// order anyway (see the package doc). From the moment a message arrives until it is
// acked or nacked, the subscription tells JetStream every third of its ack
// wait that it is still in progress, so JetStream does not deliver it
// again meanwhile. When two heartbeats in a row fail, which leaves too
// little of the ack wait for a third, the message's context is cancelled
// with cause [ErrHeartbeat]: JetStream will deliver it again, and the
// handler should stop. An ack is sent as a request that JetStream
// confirms, sent again (for up to 10s) when the connection drops before
// the answer or JetStream answers "no responders", as it does while the
// server shuts down; a nack asks JetStream to deliver the message again
// after [SubscriberConfig.NackBackoff] of its attempt.
//
// When the subscription ends (ctx is done or the subscriber closes) it
// drains: it fetches and hands out nothing more, nacks at once the
// messages fetched but not handed out, and waits up to
// [SubscriberConfig.DrainTimeout] for the handlers' acks and nacks, the
// heartbeats still going; a message still held then has its context
// cancelled and is delivered again after its ack wait.
//
// Every message has the metadata delivery.Topic (topic), delivery.Stream,
// delivery.StreamSequence, delivery.Attempts (NumDelivered) and
// delivery.Redelivered, and delivery.MaxDeliveries (the consumer's
// MaxDeliver) when the consumer has a limit; its context derives from
// ctx.
func (s *Subscriber) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	if !s.life.Enter() {
		return nil, fmt.Errorf("nats: subscribe to %q: %w", topic, ErrClosed)
	}
	subCtx, cancel := s.life.Join(ctx)
	cons, err := s.consumer(subCtx, topic)
	if err != nil {
		cancel()
		s.life.Leave()
		if s.life.Closed() {
			return nil, fmt.Errorf("nats: subscribe to %q: %w", topic, ErrClosed)
		}
		return nil, fmt.Errorf("nats: subscribe to %q: %w", topic, err)
	}
	info := cons.CachedInfo()
	sub := &subscription{
		s:       s,
		cfg:     s.cfg,
		cons:    cons,
		topic:   topic,
		ctx:     subCtx,
		cancel:  cancel,
		msgCtx:  ctx,
		out:     make(chan *message.Message),
		slots:   keygate.NewRoom(s.cfg.MaxInFlight),
		abandon: make(chan struct{}),
		logger:  s.logger.With(watermill.LogFields{"topic": topic, "stream": info.Stream, "consumer": info.Name}),
	}
	sub.gate = keygate.New(sub.out, s.cfg.MaxInFlight, keygate.Hooks[*held]{
		// The holders ack and nack; a message never handed out is
		// nacked without delay.
		Release: func(hs []*held) {
			for _, h := range hs {
				sub.release(h)
			}
		},
	})
	go sub.run()
	sub.logger.Debug("Subscribed to JetStream consumer", nil)
	return sub.out, nil
}

// SubscribeInitialize makes sure topic's stream (created with
// [Config.CreateStreams]) and the group's durable consumer exist, as
// Subscribe does, without subscribing. It implements
// message.SubscribeInitializer.
func (s *Subscriber) SubscribeInitialize(topic string) error {
	if s.life.Closed() {
		return fmt.Errorf("nats: initialize %q: %w", topic, ErrClosed)
	}
	if _, err := s.consumer(s.life.Context(), topic); err != nil {
		return fmt.Errorf("nats: initialize %q: %w", topic, err)
	}
	return nil
}

// Close ends every subscription, draining each as Subscribe describes,
// waits for the goroutines and closes the connection. Close is
// idempotent; every call returns nil once the first has finished.
func (s *Subscriber) Close() error {
	return s.life.Close(func() error {
		s.client.close()
		s.logger.Debug("NATS subscriber closed", nil)
		return nil
	})
}

// consumerConfig is the config of the group's durable consumer of topic.
func (s *Subscriber) consumerConfig(topic string) jetstream.ConsumerConfig {
	return jetstream.ConsumerConfig{
		Durable:       s.cfg.ConsumerName(topic),
		Description:   "Group " + s.cfg.ConsumerGroup + " of topic " + topic + ", created by oncemill",
		DeliverPolicy: jetstream.DeliverAllPolicy,
		AckPolicy:     jetstream.AckExplicitPolicy,
		AckWait:       s.cfg.AckWait,
		MaxDeliver:    s.cfg.MaxDeliver,
		BackOff:       slices.Clone(s.cfg.BackOff),
		MaxAckPending: s.cfg.MaxAckPending,
		FilterSubject: topic,
		ReplayPolicy:  jetstream.ReplayInstantPolicy,
	}
}

// consumer returns the group's durable consumer of topic, created if it
// does not exist, after checking its settings.
func (s *Subscriber) consumer(ctx context.Context, topic string) (jetstream.Consumer, error) {
	stream, err := s.client.stream(ctx, topic, s.cfg.CreateStreams)
	if err != nil {
		return nil, err
	}
	want := s.consumerConfig(topic)
	streamName := stream.CachedInfo().Config.Name
	ctx, cancel := context.WithTimeout(ctx, requestTimeout)
	defer cancel()
	cons, err := stream.Consumer(ctx, want.Durable)
	if errors.Is(err, jetstream.ErrConsumerNotFound) {
		cons, err = stream.CreateConsumer(ctx, want)
		if err == nil {
			s.logger.Info("Created JetStream durable consumer", watermill.LogFields{"stream": streamName, "consumer": want.Durable, "topic": topic})
		} else if errors.Is(err, jetstream.ErrConsumerExists) || errors.Is(err, jetstream.ErrConsumerNameAlreadyInUse) {
			// Created meanwhile, with other settings than these in
			// some field: say which, below.
			cons, err = stream.Consumer(ctx, want.Durable)
		}
	}
	if errors.Is(err, jetstream.ErrStreamNotFound) {
		s.client.forget(topic)
	}
	if err != nil {
		return nil, fmt.Errorf("nats: durable consumer %q of stream %q: %w", want.Durable, streamName, err)
	}
	if diffs := consumerDiff(cons.CachedInfo().Config, want); len(diffs) > 0 {
		return nil, fmt.Errorf("%w: consumer %q of stream %q has %s; delete it (nats consumer rm %s %s) to have it made again, which replays the stream from its start, or subscribe with its settings",
			ErrConsumerMismatch, want.Durable, streamName, strings.Join(diffs, ", "), streamName, want.Durable)
	}
	return cons, nil
}

// consumerDiff names each setting the subscriber owns in which got, an
// existing consumer's config, differs from want, with both values.
func consumerDiff(got, want jetstream.ConsumerConfig) []string {
	var diffs []string
	differ := func(field string, g, w any) {
		diffs = append(diffs, fmt.Sprintf("%s %v (want %v)", field, g, w))
	}
	if got.DeliverSubject != "" {
		differ("DeliverSubject (a push consumer)", strconv.Quote(got.DeliverSubject), `"" (a pull consumer)`)
	}
	if got.DeliverPolicy != want.DeliverPolicy {
		differ("DeliverPolicy", got.DeliverPolicy, want.DeliverPolicy)
	}
	if got.AckPolicy != want.AckPolicy {
		differ("AckPolicy", got.AckPolicy, want.AckPolicy)
	}
	if got.AckWait != want.AckWait {
		differ("AckWait (ack_wait)", got.AckWait, want.AckWait)
	}
	if got.MaxDeliver != want.MaxDeliver {
		differ("MaxDeliver (max_deliver)", got.MaxDeliver, want.MaxDeliver)
	}
	if !slices.Equal(got.BackOff, want.BackOff) {
		differ("BackOff (backoff)", got.BackOff, want.BackOff)
	}
	if got.MaxAckPending != want.MaxAckPending {
		differ("MaxAckPending (max_ack_pending)", got.MaxAckPending, want.MaxAckPending)
	}
	filter := got.FilterSubjects
	if got.FilterSubject != "" {
		filter = append([]string{got.FilterSubject}, filter...)
	}
	if !slices.Equal(filter, []string{want.FilterSubject}) {
		differ("FilterSubject (filter_subject)", strconv.Quote(strings.Join(filter, ", ")), strconv.Quote(want.FilterSubject))
	}
	if got.InactiveThreshold != 0 {
		// JetStream would delete the consumer after that long without
		// a subscriber, and the next Subscribe would make it again and
		// replay the stream.
		differ("InactiveThreshold (inactive_threshold)", got.InactiveThreshold, time.Duration(0))
	}
	return diffs
}

// subscription is one Subscribe call: its pull loop, its gate and the
// holders of its messages.
type subscription struct {
	s      *Subscriber
	cfg    SubscriberConfig
	cons   jetstream.Consumer
	logger watermill.LoggerAdapter
	topic  string

	// ctx ends the subscription: no more pulls or hand-outs. It is
	// Subscribe's context, also cancelled by Close.
	ctx    context.Context
	cancel context.CancelFunc
	// msgCtx, Subscribe's context, is the parent of the message
	// contexts, which Close leaves alone until the drain ends.
	msgCtx context.Context
	out    chan *message.Message

	// slots holds a token for each message held, fetched or handed out
	// and not yet acked or nacked: at most MaxInFlight.
	slots *keygate.Room
	// gate hands out the messages fetched, per ordering key, to out,
	// which it closes once it hands out nothing more.
	gate *keygate.Gate[*held]
	// abandon is closed when the drain ends: holders stop.
	abandon chan struct{}
	holders sync.WaitGroup
}

// held is a message that the subscription holds.
type held struct {
	m        jetstream.Msg
	msg      *message.Message
	attempt  int
	received time.Time
	cancel   context.CancelCauseFunc
	// released is set for a message never handed out: its nack asks for
	// no delay.
	released atomic.Bool
	fields   watermill.LogFields
}

// run pulls messages, which the gate hands out, until the subscription
// ends, then drains: the gate hands out nothing more, gives back the
// messages it holds, and waits up to DrainTimeout for the handlers' acks
// and nacks; the holders of the messages still held then stop.
func (sub *subscription) run() {
	defer sub.s.life.Leave()
	defer sub.cancel()
	sub.pull()
	if sub.gate.Close(sub.cfg.DrainTimeout) > 0 {
		close(sub.abandon)
	}
	sub.holders.Wait()
}

// pull fetches messages while the subscription holds fewer than
// MaxInFlight, as many as it has room for, until the subscription ends.
func (sub *subscription) pull() {
	keygate.Poll(sub.ctx, sub.slots, sub.fetch, func(err error, retryIn time.Duration) {
		sub.logger.Error("Cannot fetch from JetStream consumer, retrying", err, watermill.LogFields{"retry_in": retryIn.String()})
	}, keygate.Backoff{Min: fetchRetryMin, Max: fetchRetryMax})
}

// fetch asks for up to n messages and holds each as it arrives. It
// returns how many arrived. While the client is disconnected it waits for
// the next connection; a connection that drops ends the pull, which the
// server lost with it (a restarted server knows nothing of it), so that
// the next pull goes out as soon as the client has reconnected.
func (sub *subscription) fetch(n int) (int, error) {
	lost, err := sub.s.client.link(sub.ctx)
	if err != nil {
		return 0, nil // the subscription ended
	}
	ctx, cancel := context.WithTimeout(sub.ctx, fetchWait)
	defer cancel()
	defer context.AfterFunc(lost, cancel)()
	batch, err := sub.cons.Fetch(n, jetstream.FetchContext(ctx))
	if err != nil {
		if lost.Err() != nil && sub.ctx.Err() == nil {
			return 0, nil
		}
		return 0, err
	}
	got := 0
	for m := range batch.Messages() {
		got++
		sub.hold(m)
	}
	err = batch.Error()
	switch {
	case sub.ctx.Err() != nil:
	case errors.Is(err, context.DeadlineExceeded):
		return got, nil // the pull expired on our side first
	case lost.Err() != nil:
		sub.logger.Debug("The connection to NATS dropped during a pull; pulling again once reconnected", watermill.LogFields{"received": got})
		return got, nil
	}
	return got, err
}

// hold starts the holder of m, which heartbeats from now on, and queues m
// at the gate behind the earlier messages of its ordering key.
func (sub *subscription) hold(m jetstream.Msg) {
	received := time.Now()
	meta, _ := m.Metadata()
	msg := unmarshal(m, sub.topic, meta)
	attempt := 1
	if meta != nil {
		attempt = max(int(meta.NumDelivered), 1)
	}
	if max := sub.cons.CachedInfo().Config.MaxDeliver; max > 0 {
		msg.Metadata.Set(delivery.MaxDeliveries, strconv.Itoa(max))
	}
	ctx, cancel := context.WithCancelCause(sub.msgCtx)
	msg.SetContext(ctx)
	h := &held{
		m:        m,
		msg:      msg,
		attempt:  attempt,
		received: received,
		cancel:   cancel,
		fields: watermill.LogFields{
			"message_uuid":    msg.UUID,
			"stream_sequence": msg.Metadata.Get(delivery.StreamSequence),
			"attempt":         attempt,
		},
	}
	if why := delivery.DecodeErrorOf(msg); why != "" {
		sub.logger.Error("Cannot decode JetStream message; delivering it with its decode error", nil, h.fields.Add(watermill.LogFields{"decode_error": why}))
	}
	sub.holders.Add(1)
	go sub.keep(h)
	sub.gate.Add(delivery.PartitionKeyOf(msg), msg, h)
}

// release gives back a message that was never handed out: its holder
// nacks it without delay, for another subscriber to take at once.
func (sub *subscription) release(h *held) {
	h.released.Store(true)
	h.msg.Nack()
}

// keep holds h until it is acked or nacked, or the drain ends: it sends a
// heartbeat every third of the message's ack wait, and cancels the
// message's context when the heartbeats fail for so long that JetStream
// may deliver the message again before the next one.
func (sub *subscription) keep(h *held) {
	defer sub.holders.Done()
	// The slot is given back once the handler has acked or nacked, before
	// JetStream confirms it, so that the next pull overlaps the ack's
	// round trip: the handler no longer holds the message.
	var released bool
	release := func() {
		if !released {
			released = true
			sub.slots.Free(1)
		}
	}
	defer release()
	defer h.cancel(nil)
	deadline := sub.cfg.ackDeadline(h.attempt)
	interval := deadline / 3
	t := time.NewTicker(interval)
	defer t.Stop()
	// confirmed is when JetStream last restarted the ack wait, at the
	// latest: the message's arrival, then the sending of each heartbeat
	// it confirmed.
	confirmed, alive := h.received, true
	for {
		select {
		case <-h.msg.Acked():
			release()
			sub.ack(h)
			return
		case <-h.msg.Nacked():
			release()
			sub.nak(h)
			return
		case <-sub.abandon:
			sub.logger.Info("Drain timeout while the handler holds a message; JetStream delivers it again after its ack wait",
				h.fields.Add(watermill.LogFields{"drain_timeout": sub.cfg.DrainTimeout.String()}))
			return
		case <-t.C:
			if !alive {
				continue
			}
			sent := time.Now()
			err := sub.reply(h, ackProgress, interval/2)
			if err == nil {
				confirmed = sent
				continue
			}
			if time.Since(confirmed)+interval < deadline {
				sub.logger.Info("Heartbeat to JetStream failed, trying again", h.fields.Add(watermill.LogFields{"err": err.Error()}))
				continue
			}
			alive = false
			h.cancel(ErrHeartbeat)
			sub.logger.Error("Heartbeats to JetStream failed; the message's context is cancelled, as JetStream will deliver it again", err,
				h.fields.Add(watermill.LogFields{"since_confirmed": time.Since(confirmed).String(), "ack_wait": deadline.String()}))
		}
	}
}

// ack acknowledges h and waits for JetStream to confirm it (a double
// ack). When that fails, JetStream delivers the message again after its
// ack wait, and the inbox absorbs the duplicate.
func (sub *subscription) ack(h *held) {
	if err := sub.reply(h, ackAck, requestTimeout); err != nil {
		sub.logger.Error("JetStream did not confirm an ack; it will deliver the message again after its ack wait", err, h.fields)
		return
	}
	sub.logger.Trace("Message acked", h.fields)
}

// nak asks JetStream to deliver h again: after the NackBackoff of its
// attempt, or at once for a message never handed out.
func (sub *subscription) nak(h *held) {
	var delay time.Duration
	if !h.released.Load() {
		delay = max(sub.cfg.NackBackoff(h.attempt), 0)
	}
	body := ackNak
	if delay > 0 {
		body = fmt.Appendf(nil, `%s {"delay": %d}`, ackNak, delay.Nanoseconds())
	}
	fields := h.fields.Add(watermill.LogFields{"delay": delay.String()})
	if err := sub.reply(h, body, requestTimeout); err != nil {
		sub.logger.Error("JetStream did not confirm a nack; it will deliver the message again after its ack wait", err, fields)
		return
	}
	sub.logger.Debug("Message nacked", fields)
}

// reply sends body to h's reply subject as a request and waits up to
// timeout for JetStream's answer, sending it again when the connection
// drops before the answer came or JetStream answered "no responders"
// (see client.request). An ack, a nack or a heartbeat can be taken twice,
// and one for a message no longer pending changes nothing. JetStream
// applies each to the message's stream sequence, not to the delivery: one
// sent again after JetStream delivered the message anew acts on the newer
// delivery. An ack then settles a message whose handler has finished; a
// nack or a heartbeat only moves the time of its next delivery, which the
// inbox absorbs.
func (sub *subscription) reply(h *held, body []byte, timeout time.Duration) error {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	return sub.s.client.request(ctx, h.m.Reply(), body)
}
