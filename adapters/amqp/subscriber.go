package amqp

import (
	"context"
	"errors"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
)

// ErrSubscriberClosed is returned by Subscribe, SubscribeInitialize and
// Backlog (wrapped) once Close has begun.
var ErrSubscriberClosed = errors.New("amqp: subscriber closed")

// Subscriber is watermill-amqp's subscriber with a drain: its Close hands
// out no more messages, then waits up to [Config.DrainTimeout] for the
// messages already handed out to be acked or nacked, with the channels and
// the connection still open, so that those acks reach the broker; only
// then does it close watermill-amqp's subscriber, which nacks (requeues)
// what is still unacked, and closes the channels and the connection.
//
// watermill-amqp's own Close does not wait: it nacks the message a
// handler holds at once and closes the channel and the connection, so an
// ack that comes later is lost and the message is delivered again.
//
// It is safe for concurrent use.
type Subscriber struct {
	sub    *wamqp.Subscriber
	drain  time.Duration
	logger watermill.LoggerAdapter
	// queueName is [Config.QueueName] of the subscriber's config, and url
	// its URL, for the backlog and its errors.
	queueName func(topic string) string
	url       string

	// closing is closed when Close begins: the forwarders stop handing
	// out messages.
	closing chan struct{}
	// abandon is closed when the drain ends: the watchers stop waiting.
	abandon chan struct{}
	// done is closed when Close has finished; err is its result.
	done chan struct{}
	err  error

	mu     sync.Mutex
	closed bool
	// inFlight counts the messages handed out and not yet acked or
	// nacked; idle is signalled when it drops to zero.
	inFlight int
	idle     chan struct{}
	// workers are the forwarders and the watchers of the messages in
	// flight; Close waits for them.
	workers sync.WaitGroup
}

var (
	_ message.Subscriber           = (*Subscriber)(nil)
	_ message.SubscribeInitializer = (*Subscriber)(nil)
)

func newSubscriber(sub *wamqp.Subscriber, cfg Config, logger watermill.LoggerAdapter) *Subscriber {
	return &Subscriber{
		sub:       sub,
		drain:     cfg.withDefaults().DrainTimeout,
		logger:    logger,
		queueName: cfg.QueueName,
		url:       cfg.URL,
		closing:   make(chan struct{}),
		abandon:   make(chan struct{}),
		done:      make(chan struct{}),
		idle:      make(chan struct{}, 1),
	}
}

// Subscribe declares topic's exchange and queue, binds them and consumes
// from the queue, as watermill-amqp's Subscribe does. The channel is
// closed when ctx is done or Close begins; messages handed out before
// then can still be acked or nacked until the drain ends.
func (s *Subscriber) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil, ErrSubscriberClosed
	}
	// Reserved under the lock, so that Close, which takes it to set
	// closed, waits for this forwarder.
	s.workers.Add(1)
	s.mu.Unlock()

	in, err := s.sub.Subscribe(ctx, topic)
	if err != nil {
		s.workers.Done()
		return nil, err
	}
	out := make(chan *message.Message)
	go s.forward(ctx, in, out)
	return out, nil
}

// forward hands the messages of in to out until ctx is done, Close
// begins or in is closed. A message it has received and not handed out
// when Close begins is left to watermill-amqp, which nacks it with
// requeue when it closes. When ctx is done it nacks that message and
// every later one until watermill-amqp closes in: watermill-amqp sends
// on in without watching ctx, and would hold its channel's prefetched
// deliveries, unacked, until Close.
func (s *Subscriber) forward(ctx context.Context, in <-chan *message.Message, out chan<- *message.Message) {
	defer s.workers.Done()
	cancelled := func(held *message.Message) {
		close(out)
		if held != nil {
			held.Nack()
		}
		s.refuse(in)
	}
	for {
		var (
			msg *message.Message
			ok  bool
		)
		select {
		case msg, ok = <-in:
			if !ok {
				close(out)
				return
			}
		case <-s.closing:
			close(out)
			return
		case <-ctx.Done():
			cancelled(nil)
			return
		}
		if !s.enter() {
			close(out)
			return
		}
		// Asked first: a select with several ready cases picks one at
		// random, and nothing is handed out once Close has begun.
		select {
		case <-s.closing:
			s.leave()
			close(out)
			return
		default:
		}
		select {
		case out <- msg:
		case <-s.closing:
			s.leave()
			close(out)
			return
		case <-ctx.Done():
			s.leave()
			cancelled(msg)
			return
		}
		s.workers.Add(1)
		go s.watch(msg)
	}
}

// refuse nacks what watermill-amqp still sends on in after the
// subscription's context is done, until it closes in or Close begins
// (watermill-amqp then nacks by itself).
func (s *Subscriber) refuse(in <-chan *message.Message) {
	for {
		select {
		case msg, ok := <-in:
			if !ok {
				return
			}
			msg.Nack()
		case <-s.closing:
			return
		}
	}
}

// watch waits until msg is acked or nacked, or the drain ends, and
// counts it out.
func (s *Subscriber) watch(msg *message.Message) {
	defer s.workers.Done()
	defer s.leave()
	select {
	case <-msg.Acked():
	case <-msg.Nacked():
	case <-s.abandon:
	}
}

// enter counts a message about to be handed out; false once Close has
// begun.
func (s *Subscriber) enter() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return false
	}
	s.inFlight++
	return true
}

// leave counts a message out: acked, nacked, or not handed out after all.
func (s *Subscriber) leave() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.inFlight--
	if s.closed && s.inFlight == 0 {
		select {
		case s.idle <- struct{}{}:
		default:
		}
	}
}

// SubscribeInitialize declares topic's exchange and queue and binds them.
func (s *Subscriber) SubscribeInitialize(topic string) error {
	s.mu.Lock()
	closed := s.closed
	s.mu.Unlock()
	if closed {
		return ErrSubscriberClosed
	}
	return s.sub.SubscribeInitialize(topic)
}

// Close stops handing out messages and closes every subscription's
// channel of messages, waits up to [Config.DrainTimeout] for the messages
// handed out to be acked or nacked, whose acks and nacks still reach the
// broker, then closes watermill-amqp's subscriber: what is still unacked
// is nacked with requeue (or without under [Config.NoRequeueOnNack]) and
// delivered again, and the channels and the connection are closed. It
// does not cancel message contexts (they derive from the Subscribe
// context, which a router that closes cancels itself). It returns once
// every goroutine the subscriber started has stopped; a handler that
// outlives the drain runs on, in the router, and its ack is lost. Close
// is idempotent: every call returns the first one's result once it has
// finished.
func (s *Subscriber) Close() error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		<-s.done
		return s.err
	}
	s.closed = true
	close(s.closing)
	pending := s.inFlight
	s.mu.Unlock()

	if pending > 0 {
		timer := time.NewTimer(s.drain)
		select {
		case <-s.idle:
			s.logger.Debug("AMQP subscriber drained", watermill.LogFields{"acked_or_nacked": pending})
		case <-timer.C:
			s.mu.Lock()
			left := s.inFlight
			s.mu.Unlock()
			s.logger.Info("Drain timeout: messages still unacked are returned to the queue", watermill.LogFields{
				"in_flight": left, "drain_timeout": s.drain.String(),
			})
		}
		timer.Stop()
	}
	close(s.abandon)
	s.err = s.sub.Close()
	// The forwarders stopped as Close began, the watchers at the latest
	// with abandon.
	s.workers.Wait()
	close(s.done)
	s.logger.Debug("AMQP subscriber closed", nil)
	return s.err
}
