package middleware

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/oncemill/oncemill/dedup"
	"github.com/oncemill/oncemill/observe"
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
	// ErrTxAborted is wrapped by the error a batched attempt ends with
	// when its handler returned nil but left the batch's transaction
	// aborted: one of its statements failed and it did not return the
	// error (a unique violation read as "already done", say). The attempt
	// is counted against that message, and its batch mates run again
	// without it. Return the statement's error, or run the statement in a
	// savepoint (pgx's tx.Begin) when its failure is expected.
	ErrTxAborted = errors.New("middleware: the handler returned nil after a statement of its transaction failed")
)

// ErrDeadLetter is wrapped by the error a [Poison] middleware returns when
// it could not publish a message to the dead-letter queue: the original is
// nacked then, never acked, so it is delivered again.
var ErrDeadLetter = errors.New("middleware: dead-letter publish failed")

// ErrUndecodable is wrapped by the permanent error a [Poison] middleware
// records for a message that its broker adapter could not decode.
var ErrUndecodable = errors.New("middleware: message could not be decoded")

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

// storedAttempts returns the attempt count that the inbox's store recorded
// for the failed attempt err came from (this attempt included) and when the
// key first failed. ok is false when err did not come from an inbox
// attempt, e.g. a key error or a store outage. The count survives restarts
// and rebalances: it is what the poison middleware counts on a broker that
// keeps none, such as Kafka.
func storedAttempts(err error) (attempts int, firstFailedAt time.Time, ok bool) {
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

// errClass is what an attempt's error says about its message: the one
// decision the middlewares take from an error, made here in one order.
type errClass int

const (
	// classNone: no error.
	classNone errClass = iota
	// classUncounted: the attempt says nothing about the message; it is
	// nacked at once, not counted, never dead-lettered.
	classUncounted
	// classInfrastructure: the infrastructure's fault; nacked after a
	// backoff, not counted, never dead-lettered.
	classInfrastructure
	// classPermanent: retrying cannot succeed; dead-lettered at once.
	classPermanent
	// classFailure: a failed attempt; counted, retried, dead-lettered
	// after MaxAttempts.
	classFailure
)

// classOf classifies err, the end of an attempt of a delivery whose
// context was base. The order matters and is kept here only: a consumer
// that is stopping ends every attempt uncounted, whatever the error says;
// an infrastructure fault beats a permanent mark (a dead-letter publish
// that failed for a permanent error is still retried).
func classOf(base context.Context, err error) errClass {
	switch {
	case err == nil:
		return classNone
	case uncounted(base, err):
		return classUncounted
	case IsInfrastructure(err):
		return classInfrastructure
	case IsPermanent(err):
		return classPermanent
	}
	return classFailure
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
// (dedup.ErrConflict), or a dead-letter publish or a park that failed
// ([ErrDeadLetter], [ErrPark]). Such errors are never counted as attempts and never
// dead-lettered: the poison middleware nacks the message after a backoff,
// and it comes back, in its order, when the infrastructure does. Like
// pgconn.SafeToRetry, it looks only at the error.
func IsInfrastructure(err error) bool {
	return errors.Is(err, dedup.ErrUnavailable) || errors.Is(err, dedup.ErrConflict) || errors.Is(err, ErrDeadLetter) ||
		errors.Is(err, ErrPark)
}

// uncounted reports whether err ends an attempt that says nothing about the
// message: the consumer is stopping, another delivery holds the key, or
// the lease was lost to another delivery. Such attempts are nacked at once,
// never counted or dead-lettered.
func uncounted(base context.Context, err error) bool {
	return stopping(base) || errors.Is(err, ErrShutdown) || errors.Is(err, ErrInFlight) || errors.Is(err, dedup.ErrLeaseLost)
}

// reasonOf classifies why a message was dead-lettered, for the hooks.
func reasonOf(cause error) observe.Reason {
	switch {
	case errors.Is(cause, ErrUndecodable):
		return observe.ReasonUndecodable
	case errors.Is(cause, ErrCrashLoop):
		return observe.ReasonCrashLoop
	case errors.Is(cause, ErrPanicked):
		return observe.ReasonPanic
	case errors.Is(cause, context.DeadlineExceeded):
		return observe.ReasonDeadline
	case IsPermanent(cause):
		return observe.ReasonPermanent
	}
	return observe.ReasonError
}
