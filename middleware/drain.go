package middleware

import (
	"context"
	"errors"
	"sync"
	"time"
)

// defaultDrainTimeout is the default [InboxConfig.DrainTimeout].
const defaultDrainTimeout = 20 * time.Second

// errDrainTimeout is the cause of a handler context cancelled because the
// consumer shut down and the drain budget ran out.
var errDrainTimeout = errors.New("middleware: consumer shut down and the drain timeout passed")

// drainContext returns the context a handler runs on: base's values and
// deadline, but not its cancellation, which arrives only drain after base
// was cancelled (the consumer shutting down). A deadline that base
// reaches is not a shutdown, and ends the returned context at once too.
// end releases the context and its timer; call it when the handler has
// returned.
func drainContext(base context.Context, drain time.Duration) (ctx context.Context, end func()) {
	return drainContextOf(base, drain, true)
}

// drainContextOf is drainContext, with base's deadline left out unless
// keepDeadline: a batched delivery's handler gets its deadline's budget
// from when it starts instead (see queued.budget).
func drainContextOf(base context.Context, drain time.Duration, keepDeadline bool) (ctx context.Context, end func()) {
	ctx, cancel := context.WithCancelCause(context.WithoutCancel(base))
	cancelDeadline := func() {}
	if d, ok := base.Deadline(); ok && keepDeadline {
		ctx, cancelDeadline = context.WithDeadline(ctx, d)
	}
	var (
		mu    sync.Mutex
		ended bool
		timer *time.Timer
	)
	stop := context.AfterFunc(base, func() {
		if !errors.Is(base.Err(), context.Canceled) {
			return // base's own deadline: ctx has it too
		}
		mu.Lock()
		defer mu.Unlock()
		if !ended {
			timer = time.AfterFunc(drain, func() { cancel(errDrainTimeout) })
		}
	})
	return ctx, func() {
		stop()
		mu.Lock()
		ended = true
		if timer != nil {
			timer.Stop()
		}
		mu.Unlock()
		cancel(nil)
		cancelDeadline()
	}
}
