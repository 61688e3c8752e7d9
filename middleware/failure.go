package middleware

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"runtime/debug"

	"github.com/oncemill/oncemill/dedup"
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
	// try numbers the attempts of one delivery that the poison middleware
	// retries in process, from 0: only try 0 of a broker's first delivery
	// is one that the broker counted once (see [Inbox.brokerFirst]).
	try int

	inbox *Inbox
	key   dedup.Key
	// keyed is set once the inbox ran the key function for the attempt,
	// whatever its answer: the poison middleware then does not run it
	// again for the dead letter (a key error leaves the dead letter's key
	// empty).
	keyed bool

	// ends are called when the poison middleware is done with the
	// attempt: it succeeded, was dead-lettered, or is to be retried.
	ends []func()
}

// onEnd has end called when the poison middleware is done with the attempt.
func (s *attemptSlot) onEnd(end func()) { s.ends = append(s.ends, end) }

// end calls what onEnd was given; s may be nil.
func (s *attemptSlot) end() {
	if s == nil {
		return
	}
	for _, end := range s.ends {
		end()
	}
	s.ends = nil
}

type slotCtxKey struct{}

func slotOf(ctx context.Context) *attemptSlot {
	s, _ := ctx.Value(slotCtxKey{}).(*attemptSlot)
	return s
}

func withSlot(ctx context.Context, s *attemptSlot) context.Context {
	return context.WithValue(ctx, slotCtxKey{}, s)
}
