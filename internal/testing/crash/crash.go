// Package crash simulates a consumer process that dies at a chosen point,
// for tests that prove redelivery after a crash loses and doubles nothing.
package crash

import (
	"errors"
	"sync"
	"sync/atomic"

	"github.com/ThreeDotsLabs/watermill/message"
)

// ErrCrashed is returned for every delivery a crashed consumer receives.
var ErrCrashed = errors.New("crash: consumer crashed")

// AfterCommit is a router middleware placed outside the inbox. The Nth
// delivery that the wrapped handler completes (its transaction committed)
// is not acked: the consumer "dies" there. From then on every delivery
// fails without reaching the handler, as nothing runs in a dead process,
// until the test closes the router and starts a new consumer.
type AfterCommit struct {
	n       int64
	handled atomic.Int64
	crashed chan struct{}
	once    sync.Once
}

// NewAfterCommit crashes after the nth completed delivery (n ≥ 1).
func NewAfterCommit(n int) *AfterCommit {
	return &AfterCommit{n: int64(n), crashed: make(chan struct{})}
}

// Crashed is closed when the crash happens.
func (c *AfterCommit) Crashed() <-chan struct{} { return c.crashed }

// Middleware wraps the inbox-wrapped handler.
func (c *AfterCommit) Middleware(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		select {
		case <-c.crashed:
			return nil, ErrCrashed
		default:
		}
		out, err := h(msg)
		if err != nil {
			return out, err
		}
		if c.handled.Add(1) == c.n {
			// Committed, not acked, produced messages not published.
			c.once.Do(func() { close(c.crashed) })
			return nil, ErrCrashed
		}
		return out, nil
	}
}
