package middleware

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/oncemill/oncemill/dedup"
	"github.com/oncemill/oncemill/dedup/dedupdriver"
	"github.com/oncemill/oncemill/observe"
)

// attemptObs is what one delivery tells the hooks: set where the inbox
// counts the outcome. With no hooks it costs a few stores on the stack.
type attemptObs struct {
	hooks    *observe.Hooks // nil: no hook observes
	consumer string
	outcome  observe.Outcome
	handler  time.Duration
	panicked bool
	// unrecorded is set when no start was recorded for the attempt
	// (SkipAttemptRecord, or a broker-counted first delivery): nothing
	// is taken back when it ends uncounted.
	unrecorded bool
}

// failed notes a failed attempt: panicked when the handler panicked.
func (o *attemptObs) failed(error) {
	if o.panicked {
		o.outcome = observe.Panicked
		return
	}
	o.outcome = observe.Failed
}

// step reports a step of the attempt to the trace hooks.
func (o *attemptObs) step(ctx context.Context, s observe.Step) {
	if o.hooks != nil {
		o.hooks.InboxStep(ctx, s)
	}
}

// finishContext is what ends an attempt whose handler has returned:
// detached from the message's cancellation (a shutdown must not throw
// finished work away), bounded by FinishTimeout (a hung store must not
// hang the shutdown).
func (in *Inbox) finishContext(base context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.WithoutCancel(base), in.cfg.FinishTimeout)
}

// callOutbox writes produced into the outbox, a panic in it being a failure
// like the handler's.
func (in *Inbox) callOutbox(ctx context.Context, produced []*message.Message) (err error) {
	defer func() {
		if r := recover(); r != nil {
			err = panicError(r)
		}
	}()
	return in.cfg.Outbox(ctx, produced)
}

// run calls h with the message's context replaced by ctx plus the key, and
// puts the original context back afterwards: the transaction in it is dead
// once the inbox commits. A panic in h is recovered here and returned as an
// error wrapping [ErrPanicked], so that the attempt is rolled back and
// counted like any failure: Watermill's router would recover it too, but
// only to nack, and the message would come back forever.
func (in *Inbox) run(ctx context.Context, msg *message.Message, key dedup.Key, h message.HandlerFunc, o *attemptObs) (produced []*message.Message, err error) {
	orig := msg.Context()
	msg.SetContext(context.WithValue(ctx, keyCtxKey{}, key.Key))
	defer msg.SetContext(orig)
	var began time.Time
	if o.hooks != nil {
		began = time.Now()
	}
	defer func() {
		if r := recover(); r != nil {
			in.panicked.Add(1)
			o.panicked = true
			produced, err = nil, panicError(r)
			in.cfg.Logger.Error("Handler panicked", err, logFields(msg, key))
		}
		if o.hooks != nil {
			o.handler = time.Since(began)
			o.step(orig, observe.StepHandled)
		}
	}()
	produced, err = h(msg)
	return produced, txOwned(err)
}

// txOwned makes the error of a handler that tried to commit or roll back
// the inbox's transaction (dedup.ErrTxOwned) permanent, wrapping
// [ErrTxEnded]: the same code fails every attempt the same way, and the
// reason names the mistake.
func txOwned(err error) error {
	if err == nil || !errors.Is(err, dedup.ErrTxOwned) || errors.Is(err, ErrTxEnded) {
		return err
	}
	return Permanent(fmt.Errorf("%w: %w", ErrTxEnded, err))
}

func (in *Inbox) duplicate(msg *message.Message, key dedup.Key, claim dedup.Claim, o *attemptObs) ([]*message.Message, error) {
	produced, err := decodeResult(claim.Result)
	if err != nil {
		o.outcome = observe.Rejected
		return nil, Permanent(fmt.Errorf("consumer %q key %q: %w", key.Consumer, key.Key, err))
	}
	in.duplicates.Add(1)
	o.outcome = observe.Duplicate
	in.cfg.Logger.Debug("Duplicate message dropped", logFields(msg, key).Add(watermill.LogFields{
		"attempts":          claim.Attempts,
		"replayed_messages": len(produced),
	}))
	return produced, nil
}

// awaitInFlight handles a key another delivery holds. It waits up to
// InFlightDelay (less if the lease ends sooner) so that the broker does not
// redeliver in a tight loop, and, when the store can be read without a
// claim (dedupdriver.Peeker), looks every few milliseconds whether the holder
// finished: then this delivery is a plain duplicate, answered with the
// stored result and acked. Otherwise it is nacked, never acked: acking it
// could commit an offset past a message whose effect is not yet durable.
func (in *Inbox) awaitInFlight(msg *message.Message, key dedup.Key, claim dedup.Claim, o *attemptObs) ([]*message.Message, error) {
	ctx := msg.Context()
	in.inFlight.Add(1)
	o.outcome = observe.InFlight
	wait := in.cfg.Tuning.InFlightDelay
	if left := time.Until(claim.Until); left > 0 && left < wait {
		wait = left
	}
	peeker, _ := in.store().(dedupdriver.Peeker)
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
			return in.duplicate(msg, key, c, o)
		}
	}
	return nil, fmt.Errorf("%w: consumer %q key %q is leased until %s", ErrInFlight, key.Consumer, key.Key, claim.Until.Format(time.RFC3339Nano))
}
