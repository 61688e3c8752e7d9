package middleware

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"

	"github.com/oncemill/oncemill/dedup"
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
