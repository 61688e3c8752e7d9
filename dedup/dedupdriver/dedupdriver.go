package dedupdriver

import (
	"context"
	"errors"
	"time"

	"github.com/oncemill/oncemill/dedup"
)

// Classifier is implemented by a [dedup.InboxTx] that can tell, of an
// error the handler returned after writing its effect through the
// transaction, whether the transaction itself failed for the
// infrastructure's fault. It asks the transaction, not the error: a
// handler's own error is the message's whatever it wraps (a payload that
// fails to decode wraps io.EOF, an HTTP client that is refused wraps a
// net.Error), so an implementation never marks an error for what its chain
// holds alone.
type Classifier interface {
	// InboxClassify returns err wrapped with [dedup.ErrUnavailable] when
	// the transaction's connection was lost (closed or broken), or with
	// [dedup.ErrConflict] when the database aborted the transaction for a
	// conflict (a serialization failure or a deadlock, as the database's
	// own answer), else err unchanged.
	InboxClassify(err error) error
}

// AbortReporter is implemented by a [dedup.InboxTx] that can tell, without
// a round trip, whether a statement in it failed, so that the database
// refuses every later statement until the transaction is rolled back
// (PostgreSQL's "current transaction is aborted"). Group commit asks it
// after each handler of a batch returns: a handler that swallowed its
// failed statement and returned nil is the one at fault, not the batch
// mate whose first statement the database then refuses.
type AbortReporter interface {
	// InboxAborted reports whether the transaction can no longer commit.
	InboxAborted() bool
}

// StartClaimer is implemented by a [dedup.TxStore] that can do what
// [dedup.TxStore.InboxStart], [dedup.TxStore.InboxBegin] and
// [dedup.InboxTx.InboxClaim] do in turn in one exchange with its database.
// The start still commits on its own, before the transaction begins, with
// the guarantees InboxStart gives.
type StartClaimer interface {
	// InboxStartClaim counts an attempt of key, begins a transaction and
	// claims key in it; the transaction lives on ctx as one that
	// [dedup.TxStore.InboxBegin] began on it does. It answers in one of
	// four ways:
	//
	//   - start is StateDone (with the stored result) or StateDead: the key
	//     must not run; tx is nil and nothing is held.
	//   - start is StateNew and err is nil: the attempt is counted
	//     (start.Attempts), tx is open and claim is what InboxClaim would
	//     have answered in it. The caller ends tx.
	//   - err is not nil and start.Attempts is above zero: the attempt is
	//     counted but the transaction could not begin or the claim failed;
	//     tx is nil, whatever was opened has been ended. The caller takes
	//     the count back ([dedup.TxStore.InboxUnstart]), or runs the
	//     transaction again with InboxBegin when err wraps
	//     [dedup.ErrConflict].
	//   - err is not nil, start.State is StateNew and start.Attempts is
	//     zero: the exchange broke after the start was sent, and it may
	//     have been counted. The caller takes a count back once the store
	//     answers again (at worst a crash loop is dead-lettered one
	//     attempt later).
	//   - err is not nil and start is the zero Claim: nothing was counted,
	//     as when InboxStart fails.
	InboxStartClaim(ctx context.Context, key dedup.Key, window time.Duration) (start dedup.Claim, tx dedup.InboxTx, claim dedup.Claim, err error)
}

// BeginClaimer is implemented by a [dedup.TxStore] that can do what
// [dedup.TxStore.InboxBegin] and [dedup.InboxTx.InboxClaim] do in turn in
// one exchange with its database.
type BeginClaimer interface {
	// InboxBeginClaim begins a transaction and claims key in it, the
	// transaction living on ctx as [dedup.TxStore.InboxBegin]'s does. Without
	// an error, tx is open and claim is what InboxClaim would have
	// answered in it; the caller ends tx. With an error, nothing is held.
	// hint lets the store pick the cheapest statements; the answers are
	// the same for every hint.
	InboxBeginClaim(ctx context.Context, key dedup.Key, window time.Duration, hint ClaimHint) (tx dedup.InboxTx, claim dedup.Claim, err error)
}

// ClaimHint says what the caller of [BeginClaimer.InboxBeginClaim] expects,
// so that the store can spend its work where it pays. The zero ClaimHint
// expects nothing.
type ClaimHint struct {
	// New says the key is expected to be new: a start has just found it
	// so, or few recent deliveries found their key done. A store may then
	// answer a key that has a record with one round trip more, to save
	// work on a new one.
	New bool
	// Unstarted says this delivery started no count of the key
	// ([dedup.TxStore.InboxStart] was not called for it): the claim need
	// not clear one.
	Unstarted bool
}

// ErrMaybeCounted is wrapped by the error of a batch start
// ([BatchClaimer.InboxStartBatch]) whose connection broke after the
// statement was sent: its attempts may have been counted. The caller takes
// the counts back once the store answers again.
var ErrMaybeCounted = errors.New("dedupdriver: the start was sent and may have been counted")

// BatchClaimer is implemented by a [dedup.TxStore] that can claim the keys
// of many deliveries of one consumer in one transaction (group commit): one
// start, one claim and one commit for the batch.
type BatchClaimer interface {
	// InboxStartBatch does what [dedup.TxStore.InboxStart] does for each of
	// keys (distinct, of one consumer), in one exchange: claims[i] answers
	// keys[i]. With an error nothing was counted, unless it wraps
	// [ErrMaybeCounted].
	InboxStartBatch(ctx context.Context, consumer string, keys []string, window time.Duration) (claims []dedup.Claim, err error)
	// InboxBeginClaimBatch begins a transaction and claims in it each of
	// keys (distinct, of one consumer) that is new: claims[i].State is
	// StateNew for the keys the transaction holds. A key that has a
	// record already (done meanwhile, failed before, dead) is not taken:
	// its claim is the zero Claim, and the caller runs it on the
	// single-message path. An error wrapping [dedup.ErrConflict] says
	// another transaction holds one of the keys; with any error nothing is
	// held.
	InboxBeginClaimBatch(ctx context.Context, consumer string, keys []string, window time.Duration) (tx dedup.InboxTx, claims []dedup.Claim, err error)
}

// RecordFinder tells whether a key has a record at all. A replay asks it
// when the key of a dead letter is not dead in the store it grants on:
// a record that is done, failed or in flight makes the replayed copy a
// duplicate or a normal retry, while no record means the consumer's
// inbox is another store, or its record expired, and the copy would run
// as a new key or be acked as a dead copy elsewhere.
type RecordFinder interface {
	// InboxHasRecord reports whether the store holds a record of key, in
	// any state (failed, in flight, done or dead). It writes nothing.
	InboxHasRecord(ctx context.Context, key dedup.Key) (bool, error)
}

// Peeker reads a key's record without claiming it: the cheap check a
// prefilter makes when it may have seen a key before.
type Peeker interface {
	// InboxPeek answers StateDone with the stored result when key is done,
	// StateInFlight with the lease end when a live lease holds it,
	// StateDead for a dead key, and StateNew when it is unknown, failed, or
	// its lease has expired. It writes nothing, and one call costs one
	// read.
	InboxPeek(ctx context.Context, key dedup.Key) (dedup.Claim, error)
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
