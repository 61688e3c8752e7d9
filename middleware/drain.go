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

// drain shelters one attempt from the consumer's shutdown. Watermill's
// router cancels every in-flight message's context the moment it closes;
// the attempt's transaction and its handler live on for the drain budget,
// counted from that cancellation, so that work in flight finishes and is
// committed.
//
// ctx is the transaction's context: the store begins the attempt's
// transaction on it, and database/sql rolls a transaction back when the
// context it was begun with ends. It has base's values but neither its
// cancellation nor its deadline, and ends when the budget runs out while
// no handler has returned (a handler that returned is being committed,
// bounded by FinishTimeout, and is not cut), or at end. The handler runs
// on [drain.handler]'s context, a child of ctx that has base's deadline.
type drain struct {
	ctx    context.Context
	cancel context.CancelCauseFunc
	stop   func() bool

	mu        sync.Mutex
	timer     *time.Timer
	expired   bool // the budget ran out
	finishing bool // a handler returned and none runs
	ended     bool
}

// newDrain starts the drain of an attempt on base, the message's context;
// call end when the attempt is over, its transaction ended.
func newDrain(base context.Context, budget time.Duration) *drain {
	d := &drain{}
	d.ctx, d.cancel = context.WithCancelCause(context.WithoutCancel(base))
	d.stop = context.AfterFunc(base, func() {
		if !errors.Is(base.Err(), context.Canceled) {
			return // base's own deadline: the handler's context has it too
		}
		d.mu.Lock()
		defer d.mu.Unlock()
		if !d.ended {
			d.timer = time.AfterFunc(budget, d.expire)
		}
	})
	return d
}

// expire ends the drain's budget: a handler that has not returned is cut,
// its transaction with it.
func (d *drain) expire() {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.expired = true
	if !d.finishing {
		d.cancel(errDrainTimeout)
	}
}

// handler returns the context a handler runs on: ctx with base's deadline.
// done ends it once the handler has returned: from then the budget no
// longer cuts the transaction, which is being committed or rolled back.
func (d *drain) handler(base context.Context) (ctx context.Context, done func()) {
	d.mu.Lock()
	d.finishing = false
	if d.expired {
		d.cancel(errDrainTimeout)
	}
	d.mu.Unlock()
	ctx, cancel := context.WithCancel(d.ctx)
	cancelDeadline := func() {}
	if dl, ok := base.Deadline(); ok {
		ctx, cancelDeadline = context.WithDeadline(ctx, dl)
	}
	return ctx, func() {
		d.mu.Lock()
		d.finishing = true
		d.mu.Unlock()
		cancelDeadline()
		cancel()
	}
}

// end releases the drain, its context and its timer.
func (d *drain) end() {
	d.stop()
	d.mu.Lock()
	d.ended = true
	if d.timer != nil {
		d.timer.Stop()
	}
	d.mu.Unlock()
	d.cancel(nil)
}

// drainContext returns the context a handler runs on, for an attempt with
// no transaction of the drain's (lease mode, a batch): base's values and
// deadline, but not its cancellation, which arrives only budget after base
// was cancelled (the consumer shutting down). end releases the context
// and its timer; call it when the handler has returned.
func drainContext(base context.Context, budget time.Duration) (ctx context.Context, end func()) {
	d := newDrain(base, budget)
	ctx, done := d.handler(base)
	return ctx, func() {
		done()
		d.end()
	}
}
