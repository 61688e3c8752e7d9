package middleware

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/oncemill/oncemill/dedup"
	"github.com/oncemill/oncemill/observe"
)

// crashLoop stops an attempt before its handler runs when every one of
// the key's last MaxAttempts attempts (as the poison middleware in front
// counts them) started and none finished: their process died in them, or
// their dead-lettering failed. The error makes the poison middleware
// dead-letter the message at once.
func (in *Inbox) crashLoop(msg *message.Message, key dedup.Key, c dedup.Claim, o *attemptObs) error {
	if !in.overLimit(msg.Context(), c) {
		return nil
	}
	in.crashLooped.Add(1)
	o.outcome = observe.CrashLoop
	ran := c.Attempts - 1
	err := Permanent(fmt.Errorf("%w: consumer %q key %q: the last %d attempts all died or failed before they finished (a process killed mid-handler leaves no error of its own)", ErrCrashLoop, key.Consumer, key.Key, ran))
	in.cfg.Logger.Error("Message stops every attempt, dead-lettering it without running the handler", err, logFields(msg, key).Add(watermill.LogFields{"attempts": ran}))
	return attempted(err, dedup.Claim{Attempts: ran, FirstFailedAt: c.FirstFailedAt}, time.Now())
}

// overLimit reports whether the attempts counted for a key, this one
// included, exceed the MaxAttempts of the Poison middleware in front.
func (in *Inbox) overLimit(ctx context.Context, c dedup.Claim) bool {
	slot := slotOf(ctx)
	return slot != nil && slot.maxAttempts >= 1 && c.Attempts > slot.maxAttempts
}

// settle waits until no other delivery holds key (a claim waits for the
// holder's transaction to end; this one is rolled back) and no attempt of
// key that this inbox counted is running (see running), then takes this
// attempt's count back and counts it again.
func (in *Inbox) settle(base context.Context, key dedup.Key) (dedup.Claim, error) {
	store := in.cfg.TxStore
	tx, err := store.InboxBegin(base)
	if err == nil {
		_, err = tx.InboxClaim(base, key, in.cfg.Window)
		err = errors.Join(err, in.rollback(base, tx))
	}
	if err == nil {
		err = in.running.wait(base, key)
	}
	if err != nil {
		return dedup.Claim{}, in.unstart(base, key, err)
	}
	if err := in.unstart(base, key, nil); err != nil {
		return dedup.Claim{}, err
	}
	return store.InboxStart(base, key, in.cfg.Window)
}

// abandoned reports an attempt cut short by the consumer shutting down: it
// is not counted, so that deploys never push a message toward the DLQ.
func (in *Inbox) abandoned(ctx context.Context, msg *message.Message, key dedup.Key, err error, o *attemptObs) error {
	in.abandonedN.Add(1)
	o.outcome = observe.Abandoned
	if in.cfg.TxStore != nil && !in.cfg.Tuning.SkipAttemptRecord {
		if uerr := in.cfg.TxStore.InboxUnstart(ctx, key); uerr != nil {
			in.debts.owe(key)
			err = errors.Join(err, uerr)
		}
	}
	in.cfg.Logger.Debug("Attempt cut short by shutdown, not counted", logFields(msg, key))
	return fmt.Errorf("%w: %w", ErrShutdown, err)
}

// unstart takes back the count of an attempt that stopped before its
// handler ran, and returns cause.
func (in *Inbox) unstart(base context.Context, key dedup.Key, cause error) error {
	if in.cfg.Tuning.SkipAttemptRecord {
		return cause
	}
	ctx, cancel := in.finishContext(base)
	defer cancel()
	if err := in.cfg.TxStore.InboxUnstart(ctx, key); err != nil {
		// The store is down, most likely: the count stays until the key
		// comes back and the store answers.
		in.debts.owe(key)
		return errors.Join(cause, err)
	}
	return cause
}
