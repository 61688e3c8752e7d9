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
		ends := time.Now().Add(lease - margin) // the claim was sent a little before now
		timer := time.NewTimer(interval)
		defer timer.Stop()
		for {
			select {
			case <-done:
				return
			case <-ctx.Done():
				return
			case <-timer.C:
			}
			sent := time.Now()
			_, err := in.cfg.LeaseStore.LeaseExtend(ctx, key, claim.Token, lease)
			switch {
			case err == nil:
				ends = sent.Add(lease)
				timer.Reset(interval)
				continue
			case errors.Is(err, dedup.ErrLeaseLost):
				cancel(fmt.Errorf("consumer %q key %q: %w", key.Consumer, key.Key, err))
				return
			}
			left := time.Until(ends) - margin
			if left <= 0 {
				cancel(fmt.Errorf("consumer %q key %q: %w: could not renew it before it ended: %w", key.Consumer, key.Key, dedup.ErrLeaseLost, err))
				return
			}
			in.cfg.Logger.Error("Lease renewal failed, retrying", err, watermill.LogFields{"consumer": key.Consumer, "key": key.Key})
			timer.Reset(min(interval/4+time.Millisecond, left))
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
