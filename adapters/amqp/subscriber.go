package amqp

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/oncemill/oncemill/adapters/internal/keygate"
	"github.com/oncemill/oncemill/adapters/internal/lifecycle"
	"github.com/oncemill/oncemill/delivery"
)

// ErrSubscriberClosed is returned by Subscribe, SubscribeInitialize and
// Backlog (wrapped) once Close has begun.
var ErrSubscriberClosed = errors.New("amqp: subscriber closed")

// Subscriber consumes from RabbitMQ, each subscription on a connection of
// its own that it makes again when it drops, handing out up to
// [Config.Prefetch] messages at once per subscription, in the order of
// each ordering key (see Subscribe). Its Close hands out no more messages,
// then waits up to [Config.DrainTimeout] for the messages already handed
// out to be acked or nacked, with the channels and the connections still
// open, so that those acks reach the broker; only then does it nack what
// is still unacked and close the connections.
//
// watermill-amqp's own subscriber hands out one message at a time per
// subscription, and its Close does not wait: it nacks the message a
// handler holds at once and closes the channel and the connection, so an
// ack that comes later is lost and the message is delivered again.
//
// It is safe for concurrent use.
type Subscriber struct {
	// sub is watermill-amqp's subscriber, whose connection, which it
	// makes again when it drops, serves SubscribeInitialize and Backlog;
	// its Subscribe is not used.
	sub    *wamqp.Subscriber
	cfg    Config
	drain  time.Duration
	logger watermill.LoggerAdapter
	// queues holds each queue's settled arguments and each topic's
	// delivery limit (see settleQueue).
	queues *queues
	// queueName is [Config.QueueName] of the subscriber's config, and url
	// its URL, for the backlog and its errors.
	queueName func(topic string) string
	url       string

	// life is Close and what it waits for, the subscriptions and the
	// backlog reads; its context is done when Close begins: the
	// subscriptions stop consuming and drain.
	life *lifecycle.Closer

	mu sync.Mutex
	// conns are the subscriptions' connections.
	conns map[*amqp091.Connection]bool
}

var (
	_ message.Subscriber           = (*Subscriber)(nil)
	_ message.SubscribeInitializer = (*Subscriber)(nil)
)

func newSubscriber(sub *wamqp.Subscriber, cfg Config, q *queues, logger watermill.LoggerAdapter) *Subscriber {
	return &Subscriber{
		life:      lifecycle.New(),
		conns:     map[*amqp091.Connection]bool{},
		sub:       sub,
		cfg:       cfg,
		queues:    q,
		drain:     cfg.withDefaults().DrainTimeout,
		logger:    logger,
		queueName: cfg.QueueName,
		url:       cfg.URL,
	}
}

// Subscribe declares topic's exchange and queue, binds them and consumes
// from the queue with manual acknowledgement and a prefetch of
// [Config.Prefetch], on a connection of its own, made again (and the
// topology declared again) each time it drops.
//
// Up to Prefetch messages are handed out at once: messages of different
// ordering keys ([delivery.PartitionKeyOf]: the partition_key header,
// else the idempotency key; a message without either is its own key)
// concurrently, a key's messages one at a time, in the order the queue
// delivers them, the next once the
// previous was acked or nacked. A message is acked on the broker when the
// handler acks it, and nacked (requeued, or dropped or dead-lettered under
// [Config.NoRequeueOnNack]) when it nacks. When the connection drops, the
// broker returns the messages not yet acked to the queue: those the
// subscription still holds or a handler still runs are not acked (their
// acks are dropped), and are delivered again.
//
// The channel is closed when ctx is done or Close begins; messages handed
// out before then can still be acked or nacked until the drain ends
// ([Config.DrainTimeout]), and the messages received and not handed out
// are returned to the queue.
func (s *Subscriber) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	if !s.life.Enter() {
		return nil, ErrSubscriberClosed
	}

	// The queue's arguments first, on a connection of its own: a queue
	// that exists with another delivery limit is taken as it is (or
	// refused, see settleQueue) before the subscription declares it with
	// these arguments.
	if err := s.settle(ctx, topic); err != nil {
		s.life.Leave()
		return nil, err
	}
	wcfg, err := s.cfg.WatermillConfig()
	if err != nil {
		s.life.Leave()
		return nil, err
	}
	limit, _ := s.queues.limitOf(topic)
	sub := &subscription{
		s:    s,
		ctx:  ctx,
		wcfg: wcfg,
		params: wamqp.BuildTopologyParams{
			Topic:        topic,
			QueueName:    wcfg.Queue.GenerateName(topic),
			ExchangeName: wcfg.Exchange.GenerateName(topic),
			RoutingKey:   wcfg.QueueBind.GenerateRoutingKey(topic),
		},
		maxDeliveries: limit.Deliveries,
		out:           make(chan *message.Message),
	}
	sub.fields = watermill.LogFields{"topic": topic, "amqp_queue_name": sub.params.QueueName}
	sub.gate = keygate.New(sub.out, wcfg.Consume.Qos.PrefetchCount, keygate.Hooks[*held]{
		Settled:   sub.settled,
		Release:   sub.release,
		Abandoned: sub.abandoned,
	})
	go sub.run()
	return sub.out, nil
}

// Delays before a subscription connects again after its connection
// dropped or could not be set up: doubled at each failure in a row.
const (
	reconnectMin = 100 * time.Millisecond
	reconnectMax = 5 * time.Second
)

// subscription is one Subscribe call: its consumer, on a connection and
// a channel of its own, made again when the connection drops, and the
// gate that hands out what the consumer receives.
type subscription struct {
	s             *Subscriber
	ctx           context.Context
	wcfg          wamqp.Config
	params        wamqp.BuildTopologyParams
	maxDeliveries int
	fields        watermill.LogFields
	out           chan *message.Message
	// gate hands out the deliveries per ordering key to out, which it
	// closes once it hands out nothing more.
	gate *keygate.Gate[*held]
}

// held is a delivery the subscription holds, and its message.
type held struct {
	d      amqp091.Delivery
	msg    *message.Message
	cancel context.CancelFunc
}

// run consumes until the subscription's context is done or Close begins,
// connecting again each time the connection drops, then drains: the gate
// hands out nothing more, gives back what it holds and waits up to the
// drain timeout for the handlers' acks and nacks, the channel still open
// so that they reach the broker, then nacks what handlers still hold.
func (sub *subscription) run() {
	defer sub.s.life.Leave()
	// ctx ends the connection attempts too.
	ctx, cancel := sub.s.life.Join(sub.ctx)
	defer cancel()
	var conn *amqp091.Connection
	retry := reconnectMin
	for {
		var err error
		conn, err = sub.consume(ctx)
		if conn != nil {
			break
		}
		if ctx.Err() != nil {
			break
		}
		if err != nil {
			sub.s.logger.Error("Cannot consume from AMQP queue, retrying", err, sub.fields.Add(watermill.LogFields{"retry_in": retry.String()}))
		} else {
			// It consumed until the connection dropped.
			retry = reconnectMin
		}
		select {
		case <-time.After(retry):
		case <-ctx.Done():
		}
		retry = min(2*retry, reconnectMax)
	}
	if n := sub.gate.Close(sub.s.drain); n > 0 {
		sub.s.logger.Info("Drain timeout: messages still unacked are returned to the queue", sub.fields.Add(watermill.LogFields{
			"in_flight": n, "drain_timeout": sub.s.drain.String(),
		}))
	} else {
		sub.s.logger.Debug("AMQP subscription drained", sub.fields)
	}
	if conn != nil {
		sub.s.closeConn(conn)
	}
	sub.s.logger.Info("Stopped consuming from AMQP channel", sub.fields)
}

// consume connects, opens a channel, declares the topology and adds what
// it receives to the gate, until ctx is done (it returns the connection,
// open, for the drain: the consumer is cancelled) or the connection drops
// or cannot be set up (nil, and the error if any: it has closed the
// connection).
func (sub *subscription) consume(ctx context.Context) (*amqp091.Connection, error) {
	conn, err := dial(ctx, sub.wcfg)
	if err != nil {
		return nil, connectError("subscribe", sub.s.url, errors.Join(err, ctx.Err()))
	}
	sub.s.openConn(conn)
	ch, deliveries, tag, err := sub.open(conn)
	if err != nil {
		sub.s.closeConn(conn)
		return nil, redactErr(err, sub.s.url)
	}
	sub.s.logger.Info("Starting consuming from AMQP channel", sub.fields)
	for {
		select {
		case d, ok := <-deliveries:
			if !ok {
				// The channel or the connection closed: the broker
				// returns what was unacked to the queue, and the acks
				// of what handlers hold are dropped.
				sub.s.logger.Error("AMQP channel closed, connecting again", nil, sub.fields)
				sub.s.closeConn(conn)
				return nil, nil
			}
			sub.add(d)
		case <-ctx.Done():
			sub.stop(ch, tag)
			return conn, nil
		}
	}
}

// open opens a channel on conn with the prefetch, declares the topology
// and starts a consumer on the queue, with manual acknowledgement.
func (sub *subscription) open(conn *amqp091.Connection) (*amqp091.Channel, <-chan amqp091.Delivery, string, error) {
	ch, err := conn.Channel()
	if err != nil {
		return nil, nil, "", fmt.Errorf("open channel: %w", err)
	}
	if err := ch.Qos(sub.wcfg.Consume.Qos.PrefetchCount, 0, false); err != nil {
		return nil, nil, "", fmt.Errorf("set prefetch (Prefetch %d): %w", sub.wcfg.Consume.Qos.PrefetchCount, err)
	}
	if err := (&topology{queues: sub.s.queues}).BuildTopology(ch, sub.params, sub.wcfg, sub.s.logger); err != nil {
		return nil, nil, "", fmt.Errorf("%w: topic %q (queue %q): %w", ErrDeclare, sub.params.Topic, sub.params.QueueName, err)
	}
	tag := "oncemill-" + watermill.NewShortUUID()
	deliveries, err := ch.Consume(sub.params.QueueName, tag, false, false, false, false, nil)
	if err != nil {
		return nil, nil, "", fmt.Errorf("consume from queue %q: %w", sub.params.QueueName, err)
	}
	return ch, deliveries, tag, nil
}

// stop cancels the consumer, so that the broker sends nothing more; ch
// stays open for the drain. What the client received and the
// subscription did not read is returned to the queue when ch closes.
func (sub *subscription) stop(ch *amqp091.Channel, tag string) {
	if err := ch.Cancel(tag, false); err != nil && !errors.Is(err, amqp091.ErrClosed) {
		sub.s.logger.Error("Cannot cancel AMQP consumer", err, sub.fields)
	}
}

// openConn and closeConn keep the subscriptions' connections.
func (s *Subscriber) openConn(conn *amqp091.Connection) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.conns[conn] = true
}

func (s *Subscriber) closeConn(conn *amqp091.Connection) {
	s.mu.Lock()
	delete(s.conns, conn)
	s.mu.Unlock()
	if err := conn.Close(); err != nil && !errors.Is(err, amqp091.ErrClosed) {
		s.logger.Error("Cannot close AMQP connection", err, nil)
	}
}

// add unmarshals d and adds it to the gate, under its ordering key. A
// delivery that cannot be unmarshalled is nacked.
func (sub *subscription) add(d amqp091.Delivery) {
	msg, err := sub.wcfg.Marshaler.Unmarshal(d)
	if err != nil {
		sub.s.logger.Error("Processing message failed, sending nack", err, sub.fields)
		if err := d.Nack(false, !sub.wcfg.Consume.NoRequeueOnNack); err != nil {
			sub.s.logger.Error("Cannot nack message", err, sub.fields)
		}
		return
	}
	if d.Redelivered {
		msg.Metadata.Set(wamqp.MetadataRedeliveredKey, "true")
	}
	if sub.maxDeliveries > 0 {
		msg.Metadata.Set(delivery.MaxDeliveries, strconv.Itoa(sub.maxDeliveries))
	}
	ctx, cancel := context.WithCancel(sub.ctx)
	msg.SetContext(ctx)
	sub.gate.Add(delivery.PartitionKeyOf(msg), msg, &held{d: d, msg: msg, cancel: cancel})
}

// settled acks or nacks h on the broker, as its handler did. On a channel
// that has closed meanwhile nothing is sent: the broker has returned the
// message to the queue already.
func (sub *subscription) settled(h *held, acked bool) {
	defer h.cancel()
	var err error
	if acked {
		err = h.d.Ack(false)
	} else {
		err = h.d.Nack(false, !sub.wcfg.Consume.NoRequeueOnNack)
	}
	sub.settleErr(h, err)
}

// abandoned nacks h, whose handler still runs when the drain ends, as a
// nack of the handler would be.
func (sub *subscription) abandoned(h *held) {
	sub.settled(h, false)
}

// release returns deliveries never handed out to the queue.
func (sub *subscription) release(hs []*held) {
	for _, h := range hs {
		h.cancel()
		sub.settleErr(h, h.d.Nack(false, true))
	}
}

func (sub *subscription) settleErr(h *held, err error) {
	fields := sub.fields.Add(watermill.LogFields{"message_uuid": h.msg.UUID})
	switch {
	case errors.Is(err, amqp091.ErrClosed):
		sub.s.logger.Debug("AMQP channel closed before the ack or nack: the broker delivers the message again", fields)
	case err != nil:
		sub.s.logger.Error("Cannot ack or nack message", err, fields)
	}
}

// SubscribeInitialize declares topic's exchange and queue and binds them.
func (s *Subscriber) SubscribeInitialize(topic string) error {
	if s.life.Closed() {
		return ErrSubscriberClosed
	}
	if err := s.settle(context.Background(), topic); err != nil {
		return err
	}
	return s.sub.SubscribeInitialize(topic)
}

// Close stops every subscription, which hands out no more messages and
// closes its channel of messages, waits up to [Config.DrainTimeout] for
// the messages handed out to be acked or nacked, whose acks and nacks
// still reach the broker, then nacks what is still unacked, with requeue
// (or without under [Config.NoRequeueOnNack]), and closes the
// subscriptions' connections and its own; the messages received and not
// handed out are returned to the queue as Close begins. A message's context is cancelled once it is acked
// or nacked, or when the drain ends; it derives from the Subscribe
// context, which a router that closes cancels itself. Close returns once
// every goroutine the subscriber started has stopped; a handler that
// outlives the drain runs on, in the router, and its ack is lost. Close
// is idempotent: every call returns the first one's result once it has
// finished.
func (s *Subscriber) Close() error {
	// The subscriptions drain, each up to the drain timeout, and close
	// their channels, before the shared connection closes.
	return s.life.Close(func() error {
		err := s.sub.Close()
		s.logger.Debug("AMQP subscriber closed", nil)
		return err
	})
}
