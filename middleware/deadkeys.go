package middleware

import (
	"context"
	"errors"
	"fmt"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/oncemill/oncemill/dedup"
	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/observe"
)

// deadCopy answers a delivery of a dead key. The replay of its dead
// letter reopens the key and runs once: the copy whose delivery.Replay is
// the grant the operator's replay wrote on the key's record
// ([dedup.Graveyard.InboxReopen]). Any other copy, a producer's retry or a
// message whose replay marker the store did not grant (forged, forwarded
// with all its headers, or a replay already used), is acked without
// running and counted on the key's record: its message already sits in
// the dead-letter queue, and running it could apply an effect that an
// operator is compensating by hand.
func (in *Inbox) deadCopy(msg *message.Message, key dedup.Key, h message.HandlerFunc, reopened bool, o *attemptObs) ([]*message.Message, error) {
	ctx := msg.Context()
	store := in.graveyard()
	if grant := msg.Metadata.Get(delivery.Replay); !reopened && grant != "" {
		ok, err := store.InboxReopen(ctx, key, grant)
		if err != nil {
			return nil, err
		}
		if ok {
			in.cfg.Logger.Info("Dead key reopened for its replay", logFields(msg, key))
			if in.cfg.TxStore != nil {
				return in.handleTx(msg, key, h, true, o)
			}
			return in.handleLease(msg, key, h, true, o)
		}
		in.cfg.Logger.Info("Replay marker not granted by the store, copy of a dead key acked without running", logFields(msg, key))
	}
	if err := store.InboxDeadCopy(ctx, key); err != nil {
		in.cfg.Logger.Error("Could not count a copy of a dead key", err, logFields(msg, key))
	}
	in.deadCopies.Add(1)
	o.outcome = observe.Dead
	in.cfg.Logger.Info("Copy of a dead-lettered key acked without running", logFields(msg, key))
	return nil, nil
}

// othersReplay reports whether a message marked as the replay of owner's
// dead letter is one: owner's record of key, in this inbox's store, holds
// grant. Without a grant, or with owner's record elsewhere, it is not.
func (in *Inbox) othersReplay(ctx context.Context, owner string, key dedup.Key, grant string) (bool, error) {
	if grant == "" {
		return false, nil
	}
	return in.graveyard().InboxReplayGranted(ctx, dedup.Key{Consumer: owner, Key: key.Key}, grant)
}

func (in *Inbox) graveyard() dedup.Graveyard {
	if in.cfg.TxStore != nil {
		return in.cfg.TxStore
	}
	return in.cfg.LeaseStore
}

// buryOutcome is what dead-lettering under the key's claim came to.
type buryOutcome int

const (
	buryFailed      buryOutcome = iota // nothing changed; nack
	buried                             // in the dead-letter queue, key dead; ack
	buryApplied                        // another delivery applied the key meanwhile; ack, no dead letter
	buryAlreadyDead                    // another delivery dead-lettered it meanwhile; ack
)

// bury dead-letters the message of key while holding the key's claim, so
// that no other delivery applies it meanwhile: publish sends the dead
// letter (with the claim's transaction in its context in transactional
// mode, for a dead-letter publisher on the same database to join), then
// the key is marked dead and the claim committed. It runs detached from
// the message's cancellation, bounded by FinishTimeout.
func (in *Inbox) bury(base context.Context, key dedup.Key, f dedup.Failure, publish func(ctx context.Context) error) (buryOutcome, error) {
	ctx, cancel := in.finishContext(base)
	defer cancel()
	if in.cfg.TxStore != nil {
		tx, err := in.cfg.TxStore.InboxBegin(ctx)
		if err != nil {
			return buryFailed, err
		}
		undo := func(o buryOutcome, err error) (buryOutcome, error) {
			return o, errors.Join(err, tx.Rollback(ctx))
		}
		claim, err := tx.InboxClaim(ctx, key, in.cfg.Window)
		if err != nil {
			return undo(buryFailed, err)
		}
		switch claim.State {
		case dedup.StateDone:
			return undo(buryApplied, nil)
		case dedup.StateDead:
			if o, err := undo(buryAlreadyDead, nil); err != nil {
				return o, err
			}
			// Counted once the claim's transaction, which may lock the
			// key's row, has ended.
			return in.alreadyDead(ctx, key)
		case dedup.StateInFlight:
			return undo(buryFailed, fmt.Errorf("%w: consumer %q key %q: cannot dead-letter it now", ErrInFlight, key.Consumer, key.Key))
		}
		if err := publish(tx.WithTx(ctx)); err != nil {
			return undo(buryFailed, err)
		}
		if err := tx.InboxBury(ctx, key, f); err != nil {
			return undo(buryFailed, err)
		}
		if err := tx.Commit(ctx); err != nil {
			return undo(buryFailed, err)
		}
		return buried, nil
	}

	store := in.cfg.LeaseStore
	claim, err := store.LeaseClaim(ctx, key, in.cfg.Lease, in.cfg.Window)
	if err != nil {
		return buryFailed, err
	}
	switch claim.State {
	case dedup.StateDone:
		return buryApplied, nil
	case dedup.StateDead:
		return in.alreadyDead(ctx, key)
	case dedup.StateInFlight:
		return buryFailed, fmt.Errorf("%w: consumer %q key %q: cannot dead-letter it now", ErrInFlight, key.Consumer, key.Key)
	}
	if err := publish(ctx); err != nil {
		return buryFailed, errors.Join(err, ignoreLost(store.LeaseRelease(ctx, key, claim.Token, dedup.Failure{Abandoned: true})))
	}
	if err := store.LeaseBury(ctx, key, claim.Token, f); err != nil {
		return buryFailed, err
	}
	return buried, nil
}

// alreadyDead counts, as a copy of a dead key, a delivery that was to be
// dead-lettered and found that another delivery of its key had been: it
// is acked without a dead letter of its own, as every later copy is.
func (in *Inbox) alreadyDead(ctx context.Context, key dedup.Key) (buryOutcome, error) {
	if err := in.graveyard().InboxDeadCopy(ctx, key); err != nil {
		in.cfg.Logger.Error("Could not count a copy of a dead key", err, watermill.LogFields{"consumer": key.Consumer, "key": key.Key})
	}
	in.deadCopies.Add(1)
	return buryAlreadyDead, nil
}
