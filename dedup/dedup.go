package dedup

import (
	"context"
	"errors"
	"time"
)

// DefaultWindow is how long a key is remembered when a caller does not say:
// longer than any broker's redelivery window.
const DefaultWindow = 72 * time.Hour

// ErrLeaseLost is returned by [LeaseStore.LeaseComplete] and
// [LeaseStore.LeaseRelease] when the token is no longer the current one: the
// lease expired and another delivery took the key over, or the key is done.
var ErrLeaseLost = errors.New("dedup: lease lost: token is not the current one")

// State is what a claim found.
type State int

const (
	// StateNew means the key was never applied, or every earlier attempt
	// failed; the caller now holds it and must apply the effect.
	StateNew State = iota + 1
	// StateDone means the effect was committed before; [Claim.Result] holds
	// what was stored with it.
	StateDone
	// StateInFlight means another delivery holds a live lease on the key
	// until [Claim.Until]; the caller must not apply the effect (lease mode
	// only).
	StateInFlight
)

// String returns the state's name.
func (s State) String() string {
	switch s {
	case StateNew:
		return "new"
	case StateDone:
		return "done"
	case StateInFlight:
		return "in_flight"
	default:
		return "unknown"
	}
}

// Claim is the answer to a claim.
type Claim struct {
	// State is what the claim found.
	State State
	// Attempts counts the deliveries that claimed the key, this one included
	// when State is StateNew. Failed attempts are counted durably, so the
	// count survives restarts.
	Attempts int
	// Token is the fencing token of a lease (lease mode, StateNew only).
	Token int64
	// Until is when the current lease ends (lease mode, StateNew and
	// StateInFlight).
	Until time.Time
	// Result is the opaque result stored when the key was completed
	// (StateDone only); nil when none was stored.
	Result []byte
	// FirstFailedAt is when the key's first failed attempt was recorded;
	// zero when none failed. The poison middleware reports it with a
	// dead-lettered message.
	FirstFailedAt time.Time
}

// Failure describes one failed attempt, recorded so that operators and the
// poison middleware can see how often and why a key failed.
type Failure struct {
	// Err is the error text of the attempt.
	Err string
	// At is when the attempt failed.
	At time.Time
}

// Key names one record: a message key as seen by one consumer. Two consumers
// of the same topic keep separate records.
type Key struct {
	// Consumer is the name of the consuming handler or service.
	Consumer string
	// Key is the message's idempotency key.
	Key string
}

// TxStore claims keys inside the transaction that holds the business effect.
//
// Implementations must guarantee that, of any number of concurrent
// transactions that claim the same Key, at most one commits with StateNew;
// the others either block until it ends and then see StateDone, or claim the
// key themselves if it rolled back.
type TxStore interface {
	// InboxBegin starts a transaction in which the key is claimed and the
	// handler's effect is written.
	InboxBegin(ctx context.Context) (InboxTx, error)
	// InboxFail records a failed attempt outside any transaction (the
	// handler's transaction has been rolled back). It never changes a key
	// that is done.
	InboxFail(ctx context.Context, key Key, f Failure, window time.Duration) error
}

// InboxTx is a transaction opened by [TxStore.InboxBegin]. It is used by one
// goroutine.
type InboxTx interface {
	// InboxClaim claims key in this transaction. StateNew means the caller
	// holds the key until the transaction ends; StateDone means the key was
	// committed by an earlier transaction. The record expires window after
	// the claim.
	InboxClaim(ctx context.Context, key Key, window time.Duration) (Claim, error)
	// InboxComplete stores result with the claimed key, in this transaction.
	// A nil result may be skipped by the implementation.
	InboxComplete(ctx context.Context, key Key, result []byte) error
	// WithTx returns a context that carries this transaction, for the
	// handler to read with the store package's accessor.
	WithTx(ctx context.Context) context.Context
	// Commit commits the claim, the effect and the result together.
	Commit(ctx context.Context) error
	// Rollback undoes the claim and the effect. Calling it after Commit
	// is a no-op.
	Rollback(ctx context.Context) error
}

// LeaseStore claims keys as fenced leases, for effects that live outside the
// store's database.
type LeaseStore interface {
	// LeaseClaim takes key for lease if it is new, failed, or its lease has
	// expired, answering StateNew with a fresh token; otherwise it answers
	// StateDone with the stored result or StateInFlight with the end of the
	// live lease. The record expires window after the claim.
	LeaseClaim(ctx context.Context, key Key, lease, window time.Duration) (Claim, error)
	// LeaseComplete marks key done with result, only if token is current;
	// otherwise it returns [ErrLeaseLost] and changes nothing.
	LeaseComplete(ctx context.Context, key Key, token int64, result []byte) error
	// LeaseRelease gives key up after a failed attempt so that the next
	// delivery can claim it at once, only if token is current; otherwise it
	// returns [ErrLeaseLost] and changes nothing.
	LeaseRelease(ctx context.Context, key Key, token int64, f Failure) error
}

// Peeker reads a key's record without claiming it: the cheap check a
// prefilter makes when it may have seen a key before.
type Peeker interface {
	// InboxPeek answers StateDone with the stored result when key is done,
	// StateInFlight with the lease end when a live lease holds it, and
	// StateNew when it is unknown, failed, or its lease has expired. It
	// writes nothing, and one call costs one read.
	InboxPeek(ctx context.Context, key Key) (Claim, error)
}

// KeyLister streams the keys a consumer has completed, to warm a prefilter
// up on start.
type KeyLister interface {
	// InboxDoneKeys calls fn with every key of consumer that was completed
	// at or after since and has not expired, in no set order. It streams:
	// memory use does not grow with the number of keys. It stops at the
	// first error from fn or ctx and returns it.
	InboxDoneKeys(ctx context.Context, consumer string, since time.Time, fn func(key string) error) error
}

// Expirer deletes records whose dedup window has passed.
type Expirer interface {
	// InboxDeleteExpired deletes at most limit expired records in one short
	// statement and returns how many it deleted.
	InboxDeleteExpired(ctx context.Context, limit int) (int, error)
}
