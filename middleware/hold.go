package middleware

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/retry"
)

// DefaultOutageHold is the default PoisonConfig.OutageHold: how long a
// delivery waits in the consumer, unacked, through an outage before it is
// nacked once. It is half of RabbitMQ's default consumer_timeout (30
// minutes), past which the broker closes the channel of a consumer that
// holds a delivery unacked.
const DefaultOutageHold = 15 * time.Minute

// ErrDeliveryLimit is wrapped by the error a message is dead-lettered with
// when it failed, or could not be handled, at the last delivery its broker
// makes (delivery.LastDelivery): a nack would have the broker drop it (a
// RabbitMQ quorum queue past its x-delivery-limit, a JetStream consumer
// past MaxDeliver) or move it to a queue oncemill does not read (an SQS
// redrive policy), so the poison middleware ends it itself.
var ErrDeliveryLimit = errors.New("middleware: the broker's delivery limit is reached")

// ErrLowDeliveryLimit is wrapped by the error [Poison.Subscriber]'s
// subscription returns when the broker's delivery limit for the topic is
// below what the poison policy needs ([Poison.DeliveriesNeeded]); the
// message names the queue or consumer, its limit and the fix.
var ErrLowDeliveryLimit = errors.New("middleware: the broker's delivery limit is below the poison policy's")

// hold is one delivery's wait through an outage: while the store, the
// broker or the handler's dependency is down, the delivery is retried in
// process, unacked, instead of being nacked, so that the outage spends
// none of the deliveries a broker makes of a message. It also holds the
// consumer's gate token while this delivery is the one that probes a
// dependency that is down.
type hold struct {
	p    *Poison
	msg  *message.Message
	base context.Context
	// since is when the delivery first met an outage (or a closed gate);
	// zero until then.
	since time.Time
	// last is set when this is the last delivery the broker makes of the
	// message: it is never nacked while the consumer runs.
	last  bool
	limit int
	// release gives the gate's token back; nil while not held.
	release func()
	// waited counts the outage waits, for the log lines.
	waited int
}

func (p *Poison) newHold(msg *message.Message) *hold {
	h := &hold{p: p, msg: msg, base: msg.Context()}
	if _, ok := retry.LeaseOf(msg.Context()); !ok {
		// A parked message handed back carries no broker facts.
		h.limit, h.last = delivery.LastDelivery(msg)
	}
	return h
}

// started marks the beginning of the hold, once.
func (h *hold) started() {
	if h.since.IsZero() {
		h.since = time.Now()
	}
}

// deadline is when the hold ends, for a delivery that is not the last.
func (h *hold) deadline() time.Time { return h.since.Add(h.p.cfg.OutageHold) }

// enterGate waits, while the consumer's dependency is down, until this
// delivery holds the gate's token (it probes) or the gate opens; false
// when the delivery's context ends or its hold runs out first.
func (h *hold) enterGate() bool {
	if h.release != nil || !h.p.gate.down() {
		return true
	}
	h.started()
	h.p.paused.Add(1)
	var deadline <-chan time.Time
	if !h.last {
		t := time.NewTimer(time.Until(h.deadline()))
		defer t.Stop()
		deadline = t.C
	}
	release, ok := h.p.gate.enter(h.base, deadline)
	h.release = release
	return ok
}

// leave gives back the gate's token, if held.
func (h *hold) leave() {
	if h.release != nil {
		h.release()
		h.release = nil
	}
}

// wait is called after an attempt ended for a fault that is not the
// message's: err. It counts the fault, waits the backoff of the faults in
// a row, and reports whether to try again in process: false when the
// consumer stops, or when the hold is over (OutageHold since the first
// fault), unless this is the broker's last delivery, which waits as long
// as the consumer runs. An attempt that another delivery of the key
// stopped (inFlight) waits only InitialBackoff: the inbox waited for that
// delivery already.
func (h *hold) wait(err error, inFlight bool) bool {
	p := h.p
	h.started()
	h.waited++
	if !inFlight {
		p.infrastructure.Add(1)
		n := p.outages.Add(1)
		p.logOutage(h, err, n)
	}
	if stopping(h.base) {
		return false
	}
	remaining := time.Until(h.deadline())
	if !h.last && remaining <= 0 {
		return false
	}
	d := p.backoff(int(min(p.outages.Load(), 32)))
	if inFlight {
		d = p.cfg.InitialBackoff
	}
	if !h.last {
		d = min(d, remaining)
	}
	return sleepCtx(h.base, d)
}

// logOutage writes the consumer's line for an attempt that met an outage:
// at Error for the first fault in a row, at Debug for the others, with
// what the delivery does next.
func (p *Poison) logOutage(h *hold, err error, inARow int64) {
	fields := p.fields(h.msg, nil).Add(watermill.LogFields{"failures_in_a_row": inARow,
		"next": "held unacked and tried again in process after the backoff"})
	if h.last {
		fields["next"] = "held unacked (the broker's last delivery) and tried again in process after the backoff"
	}
	what := "Infrastructure unavailable: message held, not counted"
	if dependencyDown(err) {
		what = "Dependency unavailable (the handler said so): message held, not counted"
	}
	if inARow == 1 || h.waited == 1 {
		p.cfg.Logger.Error(what, err, fields)
		return
	}
	p.cfg.Logger.Debug(what, fields.Add(watermill.LogFields{"error": err.Error()}))
}

// giveUp ends a hold that cannot go on (the consumer stops, or OutageHold
// passed) and returns what the middleware returns: err, so that the
// message is nacked. At the broker's last delivery a nack would lose the
// message, so it is parked instead (uncounted), or, where it cannot be,
// dead-lettered with ErrDeliveryLimit; only when neither can be written
// is it nacked, with an Error line.
func (h *hold) giveUp(slot *attemptSlot, err error) error {
	p := h.p
	if !h.last {
		if !stopping(h.base) {
			p.cfg.Logger.Error("Outage outlasted PoisonConfig.OutageHold: message nacked once, for the broker to deliver again", err,
				p.fields(h.msg, slot).Add(watermill.LogFields{"held_for": time.Since(h.since).Round(time.Millisecond).String()}))
		}
		return err
	}
	return p.endLast(h, slot, err)
}

// gate keeps a consumer whose dependency is down from spinning: while
// the handler's attempts say so ([Pause], [Unavailable]), one attempt at
// a time runs, and it holds the gate through its backoff, so that the
// dependency sees at most one attempt per backoff period per middleware,
// however many messages are in flight; the others wait, unacked, before
// the handler, until the gate opens.
type gate struct {
	token chan struct{}
	down  func() bool

	mu     sync.Mutex
	opened chan struct{} // closed when the gate opens; then made anew
}

func newGate(down func() bool) *gate {
	return &gate{token: make(chan struct{}, 1), down: down, opened: make(chan struct{})}
}

// enter waits, while the gate is down, for the one attempt that may run
// or for the gate to open, and returns what ends the hold of the token
// (nil when the gate opened and no token was taken); ok is false when ctx
// ended or deadline passed first.
func (g *gate) enter(ctx context.Context, deadline <-chan time.Time) (release func(), ok bool) {
	for g.down() {
		g.mu.Lock()
		opened := g.opened
		g.mu.Unlock()
		select {
		case g.token <- struct{}{}:
			var once sync.Once
			return func() { once.Do(func() { <-g.token }) }, true
		case <-opened:
		case <-ctx.Done():
			return nil, false
		case <-deadline:
			return nil, false
		}
	}
	return nil, true
}

// open wakes the deliveries that wait for the gate: the dependency
// answered.
func (g *gate) open() {
	g.mu.Lock()
	defer g.mu.Unlock()
	close(g.opened)
	g.opened = make(chan struct{})
}

// resume ends a pause: the handler's dependency answered.
func (p *Poison) resume() {
	p.outages.Store(0)
	if p.pauses.Swap(0) > 0 {
		p.gate.open()
	}
}

// fields are the log fields of msg: its UUID, consumer, topic, key and
// ordering key, the key as the inbox read it when slot has it.
func (p *Poison) fields(msg *message.Message, slot *attemptSlot) watermill.LogFields {
	consumer := p.consumerOf(msg)
	var key string
	if slot != nil && slot.inbox != nil {
		key = slot.key.Key
	} else if slot == nil || !slot.keyed {
		key, _ = keyOf(p.cfg.Key, msg)
	}
	f := watermill.LogFields{"message_uuid": delivery.Bound(msg.UUID), "consumer": consumer, "topic": topicOf(msg),
		"key": delivery.Bound(key)}
	if order := delivery.PartitionKeyOf(msg); order != "" {
		f["order_key"] = delivery.Bound(order)
	}
	if n, ok := delivery.AttemptsOf(msg); ok {
		f["delivery"] = n
	}
	return f
}

// lastDeliveryError wraps err, the end of an attempt at the broker's last
// delivery of msg, in [ErrDeliveryLimit], naming the limit.
func lastDeliveryError(limit int, err error) error {
	return fmt.Errorf("%w (%d deliveries; a nack would have the broker drop the message): %w", ErrDeliveryLimit, limit, err)
}
