package middleware

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/observe"
	"github.com/oncemill/oncemill/retry"
)

// DefaultDelays are the waits before the delayed attempts of a message
// whose MaxAttempts attempts in a row failed, when PoisonConfig.Retries
// is set: 5s, 15s, 30s, 1m, 2m and 5m. With the default MaxAttempts (5,
// about 1.5s of backoff) a message is dead-lettered about 8m50s after its
// first failure, after 11 attempts; a dependency down for a minute or two
// costs no dead letter.
var DefaultDelays = []time.Duration{5 * time.Second, 15 * time.Second, 30 * time.Second, time.Minute, 2 * time.Minute, 5 * time.Minute}

// Decision is what the poison middleware does with a failed attempt: the
// answer of PoisonConfig.Classify.
type Decision struct {
	kind  decisionKind
	delay time.Duration
}

type decisionKind int

const (
	decideRetry decisionKind = iota
	decideRetryNow
	decideRetryIn
	decideDeadLetter
	decidePause
)

var (
	// Retry counts the attempt and retries by the policy: at once (after
	// the backoff) while the message has had fewer than MaxAttempts
	// attempts, then parked for each of Delays in turn, then
	// dead-lettered.
	Retry = Decision{kind: decideRetry}
	// RetryNow counts the attempt and retries at once (after the
	// backoff), never parked; the message is dead-lettered when its
	// attempts reach the policy's horizon (MaxAttempts + len(Delays)).
	RetryNow = Decision{kind: decideRetryNow}
	// DeadLetter dead-letters the message now: retrying cannot help.
	// It is what a [Permanent] error gets, whatever Classify says.
	DeadLetter = Decision{kind: decideDeadLetter}
	// Pause says a dependency is down: the attempt is not counted, the
	// message is nacked after a backoff, and the consumer takes one
	// message at a time until an attempt succeeds (see [Poison]). It is
	// what an [Unavailable] error gets, whatever Classify says.
	Pause = Decision{kind: decidePause}
)

// RetryIn counts the attempt and parks the message for d (a 429 or 503
// with a Retry-After, say); without PoisonConfig.Retries it waits d, at
// most MaxBackoff, before the nack. The message is dead-lettered when its
// attempts reach the policy's horizon.
func RetryIn(d time.Duration) Decision { return Decision{kind: decideRetryIn, delay: max(d, 0)} }

// String names the decision, for logs.
func (d Decision) String() string {
	switch d.kind {
	case decideRetryNow:
		return "retry now"
	case decideRetryIn:
		return "retry in " + d.delay.String()
	case decideDeadLetter:
		return "dead-letter"
	case decidePause:
		return "pause"
	}
	return "retry"
}

// retryAfterError marks an error with the wait its dependency asked for.
type retryAfterError struct {
	err   error
	delay time.Duration
}

func (e retryAfterError) Error() string { return e.err.Error() }
func (e retryAfterError) Unwrap() error { return e.err }

// RetryAfter marks err as a failure that its dependency asked to retry
// after d, such as an HTTP 429 or 503 with a Retry-After header: the
// default classifier answers RetryIn(d). It returns nil for a nil err.
func RetryAfter(err error, d time.Duration) error {
	if err == nil {
		return nil
	}
	return retryAfterError{err: err, delay: d}
}

// RetryAfterOf returns the wait that [RetryAfter] marked err, or any
// error it wraps, with.
func RetryAfterOf(err error) (time.Duration, bool) {
	var r retryAfterError
	if !errors.As(err, &r) {
		return 0, false
	}
	return r.delay, true
}

// DefaultClassify is the classifier PoisonConfig.Classify defaults to:
// RetryIn(d) for an error marked with [RetryAfter], DeadLetter for one
// marked [Permanent], Pause for one marked [Unavailable], Retry for any
// other. A classifier of one's own can fall back to it:
//
//	Classify: func(err error) middleware.Decision {
//		if errors.Is(err, syscall.ECONNREFUSED) {
//			return middleware.Pause
//		}
//		return middleware.DefaultClassify(err)
//	},
func DefaultClassify(err error) Decision {
	switch {
	case IsPermanent(err):
		return DeadLetter
	case IsInfrastructure(err):
		return Pause
	}
	if d, ok := RetryAfterOf(err); ok {
		return RetryIn(d)
	}
	return Retry
}

// horizon is how many attempts a message gets before it is dead-lettered.
func (p *Poison) horizon(parking bool) int {
	if parking {
		return p.cfg.MaxAttempts + len(p.cfg.Delays)
	}
	return p.cfg.MaxAttempts
}

// delayFor returns how long the message waits parked after its attempts-th
// failed attempt, and whether it is parked at all.
func (p *Poison) delayFor(dec Decision, attempts int) (time.Duration, bool) {
	switch dec.kind {
	case decideRetryIn:
		return dec.delay, true
	case decideRetryNow:
		return 0, false
	}
	if attempts < p.cfg.MaxAttempts {
		return 0, false
	}
	i := min(attempts-p.cfg.MaxAttempts, len(p.cfg.Delays)-1)
	if i < 0 {
		return 0, false
	}
	return p.cfg.Delays[i], true
}

// consumerOf is the consumer a message is parked under before an inbox
// ran: the inbox's (PoisonConfig.Inbox) or PoisonConfig.Consumer, else
// the router handler's name, which is the inbox's default too.
func (p *Poison) consumerOf(msg *message.Message) string {
	if p.cfg.Consumer != "" {
		return p.cfg.Consumer
	}
	return message.HandlerNameFromCtx(msg.Context())
}

// sameConsumer says once, at Error, that the inbox behind this middleware
// scopes keys under another consumer name than the one messages are
// parked under: the parked messages still come back (to the retry
// subscriber of the parking name), but an operator finds the dead letters
// under one name and the parked messages under the other.
func (p *Poison) sameConsumer(inbox, parking string) {
	if inbox == parking {
		return
	}
	if _, told := p.unparked.LoadOrStore([3]string{"consumer", inbox, parking}, true); told {
		return
	}
	p.cfg.Logger.Error("The inbox and the poison middleware name the consumer differently", fmt.Errorf(
		"messages are parked under %q and dead-lettered under the inbox's %q: build the poison middleware with PoisonConfig.Inbox, so that both take the inbox's name",
		parking, inbox), watermill.LogFields{"inbox_consumer": inbox, "parking_consumer": parking})
}

// parking reports whether msg, of consumer, can be parked: a store is
// set and a subscription of this process hands the consumer's parked
// messages of the topic back. Without one the policy ends at MaxAttempts,
// as without a store, and a line says why, once per consumer and topic.
func (p *Poison) parking(msg *message.Message, consumer string) bool {
	if p.cfg.Retries == nil {
		return false
	}
	topic := topicOf(msg)
	if retry.Delivering(consumer, topic) {
		return true
	}
	if _, warned := p.unparked.LoadOrStore([2]string{consumer, topic}, true); !warned {
		p.cfg.Logger.Error("Delayed retries are off for this consumer: no retry subscriber hands its parked messages back in this process, so failing messages are dead-lettered after MaxAttempts",
			errors.New("merge the store's Subscriber (retry.Merge) into the handler's subscriber, with the consumer's name"),
			watermill.LogFields{"consumer": consumer, "topic": topic})
	}
	return false
}

// orderKey is the key msg is ordered by while its key's messages wait,
// "" when it waits unordered.
func (p *Poison) orderKey(msg *message.Message) string {
	if p.cfg.Unordered {
		return ""
	}
	return delivery.PartitionKeyOf(msg)
}

// waitBehind parks a message that the broker delivered while a message of
// its ordering key is parked: it waits behind it, in order, and is not
// run. It reports whether it parked msg.
func (p *Poison) waitBehind(msg *message.Message) (bool, error) {
	if p.cfg.Retries == nil || p.cfg.Unordered {
		return false, nil
	}
	if _, ok := retry.LeaseOf(msg.Context()); ok {
		return false, nil // a parked message handed back: it is its key's first
	}
	order := p.orderKey(msg)
	consumer := p.consumerOf(msg)
	if order == "" || consumer == "" || !p.parking(msg, consumer) {
		return false, nil
	}
	ctx, cancel := context.WithTimeout(msg.Context(), p.cfg.PublishTimeout)
	defer cancel()
	topic := topicOf(msg)
	waiting, err := p.cfg.Retries.Waiting(ctx, consumer, topic, order)
	if err != nil || !waiting {
		return false, err
	}
	// The key as the inbox will read it, for the operators' lists and to
	// tell apart two messages of one UUID; a message whose key cannot be
	// read is parked without one, and its attempt says why when it runs.
	key, _ := keyOf(p.cfg.Key, msg)
	_, err = p.cfg.Retries.Park(ctx, retry.Message{
		Consumer: consumer, Topic: topic, UUID: msg.UUID, Key: key, OrderKey: order, Behind: true, DueAt: time.Now(),
		Payload: msg.Payload, Metadata: parkedMetadata(msg),
	})
	if errors.Is(err, retry.ErrNotParkable) {
		// Nothing would tell it from another message: it runs now, out
		// of its key's order, rather than wait for ever.
		p.cfg.Logger.Error("Message cannot wait behind its ordering key: it runs now", err, p.fields(msg, nil))
		return false, nil
	}
	if err != nil {
		return false, err
	}
	p.parkedBehind.Add(1)
	p.hooks.Retry(msg.Context(), observe.Retry{Consumer: consumer, Topic: topic, Behind: true})
	p.cfg.Logger.Debug("Message parked behind a parked message of its ordering key", p.fields(msg, nil))
	return true, nil
}

// parkedMetadata is the metadata a message is parked with: its own, and
// none of the facts of this delivery that an adapter set, which the
// delivery that hands it back does not have.
func parkedMetadata(msg *message.Message) map[string]string {
	md := make(map[string]string, len(msg.Metadata))
	for k, v := range msg.Metadata {
		if !delivery.IsAdapterFact(k) && !isRetryFact(k) {
			md[k] = v
		}
	}
	return md
}

func isRetryFact(k string) bool {
	return len(k) >= len(delivery.RetryPrefix) && k[:len(delivery.RetryPrefix)] == delivery.RetryPrefix
}

// park parks msg, whose attempts-th attempt failed with cause, for delay,
// and returns nil so that the router acks it; or the error of a park that
// failed, so that it is nacked and delivered again.
func (p *Poison) park(msg *message.Message, slot *attemptSlot, cause error, attempts int, first, last time.Time, delay time.Duration) error {
	// The consumer the retry subscriber hands messages back to, and the
	// one waitBehind looks under: one name, whatever the inbox scopes
	// keys by.
	consumer := p.consumerOf(msg)
	var key string
	if slot != nil && slot.inbox != nil {
		key = slot.key.Key
		p.sameConsumer(slot.key.Consumer, consumer)
	}
	topic := topicOf(msg)
	m := retry.Message{
		Consumer: consumer, Topic: topic, UUID: msg.UUID, Key: key, OrderKey: p.orderKey(msg),
		Attempts: attempts, Error: cause.Error(), FirstFailedAt: first, LastFailedAt: last, DueAt: last.Add(delay),
		Payload: msg.Payload, Metadata: parkedMetadata(msg),
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(msg.Context()), p.cfg.PublishTimeout)
	defer cancel()
	fields := p.fields(msg, slot).Add(watermill.LogFields{"consumer": consumer, "attempts": attempts,
		"due_at": m.DueAt.UTC().Format(time.RFC3339Nano), "retry_in": delay.String(), "error": cause.Error()})
	var err error
	if l, ok := retry.LeaseOf(msg.Context()); ok {
		var kept bool
		kept, err = l.Store.Repark(ctx, l, m)
		if err == nil && !kept {
			// The lease ran out and the message is out again, or an
			// operator took it: its row is someone else's now, and the
			// ack of this copy deletes nothing.
			p.cfg.Logger.Info("Parked message not parked again: its lease was lost", fields)
			return nil
		}
	} else {
		_, err = p.cfg.Retries.Park(ctx, m)
	}
	if errors.Is(err, retry.ErrNotParkable) {
		// The message's own fault (no UUID, say): no park can take it, so
		// it ends in the dead-letter queue now, with why.
		p.cfg.Logger.Error("Message cannot be parked: dead-lettered instead", err, fields)
		return p.deadLetter(msg, slot, fmt.Errorf("%w (it failed with: %w)", err, cause), attempts, first, last)
	}
	if err != nil {
		p.cfg.Logger.Error("Parking a message failed", err, fields)
		return fmt.Errorf("%w: %w (message failed with: %w)", ErrPark, err, cause)
	}
	p.parked.Add(1)
	p.retried.Add(1)
	p.forwards.parked(topic)
	p.hooks.Retry(msg.Context(), observe.Retry{Consumer: consumer, Topic: topic, Attempts: attempts, Delay: delay})
	p.cfg.Logger.Info("Message parked for a delayed retry", fields)
	return nil
}

// ErrPark is wrapped by the error a [Poison] middleware returns when it
// could not park a message for a delayed retry: the original is nacked
// then, never acked, so it is delivered again. It is an infrastructure
// fault ([IsInfrastructure]), never counted.
var ErrPark = errors.New("middleware: parking the message for a delayed retry failed")

// leaseAttempts is what a parked message handed back says of its earlier
// attempts: how many failed, and when the first did.
func leaseAttempts(msg *message.Message) (int, time.Time, bool) {
	l, ok := retry.LeaseOf(msg.Context())
	if !ok {
		return 0, time.Time{}, false
	}
	return l.Attempts, l.FirstFailedAt, true
}

// dependencyDown reports whether err is the handler's word that its
// dependency is down ([Unavailable]), not a store's own outage: only the
// former closes the gate. A store that is down fails every attempt before
// the handler runs, and is left to its own backoff.
func dependencyDown(err error) bool {
	var u unavailableError
	return errors.As(err, &u)
}

// Subscriber returns sub ready for the router, in place of sub: with the
// consumer's parked messages merged in when PoisonConfig.Retries is set
// (retry.Merge with a subscriber of Retries for the consumer), so that a
// parked message comes back to the same handler when due; and checked,
// as each topic is subscribed, against the broker's delivery limit (sub
// a delivery.Limiter, as oncemill's RabbitMQ, SQS and NATS subscribers
// are): a queue or consumer whose limit is below [Poison.DeliveriesNeeded]
// is refused with ErrLowDeliveryLimit, naming it, its limit and the fix,
// unless PoisonConfig.AcceptDeliveryLimit says to go on. Parking needs the
// consumer's name (InboxConfig.Consumer through PoisonConfig.Inbox, or
// PoisonConfig.Consumer): the name the messages are parked under. Closing
// the returned subscriber closes sub.
func (p *Poison) Subscriber(sub message.Subscriber) (message.Subscriber, error) {
	if sub == nil {
		return nil, errors.New("middleware: Poison.Subscriber: the subscriber is nil")
	}
	checked := &limitChecked{Subscriber: sub, p: p}
	if p.cfg.Retries == nil {
		return checked, nil
	}
	if p.cfg.Consumer == "" {
		return nil, errors.New("middleware: Poison.Subscriber needs the consumer's name: set InboxConfig.Consumer (or PoisonConfig.Consumer without an inbox) to the router handler's name")
	}
	rs, err := p.cfg.Retries.Subscriber(retry.SubscriberConfig{Consumer: p.cfg.Consumer, Logger: p.cfg.Logger})
	if err != nil {
		return nil, err
	}
	return retry.Merge(checked, rs), nil
}

// DeliveriesNeeded is how many deliveries of a message the policy needs
// from its broker: one more than its horizon (MaxAttempts, plus
// len(Delays) with Retries), so that a message whose every delivery
// kills its consumer is dead-lettered after the policy's attempts, by the
// delivery after them. A failing message needs fewer: its immediate
// attempts run in process (InProcessRetries) and its delayed ones off
// the broker.
func (p *Poison) DeliveriesNeeded() int {
	return p.horizon(p.cfg.Retries != nil) + 1
}

// limitChecked is a subscriber whose Subscribe first checks the broker's
// delivery limit for the topic against the policy.
type limitChecked struct {
	message.Subscriber
	p *Poison
}

func (s *limitChecked) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	if err := s.p.checkLimit(ctx, s.Subscriber, topic); err != nil {
		return nil, err
	}
	return s.Subscriber.Subscribe(ctx, topic)
}

// DeliveryLimit forwards the question to the subscriber it checks.
func (s *limitChecked) DeliveryLimit(ctx context.Context, topic string) (delivery.Limit, error) {
	if l, ok := s.Subscriber.(delivery.Limiter); ok {
		return l.DeliveryLimit(ctx, topic)
	}
	return delivery.Limit{}, nil
}

// checkLimit reads the broker's delivery limit for topic and refuses one
// below what the policy needs, unless AcceptDeliveryLimit is set.
func (p *Poison) checkLimit(ctx context.Context, sub message.Subscriber, topic string) error {
	l, ok := sub.(delivery.Limiter)
	if !ok {
		return nil
	}
	lim, err := l.DeliveryLimit(ctx, topic)
	if err != nil {
		return fmt.Errorf("middleware: Poison.Subscriber: read the broker's delivery limit for topic %q: %w", topic, err)
	}
	need := p.DeliveriesNeeded()
	fields := watermill.LogFields{"topic": topic, "limit_at": lim.Where, "max_deliveries": lim.Deliveries, "needed": need}
	if lim.Deliveries == 0 || lim.Deliveries >= need {
		p.cfg.Logger.Debug("The broker's delivery limit leaves the poison policy room", fields)
		return nil
	}
	why := fmt.Sprintf("%s: the broker delivers a message %d times at most, and the poison policy needs %d "+
		"(a message that kills its consumer at every delivery is dead-lettered after %d attempts, by one more delivery): "+
		"%s; or shorten the policy (PoisonConfig.MaxAttempts, Delays); or set PoisonConfig.AcceptDeliveryLimit to subscribe anyway",
		lim.Where, lim.Deliveries, need, need-1, lim.Raise)
	if p.cfg.AcceptDeliveryLimit {
		p.cfg.Logger.Error("The broker's delivery limit is below the poison policy's: accepted (PoisonConfig.AcceptDeliveryLimit); "+
			"a message is ended at the broker's last delivery", errors.New(why), fields)
		return nil
	}
	return fmt.Errorf("%w: %s", ErrLowDeliveryLimit, why)
}
