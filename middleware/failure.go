package middleware

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"runtime/debug"

	"github.com/oncemill/oncemill/dedup"
)

var (
	// ErrPanicked is wrapped by the error an attempt ends with when its
	// handler panicked. The inbox and the poison middleware recover the
	// panic in their own frame, so that it counts as a failed attempt and
	// ends in the dead-letter queue after MaxAttempts, instead of being
	// nacked forever by the router's own recovery.
	ErrPanicked = errors.New("middleware: handler panicked")
	// ErrShutdown is wrapped by the error an attempt ends with when the
	// consumer began to shut down while its handler ran and the handler
	// failed: it was rolled back and is not counted as an attempt.
	ErrShutdown = errors.New("middleware: consumer is shutting down; attempt not counted")
	// ErrCrashLoop is wrapped by the permanent error the inbox returns,
	// without running the handler, for a key whose last MaxAttempts
	// attempts all started and never finished: the process died in each
	// of them (an OOM kill, os.Exit, a crash in cgo). The poison
	// middleware dead-letters it.
	ErrCrashLoop = errors.New("middleware: every attempt died before it finished")
)

// panicError turns a recovered panic into an error wrapping [ErrPanicked]
// (and the panic value when it is an error), with a short stack.
func panicError(r any) error {
	stack := shortStack(debug.Stack(), 12)
	if err, ok := r.(error); ok {
		return fmt.Errorf("%w: %w\n%s", ErrPanicked, err, stack)
	}
	return fmt.Errorf("%w: %v\n%s", ErrPanicked, r, stack)
}

// shortStack keeps the frames from the panicking call on, at most n of
// them (two lines each), so that the stored error says where without
// filling the record.
func shortStack(stack []byte, n int) []byte {
	lines := bytes.Split(bytes.TrimSpace(stack), []byte("\n"))
	// Skip the goroutine header and the frames of debug.Stack, this
	// function's callers and the runtime's panic machinery.
	from := 1
	for i := 1; i < len(lines); i++ {
		if bytes.HasPrefix(lines[i], []byte("panic(")) {
			from = i + 2
			break
		}
	}
	if from >= len(lines) {
		from = 1
	}
	lines = lines[from:]
	if len(lines) > 2*n {
		lines = lines[:2*n]
	}
	return bytes.Join(lines, []byte("\n"))
}

// stopping reports whether the delivery's context was cancelled: Watermill's
// router cancels the context it subscribed with when it closes, and every
// adapter derives its messages' contexts from it (watermill-kafka also on
// a rebalance, which takes the partition away). A deadline, such as the
// one Watermill's Timeout middleware sets, is not stopping: it is the
// attempt's own failure, and it is counted. base must be the context the
// middleware was called with, not one the handler derived.
func stopping(base context.Context) bool {
	return errors.Is(base.Err(), context.Canceled)
}

// IsInfrastructure reports whether err is the infrastructure's fault, not
// the message's: a store that could not be reached or could not serve
// (dedup.ErrUnavailable, which the stores wrap around their drivers'
// connection errors), a commit whose outcome is unknown
// (dedup.ErrAmbiguous), a transaction that kept losing conflicts
// (dedup.ErrConflict), or a dead-letter publish that failed
// ([ErrDeadLetter]). Such errors are never counted as attempts and never
// dead-lettered: the poison middleware nacks the message after a backoff,
// and it comes back, in its order, when the infrastructure does. Like
// pgconn.SafeToRetry, it looks only at the error.
func IsInfrastructure(err error) bool {
	return errors.Is(err, dedup.ErrUnavailable) || errors.Is(err, dedup.ErrConflict) || errors.Is(err, ErrDeadLetter)
}

// uncounted reports whether err ends an attempt that says nothing about the
// message: the consumer is stopping, another delivery holds the key, or
// the lease was lost to another delivery. Such attempts are nacked at once,
// never counted or dead-lettered.
func uncounted(base context.Context, err error) bool {
	return stopping(base) || errors.Is(err, ErrShutdown) || errors.Is(err, ErrInFlight) || errors.Is(err, dedup.ErrLeaseLost)
}

// ignoreLost drops ErrLeaseLost: releasing a lease that another delivery
// took over has nothing left to do.
func ignoreLost(err error) error {
	if errors.Is(err, dedup.ErrLeaseLost) {
		return nil
	}
	return err
}

// attemptSlot travels in the message's context from the poison middleware
// down to the inbox and back: the poison middleware's limit goes down, so
// that the inbox can stop a crash loop before the handler runs; the inbox
// and the key come back up, so that the dead-lettering marks the key dead
// and the dead letter names the key and consumer the inbox used.
type attemptSlot struct {
	maxAttempts int

	inbox *Inbox
	key   dedup.Key
}

type slotCtxKey struct{}

func slotOf(ctx context.Context) *attemptSlot {
	s, _ := ctx.Value(slotCtxKey{}).(*attemptSlot)
	return s
}

func withSlot(ctx context.Context, s *attemptSlot) context.Context {
	return context.WithValue(ctx, slotCtxKey{}, s)
}
