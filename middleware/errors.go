package middleware

import (
	"errors"
	"fmt"
	"time"

	"github.com/oncemill/oncemill/dedup"
)

var (
	// ErrKey is wrapped by every error that a key function returns: the
	// message carries no usable key. Such errors are permanent.
	ErrKey = errors.New("middleware: cannot read message key")
	// ErrEmptyKey is wrapped when a key function found an empty key. An
	// empty key never passes silently: it would make every message a
	// duplicate of every other.
	ErrEmptyKey = errors.New("middleware: message key is empty")
	// ErrNoConsumer is returned when the inbox has no consumer name: set
	// InboxConfig.Consumer or run the handler under a message.Router.
	ErrNoConsumer = errors.New("middleware: no consumer name: set InboxConfig.Consumer or run under message.Router")
	// ErrInFlight is returned (so the message is nacked, never acked) when
	// another delivery of the same key holds a live lease.
	ErrInFlight = errors.New("middleware: key is being processed by another delivery")
	// ErrBadResult is returned when a stored result cannot be decoded.
	ErrBadResult = errors.New("middleware: stored result is unreadable")
)

// permanentError marks an error that retrying cannot fix.
type permanentError struct{ err error }

func (e permanentError) Error() string { return e.err.Error() }
func (e permanentError) Unwrap() error { return e.err }

// Permanent marks err as permanent: retrying the message cannot succeed, so
// the poison middleware dead-letters it at once instead of retrying. It
// returns nil for a nil err.
func Permanent(err error) error {
	if err == nil {
		return nil
	}
	if IsPermanent(err) {
		return err
	}
	return permanentError{err: err}
}

// IsPermanent reports whether err, or any error it wraps, was marked with
// [Permanent].
func IsPermanent(err error) bool {
	var p permanentError
	return errors.As(err, &p)
}

// unavailableError marks an error of a dependency that is down.
type unavailableError struct{ err error }

func (e unavailableError) Error() string { return e.err.Error() }
func (e unavailableError) Unwrap() error { return e.err }

// Is makes a marked error match dedup.ErrUnavailable, so that every check
// of the infrastructure's errors ([IsInfrastructure]) sees it.
func (e unavailableError) Is(target error) bool { return target == dedup.ErrUnavailable }

// Unavailable marks err as the fault of a dependency that is down, not of
// the message: a payment API that refuses connections, a service that
// answers 503. The inbox and the poison middleware then treat the attempt
// like a store outage: not counted, never dead-lettered, nacked after a
// backoff, so that the message comes back, in its order, when the
// dependency does. Without it an error the handler returns is the
// message's, whatever it wraps (io.EOF, a net.Error): a payload that fails
// to decode wraps io.EOF too. It returns nil for a nil err.
func Unavailable(err error) error {
	if err == nil {
		return nil
	}
	if errors.Is(err, dedup.ErrUnavailable) {
		return err
	}
	return unavailableError{err: err}
}

// attemptError carries the store's durable count of a failed attempt from
// the inbox out to the poison middleware, which may sit several middlewares
// further out.
type attemptError struct {
	err      error
	attempts int
	first    time.Time
}

func (e *attemptError) Error() string { return e.err.Error() }
func (e *attemptError) Unwrap() error { return e.err }

// attempted wraps err, the failure of the attempt that claim started, with
// the store's count; at is when it failed.
func attempted(err error, claim dedup.Claim, at time.Time) error {
	first := claim.FirstFailedAt
	if first.IsZero() {
		first = at
	}
	return &attemptError{err: err, attempts: claim.Attempts, first: first}
}

// StoredAttempts returns the attempt count that the inbox's store recorded
// for the failed attempt err came from (this attempt included) and when the
// key first failed. ok is false when err did not come from an inbox
// attempt, e.g. a key error or a store outage. The count survives restarts
// and rebalances: it is what the poison middleware counts on a broker that
// keeps none, such as Kafka.
func StoredAttempts(err error) (attempts int, firstFailedAt time.Time, ok bool) {
	var a *attemptError
	if !errors.As(err, &a) || a.attempts < 1 {
		return 0, time.Time{}, false
	}
	return a.attempts, a.first, true
}

// keyError builds a permanent key error that wraps [ErrKey] and, when given,
// a more precise sentinel or cause.
func keyError(cause error, format string, args ...any) error {
	msg := fmt.Sprintf(format, args...)
	if cause != nil {
		return Permanent(fmt.Errorf("%w: %s: %w", ErrKey, msg, cause))
	}
	return Permanent(fmt.Errorf("%w: %s", ErrKey, msg))
}
