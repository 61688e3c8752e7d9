package middleware

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/oncemill/oncemill/adapters"
	"github.com/oncemill/oncemill/dedup"
	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/internal/typednil"
	"github.com/oncemill/oncemill/observe"
	"github.com/oncemill/oncemill/retry"
)

// PoisonConfig configures a [Poison] middleware.
type PoisonConfig struct {
	// Inbox is the inbox the middleware goes in front of: its consumer
	// name and key function are the ones dead letters are filed under,
	// so that each is given once, even for a message that never reaches
	// the inbox (one its adapter could not decode). Setting Consumer or
	// Key as well is an error. Without it, a message that went through an
	// inbox is filed under the inbox's consumer and key all the same, and
	// one that did not under Consumer and Key.
	Inbox *Inbox
	// Publisher receives dead-lettered messages: any Watermill publisher
	// (a broker topic, a queue, or dlq.NewPublisher's PostgreSQL table).
	// The original is acked once the publish returned, so a publisher that
	// lives inside this process is refused with an error wrapping
	// adapters.ErrInProcess (adapters.CheckDurable): the one adapters.Open
	// returns for kafka:// or nats:// with no host, and a non-persistent
	// GoChannel. A persistent GoChannel is accepted, for tests and demos.
	// Required. The middleware does not close it.
	Publisher message.Publisher
	// Topic is the topic dead-lettered messages are published to.
	// Optional with the dead-letter table (dlq.Publisher), which only
	// records it with each entry: defaults to dlq.DefaultTopic ("dlq")
	// there. Required with any other publisher.
	Topic string
	// MaxAttempts is how many attempts a message gets before it is
	// dead-lettered, the first included. Defaults to 5.
	MaxAttempts int
	// InProcessRetries is how many times a failed message is retried in
	// the handler's goroutine, with backoff, before it is nacked to the
	// broker for redelivery. An in-process retry holds the delivery,
	// unacked, and with it its ordering key, so that no later message of
	// the key runs before it succeeds, is parked or is dead-lettered; it
	// spends none of the deliveries a broker makes of a message (RabbitMQ
	// 4's quorum queues drop a message after 20, SQS redrive and JetStream
	// MaxDeliver move or stop it); the inbox's store counts each attempt
	// durably all the same. [NoInProcessRetries] nacks every failed
	// attempt instead. Defaults to MaxAttempts-1: every immediate attempt
	// runs in process, then the message is parked (with Retries) or
	// dead-lettered.
	InProcessRetries int
	// OutageHold bounds how long a delivery waits in the consumer,
	// unacked, while the infrastructure or the handler's dependency is
	// down (an [Unavailable] error or Classify's [Pause], the inbox's
	// store unreachable, a dead letter or a park that could not be
	// written, another delivery holding the key): it is tried again in
	// process after the backoff instead of being nacked, so that an
	// outage spends none of the broker's deliveries. Past the bound it is
	// nacked once. The broker's last delivery of a message
	// (delivery.LastDelivery) is held as long as the consumer runs. Keep
	// it under the broker's own bound on an unacked delivery (RabbitMQ's
	// consumer_timeout, 30 minutes by default; SQS and JetStream are kept
	// waiting by the adapters' heartbeats). Defaults to
	// [DefaultOutageHold] (15 minutes).
	OutageHold time.Duration
	// AcceptDeliveryLimit lets [Poison.Subscriber] subscribe where the
	// broker's delivery limit for the topic (RabbitMQ's x-delivery-limit,
	// SQS's maxReceiveCount, JetStream's MaxDeliver) is below what the
	// policy needs ([Poison.DeliveriesNeeded]), with an Error line, instead
	// of refusing to: a message that kills its consumer at every delivery
	// is then dead-lettered at the broker's last delivery, before the
	// policy's horizon. Defaults to false: refused, with the fix.
	AcceptDeliveryLimit bool
	// InitialBackoff is the wait after the first failed attempt; it
	// doubles with every attempt up to MaxBackoff. The wait comes before
	// an in-process retry and before a nack, so that the broker does not
	// redeliver in a tight loop. Defaults to 100ms and 10s.
	InitialBackoff, MaxBackoff time.Duration
	// Retries is where a message waits for its delayed attempts, off the
	// consumer: once MaxAttempts attempts in a row failed, the message
	// (payload, metadata, key, attempt count, last error) is parked in
	// the store and acked, and the consumer's retry subscriber
	// (Retries.Subscriber, merged into the handler's subscriber with
	// retry.Merge) hands it back to the same handler when due, once for
	// each of Delays; the consumer meanwhile takes other work. While a
	// message waits, later messages of its ordering key wait behind it
	// (see Unordered). Parking needs the subscriber to run in the
	// process: without it, a line says so and the message is
	// dead-lettered after MaxAttempts, as without a store. Optional; the
	// middleware does not close it.
	Retries *retry.Store
	// Delays are the waits before each delayed attempt, with Retries.
	// Defaults to [DefaultDelays] (5s, 15s, 30s, 1m, 2m, 5m: a message is
	// dead-lettered about 9 minutes after its first failure).
	Delays []time.Duration
	// Classify decides what a failed attempt's error means ([Decision]):
	// retry by the policy, retry now, retry after a delay, dead-letter
	// now, or pause for a dependency that is down. Errors marked
	// [Permanent] or [Unavailable], and the infrastructure's, are decided
	// before it is asked. Defaults to [DefaultClassify].
	Classify func(error) Decision
	// Unordered turns off per-key order while a message waits: by
	// default a message whose ordering key (delivery.PartitionKeyOf: the
	// Kafka record key, the SQS FIFO group, the partition_key metadata)
	// has a message parked is parked behind it, not run, so that the key's
	// messages apply in order while other keys flow. Set it to let later
	// messages of the key overtake the one that waits. Defaults to false.
	Unordered bool
	// Consumer names the consumer in dead-letter metadata when no inbox
	// runs behind this middleware; with one, the inbox's consumer is used.
	// Defaults to the Inbox's, else to the router handler's name.
	Consumer string
	// PublishTimeout bounds the dead-letter publish when no inbox runs
	// behind this middleware. The publish runs on a context detached from
	// the message's cancellation, so that a shutdown does not cut short a
	// dead letter half written, and this bound keeps a hung publisher from
	// hanging the shutdown instead (the publisher must honour the
	// message's context, as dlq.Publisher and oncemill's adapters do).
	// With an inbox, its FinishTimeout bounds the publish. Defaults to 5s.
	PublishTimeout time.Duration
	// Key reads the message's key for dead-letter metadata when no inbox
	// runs behind this middleware; with one, the inbox's key is used, so
	// the two cannot disagree, and a message whose key the inbox could
	// not read is dead-lettered without one, the key function not run
	// again. A key error, or a panic in it, leaves the field empty. Defaults to the Inbox's, else to
	// [DefaultKey].
	Key KeyFunc
	// Hooks are told of every message dead-lettered
	// (observe.DeadLetterHook, with the reason's class) and every message
	// parked for a delayed retry (observe.RetryHook), and see each
	// dead letter before it is published (observe.MessageOutHook), which
	// is where a trace hook carries the trace into the copy.
	Hooks []observe.Hook
	// Logger receives a line for every message dead-lettered (at Info,
	// with its UUID, key and the error), every message parked for a
	// delayed retry (Info), and every outage and dead-letter publish that
	// failed (Error). Set watermill.NopLogger{} to silence it. Defaults to
	// the Inbox's Logger when Inbox is set, else to
	// watermill.NewSlogLogger(nil): slog.Default() when the middleware is
	// built, which writes Info and above to standard error.
	Logger watermill.LoggerAdapter
}

// NoInProcessRetries, as PoisonConfig.InProcessRetries, nacks every
// failed attempt for the broker to deliver again, instead of retrying it
// in process.
const NoInProcessRetries = -1

// topicNamer is a dead-letter publisher that names the topic it files
// dead letters under when PoisonConfig.Topic is empty.
type topicNamer interface{ DefaultTopic() string }

// fromInbox takes the settings the middleware shares with its inbox from
// c.Inbox, refusing any of them given twice.
func (c *PoisonConfig) fromInbox() error {
	in := c.Inbox
	if in == nil {
		return nil
	}
	for _, f := range []struct {
		name string
		set  bool
	}{{"Consumer", c.Consumer != ""}, {"Key", c.Key != nil}} {
		if f.set {
			return fmt.Errorf("middleware: PoisonConfig.%s is taken from PoisonConfig.Inbox (its InboxConfig.%[1]s): set one of them", f.name)
		}
	}
	c.Consumer, c.Key = in.cfg.Consumer, in.cfg.Key
	if c.Logger == nil {
		c.Logger = in.cfg.Logger
	}
	return nil
}

func (c *PoisonConfig) setDefaults() {
	if n, ok := c.Publisher.(topicNamer); ok && c.Topic == "" {
		c.Topic = n.DefaultTopic()
	}
	if c.MaxAttempts == 0 {
		c.MaxAttempts = 5
	}
	if c.InitialBackoff == 0 {
		c.InitialBackoff = 100 * time.Millisecond
	}
	if c.MaxBackoff == 0 {
		c.MaxBackoff = 10 * time.Second
	}
	if c.PublishTimeout == 0 {
		c.PublishTimeout = 5 * time.Second
	}
	if c.InProcessRetries == 0 {
		c.InProcessRetries = max(c.MaxAttempts-1, 0)
	}
	if c.OutageHold == 0 {
		c.OutageHold = DefaultOutageHold
	}
	if c.Key == nil {
		c.Key = DefaultKey
	}
	if c.Logger == nil {
		c.Logger = watermill.NewSlogLogger(nil)
	}
	if c.Retries != nil && c.Delays == nil {
		c.Delays = DefaultDelays
	}
	if c.Classify == nil {
		c.Classify = DefaultClassify
	}
}

// Validate reports the first field that is missing or out of range.
func (c PoisonConfig) Validate() error {
	c.setDefaults()
	switch {
	case c.Publisher == nil:
		return errors.New("middleware: PoisonConfig.Publisher is required: it receives the dead-lettered messages")
	case typednil.Is(c.Publisher):
		return fmt.Errorf("middleware: PoisonConfig.Publisher holds a nil %T: pass a publisher made by its constructor", c.Publisher)
	}
	if err := adapters.CheckDurable(c.Publisher); err != nil {
		return fmt.Errorf("middleware: PoisonConfig.Publisher would lose the dead letters, since the originals are acked: %w", err)
	}
	switch {
	case c.Topic == "":
		return errors.New("middleware: PoisonConfig.Topic is required: the dead-letter topic")
	case c.MaxAttempts < 1:
		return fmt.Errorf("middleware: PoisonConfig.MaxAttempts must be at least 1, got %d", c.MaxAttempts)
	case c.InProcessRetries < NoInProcessRetries:
		return fmt.Errorf("middleware: PoisonConfig.InProcessRetries must be NoInProcessRetries (-1), 0 for the default (MaxAttempts-1) or positive, got %d", c.InProcessRetries)
	case c.OutageHold < 0:
		return fmt.Errorf("middleware: PoisonConfig.OutageHold must not be negative, got %s", c.OutageHold)
	case c.InitialBackoff < 0:
		return fmt.Errorf("middleware: PoisonConfig.InitialBackoff must not be negative, got %s", c.InitialBackoff)
	case c.MaxBackoff < c.InitialBackoff:
		return fmt.Errorf("middleware: PoisonConfig.MaxBackoff (%s) must be at least InitialBackoff (%s)", c.MaxBackoff, c.InitialBackoff)
	case c.PublishTimeout < 0:
		return fmt.Errorf("middleware: PoisonConfig.PublishTimeout must not be negative, got %s", c.PublishTimeout)
	case c.Retries != nil && c.Retries.Ready() != nil:
		return fmt.Errorf("middleware: PoisonConfig.Retries: %w: pass the store retry.NewStore or retry.NewSQLStore returned", c.Retries.Ready())
	case len(c.Delays) > 0 && c.Retries == nil:
		return errors.New("middleware: PoisonConfig.Delays needs PoisonConfig.Retries, the store where messages wait for their delayed attempts (retry.NewStore)")
	}
	for i, d := range c.Delays {
		if d < 0 {
			return fmt.Errorf("middleware: PoisonConfig.Delays[%d] must not be negative, got %s", i, d)
		}
	}
	return checkConsumerName("PoisonConfig.Consumer", c.Consumer)
}

// PoisonStats counts what a [Poison] middleware did since it was made.
type PoisonStats struct {
	// Retried counts failed attempts that were retried (in process) or
	// nacked for redelivery.
	Retried int64
	// DeadLettered counts messages published to the dead-letter queue and
	// then acked.
	DeadLettered int64
	// DeadLetterFailed counts dead-letter publishes that failed; their
	// messages were nacked.
	DeadLetterFailed int64
	// Panicked counts attempts whose handler panicked outside an inbox
	// (the inbox counts its own).
	Panicked int64
	// Infrastructure counts attempts nacked for the infrastructure's fault
	// ([IsInfrastructure]): never counted toward MaxAttempts.
	Infrastructure int64
	// AppliedMeanwhile counts messages that were due for the dead-letter
	// queue but whose key another delivery applied meanwhile: they were
	// acked as duplicates instead, so a key is never both applied and
	// dead.
	AppliedMeanwhile int64
	// Parked counts failed attempts whose message was parked for a
	// delayed retry (PoisonConfig.Retries); ParkedBehind the messages
	// parked, unrun, behind a parked message of their ordering key.
	Parked, ParkedBehind int64
	// Paused counts the attempts that waited for the consumer's one
	// attempt at a time while its dependency was down.
	Paused int64
	// BroughtForward counts the parked messages made due at once because
	// the handler succeeded again after failures.
	BroughtForward int64
}

// Poison is a router middleware that keeps a message that cannot be
// processed from blocking its partition or queue, without losing it: after
// MaxAttempts failed attempts, or at once for a permanent error, the message
// goes to the dead-letter queue with the reason, and only then is the
// original acked. With PoisonConfig.Retries, the message is first parked
// for each of Delays, off the consumer, and handed back to the handler by
// the subscriber that [Poison.Subscriber] merges in, later messages of its
// ordering key waiting behind it; it is dead-lettered after the last. It
// starts no goroutines.
//
// Add it outside the inbox (first), so that it sees the inbox's errors:
//
//	router.AddMiddleware(poison.Middleware, inbox.Middleware)
//
// Attempts are counted durably. When the error comes from an inbox
// attempt, the inbox store's count is used: it counts
// handler attempts exactly and survives restarts and rebalances, on Kafka
// too. Otherwise the broker's own count of deliveries is used
// (delivery.Attempts: SQS ApproximateReceiveCount, RabbitMQ quorum
// x-delivery-count), and only without either (Kafka without an inbox) a
// counter in memory, which a restart resets.
//
// What counts as a failed attempt: an error, a panic (recovered here or in
// the inbox, wrapped in [ErrPanicked]) and a deadline exceeded, such as
// Watermill's Timeout middleware sets. What does not: the consumer shutting
// down (the context it subscribed with is cancelled), another delivery
// holding the key ([ErrInFlight]) and a lost lease; those are nacked and
// come back. A message whose deliveries kill the process is counted by the
// inbox, which records every attempt before the handler runs: after
// MaxAttempts such attempts the next delivery is dead-lettered without
// running the handler ([ErrCrashLoop]).
//
// With an inbox behind it, dead-lettering is done under the key's claim:
// if another delivery applied the key meanwhile, the message is acked as
// a duplicate and not dead-lettered; otherwise the key is recorded dead
// in the inbox's store, in the same transaction as the claim and after
// the dead-letter publish succeeded (a crash between the two leaves the
// message in the DLQ and the key not dead: its redelivery is attempted
// again, never lost). Later copies of a dead key are acked without
// running until its dead letter is replayed.
type Poison struct {
	cfg   PoisonConfig
	hooks observe.Hooks

	retried, deadLettered, deadLetterFailed, panicked, appliedMeanwhile atomic.Int64
	infrastructure                                                      atomic.Int64
	parked, parkedBehind, paused                                        atomic.Int64
	// outages counts the infrastructure failures in a row, for the backoff.
	outages atomic.Int64
	// pauses counts the attempts in a row whose handler said its
	// dependency is down (Unavailable, or Classify's Pause); gate lets
	// one attempt at a time run while pauses > 0.
	pauses atomic.Int64
	gate   *gate
	// unparked remembers the consumers and topics told that no retry
	// subscriber runs for them.
	unparked sync.Map
	// forwards brings parked messages forward once the handler succeeds
	// again; broughtForward counts them.
	forwards       forwards
	broughtForward atomic.Int64

	mu    sync.Mutex
	local map[string]localCount // by message UUID; bounded by maxLocal
}

type localCount struct {
	attempts int
	first    time.Time
}

// maxLocal bounds the in-memory fallback counter; when full it starts over,
// which only ever delays a dead-letter, never loses a message.
const maxLocal = 10000

// NewPoison returns a poison middleware for cfg; cfg is copied, defaulted
// and validated.
func NewPoison(cfg PoisonConfig) (*Poison, error) {
	if err := cfg.fromInbox(); err != nil {
		return nil, err
	}
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	p := &Poison{cfg: cfg, hooks: observe.New(cfg.Hooks...), local: map[string]localCount{}}
	p.gate = newGate(func() bool { return p.pauses.Load() > 0 })
	return p, nil
}

// Stats returns the middleware's counters.
func (p *Poison) Stats() PoisonStats {
	return PoisonStats{
		Retried:          p.retried.Load(),
		DeadLettered:     p.deadLettered.Load(),
		DeadLetterFailed: p.deadLetterFailed.Load(),
		Panicked:         p.panicked.Load(),
		AppliedMeanwhile: p.appliedMeanwhile.Load(),
		Infrastructure:   p.infrastructure.Load(),
		Parked:           p.parked.Load(),
		ParkedBehind:     p.parkedBehind.Load(),
		Paused:           p.paused.Load(),
		BroughtForward:   p.broughtForward.Load(),
	}
}

// Middleware wraps h: add it with router.AddMiddleware, before the inbox.
//
// A message the adapter could not decode (delivery.DecodeError) never
// reaches h. A failed attempt is retried in process after a backoff, then
// parked or dead-lettered (see [PoisonConfig.InProcessRetries]). An
// attempt that says nothing about the message (see [Poison]) is not
// counted: the delivery is held and tried again in process while the
// outage lasts, up to [PoisonConfig.OutageHold], and nacked only then.
func (p *Poison) Middleware(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		base := msg.Context()
		defer msg.SetContext(base)
		hold := p.newHold(msg)
		defer hold.leave()
		if reason := delivery.DecodeErrorOf(msg); reason != "" {
			now := time.Now()
			err := Permanent(fmt.Errorf("%w: %s", ErrUndecodable, reason))
			broker, _ := delivery.AttemptsOf(msg)
			return nil, p.ending(hold, nil, func() error { return p.deadLetter(msg, nil, err, max(broker, 1), now, now) })
		}
		var slot *attemptSlot
		defer func() { slot.end() }()
		// try numbers the counted attempts of this delivery: waits through
		// an outage are not attempts.
		try := 0
		for {
			if behind, err := p.waitBehind(msg); err != nil {
				err = fmt.Errorf("%w: %w", ErrPark, err)
				if hold.wait(err, false) {
					continue
				}
				return nil, hold.giveUp(nil, err)
			} else if behind {
				return nil, nil
			}
			if !hold.enterGate() {
				if err := base.Err(); err != nil {
					return nil, hold.giveUp(nil, err)
				}
				return nil, hold.giveUp(nil, fmt.Errorf("%w: its dependency is still down after %s", dedup.ErrUnavailable, p.cfg.OutageHold))
			}
			// The inbox stops a crash loop at the policy's horizon: the
			// delayed attempts count too.
			parking := p.parking(msg, p.consumerOf(msg))
			slot = &attemptSlot{maxAttempts: p.crashHorizon(parking, hold), try: try}
			// Every try starts from the delivery's own context: a Timeout
			// middleware behind this one leaves its cancelled context on
			// the message.
			msg.SetContext(withSlot(base, slot))
			produced, err := p.call(h, msg)
			msg.SetContext(base)
			if err == nil {
				p.succeeded(msg, hold)
				return produced, nil
			}
			class := classOf(base, err)
			switch class {
			case classUncounted:
				slot.end()
				if stopping(base) || errors.Is(err, ErrShutdown) {
					return nil, hold.giveUp(slot, err)
				}
				// Another delivery holds the key, or took its lease over:
				// wait for it here rather than spend a broker delivery.
				if hold.wait(err, true) {
					continue
				}
				return nil, hold.giveUp(slot, err)
			case classInfrastructure:
				slot.end()
				if dependencyDown(err) {
					p.pauses.Add(1)
				}
				if hold.wait(err, false) {
					continue
				}
				return nil, hold.giveUp(slot, err)
			}
			dec := DeadLetter
			if class == classFailure {
				dec = p.classify(err)
			}
			if dec.kind == decidePause {
				slot.end()
				p.pauses.Add(1)
				if hold.wait(err, false) {
					continue
				}
				return nil, hold.giveUp(slot, err)
			}
			// The dependencies answered: an outage, if one was on, is over.
			p.resume()
			now := time.Now()
			attempts, first := p.count(msg, err, try, now)
			p.forwards.failed(topicOf(msg), msg.UUID)
			if dec.kind == decideDeadLetter || attempts >= p.horizon(parking) {
				return nil, p.ending(hold, slot, func() error { return p.deadLetter(msg, slot, p.atLimit(hold, err), attempts, first, now) })
			}
			delay, park := p.delayFor(dec, attempts)
			if park && parking {
				slot.end()
				return nil, p.ending(hold, slot, func() error { return p.park(msg, slot, err, attempts, first, now, delay) })
			}
			p.retried.Add(1)
			slot.end() // done with this attempt: the backoff is not part of it
			wait := p.backoff(attempts)
			if park { // RetryIn without a store: its wait, within MaxBackoff
				wait = max(wait, min(delay, p.cfg.MaxBackoff))
			}
			redeliver := try >= p.inProcessRetries()
			if redeliver && hold.last {
				// A nack now would be the broker's last: end the message
				// here, parked for its next attempt or dead-lettered.
				if parking {
					return nil, p.ending(hold, slot, func() error {
						return p.park(msg, slot, err, attempts, first, now, max(wait, p.cfg.InitialBackoff))
					})
				}
				return nil, p.ending(hold, slot, func() error {
					return p.deadLetter(msg, slot, lastDeliveryError(hold.limit, err), attempts, first, now)
				})
			}
			p.logFailing(msg, slot, err, attempts, try, redeliver, wait)
			if !sleepCtx(base, wait) {
				return nil, hold.giveUp(slot, err)
			}
			if redeliver {
				return nil, err
			}
			try++
		}
	}
}

// logFailing writes the line of a failed attempt that is retried: at
// Info for a delivery's first failure (the message's state changes to
// failing), at Debug for the others, with what comes next.
func (p *Poison) logFailing(msg *message.Message, slot *attemptSlot, err error, attempts, try int, redeliver bool, wait time.Duration) {
	next := "tried again in process in " + wait.String()
	if redeliver {
		next = "nacked in " + wait.String() + ", for the broker to deliver again"
	}
	fields := p.fields(msg, slot).Add(watermill.LogFields{"attempt": attempts, "next": next, "error": err.Error()})
	if try == 0 {
		p.cfg.Logger.Info("Message failed", fields)
		return
	}
	p.cfg.Logger.Debug("Message failed again", fields)
}

// succeeded ends a delivery whose attempt succeeded.
func (p *Poison) succeeded(msg *message.Message, hold *hold) {
	p.forget(msg.UUID)
	p.resume()
	p.bringForward(msg)
	if hold.waited > 0 {
		p.cfg.Logger.Info("Message applied after an outage", p.fields(msg, nil).Add(watermill.LogFields{
			"held_for": time.Since(hold.since).Round(time.Millisecond).String()}))
	}
}

// classify runs Classify, turning a panic in it into the default
// policy's decision: a classifier that cannot read the error says nothing
// of the message.
func (p *Poison) classify(err error) (dec Decision) {
	defer func() {
		if r := recover(); r != nil {
			p.cfg.Logger.Error("PoisonConfig.Classify panicked: the failure is decided by DefaultClassify", panicError(r), nil)
			dec = DefaultClassify(err)
		}
	}()
	return p.cfg.Classify(err)
}

// inProcessRetries is how many failed attempts of one delivery are
// retried in process before the delivery is nacked.
func (p *Poison) inProcessRetries() int {
	if p.cfg.InProcessRetries == NoInProcessRetries {
		return 0
	}
	return p.cfg.InProcessRetries
}

// crashHorizon is the limit the inbox stops a crash loop at: the
// policy's horizon, and at the broker's last delivery of a message n
// times delivered, n-1, so that a message whose every earlier delivery
// died with its process is dead-lettered instead of run once more, which
// would have the broker drop it if it died again. The count cannot tell
// a delivery that died from one that failed and was nacked, so the
// horizon is lowered only where failures are not nacked: with the
// immediate attempts in process (the default InProcessRetries), a
// delivery that comes back is one that did not end.
func (p *Poison) crashHorizon(parking bool, hold *hold) int {
	h := p.horizon(parking)
	if hold.last && p.inProcessRetries() >= p.cfg.MaxAttempts-1 {
		if n, ok := delivery.AttemptsOf(hold.msg); ok && n > 1 {
			h = min(h, n-1)
		}
	}
	return h
}

// atLimit wraps err in [ErrDeliveryLimit] when it ends the broker's last
// delivery of the message.
func (p *Poison) atLimit(hold *hold, err error) error {
	if hold.last && !errors.Is(err, ErrDeliveryLimit) {
		return lastDeliveryError(hold.limit, err)
	}
	return err
}

// endLast ends the broker's last delivery of a message that the consumer
// cannot handle now (it stops, or an outage outlasted OutageHold): a nack
// would have the broker drop it. It is parked, not counted, to be handed
// back in a moment; without parking it is dead-lettered with
// ErrDeliveryLimit. Only when neither can be written is it nacked.
func (p *Poison) endLast(h *hold, slot *attemptSlot, cause error) error {
	msg := h.msg
	now := time.Now()
	var err error
	if p.parking(msg, p.consumerOf(msg)) {
		err = p.park(msg, slot, cause, 0, now, now, p.cfg.InitialBackoff)
	} else {
		attempts, _ := delivery.AttemptsOf(msg)
		err = p.deadLetter(msg, slot, lastDeliveryError(h.limit, cause), attempts, now, now)
	}
	if err == nil {
		return nil
	}
	p.cfg.Logger.Error("The broker's last delivery of a message is nacked: neither parked nor dead-lettered, the broker may drop it", err,
		p.fields(msg, slot).Add(watermill.LogFields{"max_deliveries": h.limit}))
	return err
}

// ending runs write, the dead letter or the park that ends a message's
// delivery, again in process, through h, while it fails for the
// infrastructure's fault: the handler does not run again, and the
// delivery is not nacked while the outage lasts (see hold).
func (p *Poison) ending(h *hold, slot *attemptSlot, write func() error) error {
	for {
		err := write()
		if err == nil || !IsInfrastructure(err) {
			return err
		}
		if !h.wait(err, false) {
			return h.giveUp(slot, err)
		}
	}
}

// call runs h, turning a panic into an error wrapping [ErrPanicked], so that
// a chain without an inbox counts it too.
func (p *Poison) call(h message.HandlerFunc, msg *message.Message) (produced []*message.Message, err error) {
	defer func() {
		if r := recover(); r != nil {
			p.panicked.Add(1)
			produced, err = nil, panicError(r)
		}
	}()
	return h(msg)
}

// count returns the number of the attempt that just failed and when the
// message first failed: the highest of the broker's count, the store's
// count and the in-memory one.
func (p *Poison) count(msg *message.Message, err error, try int, now time.Time) (int, time.Time) {
	p.mu.Lock()
	lc, ok := p.local[msg.UUID]
	if !ok {
		if len(p.local) >= maxLocal {
			p.local = map[string]localCount{}
		}
		lc.first = now
	}
	lc.attempts++
	p.local[msg.UUID] = lc
	p.mu.Unlock()

	if n, at, ok := storedAttempts(err); ok {
		// The store counts handler attempts, durably and exactly; the
		// broker counts deliveries, and a consumer shutting down returns
		// its messages (RabbitMQ counts that as one or two more), so the
		// store's count is the one that dead-letters at MaxAttempts and not
		// before.
		if at.After(lc.first) {
			at = lc.first
		}
		return n, at
	}
	attempts := lc.attempts
	if n, ok := delivery.AttemptsOf(msg); ok {
		attempts = max(attempts, n+try)
	}
	if n, at, ok := leaseAttempts(msg); ok {
		// A parked message handed back: its count goes on from the
		// attempts it was parked with.
		attempts = max(attempts, n+1+try)
		if !at.IsZero() && at.Before(lc.first) {
			lc.first = at
		}
	}
	return attempts, lc.first
}

func (p *Poison) forget(uuid string) {
	p.mu.Lock()
	delete(p.local, uuid)
	p.mu.Unlock()
}

// backoff is the wait after the given failed attempt.
func (p *Poison) backoff(attempts int) time.Duration {
	d := p.cfg.InitialBackoff
	for i := 1; i < attempts && d < p.cfg.MaxBackoff; i++ {
		d *= 2
	}
	return min(d, p.cfg.MaxBackoff)
}

// attemptsSource names the count that [Poison.count] took for msg's
// attempts, for delivery.DeadAttemptsSource: the inbox store's, else the
// broker's, else the one in memory.
func attemptsSource(msg *message.Message, cause error) string {
	if _, _, ok := storedAttempts(cause); ok {
		return delivery.AttemptsFromInbox
	}
	if _, ok := delivery.AttemptsOf(msg); ok {
		return delivery.AttemptsFromBroker
	}
	return delivery.AttemptsFromProcess
}

// deadLetter publishes a copy of msg to the dead-letter topic and returns
// nil, so that the router acks the original, or, when the publish fails, an
// error wrapping ErrDeadLetter and cause, so that it nacks it.
func (p *Poison) deadLetter(msg *message.Message, slot *attemptSlot, cause error, attempts int, first, last time.Time) error {
	consumer := p.cfg.Consumer
	if consumer == "" {
		consumer = message.HandlerNameFromCtx(msg.Context())
	}
	topic := topicOf(msg)
	var key string
	switch {
	case slot != nil && slot.inbox != nil:
		consumer, key = slot.key.Consumer, slot.key.Key
	case slot != nil && slot.keyed:
		// The inbox could not read a key: the key function ran once for
		// this attempt, and the dead letter's key stays empty.
	default:
		key, _ = keyOf(p.cfg.Key, msg)
	}

	// The copy keeps the message's own metadata (its key, its partition
	// key) but none of the facts of this delivery (delivery.IsDeliveryFact):
	// a replay marker in particular must not travel into the dead letter,
	// which a replay publishes again with a fresh grant of its own.
	dead := message.NewMessage(msg.UUID, msg.Payload)
	for k, v := range msg.Metadata {
		if !delivery.IsDeliveryFact(k) {
			dead.Metadata.Set(k, v)
		}
	}
	md := dead.Metadata
	md.Set(delivery.DeadTopic, topic)
	md.Set(delivery.DeadConsumer, consumer)
	md.Set(delivery.DeadKey, key)
	md.Set(delivery.DeadAttempts, strconv.Itoa(attempts))
	md.Set(delivery.DeadAttemptsSource, attemptsSource(msg, cause))
	md.Set(delivery.DeadError, cause.Error())
	md.Set(delivery.DeadPermanent, strconv.FormatBool(IsPermanent(cause)))
	md.Set(delivery.DeadFirstFailedAt, first.UTC().Format(time.RFC3339Nano))
	md.Set(delivery.DeadLastFailedAt, last.UTC().Format(time.RFC3339Nano))
	if v := msg.Metadata.Get(delivery.Partition); v != "" {
		md.Set(delivery.DeadPartition, v)
	}
	if v := msg.Metadata.Get(delivery.Offset); v != "" {
		md.Set(delivery.DeadOffset, v)
	}
	if v := msg.Metadata.Get(delivery.Stream); v != "" {
		md.Set(delivery.DeadStream, v)
	}
	if v := msg.Metadata.Get(delivery.StreamSequence); v != "" {
		md.Set(delivery.DeadStreamSequence, v)
	}

	fields := watermill.LogFields{
		"message_uuid": delivery.Bound(msg.UUID), "consumer": consumer, "topic": topic, "key": delivery.Bound(key),
		"attempts": attempts, "dlq_topic": p.cfg.Topic,
	}
	if order := delivery.PartitionKeyOf(msg); order != "" {
		fields["order_key"] = delivery.Bound(order)
	}
	publish := func(ctx context.Context) error {
		dead.SetContext(ctx)
		p.hooks.MessageOut(msg.Context(), observe.OutDeadLetter, dead)
		return p.cfg.Publisher.Publish(p.cfg.Topic, dead)
	}
	var err error
	if slot != nil && slot.inbox != nil {
		var outcome buryOutcome
		outcome, err = slot.inbox.bury(msg.Context(), slot.key, dedup.Failure{Err: cause.Error(), At: last}, publish)
		switch outcome {
		case buryApplied:
			p.appliedMeanwhile.Add(1)
			p.forget(msg.UUID)
			p.cfg.Logger.Info("Message not dead-lettered: another delivery applied its key meanwhile", fields)
			return nil
		case buryAlreadyDead:
			p.forget(msg.UUID)
			p.cfg.Logger.Info("Message not dead-lettered again: its key is dead already", fields)
			return nil
		}
	} else {
		ctx, cancel := context.WithTimeout(context.WithoutCancel(msg.Context()), p.cfg.PublishTimeout)
		err = publish(ctx)
		cancel()
	}
	if err != nil {
		p.deadLetterFailed.Add(1)
		p.cfg.Logger.Error("Dead-letter publish failed", err, fields)
		return fmt.Errorf("%w: to %q: %w (message failed with: %w)", ErrDeadLetter, p.cfg.Topic, err, cause)
	}
	p.deadLettered.Add(1)
	p.forget(msg.UUID)
	p.hooks.DeadLetter(msg.Context(), observe.DeadLetter{Consumer: consumer, Topic: topic, Reason: reasonOf(cause), Attempts: attempts})
	p.cfg.Logger.Info("Message dead-lettered", fields.Add(watermill.LogFields{"error": cause.Error()}))
	return nil
}

// sleepCtx waits d or until ctx is done, and reports whether it waited the
// whole time.
func sleepCtx(ctx context.Context, d time.Duration) bool {
	if d <= 0 {
		return ctx.Err() == nil
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}
