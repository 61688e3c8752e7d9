package sqs

import (
	"context"
	"fmt"
	"strconv"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/sqs"
	"github.com/aws/aws-sdk-go-v2/service/sqs/types"

	"github.com/oncemill/oncemill/adapters/internal/keygate"
	"github.com/oncemill/oncemill/adapters/internal/lifecycle"
	"github.com/oncemill/oncemill/delivery"
)

const (
	// requestTimeout bounds one SQS request other than a long poll, and
	// what a long poll may take beyond its WaitTime.
	requestTimeout = 30 * time.Second
	// deleteAttempts is how often an acked message's deletion is tried.
	deleteAttempts = 3
	// deleteRetryDelay is the pause before the second deletion attempt;
	// it doubles for each further one.
	deleteRetryDelay = 100 * time.Millisecond
	// receiveRetryMin and receiveRetryMax bound the pause after a failed
	// ReceiveMessage, which doubles while the failures go on.
	receiveRetryMin = 250 * time.Millisecond
	receiveRetryMax = 10 * time.Second
)

// Subscriber consumes Watermill messages from SQS queues, one queue per
// topic. It is safe for concurrent use.
//
// Each Subscribe call starts goroutines, owned by the Subscriber and
// stopped by Close or by the cancellation of Subscribe's context: one
// polls the queue, a per-key gate hands the messages to the output channel
// (with a goroutine per message handed out, which waits for its ack or
// nack and then deletes it or sets its backoff), and one extends the
// visibility timeout of the messages the subscription holds. NewSubscriber
// starts none.
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

// NewSubscriber returns a subscriber for cfg. It validates a copy of cfg
// with its defaults applied and builds the SQS client; it makes no request
// and starts no goroutines.
func NewSubscriber(cfg SubscriberConfig) (*Subscriber, error) {
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	c, err := newClient(cfg.Config)
	if err != nil {
		return nil, err
	}
	return &Subscriber{
		cfg:    cfg,
		client: c,
		logger: cfg.Logger,
		life:   lifecycle.New(),
	}, nil
}

// Subscribe looks up topic's queue (creating it with
// [Config.CreateQueueIfMissing]), starts polling it and returns the channel
// of its messages. The channel is closed when ctx is cancelled or the
// subscriber is closed.
//
// The subscription holds at most [SubscriberConfig.MaxInFlight] messages
// (received and not yet acked or nacked) and receives again only when it
// holds fewer, asking for as many as it has room for, up to
// MaxNumberOfMessages a receive. It hands
// them out concurrently, keeping the order of each ordering key: on a FIFO
// queue the message group, on a standard queue [delivery.PartitionKeyOf]
// the message (the partition_key attribute, else idempotency_key; a
// message without one is its own key). Messages of different keys are in
// flight at once, a key's one at a time in the order received, the next
// once the previous is acked or nacked. An ack deletes the message from
// the queue; a nack makes it visible again after
// [SubscriberConfig.NackBackoff]. When the subscription ends (ctx is done
// or the subscriber closes) while handlers hold messages, it drains: it
// hands out nothing more and waits up to [SubscriberConfig.DrainTimeout]
// for the acks (which delete the messages) and nacks, the heartbeat still
// extending the messages' visibility; a message neither acked nor nacked
// by then is left as it is, and SQS delivers it again once its visibility
// timeout has passed. Messages received but not yet handed out when it
// ends are made visible at once.
//
// Every message has the metadata delivery.Topic (topic) and
// delivery.Attempts (ApproximateReceiveCount), and delivery.MaxDeliveries
// (the maxReceiveCount of the queue's redrive policy, read as the
// subscription begins) when the queue has one; its context derives from
// ctx and is cancelled once the message is acked or nacked or the drain
// ends; Close does not cancel it before (a router that closes cancels ctx
// itself). A message that cannot be decoded is still delivered,
// with delivery.DecodeError set and the raw body as payload.
//
// On a FIFO queue the order within a message group is kept, across
// nacks too: after a nack, the messages of the same group that the
// subscription holds are made visible again instead of being handed out,
// so that SQS delivers them after the nacked one. On a standard queue a
// nacked message comes back after its backoff, behind the key's later
// messages, which are handed out meanwhile: SQS keeps no order to
// restore.
func (s *Subscriber) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	if !s.life.Enter() {
		return nil, fmt.Errorf("sqs: subscribe to %q: %w", topic, ErrClosed)
	}
	subCtx, cancel := s.life.Join(ctx)
	name, url, err := s.client.queueURL(subCtx, topic, s.cfg.CreateQueueIfMissing)
	if err != nil {
		cancel()
		s.life.Leave()
		if s.life.Closed() {
			return nil, fmt.Errorf("sqs: subscribe to %q: %w", topic, ErrClosed)
		}
		return nil, fmt.Errorf("sqs: subscribe to %q: %w", topic, err)
	}

	limit, err := s.client.redriveLimit(subCtx, name, url)
	if err != nil {
		cancel()
		s.life.Leave()
		return nil, fmt.Errorf("sqs: subscribe to %q: %w", topic, err)
	}

	hbCtx, stopHeartbeat := context.WithCancel(context.WithoutCancel(subCtx))
	receiveCtx, stopReceive := context.WithCancel(context.WithoutCancel(subCtx))
	sub := &subscription{
		s:             s,
		api:           s.client.api,
		cfg:           s.cfg,
		topic:         topic,
		queue:         name,
		url:           url,
		fifo:          isFIFO(name),
		maxReceives:   limit.Deliveries,
		ctx:           subCtx,
		cancel:        cancel,
		msgCtx:        ctx,
		hbCtx:         hbCtx,
		receiveCtx:    receiveCtx,
		stopReceive:   stopReceive,
		stopHeartbeat: stopHeartbeat,
		out:           make(chan *message.Message),
		slots:         keygate.NewRoom(s.cfg.MaxInFlight),
		held:          map[string]types.Message{},
		logger:        s.logger.With(watermill.LogFields{"topic": topic, "queue": name}),
		visSecs:       int32(s.cfg.VisibilityTimeout / time.Second),
	}
	sub.gate = keygate.New(sub.out, s.cfg.MaxInFlight, keygate.Hooks[*held]{
		Settled:           sub.settled,
		Release:           sub.releaseHeld,
		Abandoned:         sub.abandoned,
		ReleaseBehindNack: sub.fifo,
	})
	s.life.Go(sub.heartbeat)
	go sub.run()
	sub.logger.Debug("Subscribed to SQS queue", watermill.LogFields{"queue_url": url})
	return sub.out, nil
}

// SubscribeInitialize creates topic's queue, with [Config.QueueAttributes],
// unless it exists. It implements message.SubscribeInitializer.
func (s *Subscriber) SubscribeInitialize(topic string) error {
	if s.life.Closed() {
		return fmt.Errorf("sqs: initialize %q: %w", topic, ErrClosed)
	}
	ctx, cancel := context.WithTimeout(s.life.Context(), requestTimeout)
	defer cancel()
	if _, _, err := s.client.queueURL(ctx, topic, true); err != nil {
		return fmt.Errorf("sqs: initialize %q: %w", topic, err)
	}
	return nil
}

// Close ends every subscription: it cancels their polls, hands out
// nothing more, waits up to [SubscriberConfig.DrainTimeout] for the
// messages handlers hold to be acked (deleted) or nacked, keeping them
// invisible meanwhile, then cancels the contexts of those still held,
// waits for the goroutines and closes the channels. A message still held
// after the drain is neither deleted nor nacked: SQS delivers it again
// after its visibility timeout. Messages received but not yet handed out
// are made visible at once. Close is idempotent; every call returns nil
// once the first has finished.
func (s *Subscriber) Close() error {
	return s.life.Close(func() error {
		s.client.close()
		s.logger.Debug("SQS subscriber closed", nil)
		return nil
	})
}

// subscription is one Subscribe call: its poll loop and heartbeat.
type subscription struct {
	s      *Subscriber
	api    *sqs.Client
	cfg    SubscriberConfig
	logger watermill.LoggerAdapter

	topic, queue, url string
	fifo              bool
	visSecs           int32
	// maxReceives is the maxReceiveCount of the queue's redrive policy,
	// read when the subscription began; 0 without one.
	maxReceives int

	// ctx ends the subscription: no more polls or hand-outs. It is
	// Subscribe's context, also cancelled by Close.
	ctx    context.Context
	cancel context.CancelFunc
	// receiveCtx bounds the receive requests: it outlives ctx by the
	// drain (see run).
	receiveCtx  context.Context
	stopReceive context.CancelFunc
	// msgCtx, Subscribe's context, is the parent of the message
	// contexts, which Close leaves alone until the drain ends.
	msgCtx context.Context
	// hbCtx is the heartbeat's: it outlives ctx by the drain, so that a
	// message a handler finishes meanwhile stays invisible.
	hbCtx         context.Context
	stopHeartbeat context.CancelFunc
	out           chan *message.Message

	// slots holds a token for each message held, received and not yet
	// acked, nacked or given back: at most MaxInFlight.
	slots *keygate.Room
	// gate hands out the messages received, per ordering key, to out,
	// which it closes once it hands out nothing more.
	gate *keygate.Gate[*held]

	// mu guards held and is held for the whole of each heartbeat request,
	// so that once a message leaves held no heartbeat extends it any more
	// (a late extension would undo a nack's backoff).
	mu   sync.Mutex
	held map[string]types.Message // by receipt handle
}

// held is a message the subscription holds, at the gate or handed out.
type held struct {
	m      types.Message
	msg    *message.Message
	cancel context.CancelFunc
	fields watermill.LogFields
}

// run polls the queue, while the subscription holds fewer than
// MaxInFlight, until the subscription ends; then the gate drains.
//
// A receive in flight when the subscription ends is left to finish while
// the gate drains, and what it returns is given back at once: cancelled,
// its messages, which SQS may already have handed to it, would stay
// hidden for their visibility timeout. Once the drain ends (at once when
// no handler holds a message) a receive still waiting is cancelled.
func (sub *subscription) run() {
	defer sub.s.life.Leave()
	defer sub.stopHeartbeat()
	defer sub.cancel()
	polled := make(chan struct{})
	go func() {
		defer close(polled)
		sub.poll()
	}()
	<-sub.ctx.Done()
	if n := sub.gate.Close(sub.cfg.DrainTimeout); n > 0 {
		sub.logger.Info("Drain timeout while handlers hold messages; SQS delivers them again after their visibility timeout",
			watermill.LogFields{"messages": n, "drain_timeout": sub.cfg.DrainTimeout.String()})
	}
	sub.stopReceive()
	<-polled
}

// poll receives messages for the gate while there is room for them, until
// the subscription ends.
func (sub *subscription) poll() {
	keygate.Poll(sub.ctx, sub.slots, func(n int) (int, error) {
		msgs, err := sub.receive(min(n, sub.cfg.MaxNumberOfMessages))
		for _, m := range msgs {
			sub.add(m)
		}
		return len(msgs), err
	}, func(err error, retryIn time.Duration) {
		sub.logger.Error("Cannot receive from SQS queue, retrying", err, watermill.LogFields{"retry_in": retryIn.String()})
	}, keygate.Backoff{Min: receiveRetryMin, Max: receiveRetryMax})
}

// receive long-polls the queue once for up to n messages and holds what
// it returns.
func (sub *subscription) receive(n int) ([]types.Message, error) {
	ctx, cancel := context.WithTimeout(sub.receiveCtx, sub.cfg.WaitTime+requestTimeout)
	defer cancel()
	out, err := sub.api.ReceiveMessage(ctx, &sqs.ReceiveMessageInput{
		QueueUrl:                    aws.String(sub.url),
		MaxNumberOfMessages:         int32(n),
		WaitTimeSeconds:             int32(sub.cfg.WaitTime / time.Second),
		VisibilityTimeout:           sub.visSecs,
		MessageAttributeNames:       []string{"All"},
		MessageSystemAttributeNames: []types.MessageSystemAttributeName{types.MessageSystemAttributeNameAll},
	})
	if err != nil {
		return nil, err
	}
	sub.mu.Lock()
	for _, m := range out.Messages {
		sub.held[aws.ToString(m.ReceiptHandle)] = m
	}
	sub.mu.Unlock()
	return out.Messages, nil
}

// add queues m at the gate behind the earlier messages of its ordering
// key: its FIFO group, or on a standard queue its partition key.
func (sub *subscription) add(m types.Message) {
	msg := unmarshal(m, sub.topic)
	if sub.maxReceives > 0 {
		msg.Metadata.Set(delivery.MaxDeliveries, strconv.Itoa(sub.maxReceives))
	}
	ctx, cancel := context.WithCancel(sub.msgCtx)
	msg.SetContext(ctx)
	h := &held{m: m, msg: msg, cancel: cancel, fields: watermill.LogFields{
		"message_uuid":   msg.UUID,
		"sqs_message_id": aws.ToString(m.MessageId),
		"attempt":        attempt(m),
	}}
	if why := delivery.DecodeErrorOf(msg); why != "" {
		sub.logger.Error("Cannot decode SQS message; delivering it with its decode error", nil, h.fields.Add(watermill.LogFields{"decode_error": why}))
	}
	key := delivery.PartitionKeyOf(msg)
	if sub.fifo {
		key = m.Attributes[string(types.MessageSystemAttributeNameMessageGroupId)]
	}
	sub.gate.Add(key, msg, h)
}

// settled deletes an acked message, or sets the backoff of a nacked one,
// and frees its slot.
func (sub *subscription) settled(h *held, acked bool) {
	defer sub.slots.Free(1)
	defer h.cancel()
	if acked {
		sub.ack(h.m, h.fields)
		return
	}
	sub.nack(h.m, h.fields)
}

// releaseHeld makes messages that were never handed out visible again at
// once, and frees their slots.
func (sub *subscription) releaseHeld(hs []*held) {
	why := "an earlier message of its FIFO group was nacked"
	if sub.ctx.Err() != nil {
		why = "subscription closed"
	}
	msgs := make([]types.Message, len(hs))
	for i, h := range hs {
		msgs[i] = h.m
	}
	sub.release(msgs, why)
	for _, h := range hs {
		h.cancel()
		sub.slots.Free(1)
	}
}

// abandoned leaves a message that a handler still holds after the drain
// to its visibility timeout: its context is cancelled, as the handler may
// still be working on it, and the heartbeat stops extending it.
func (sub *subscription) abandoned(h *held) {
	defer sub.slots.Free(1)
	h.cancel()
	sub.unhold(h.m)
	sub.logger.Info("Drain timeout while the handler holds a message; SQS delivers it again after its visibility timeout",
		h.fields.Add(watermill.LogFields{"drain_timeout": sub.cfg.DrainTimeout.String()}))
}

// unhold stops the heartbeat of msgs, waiting for a heartbeat request in
// flight.
func (sub *subscription) unhold(msgs ...types.Message) {
	sub.mu.Lock()
	for _, m := range msgs {
		delete(sub.held, aws.ToString(m.ReceiptHandle))
	}
	sub.mu.Unlock()
}

// detached returns a context for a request that must be made even when the
// subscription is ending (deleting an acked message, making a message
// visible), bounded by requestTimeout.
func (sub *subscription) detached() (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.WithoutCancel(sub.ctx), requestTimeout)
}

// ack deletes m from the queue, trying deleteAttempts times. When all
// fail, SQS delivers the message again after its visibility timeout.
func (sub *subscription) ack(m types.Message, fields watermill.LogFields) {
	sub.unhold(m)
	delay := deleteRetryDelay
	for i := 1; ; i++ {
		ctx, cancel := sub.detached()
		_, err := sub.api.DeleteMessage(ctx, &sqs.DeleteMessageInput{
			QueueUrl:      aws.String(sub.url),
			ReceiptHandle: m.ReceiptHandle,
		})
		cancel()
		if err == nil {
			sub.logger.Trace("Message acked and deleted", fields)
			return
		}
		if i == deleteAttempts {
			sub.logger.Error("Cannot delete acked message; SQS will deliver it again after its visibility timeout", err, fields)
			return
		}
		sub.logger.Info("Cannot delete acked message, retrying", fields.Add(watermill.LogFields{"err": err.Error(), "retry_in": delay.String()}))
		time.Sleep(delay)
		delay *= 2
	}
}

// nack makes m visible again after the NackBackoff of its attempt.
func (sub *subscription) nack(m types.Message, fields watermill.LogFields) {
	sub.unhold(m)
	backoff := visibilitySeconds(sub.cfg.NackBackoff(attempt(m)))
	ctx, cancel := sub.detached()
	defer cancel()
	_, err := sub.api.ChangeMessageVisibility(ctx, &sqs.ChangeMessageVisibilityInput{
		QueueUrl:          aws.String(sub.url),
		ReceiptHandle:     m.ReceiptHandle,
		VisibilityTimeout: backoff,
	})
	fields = fields.Add(watermill.LogFields{"visibility_timeout": strconv.Itoa(int(backoff)) + "s"})
	if err != nil {
		sub.logger.Error("Cannot set the backoff of a nacked message; SQS will deliver it again after its visibility timeout", err, fields)
		return
	}
	sub.logger.Debug("Message nacked", fields)
}

// release makes msgs, which were never handed out, visible again at once.
func (sub *subscription) release(msgs []types.Message, why string) {
	if len(msgs) == 0 {
		return
	}
	sub.unhold(msgs...)
	for len(msgs) > 0 {
		n := min(len(msgs), maxBatchEntries)
		sub.changeVisibility(msgs[:n], 0, true, watermill.LogFields{"reason": why})
		msgs = msgs[n:]
	}
}

// heartbeat extends the visibility timeout of the held messages every
// VisibilityTimeout/3 until the subscription has ended and drained.
func (sub *subscription) heartbeat() {
	interval := sub.cfg.VisibilityTimeout / 3
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		select {
		case <-sub.hbCtx.Done():
			return
		case <-t.C:
			sub.extend()
		}
	}
}

// extend sets the visibility timeout of every held message to
// VisibilityTimeout from now. It keeps sub.mu for its requests.
func (sub *subscription) extend() {
	sub.mu.Lock()
	defer sub.mu.Unlock()
	batch := make([]types.Message, 0, maxBatchEntries)
	for _, m := range sub.held {
		batch = append(batch, m)
		if len(batch) == maxBatchEntries {
			sub.changeVisibility(batch, sub.visSecs, false, nil)
			batch = batch[:0]
		}
	}
	if len(batch) > 0 {
		sub.changeVisibility(batch, sub.visSecs, false, nil)
	}
}

// changeVisibility sets the visibility timeout of msgs (at most 10) to
// secs. detached requests are made even while the subscription ends.
func (sub *subscription) changeVisibility(msgs []types.Message, secs int32, detached bool, fields watermill.LogFields) {
	var (
		ctx    context.Context
		cancel context.CancelFunc
	)
	if detached {
		ctx, cancel = sub.detached()
	} else {
		ctx, cancel = context.WithTimeout(sub.hbCtx, sub.cfg.VisibilityTimeout/3)
	}
	defer cancel()
	entries := make([]types.ChangeMessageVisibilityBatchRequestEntry, len(msgs))
	for i, m := range msgs {
		entries[i] = types.ChangeMessageVisibilityBatchRequestEntry{
			Id:                aws.String(strconv.Itoa(i)),
			ReceiptHandle:     m.ReceiptHandle,
			VisibilityTimeout: secs,
		}
	}
	fields = fields.Add(watermill.LogFields{"count": len(msgs), "visibility_timeout": strconv.Itoa(int(secs)) + "s"})
	out, err := sub.api.ChangeMessageVisibilityBatch(ctx, &sqs.ChangeMessageVisibilityBatchInput{
		QueueUrl: aws.String(sub.url),
		Entries:  entries,
	})
	if err != nil {
		if !detached && sub.hbCtx.Err() != nil {
			return // the subscription ended during the heartbeat
		}
		sub.logger.Error("Cannot change the visibility timeout of messages", err, fields)
		return
	}
	for _, f := range out.Failed {
		id := aws.ToString(f.Id)
		if i, err := strconv.Atoi(id); err == nil && i >= 0 && i < len(msgs) {
			id = aws.ToString(msgs[i].MessageId)
		}
		sub.logger.Info("Cannot change the visibility timeout of a message", fields.Add(watermill.LogFields{
			"sqs_message_id": id,
			"err_code":       aws.ToString(f.Code),
			"err":            aws.ToString(f.Message),
		}))
	}
	sub.logger.Trace("Changed the visibility timeout of messages", fields)
}
