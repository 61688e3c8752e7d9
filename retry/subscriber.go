package retry

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/internal/merge"
)

// Lease is a parked message handed out to its consumer: the poison
// middleware reads it from the message's context ([LeaseOf]) to park the
// message again in its own row when the attempt fails, and the subscriber
// deletes the row on the ack only while the lease still holds.
type Lease struct {
	// ID is the parked message's row.
	ID int64
	// Version is the row's version when it was handed out.
	Version int64
	// Attempts is how many attempts of the message had failed.
	Attempts int
	// FirstFailedAt is when the first of them failed; zero for a message
	// parked behind another.
	FirstFailedAt time.Time
	// Store is the store the message was parked in.
	Store *Store
}

type leaseKey struct{}

// LeaseOf returns the lease of a message that a [Subscriber] handed out;
// ok is false for any other message. The lease travels in the message's
// context, never in its metadata: a message that a handler publishes on
// carries no lease.
func LeaseOf(ctx context.Context) (Lease, bool) {
	l, ok := ctx.Value(leaseKey{}).(Lease)
	return l, ok
}

// SubscriberConfig configures a [Subscriber].
type SubscriberConfig struct {
	// Consumer is the consumer whose parked messages are handed back: the
	// name the poison middleware parks them under (the inbox's consumer,
	// by default the router handler's name). Required.
	Consumer string
	// PollInterval is how often the table is read while a slot is free
	// (see Batch) and nothing is due; each read is a transaction. At least
	// 10ms. Defaults to 1s.
	PollInterval time.Duration
	// Batch is how many parked messages are out to the handler at once,
	// each of a different ordering key. The keys are independent: an
	// acked message's slot is filled by the next due message at once, so
	// a slow handler holds one slot, never the other keys. Defaults to
	// 16.
	Batch int
	// Lease is how long a message handed out is not handed out again
	// while its consumer has neither acked nor nacked it (a consumer that
	// died with it). A handler that runs longer may see the message twice,
	// which its inbox absorbs. Defaults to 1m.
	Lease time.Duration
	// Logger receives a line for every read that failed. Defaults to
	// watermill.NopLogger.
	Logger watermill.LoggerAdapter
}

// MinPollInterval is the shortest SubscriberConfig.PollInterval: each
// read of the table is a transaction, and an idle subscriber reads once
// per interval.
const MinPollInterval = 10 * time.Millisecond

func (c *SubscriberConfig) setDefaults() {
	if c.PollInterval == 0 {
		c.PollInterval = time.Second
	}
	if c.Batch == 0 {
		c.Batch = 16
	}
	if c.Lease == 0 {
		c.Lease = time.Minute
	}
	if c.Logger == nil {
		c.Logger = watermill.NopLogger{}
	}
}

// Validate reports the first field that is missing or out of range.
func (c SubscriberConfig) Validate() error {
	c.setDefaults()
	switch {
	case c.Consumer == "":
		return errors.New("retry: SubscriberConfig.Consumer is required: the consumer whose parked messages are handed back (the inbox's consumer, or the router handler's name)")
	case c.PollInterval < MinPollInterval:
		return fmt.Errorf("retry: SubscriberConfig.PollInterval must be at least %s (each read of the table is a transaction), got %s", MinPollInterval, c.PollInterval)
	case c.Batch < 1:
		return fmt.Errorf("retry: SubscriberConfig.Batch must be at least 1, got %d", c.Batch)
	case c.Lease < time.Second:
		return fmt.Errorf("retry: SubscriberConfig.Lease must be at least 1s, got %s", c.Lease)
	}
	return nil
}

// Subscriber is a Watermill subscriber over the table of parked messages:
// Subscribe(ctx, topic) hands the consumer's parked messages of topic back
// once due, each first of its ordering key, and deletes each once the
// consumer acked it; a nacked one goes out again at the next poll. Merge
// it into the consumer's own subscription with [Merge], so that the
// parked messages run through the same handler, poison middleware and
// inbox as the broker's. Nothing is republished to the broker: other
// consumer groups of the topic never see a retry. Each subscription
// starts a goroutine that ends with its context or Close.
type Subscriber struct {
	s   *Store
	cfg SubscriberConfig

	closing   chan struct{}
	closeOnce sync.Once
	wg        sync.WaitGroup
}

var _ message.Subscriber = (*Subscriber)(nil)

// Subscriber returns a subscriber that hands back the parked messages of
// cfg.Consumer; cfg is copied, defaulted and validated.
func (s *Store) Subscriber(cfg SubscriberConfig) (*Subscriber, error) {
	if err := s.Ready(); err != nil {
		return nil, err
	}
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	return &Subscriber{s: s, cfg: cfg, closing: make(chan struct{})}, nil
}

// Merge returns sub with r's parked messages merged into every
// subscription: Subscribe(ctx, topic) delivers the topic's messages from
// sub and the parked messages of topic for r's consumer, so that one
// handler takes both. Close closes sub and r.
func Merge(sub message.Subscriber, r *Subscriber) message.Subscriber {
	return merge.Subscribers(sub, r)
}

// subscriptions counts the subscriptions that run in this process, per
// consumer and topic: the poison middleware parks a message only where
// one will hand it back ([Delivering]).
var subscriptions = struct {
	sync.Mutex
	n map[[2]string]int
}{n: map[[2]string]int{}}

func subscribed(consumer, topic string, delta int) {
	subscriptions.Lock()
	defer subscriptions.Unlock()
	k := [2]string{consumer, topic}
	subscriptions.n[k] += delta
	if subscriptions.n[k] <= 0 {
		delete(subscriptions.n, k)
	}
}

// Delivering reports whether a [Subscriber] of consumer's parked messages
// of topic runs in this process: a message parked for a consumer whose
// subscription never runs would wait for ever.
func Delivering(consumer, topic string) bool {
	subscriptions.Lock()
	defer subscriptions.Unlock()
	return subscriptions.n[[2]string{consumer, topic}] > 0
}

// Subscribe hands back the parked messages of topic until ctx is done or
// the subscriber closes; then the channel closes.
//
// Keys are independent: up to SubscriberConfig.Batch messages are out at
// once, each first of its ordering key, and a slot that frees (an ack, a
// nack) is filled by the next due message at once, whatever the others
// out still take: one slow handler holds its own key and one slot, never
// the consumer's other keys.
func (r *Subscriber) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	select {
	case <-r.closing:
		return nil, errors.New("retry: subscriber is closed")
	default:
	}
	out := make(chan *message.Message)
	subscribed(r.cfg.Consumer, topic, 1)
	r.wg.Add(1)
	go func() {
		defer r.wg.Done()
		defer close(out)
		defer subscribed(r.cfg.Consumer, topic, -1)
		r.run(ctx, topic, out)
	}()
	return out, nil
}

// run hands out the due messages of topic while slots are free, and
// waits for the next poll, an acked message's slot or the end. A message
// that frees its slot by an ack wakes it at once: the message behind it
// in its ordering key may be due. A nacked one goes out again at the
// next poll.
func (r *Subscriber) run(ctx context.Context, topic string, out chan<- *message.Message) {
	var (
		wg    sync.WaitGroup
		slots = make(chan struct{}, r.cfg.Batch) // one token per message out
		acked = make(chan struct{}, 1)
		poll  = time.NewTimer(r.cfg.PollInterval)
	)
	defer wg.Wait()
	defer poll.Stop()
	poll.Stop()
	for {
		if free := cap(slots) - len(slots); free > 0 {
			n, err := r.deliver(ctx, topic, free, out, slots, acked, &wg)
			if err != nil && ctx.Err() == nil {
				r.cfg.Logger.Error("Reading parked messages failed", err, watermill.LogFields{"consumer": r.cfg.Consumer, "topic": topic})
			}
			if err == nil && n == free {
				continue // every free slot filled: more may be due
			}
		}
		poll.Reset(r.cfg.PollInterval)
		select {
		case <-ctx.Done():
			return
		case <-r.closing:
			return
		case <-acked:
		case <-poll.C:
		}
		poll.Stop()
	}
}

// deliver hands out up to n due messages of one lease, each taking a slot
// until it is acked or nacked; it returns how many it handed out. acked
// is signalled when an ack frees a slot.
func (r *Subscriber) deliver(ctx context.Context, topic string, n int, out chan<- *message.Message,
	slots chan struct{}, acked chan struct{}, wg *sync.WaitGroup) (int, error) {
	leased, err := r.s.lease(ctx, r.cfg.Consumer, topic, n, r.cfg.Lease)
	if err != nil || len(leased) == 0 {
		return 0, err
	}
	for i, m := range leased {
		l := Lease{ID: m.ID, Version: m.Version, Attempts: m.Attempts, FirstFailedAt: m.FirstFailedAt, Store: r.s}
		msg := message.NewMessage(m.UUID, m.Payload)
		for k, v := range m.Metadata {
			msg.Metadata.Set(k, v)
		}
		msg.Metadata.Set(delivery.RetryID, strconv.FormatInt(m.ID, 10))
		msg.Metadata.Set(delivery.RetryAttempts, strconv.Itoa(m.Attempts))
		msgCtx, cancel := context.WithCancel(context.WithValue(ctx, leaseKey{}, l))
		msg.SetContext(msgCtx)
		slots <- struct{}{} // never blocks: n slots were free
		select {
		case out <- msg:
		case <-ctx.Done():
			cancel()
			<-slots
			r.releaseAll(ctx, leased[i:])
			return i, nil
		case <-r.closing:
			cancel()
			<-slots
			r.releaseAll(ctx, leased[i:])
			return i, nil
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer cancel()
			ok := settled(ctx, r.closing, msg)
			// The row's fate is written even if ctx ends now: the
			// consumer took the message durably, or gave it back.
			wctx, wcancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
			defer wcancel()
			var err error
			if ok {
				err = r.s.ack(wctx, l)
			} else {
				err = r.s.release(wctx, l)
			}
			if err != nil && ctx.Err() == nil {
				r.cfg.Logger.Error("Settling a parked message failed", err, watermill.LogFields{
					"consumer": r.cfg.Consumer, "topic": topic, "retry_id": l.ID, "acked": ok})
			}
			<-slots
			if ok {
				select {
				case acked <- struct{}{}:
				default: // a wake-up is pending already
				}
			}
		}()
	}
	return len(leased), nil
}

// settled waits for the consumer's ack (true) or nack of msg. When the
// subscription ends first, it waits a little longer: the router lets a
// handler that runs finish, and its ack must still delete the row, or a
// consumer without an inbox would run the message again.
func settled(ctx context.Context, closing <-chan struct{}, msg *message.Message) bool {
	select {
	case <-msg.Acked():
		return true
	case <-msg.Nacked():
		return false
	case <-ctx.Done():
	case <-closing:
	}
	t := time.NewTimer(settleGrace)
	defer t.Stop()
	select {
	case <-msg.Acked():
		return true
	case <-msg.Nacked():
	case <-t.C:
	}
	return false
}

// settleGrace is how long a subscription that ends waits for the handlers
// of the messages it handed out.
const settleGrace = 5 * time.Second

// releaseAll gives back the leases of messages that were never handed
// out.
func (r *Subscriber) releaseAll(ctx context.Context, ms []Message) {
	wctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer cancel()
	for _, m := range ms {
		_ = r.s.release(wctx, Lease{ID: m.ID, Version: m.Version})
	}
}

// Close stops every subscription and waits for them; messages out are
// given back. It is safe to call more than once.
func (r *Subscriber) Close() error {
	r.closeOnce.Do(func() { close(r.closing) })
	r.wg.Wait()
	return nil
}
