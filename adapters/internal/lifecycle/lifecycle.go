// Package lifecycle is the open and close bookkeeping that the broker
// packages' subscribers share: the work Close waits for (subscriptions,
// backlog reads), refusing new work once Close has begun, and a Close
// that runs once and gives every caller its result.
package lifecycle

import (
	"context"
	"sync"
)

// Closer is an idempotent Close and the work it waits for. It is safe for
// concurrent use; create it with [New].
type Closer struct {
	ctx    context.Context
	cancel context.CancelFunc

	mu     sync.Mutex
	closed bool
	work   sync.WaitGroup
	done   chan struct{}
	err    error
}

// New returns a Closer that is open.
func New() *Closer {
	ctx, cancel := context.WithCancel(context.Background())
	return &Closer{ctx: ctx, cancel: cancel, done: make(chan struct{})}
}

// Context is done once Close has begun.
func (c *Closer) Context() context.Context { return c.ctx }

// Join returns a context of ctx's that Close ends too, and its cancel.
func (c *Closer) Join(ctx context.Context) (context.Context, context.CancelFunc) {
	joined, cancel := context.WithCancel(ctx)
	stop := context.AfterFunc(c.ctx, cancel)
	return joined, func() { stop(); cancel() }
}

// Enter reserves a place for work that Close waits for, unless Close has
// begun: then it returns false. Each true is matched by a call of Leave,
// once the work has stopped.
func (c *Closer) Enter() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return false
	}
	// Under the lock: Close, which takes it to begin, waits for this.
	c.work.Add(1)
	return true
}

// Go runs f as work that Close waits for; the caller has entered, and
// holds its place until Go returns, so Close cannot have stopped waiting.
func (c *Closer) Go(f func()) {
	c.work.Add(1)
	go func() {
		defer c.work.Done()
		f()
	}()
}

// Leave ends work that Enter admitted.
func (c *Closer) Leave() { c.work.Done() }

// Closed reports whether Close has begun.
func (c *Closer) Closed() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.closed
}

// Close begins closing, once: it ends Context, waits for every work
// entered to leave, then calls finish and returns its error. A later or
// concurrent call waits for the first to finish and returns its result.
func (c *Closer) Close(finish func() error) error {
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		<-c.done
		return c.err
	}
	c.closed = true
	c.mu.Unlock()
	c.cancel()
	c.work.Wait()
	if finish != nil {
		c.err = finish()
	}
	close(c.done)
	return c.err
}
