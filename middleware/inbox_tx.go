package middleware

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/oncemill/oncemill/dedup"
	"github.com/oncemill/oncemill/dedup/dedupdriver"
	"github.com/oncemill/oncemill/observe"
)

func (in *Inbox) handleTx(msg *message.Message, key dedup.Key, h message.HandlerFunc, reopened bool, o *attemptObs) ([]*message.Message, error) {
	base := msg.Context()
	var (
		start dedup.Claim
		// pre is the transaction a dedupdriver.StartClaimer opened and claimed
		// in with the start, for the first run; preErr its failure.
		pre      dedup.InboxTx
		preClaim dedup.Claim
		preErr   error
	)
	// The attempt's transactions begin on the drain's context, never on
	// the message's: database/sql rolls a transaction back when the
	// context it was begun with ends, and the router cancels the
	// message's the moment it closes.
	o.unrecorded = in.cfg.Tuning.SkipAttemptRecord || brokerFirst(msg)
	if !o.unrecorded && !reopened {
		// A reopened key is handled inside the turn of the copy that
		// found it dead.
		give, err := in.turns.take(base, key)
		if err != nil {
			in.abandonedN.Add(1)
			o.outcome = observe.Abandoned
			return nil, fmt.Errorf("%w: waiting for another copy of the key: %w", ErrShutdown, err)
		}
		defer give()
	}
	d := newDrain(base, in.cfg.DrainTimeout)
	defer d.end()
	if !o.unrecorded {
		in.debts.pay(base, in.cfg.TxStore, key)
		var err error
		if sc, ok := in.cfg.TxStore.(dedupdriver.StartClaimer); ok && in.pipelineStart() {
			start, pre, preClaim, err = sc.InboxStartClaim(d.ctx, key, in.cfg.Window)
			if err != nil && start.Attempts > 0 {
				// Counted, but the transaction did not begin or claim.
				preErr, err = err, nil
			}
		} else {
			start, err = in.cfg.TxStore.InboxStart(base, key, in.cfg.Window)
		}
		if err != nil {
			if start.State == dedup.StateNew {
				// The exchange broke after the start was sent: it may
				// have been counted. Take one back once the store
				// answers again.
				in.debts.owe(key)
			}
			return nil, err
		}
		in.dups.observe(start.State != dedup.StateNew)
		start = withBrokerCount(msg, start)
		switch start.State {
		case dedup.StateDone:
			return in.duplicate(msg, key, start, o)
		case dedup.StateDead:
			return in.deadCopy(msg, key, h, reopened, o)
		}
		if in.overLimit(base, start) {
			// An attempt is counted from its start until it ends, and one
			// that another delivery still runs (the handler of a revoked
			// Kafka partition that outlived the drain) may yet end cut
			// short and not be counted: wait for it, then count again, so
			// that a running attempt is never taken for a dead one.
			if pre != nil {
				if err := in.rollback(base, pre); err != nil {
					return nil, in.unstart(base, key, o, err)
				}
				pre, preErr = nil, nil
			}
			var err error
			if start, err = in.settle(base, key); err != nil {
				return nil, err
			}
			start = withBrokerCount(msg, start)
			switch start.State {
			case dedup.StateDone:
				return in.duplicate(msg, key, start, o)
			case dedup.StateDead:
				return in.deadCopy(msg, key, h, reopened, o)
			}
		}
		if err := in.crashLoop(msg, key, start, o); err != nil {
			if pre != nil {
				err = errors.Join(err, in.rollback(base, pre))
			}
			return nil, err
		}
		if slot := slotOf(base); slot != nil {
			// Running until the poison middleware is done with it: see
			// running.
			slot.onEnd(in.running.mark(key))
		}
	}
	// From here the attempt is counted. Whatever ends it without running
	// the handler to its end through the message's own fault (shutdown,
	// another holder, the infrastructure) takes the count back.
	for try := 1; ; try++ {
		var (
			produced []*message.Message
			err      error
		)
		switch {
		case try == 1 && preErr != nil:
			err = in.claimFailed(base, key, o, preErr)
		case try == 1 && pre != nil:
			produced, err = in.attemptClaimed(msg, d, key, h, reopened, start, pre, preClaim, o)
		default:
			produced, err = in.attemptTx(msg, d, key, h, reopened, start, o)
		}
		if !errors.Is(err, dedup.ErrConflict) {
			return produced, err
		}
		// A serialization failure or deadlock: the transaction lost to
		// another one, which says nothing about the message. Run it again
		// at once, a few times, then nack without counting.
		if try >= maxConflictRetries || stopping(base) || !sleepCtx(base, time.Duration(try)*conflictBackoff) {
			return nil, in.unstart(base, key, o, err)
		}
		in.conflictRetries.Add(1)
	}
}

// maxConflictRetries bounds the runs of an attempt whose transaction loses a
// conflict (SQLSTATE 40001, 40P01), and conflictBackoff spaces them.
const (
	maxConflictRetries = 3
	conflictBackoff    = 5 * time.Millisecond
)

// attemptTx runs one transaction of an attempt, begun on d's context:
// claim, handler, commit. An error wrapping dedup.ErrConflict leaves the
// attempt's count for the caller, which runs it again.
func (in *Inbox) attemptTx(msg *message.Message, d *drain, key dedup.Key, h message.HandlerFunc, reopened bool, start dedup.Claim, o *attemptObs) ([]*message.Message, error) {
	base := msg.Context()
	store := in.cfg.TxStore
	if bc, ok := store.(dedupdriver.BeginClaimer); ok && in.pipelineClaim() {
		// Nothing is held after an error: the claim failed, or BEGIN did.
		tx, claim, err := bc.InboxBeginClaim(d.ctx, key, in.cfg.Window, in.claimHint(o))
		if err != nil {
			return nil, in.claimFailed(base, key, o, err)
		}
		return in.attemptClaimed(msg, d, key, h, reopened, start, tx, claim, o)
	}
	tx, err := store.InboxBegin(d.ctx)
	if err != nil {
		return nil, in.unstart(base, key, o, err)
	}
	claim, err := tx.InboxClaim(base, key, in.cfg.Window)
	if err != nil {
		return nil, in.claimFailed(base, key, o, errors.Join(err, in.rollback(base, tx)))
	}
	return in.attemptClaimed(msg, d, key, h, reopened, start, tx, claim, o)
}

// claimFailed ends an attempt whose claim failed, its transaction ended:
// a conflict is left for the caller to run again, anything else takes the
// attempt's count back.
func (in *Inbox) claimFailed(base context.Context, key dedup.Key, o *attemptObs, err error) error {
	if errors.Is(err, dedup.ErrConflict) {
		return err
	}
	return in.unstart(base, key, o, err)
}

// attemptClaimed runs the rest of an attempt whose key tx claimed: the
// handler, on d's handler context, and the commit. reopened is true when
// the attempt runs for a replay that reopened the key already: a key found
// dead is then a copy's, not the replay's to reopen again.
func (in *Inbox) attemptClaimed(msg *message.Message, d *drain, key dedup.Key, h message.HandlerFunc, reopened bool, start dedup.Claim, tx dedup.InboxTx, claim dedup.Claim, o *attemptObs) ([]*message.Message, error) {
	base := msg.Context()
	switch {
	case o.unrecorded:
		start.Attempts = claim.Attempts // the failed attempts, this one included
	default:
		// The starts count the recorded attempts that did not commit,
		// those that died included; the claim the failed attempts, those
		// that went unrecorded included (a broker's first delivery, whose
		// later attempts may come back through parking, with no broker
		// count to add it back; a producer's duplicates, each a broker's
		// first delivery). The attempt's number is the larger.
		start.Attempts = max(start.Attempts, claim.Attempts)
	}
	if o.unrecorded {
		// No start answered this delivery: its claim says whether the
		// key was a duplicate.
		in.dups.observe(claim.State == dedup.StateDone || claim.State == dedup.StateDead)
	}
	switch claim.State {
	case dedup.StateDone:
		if err := in.rollback(base, tx); err != nil {
			return nil, err
		}
		return in.duplicate(msg, key, claim, o)
	case dedup.StateDead:
		if err := in.rollback(base, tx); err != nil {
			return nil, err
		}
		// A replay whose delivery was not recorded meets its dead key
		// here, not at a start: it reopens the key unless it did already.
		return in.deadCopy(msg, key, h, reopened, o)
	case dedup.StateInFlight:
		// A store with a lock in front of its record (two-tier) answers
		// this when another delivery holds the key right now.
		if err := in.unstart(base, key, o, in.rollback(base, tx)); err != nil {
			return nil, err
		}
		return in.awaitInFlight(msg, key, claim, o)
	}
	o.step(base, observe.StepClaimed)

	hctx, handled := d.handler(base)
	produced, err := in.runOn(tx, hctx, msg, key, h, o)
	handled()

	// The handler has returned: what it did is committed, or rolled back
	// and recorded, even if the consumer is shutting down meanwhile.
	finish, cancel := in.finishContext(base)
	defer cancel()
	if err == nil {
		var result []byte
		if result, err = encodeResult(produced); err == nil {
			err = tx.InboxComplete(finish, key, result)
		}
		if err == nil {
			if err = tx.Commit(finish); err == nil {
				in.applied.Add(1)
				o.outcome = observe.Applied
				o.step(base, observe.StepCommitted)
				return produced, nil
			}
		}
	}
	err = errors.Join(err, in.rollback(finish, tx))
	if errors.Is(err, dedup.ErrConflict) && !stopping(base) {
		return nil, err // the caller runs the transaction again
	}
	return nil, in.failAttempt(finish, msg, key, o, dedup.Claim{Attempts: start.Attempts, FirstFailedAt: claim.FirstFailedAt}, err)
}

// runOn runs h in tx on drain (the handler's context: see drain.handler),
// and writes what it produced into the outbox when one is configured. The
// handler's error is the message's, whatever it wraps, unless the
// transaction it wrote through says it failed itself (its connection was
// lost, or the database aborted it for a conflict). A handler cut short
// by its deadline or the drain failed through its own slowness, even if
// the cut broke the connection: it is not asked then.
func (in *Inbox) runOn(tx dedup.InboxTx, drain context.Context, msg *message.Message, key dedup.Key, h message.HandlerFunc, o *attemptObs) ([]*message.Message, error) {
	hctx := tx.WithTx(drain)
	produced, err := in.run(hctx, msg, key, h, o)
	cut := hctx.Err() != nil
	if err == nil && in.cfg.Outbox != nil && len(produced) > 0 {
		finish, cancel := in.finishContext(msg.Context())
		err = in.callOutbox(tx.WithTx(finish), produced)
		cancel()
		if err == nil {
			produced = nil // committed with the effect; the relay publishes them
		}
	}
	if err != nil && !cut {
		err = classifyTx(tx, err)
	}
	return produced, err
}

// failAttempt ends an attempt whose transaction failed with err and has
// been rolled back: a shutdown and the infrastructure's faults (an
// outage, a commit whose outcome is unknown: its redelivery finds the key
// done, or applies it once) are not counted; anything else is recorded as
// a failed attempt, counted as counted says.
func (in *Inbox) failAttempt(ctx context.Context, msg *message.Message, key dedup.Key, o *attemptObs, counted dedup.Claim, err error) error {
	switch {
	case stopping(msg.Context()):
		return in.abandoned(ctx, msg, key, err, o)
	case IsInfrastructure(err):
		in.infra.Add(1)
		o.outcome = observe.Unavailable
		return in.unstart(ctx, key, o, err)
	}
	in.failed.Add(1)
	o.failed(err)
	f := dedup.Failure{Err: err.Error(), At: time.Now()}
	failErr := in.cfg.TxStore.InboxFail(ctx, key, f, in.cfg.Window)
	return attempted(errors.Join(err, failErr), counted, f.At)
}

// classifyTx lets tx mark the infrastructure's errors among those the
// handler returned after writing through it (dedupdriver.Classifier).
func classifyTx(tx dedup.InboxTx, err error) error {
	if c, ok := tx.(dedupdriver.Classifier); ok {
		return c.InboxClassify(err)
	}
	return err
}

func (in *Inbox) rollback(base context.Context, tx dedup.InboxTx) error {
	ctx, cancel := in.finishContext(base)
	defer cancel()
	return tx.Rollback(ctx)
}
