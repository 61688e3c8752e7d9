package dedup

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"time"
)

// DefaultWindow is how long a key is remembered when a caller does not say:
// longer than any broker's redelivery window.
const DefaultWindow = 72 * time.Hour

// ErrLeaseLost is returned by [LeaseStore.LeaseComplete] and
// [LeaseStore.LeaseRelease] when the token is no longer the current one: the
// lease expired and another delivery took the key over, or the key is done.
var ErrLeaseLost = errors.New("dedup: lease lost: token is not the current one")

// Errors of the infrastructure, not of the message: a store wraps them in
// what it returns so that the inbox and the poison middleware nack the
// message without counting an attempt, whatever the driver. Test with
// errors.Is.
var (
	// ErrUnavailable means the store could not be reached or could not
	// serve: connection refused or reset, pool closed, server shutting
	// down or out of connections.
	ErrUnavailable = errors.New("dedup: store unavailable")
	// ErrTxOwned is wrapped by the error of a Commit or Rollback that a
	// handler calls on the transaction an inbox handed it
	// (postgres.Tx(ctx)): the transaction is the inbox's, which commits
	// the handler's writes with the message's done mark, or rolls both
	// back, once the handler returns. The call does nothing: write
	// through the transaction and return nil, or return an error to roll
	// it back.
	ErrTxOwned = errors.New("dedup: the transaction is the inbox's, which commits it with the message's done mark when the handler returns nil and rolls it back when it returns an error")
	// ErrAmbiguous means a commit's outcome is unknown: the connection
	// failed while the commit was in flight. The effect may or may not
	// have committed; the redelivery finds out. It also wraps
	// ErrUnavailable.
	ErrAmbiguous = fmt.Errorf("dedup: commit outcome unknown: %w", ErrUnavailable)
	// ErrConflict means the transaction lost to a concurrent one
	// (serialization failure, deadlock) and can be run again at once.
	ErrConflict = errors.New("dedup: transaction conflict; retry")
)

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
	// StateDead means the key was dead-lettered: the poison middleware gave
	// up on it and its message sits in the dead-letter queue. Later copies
	// of the key are not run until a replay reopens it
	// ([Graveyard.InboxReopen]).
	StateDead
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
	case StateDead:
		return "dead"
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
	// count survives restarts. [TxStore.InboxStart] counts every attempt
	// that started, those whose process died before they ended included.
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
	// Abandoned marks an attempt that did not run its course through no
	// fault of the message (the consumer shut down): [LeaseStore.LeaseRelease]
	// frees the key and takes the attempt's count back, recording no error.
	Abandoned bool
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
	Graveyard

	// InboxStart records that an attempt of key is about to run, in a
	// short write of its own that commits at once, outside the handler's
	// transaction, so that an attempt whose process dies is still counted;
	// it reads the key's record in the same round trip. It answers
	// StateDone (with the stored result) or StateDead for a key that must
	// not run again, and otherwise StateNew with Attempts counting every
	// attempt started and not completed, this one included. The count is
	// forgotten when the key commits. It need not survive a crash of the
	// database server: losing it only delays a dead-letter. With an
	// error, a Claim whose State is StateNew says the statement was sent
	// and may have been counted (the connection broke before its answer);
	// the zero Claim says it was not.
	InboxStart(ctx context.Context, key Key, window time.Duration) (Claim, error)
	// InboxUnstart takes back the count of an attempt that did not run its
	// course through no fault of the message: the consumer was shutting
	// down, or another delivery held the key.
	InboxUnstart(ctx context.Context, key Key) error
	// InboxBegin starts a transaction in which the key is claimed and the
	// handler's effect is written. The transaction may end, rolled back,
	// when ctx ends (database/sql's do), but not before: an implementation
	// that opens it later (in InboxClaim) still begins it on ctx, never on
	// a later call's context. The inbox passes a context that outlives the
	// message's cancellation for its drain, and ends it once the
	// transaction is committed or rolled back.
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
	// InboxBury marks the claimed key dead in this transaction, recording
	// f as its last failure: the message was dead-lettered, and later
	// copies of the key answer StateDead until it is reopened.
	InboxBury(ctx context.Context, key Key, f Failure) error
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
	Graveyard

	// LeaseClaim takes key for lease if it is new, failed, or its lease has
	// expired, answering StateNew with a fresh token; otherwise it answers
	// StateDone with the stored result or StateInFlight with the end of the
	// live lease, or StateDead for a key that was dead-lettered. The record
	// expires window after the claim. A token is never issued twice for a
	// key, even after the record expired and was deleted.
	LeaseClaim(ctx context.Context, key Key, lease, window time.Duration) (Claim, error)
	// LeaseExtend renews the lease of token to end lease from now and
	// returns the new end, only if token is current; otherwise it returns
	// [ErrLeaseLost] and changes nothing.
	LeaseExtend(ctx context.Context, key Key, token int64, lease time.Duration) (time.Time, error)
	// LeaseBury marks key dead, recording f, only if token is current;
	// otherwise it returns [ErrLeaseLost] and changes nothing.
	LeaseBury(ctx context.Context, key Key, token int64, f Failure) error
	// LeaseComplete marks key done with result, only if token is current;
	// otherwise it returns [ErrLeaseLost] and changes nothing.
	LeaseComplete(ctx context.Context, key Key, token int64, result []byte) error
	// LeaseRelease gives key up after a failed attempt so that the next
	// delivery can claim it at once, only if token is current; otherwise it
	// returns [ErrLeaseLost] and changes nothing.
	LeaseRelease(ctx context.Context, key Key, token int64, f Failure) error
}

// Graveyard keeps the dead keys of both modes: a key dead-lettered by the
// poison middleware stays dead, its later copies acked without running,
// until the dead letter is replayed.
//
// A replay is authorised by the store, never by a message's metadata
// alone: the operator's replay writes a grant, a random value that no
// producer knows ([NewReplayGrant]), on the dead key's record
// ([Graveyard.InboxGrantReplay]) before the replayed copy is published
// with the grant in its metadata (delivery.Replay). Only a copy that
// carries the grant the record holds reopens the key
// ([Graveyard.InboxReopen]); any other copy of a dead key, a producer's
// retry or a forwarded message with a stale or forged marker, is acked
// without running. A reopen needs the key dead and the grant is cleared
// when the key is dead-lettered again, so one grant reopens a key once.
type Graveyard interface {
	// InboxGrantReplay writes grant on key's record if the key is dead,
	// replacing any grant written before, so that the replay that carries
	// it may reopen the key. It reports whether the key was dead; a key
	// that is not dead needs no grant (a copy of it is claimed or answered
	// as a duplicate as any copy is). An empty grant is refused.
	InboxGrantReplay(ctx context.Context, key Key, grant string) (bool, error)
	// InboxReopen makes a dead key claimable again, with its attempt
	// counts reset, for the replay of its dead letter, only if grant is
	// the one [Graveyard.InboxGrantReplay] wrote on it. It reports whether
	// it reopened the key: false when the key is not dead, holds no grant
	// or another one. An empty grant never matches.
	InboxReopen(ctx context.Context, key Key, grant string) (bool, error)
	// InboxReplayGranted reports whether key's record holds grant: a
	// replay of its dead letter was granted with it, and the record has
	// not been dead-lettered again since (the grant stays on a key that
	// its replay reopened, until the key is dead-lettered again or
	// expires). The inbox of another consumer of the topic asks it before
	// it acks, without running, a replay meant for key's consumer. An
	// empty grant never matches.
	InboxReplayGranted(ctx context.Context, key Key, grant string) (bool, error)
	// InboxDeadCopy counts one more copy of a dead key that arrived and
	// was acked without running, for operators to see on the dead letter.
	InboxDeadCopy(ctx context.Context, key Key) error
}

// ErrNoGrant is returned, wrapped, by [Graveyard.InboxGrantReplay] for an
// empty grant.
var ErrNoGrant = errors.New("dedup: replay grant is empty")

// NewReplayGrant returns a new replay grant: 128 bits from crypto/rand,
// hex-encoded, which no producer can guess.
func NewReplayGrant() (string, error) {
	var b [16]byte
	if _, err := rand.Read(b[:]); err != nil {
		return "", fmt.Errorf("dedup: new replay grant: %w", err)
	}
	return hex.EncodeToString(b[:]), nil
}

// Expirer deletes records whose dedup window has passed.
type Expirer interface {
	// InboxDeleteExpired deletes at most limit expired records in one short
	// statement and returns how many it deleted.
	InboxDeleteExpired(ctx context.Context, limit int) (int, error)
}
