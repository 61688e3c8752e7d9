package middleware

import (
	"context"
	"errors"
	"fmt"
	"testing"

	"github.com/oncemill/oncemill/dedup"
)

// TestClassOfOrder pins the order of the one classification the poison
// middleware takes from an attempt's error: a stopping consumer beats
// everything, the infrastructure beats a permanent mark, and an error is
// the message's failure unless something marked it otherwise.
func TestClassOfOrder(t *testing.T) {
	live := context.Background()
	stopped, cancel := context.WithCancel(context.Background())
	cancel()
	deadline, cancelDeadline := context.WithTimeout(context.Background(), 0)
	defer cancelDeadline()
	<-deadline.Done()

	boom := errors.New("boom")
	cases := []struct {
		name string
		base context.Context
		err  error
		want errClass
	}{
		{"no error", live, nil, classNone},
		{"plain error", live, boom, classFailure},
		{"error wrapping io.EOF-like cause stays the message's", live, fmt.Errorf("decode: %w", errors.New("EOF")), classFailure},
		{"permanent", live, Permanent(boom), classPermanent},
		{"store down", live, fmt.Errorf("claim: %w", dedup.ErrUnavailable), classInfrastructure},
		{"handler says its dependency is down", live, Unavailable(boom), classInfrastructure},
		{"conflicts", live, dedup.ErrConflict, classInfrastructure},
		{"dead-letter publish failed for a permanent error", live, fmt.Errorf("%w: %w", ErrDeadLetter, Permanent(boom)), classInfrastructure},
		{"key in flight elsewhere", live, ErrInFlight, classUncounted},
		{"lease lost", live, dedup.ErrLeaseLost, classUncounted},
		{"shutdown", live, fmt.Errorf("%w: %w", ErrShutdown, boom), classUncounted},
		{"consumer stopping beats permanent", stopped, Permanent(boom), classUncounted},
		{"consumer stopping beats infrastructure", stopped, dedup.ErrUnavailable, classUncounted},
		{"a deadline is the attempt's own failure", deadline, context.DeadlineExceeded, classFailure},
	}
	for _, c := range cases {
		if got := classOf(c.base, c.err); got != c.want {
			t.Errorf("%s: classOf(%v) = %d, want %d", c.name, c.err, got, c.want)
		}
	}
}
