package middleware

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/oncemill/oncemill/dedup"
	"github.com/oncemill/oncemill/observe"
)

// holdLease keeps the lease of claim while the handler runs: it renews it
// every Lease/3 and, when the lease cannot be renewed (the store refuses
// the token, or is unreachable until the lease is about to end), cancels
// the returned context, so that a handler slower than Lease is never taken
// over while it still works, and a holder that lost its lease stops.
// release stops the renewals and returns an error wrapping
// dedup.ErrLeaseLost if the lease was lost meanwhile.
//
// The end of the lease is judged by this process's clock, from the moment
// each renewal was sent, so that a clock skew with the store only makes it
// stop early.
func (in *Inbox) holdLease(base context.Context, key dedup.Key, claim dedup.Claim) (context.Context, func() error) {
	ctx, cancel := context.WithCancelCause(base)
	lease := in.cfg.Lease
	interval := lease / 3
	margin := lease / 10
	done := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		// stopAt is when the handler must stop unless the lease is renewed
		// first: a margin before the lease ends by this process's clock,
		// counted from when the claim (a little before now) or the
		// renewal was sent.
		stopAt := time.Now().Add(lease - 2*margin)
		renew := time.NewTimer(interval)
		defer renew.Stop()
		expiry := time.NewTimer(time.Until(stopAt))
		defer expiry.Stop()
		var lastErr error
		for {
			select {
			case <-done:
				return
			case <-ctx.Done():
				return
			case <-expiry.C:
				cancel(fmt.Errorf("consumer %q key %q: %w: not renewed before it ends (last renewal: %v)", key.Consumer, key.Key, dedup.ErrLeaseLost, lastErr))
				return
			case <-renew.C:
			}
			sent := time.Now()
			// A renewal that hangs must not outlive the lease either.
			callCtx, cancelCall := context.WithDeadline(ctx, stopAt)
			_, err := in.cfg.LeaseStore.LeaseExtend(callCtx, key, claim.Token, lease)
			cancelCall()
			switch {
			case err == nil:
				stopAt = sent.Add(lease - margin)
				expiry.Reset(time.Until(stopAt))
				renew.Reset(interval)
			case errors.Is(err, dedup.ErrLeaseLost):
				cancel(fmt.Errorf("consumer %q key %q: %w", key.Consumer, key.Key, err))
				return
			default:
				lastErr = err
				in.cfg.Logger.Error("Lease renewal failed, retrying", err, watermill.LogFields{"consumer": key.Consumer, "key": key.Key})
				renew.Reset(interval/4 + time.Millisecond)
			}
		}
	}()
	return ctx, func() error {
		close(done)
		wg.Wait()
		cause := context.Cause(ctx)
		cancel(nil)
		if errors.Is(cause, dedup.ErrLeaseLost) {
			return cause
		}
		return nil
	}
}

func (in *Inbox) handleLease(msg *message.Message, key dedup.Key, h message.HandlerFunc, reopened bool, o *attemptObs) ([]*message.Message, error) {
	base := msg.Context()
	store := in.cfg.LeaseStore
	claim, err := store.LeaseClaim(base, key, in.cfg.Lease, in.cfg.Window)
	if err != nil {
		return nil, err
	}
	switch claim.State {
	case dedup.StateDone:
		return in.duplicate(msg, key, claim, o)
	case dedup.StateDead:
		return in.deadCopy(msg, key, h, reopened, o)
	case dedup.StateInFlight:
		return in.awaitInFlight(msg, key, claim, o)
	}
	if err := in.crashLoop(msg, key, claim, o); err != nil {
		// Free the key for the dead-lettering, which claims it again.
		finish, cancel := in.finishContext(base)
		defer cancel()
		f := dedup.Failure{Err: err.Error(), At: time.Now()}
		return nil, errors.Join(err, ignoreLost(store.LeaseRelease(finish, key, claim.Token, f)))
	}

	o.step(base, observe.StepClaimed)
	hctx, endDrain := drainContext(base, in.cfg.DrainTimeout)
	held, release := in.holdLease(hctx, key, claim)
	produced, err := in.run(withToken(held, claim.Token), msg, key, h, o)
	lost := release()
	endDrain()

	finish, cancel := in.finishContext(base)
	defer cancel()
	if lost != nil {
		// The lease could not be renewed and may belong to another
		// delivery now. A handler that finished all the same is recorded
		// if its token is still the current one (the completion is
		// fenced); anything else is left to the next delivery.
		if err == nil {
			result, rerr := encodeResult(produced)
			if rerr == nil && in.complete(finish, key, claim.Token, result) == nil {
				in.applied.Add(1)
				o.outcome = observe.Applied
				o.step(base, observe.StepCommitted)
				return produced, nil
			}
		}
		return nil, errors.Join(lost, err)
	}
	if err != nil {
		if stopping(base) {
			relErr := ignoreLost(store.LeaseRelease(finish, key, claim.Token, dedup.Failure{Abandoned: true}))
			return nil, in.abandoned(finish, msg, key, errors.Join(err, relErr), o)
		}
		if IsInfrastructure(err) {
			// The handler said a dependency is down (Unavailable): give
			// the key up with the attempt's count taken back.
			in.infra.Add(1)
			o.outcome = observe.Unavailable
			relErr := ignoreLost(store.LeaseRelease(finish, key, claim.Token, dedup.Failure{Abandoned: true}))
			return nil, errors.Join(err, relErr)
		}
		in.failed.Add(1)
		o.failed(err)
		f := dedup.Failure{Err: err.Error(), At: time.Now()}
		relErr := store.LeaseRelease(finish, key, claim.Token, f)
		return nil, attempted(errors.Join(err, relErr), claim, f.At)
	}
	result, err := encodeResult(produced)
	if err == nil {
		err = in.complete(finish, key, claim.Token, result)
	}
	if err != nil {
		// With ErrLeaseLost another delivery took the key over: nack, and
		// the redelivery finds it done or in flight.
		return nil, err
	}
	in.applied.Add(1)
	o.outcome = observe.Applied
	o.step(base, observe.StepCommitted)
	return produced, nil
}

// complete marks the lease done. The effect has happened by now, so a
// transient failure is retried a few times within ctx, which the message's
// cancellation does not end: a nack here lets the effect run again once
// the lease expires.
func (in *Inbox) complete(ctx context.Context, key dedup.Key, token int64, result []byte) error {
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
