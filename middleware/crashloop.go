package middleware

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/oncemill/oncemill/dedup"
	"github.com/oncemill/oncemill/delivery"
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
		return dedup.Claim{}, in.unstart(base, key, nil, err)
	}
	if err := in.unstart(base, key, nil, nil); err != nil {
		return dedup.Claim{}, err
	}
	return store.InboxStart(base, key, in.cfg.Window)
}

// abandoned reports an attempt cut short by the consumer shutting down: it
// is not counted, so that deploys never push a message toward the DLQ.
func (in *Inbox) abandoned(ctx context.Context, msg *message.Message, key dedup.Key, err error, o *attemptObs) error {
	in.abandonedN.Add(1)
	o.outcome = observe.Abandoned
	if in.cfg.TxStore != nil && !in.cfg.Tuning.SkipAttemptRecord && !o.unrecorded {
		if uerr := in.cfg.TxStore.InboxUnstart(ctx, key); uerr != nil {
			in.debts.owe(key)
			err = errors.Join(err, uerr)
		}
	}
	in.cfg.Logger.Debug("Attempt cut short by shutdown, not counted", logFields(msg, key))
	return fmt.Errorf("%w: %w", ErrShutdown, err)
}

// unstart takes back the count of an attempt that stopped before its
// handler ran, and returns cause. An attempt whose start was not recorded
// (o.unrecorded) has nothing to take back; o is nil for one that was.
func (in *Inbox) unstart(base context.Context, key dedup.Key, o *attemptObs, cause error) error {
	if in.cfg.Tuning.SkipAttemptRecord || (o != nil && o.unrecorded) {
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

// brokerFirst reports whether msg is a broker-counted first delivery whose
// attempt the inbox leaves unrecorded: the broker's count
// (delivery.Attempts) is 1 and this is the delivery's first run, not an
// in-process retry nor a parked message handed back. The broker counts
// it, so the start that would record it is left out, a round trip saved
// per new key; a later delivery of the message is recorded, and counts
// this one with [withBrokerCount]. A poison limit of 1 keeps the record:
// there, an uncounted cut of the first delivery counted all the same
// would dead-letter a healthy message on its redelivery.
func brokerFirst(msg *message.Message) bool {
	n, ok := delivery.AttemptsOf(msg)
	if !ok || n != 1 {
		return false
	}
	if _, _, parked := leaseAttempts(msg); parked {
		return false
	}
	slot := slotOf(msg.Context())
	return slot == nil || (slot.try == 0 && slot.maxAttempts >= 2)
}

// withBrokerCount returns the count of a recorded start c of msg with the
// attempt that [brokerFirst] left unrecorded added back: the message's
// first delivery, which the broker counted (delivery.Attempts above 1, or
// an in-process retry of its first delivery). It adds one at most, and
// never more than the broker counted: a deploy that cut the first
// delivery is thus counted as one attempt, once per message (later cuts
// are taken back as always), so that a message that kills its process is
// stopped at the same horizon as when every start is recorded. A
// redelivery that says so (delivery.Redelivered) without a count, as a
// RabbitMQ classic queue's, whose first delivery the adapter stamps
// Attempts 1, counts its first delivery too. A message without either,
// handed back from parking, or under a poison limit of 1 (every start
// recorded) keeps c.
func withBrokerCount(msg *message.Message, c dedup.Claim) dedup.Claim {
	n, ok := brokerCount(msg, c.Attempts+1)
	if !ok || c.State != dedup.StateNew {
		return c
	}
	if _, _, parked := leaseAttempts(msg); parked {
		return c
	}
	if slot := slotOf(msg.Context()); slot != nil {
		if slot.maxAttempts < 2 {
			return c // every start was recorded
		}
		n += slot.try
	}
	c.Attempts = max(c.Attempts, min(c.Attempts+1, n))
	return c
}

// brokerCount returns the broker's count of msg's deliveries, or
// uncounted for a redelivery that the broker flags without counting it;
// false when the broker says neither.
func brokerCount(msg *message.Message, uncounted int) (int, bool) {
	if n, ok := delivery.AttemptsOf(msg); ok {
		return n, true
	}
	if msg.Metadata.Get(delivery.Redelivered) == "true" {
		return uncounted, true
	}
	return 0, false
}
