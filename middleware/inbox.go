package middleware

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/oncemill/oncemill/dedup"
)

// InboxConfig configures an [Inbox]. Exactly one of TxStore and LeaseStore
// must be set; it chooses the mode.
type InboxConfig struct {
	// TxStore claims keys in the transaction that holds the handler's
	// effect (transactional mode). The handler reads the transaction from
	// the message context with the store package's accessor, e.g.
	// postgres.Tx(msg.Context()).
	TxStore dedup.TxStore
	// LeaseStore claims keys as fenced leases (lease mode), for effects
	// outside the database. The handler passes IdempotencyKey(ctx) to the
	// effect's own idempotency mechanism where it has one.
	LeaseStore dedup.LeaseStore

	// Key extracts the key from a message. Defaults to [DefaultKey].
	Key KeyFunc
	// Consumer scopes keys, so that two consumers of one topic keep
	// separate records. Defaults to the router handler's name.
	Consumer string
	// Window is how long a key is remembered; it must exceed the longest
	// time in which the broker may redeliver. Defaults to 72 hours.
	Window time.Duration
	// Lease is how long a lease-mode claim holds the key before another
	// delivery may take it over; it must exceed the handler's longest
	// run. Lease mode only. Defaults to 30 seconds.
	Lease time.Duration
	// InFlightDelay is how long a delivery whose key is held by another
	// live lease waits before it is nacked, so that it is not redelivered
	// in a tight loop. It is cut short when the lease ends sooner, and
	// when the holder finishes meanwhile (stores that implement
	// dedup.Peeker) the delivery is answered as a duplicate. Used in
	// lease mode, and with transactional stores that keep a lock in front
	// of their record (dedup/twotier). Defaults to 1 second.
	InFlightDelay time.Duration
	// Outbox, when set, writes the messages the handler produced into an
	// outbox inside the inbox's transaction (the consumer outbox), instead
	// of returning them to the router: consume, update and produce then
	// commit as one step, and a relay publishes them. The context it gets
	// carries the transaction. Transactional mode only. See
	// forwarder.InboxOutbox for the PostgreSQL outbox.
	Outbox func(ctx context.Context, produced []*message.Message) error

	// Logger receives a line for every duplicate dropped. Defaults to
	// watermill.NopLogger.
	Logger watermill.LoggerAdapter
}

func (c *InboxConfig) setDefaults() {
	if c.Key == nil {
		c.Key = DefaultKey
	}
	if c.Window == 0 {
		c.Window = dedup.DefaultWindow
	}
	if c.Lease == 0 {
		c.Lease = 30 * time.Second
	}
	if c.InFlightDelay == 0 {
		c.InFlightDelay = time.Second
	}
	if c.Logger == nil {
		c.Logger = watermill.NopLogger{}
	}
}

// Validate reports the first field that is missing or out of range.
func (c InboxConfig) Validate() error {
	switch {
	case c.TxStore == nil && c.LeaseStore == nil:
		return errors.New("middleware: InboxConfig: set TxStore (transactional mode) or LeaseStore (lease mode)")
	case c.TxStore != nil && c.LeaseStore != nil:
		return errors.New("middleware: InboxConfig: set only one of TxStore and LeaseStore")
	case c.Window < time.Minute:
		return fmt.Errorf("middleware: InboxConfig.Window must be at least 1m, got %s", c.Window)
	case c.Lease < 10*time.Millisecond:
		return fmt.Errorf("middleware: InboxConfig.Lease must be at least 10ms, got %s", c.Lease)
	case c.Outbox != nil && c.TxStore == nil:
		return errors.New("middleware: InboxConfig.Outbox needs TxStore: the outbox is written in the claim's transaction")
	case c.InFlightDelay < 0:
		return fmt.Errorf("middleware: InboxConfig.InFlightDelay must not be negative, got %s", c.InFlightDelay)
	}
	return nil
}

// InboxStats counts what an [Inbox] did since it was made.
type InboxStats struct {
	// Applied counts handler runs whose effect was committed.
	Applied int64
	// Duplicates counts deliveries dropped because their key was done.
	Duplicates int64
	// InFlight counts deliveries nacked because another held the key.
	InFlight int64
	// Failed counts handler runs that returned an error.
	Failed int64
}

// Inbox is a router middleware that applies each message key's effect
// exactly once per consumer. It starts no goroutines.
type Inbox struct {
	cfg InboxConfig

	applied, duplicates, inFlight, failed atomic.Int64
}

// NewInbox returns an inbox for cfg; cfg is copied, defaulted and validated.
func NewInbox(cfg InboxConfig) (*Inbox, error) {
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	return &Inbox{cfg: cfg}, nil
}

// Stats returns the inbox's counters.
func (in *Inbox) Stats() InboxStats {
	return InboxStats{
		Applied:    in.applied.Load(),
		Duplicates: in.duplicates.Load(),
		InFlight:   in.inFlight.Load(),
		Failed:     in.failed.Load(),
	}
}

type keyCtxKey struct{}

// IdempotencyKey returns the key of the message being handled, for passing
// to an effect's own idempotency mechanism (a payment provider's
// Idempotency-Key header, say). It is empty outside an inbox.
func IdempotencyKey(ctx context.Context) string {
	k, _ := ctx.Value(keyCtxKey{}).(string)
	return k
}

// Middleware wraps h: add it with router.AddMiddleware or to one handler.
//
// A new key runs h and commits (or completes) its effect with the messages h
// produced; a done key returns those stored messages without running h, so
// that a crash between commit and publish loses nothing; an error from h is
// recorded as a failed attempt and returned, so that the message is nacked.
func (in *Inbox) Middleware(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		key, err := in.keyOf(msg)
		if err != nil {
			return nil, err
		}
		if in.cfg.TxStore != nil {
			return in.handleTx(msg, key, h)
		}
		return in.handleLease(msg, key, h)
	}
}

func (in *Inbox) keyOf(msg *message.Message) (dedup.Key, error) {
	consumer := in.cfg.Consumer
	if consumer == "" {
		consumer = message.HandlerNameFromCtx(msg.Context())
	}
	if consumer == "" {
		return dedup.Key{}, Permanent(ErrNoConsumer)
	}
	k, err := keyOf(in.cfg.Key, msg)
	if err != nil {
		return dedup.Key{}, err
	}
	return dedup.Key{Consumer: consumer, Key: k}, nil
}

func (in *Inbox) handleTx(msg *message.Message, key dedup.Key, h message.HandlerFunc) (produced []*message.Message, err error) {
	ctx := msg.Context()
	tx, err := in.cfg.TxStore.InboxBegin(ctx)
	if err != nil {
		return nil, err
	}
	ended := false
	defer func() {
		// Reached without ending the transaction only when h panicked:
		// undo the claim and the effect, then let the panic go on.
		if !ended {
			if err := tx.Rollback(context.WithoutCancel(ctx)); err != nil {
				in.cfg.Logger.Error("Rollback after handler panic failed", err, logFields(msg, key))
			}
		}
	}()

	claim, err := tx.InboxClaim(ctx, key, in.cfg.Window)
	if err != nil {
		ended = true
		return nil, errors.Join(err, tx.Rollback(ctx))
	}
	switch claim.State {
	case dedup.StateDone:
		ended = true
		if err := tx.Rollback(ctx); err != nil {
			return nil, err
		}
		return in.duplicate(msg, key, claim)
	case dedup.StateInFlight:
		// A store with a lock in front of its record (two-tier) answers
		// this when another delivery holds the key right now.
		ended = true
		if err := tx.Rollback(ctx); err != nil {
			return nil, err
		}
		return in.awaitInFlight(msg, key, claim)
	}

	txCtx := tx.WithTx(ctx)
	produced, err = in.run(txCtx, msg, key, h)
	if err == nil && in.cfg.Outbox != nil && len(produced) > 0 {
		if err = in.cfg.Outbox(txCtx, produced); err == nil {
			produced = nil // committed with the effect; the relay publishes them
		}
	}
	if err != nil {
		ended = true
		rbErr := tx.Rollback(ctx)
		in.failed.Add(1)
		f := dedup.Failure{Err: err.Error(), At: time.Now()}
		failErr := in.cfg.TxStore.InboxFail(context.WithoutCancel(ctx), key, f, in.cfg.Window)
		return nil, attempted(errors.Join(err, rbErr, failErr), claim, f.At)
	}

	result, err := encodeResult(produced)
	if err == nil {
		err = tx.InboxComplete(ctx, key, result)
	}
	ended = true
	if err == nil {
		err = tx.Commit(ctx)
	}
	if err != nil {
		return nil, errors.Join(err, tx.Rollback(ctx))
	}
	in.applied.Add(1)
	return produced, nil
}

func (in *Inbox) handleLease(msg *message.Message, key dedup.Key, h message.HandlerFunc) (produced []*message.Message, err error) {
	ctx := msg.Context()
	claim, err := in.cfg.LeaseStore.LeaseClaim(ctx, key, in.cfg.Lease, in.cfg.Window)
	if err != nil {
		return nil, err
	}
	switch claim.State {
	case dedup.StateDone:
		return in.duplicate(msg, key, claim)
	case dedup.StateInFlight:
		return in.awaitInFlight(msg, key, claim)
	}

	released := false
	defer func() {
		// Reached without completing or releasing only when h panicked:
		// free the key for the next delivery, then let the panic go on.
		if !released {
			f := dedup.Failure{Err: "handler panicked", At: time.Now()}
			if err := in.cfg.LeaseStore.LeaseRelease(context.WithoutCancel(ctx), key, claim.Token, f); err != nil {
				in.cfg.Logger.Error("Lease release after handler panic failed", err, logFields(msg, key))
			}
		}
	}()

	produced, err = in.run(ctx, msg, key, h)
	released = true
	if err != nil {
		in.failed.Add(1)
		f := dedup.Failure{Err: err.Error(), At: time.Now()}
		relErr := in.cfg.LeaseStore.LeaseRelease(context.WithoutCancel(ctx), key, claim.Token, f)
		return nil, attempted(errors.Join(err, relErr), claim, f.At)
	}
	result, err := encodeResult(produced)
	if err == nil {
		err = in.complete(ctx, key, claim.Token, result)
	}
	if err != nil {
		// With ErrLeaseLost another delivery took the key over: nack, and
		// the redelivery finds it done or in flight.
		return nil, err
	}
	in.applied.Add(1)
	return produced, nil
}

// complete marks the lease done. The effect has happened by now, so a
// transient failure is retried a few times, even if ctx was cancelled
// meanwhile: a nack here lets the effect run again once the lease expires.
func (in *Inbox) complete(ctx context.Context, key dedup.Key, token int64, result []byte) error {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer cancel()
	var err error
	for i := range 4 {
		if i > 0 && !sleepCtx(ctx, time.Duration(25<<i)*time.Millisecond) {
			break
		}
		err = in.cfg.LeaseStore.LeaseComplete(ctx, key, token, result)
		if err == nil || errors.Is(err, dedup.ErrLeaseLost) {
			return err
		}
		in.cfg.Logger.Error("Lease complete failed after the effect, retrying", err, watermill.LogFields{"consumer": key.Consumer, "key": key.Key})
	}
	return err
}

// run calls h with the message's context replaced by ctx plus the key, and
// puts the original context back afterwards: the transaction in it is dead
// once the inbox commits.
func (in *Inbox) run(ctx context.Context, msg *message.Message, key dedup.Key, h message.HandlerFunc) ([]*message.Message, error) {
	orig := msg.Context()
	msg.SetContext(context.WithValue(ctx, keyCtxKey{}, key.Key))
	defer msg.SetContext(orig)
	return h(msg)
}

func (in *Inbox) duplicate(msg *message.Message, key dedup.Key, claim dedup.Claim) ([]*message.Message, error) {
	produced, err := decodeResult(claim.Result)
	if err != nil {
		return nil, Permanent(fmt.Errorf("consumer %q key %q: %w", key.Consumer, key.Key, err))
	}
	in.duplicates.Add(1)
	in.cfg.Logger.Info("Duplicate message dropped", logFields(msg, key).Add(watermill.LogFields{
		"attempts":          claim.Attempts,
		"replayed_messages": len(produced),
	}))
	return produced, nil
}

// awaitInFlight handles a key another delivery holds. It waits up to
// InFlightDelay (less if the lease ends sooner) so that the broker does not
// redeliver in a tight loop, and, when the store can be read without a
// claim (dedup.Peeker), looks every few milliseconds whether the holder
// finished: then this delivery is a plain duplicate, answered with the
// stored result and acked. Otherwise it is nacked, never acked: acking it
// could commit an offset past a message whose effect is not yet durable.
func (in *Inbox) awaitInFlight(msg *message.Message, key dedup.Key, claim dedup.Claim) ([]*message.Message, error) {
	ctx := msg.Context()
	in.inFlight.Add(1)
	wait := in.cfg.InFlightDelay
	if left := time.Until(claim.Until); left > 0 && left < wait {
		wait = left
	}
	peeker, _ := in.store().(dedup.Peeker)
	deadline := time.Now().Add(wait)
	for step := 5 * time.Millisecond; ; step = min(2*step, 100*time.Millisecond) {
		left := time.Until(deadline)
		if left <= 0 || !sleepCtx(ctx, min(step, left)) {
			break
		}
		if peeker == nil {
			continue
		}
		if c, err := peeker.InboxPeek(ctx, key); err == nil && c.State == dedup.StateDone {
			in.inFlight.Add(-1)
			return in.duplicate(msg, key, c)
		}
	}
	return nil, fmt.Errorf("%w: consumer %q key %q is leased until %s", ErrInFlight, key.Consumer, key.Key, claim.Until.Format(time.RFC3339Nano))
}

// store is the configured store, of either mode.
func (in *Inbox) store() any {
	if in.cfg.TxStore != nil {
		return in.cfg.TxStore
	}
	return in.cfg.LeaseStore
}

func logFields(msg *message.Message, key dedup.Key) watermill.LogFields {
	return watermill.LogFields{"message_uuid": msg.UUID, "consumer": key.Consumer, "key": key.Key}
}
