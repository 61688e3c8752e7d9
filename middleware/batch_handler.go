package middleware

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/oncemill/oncemill/dedup"
	"github.com/oncemill/oncemill/dedup/dedupdriver"
	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/observe"
)

// BatchFunc writes the effects of a batch of new messages at once, in
// the transaction that ctx carries, read with the store package's
// accessor as a handler reads it (postgres.Tx(ctx), sqlite.Tx(ctx)), and
// ends at the batch's deadline. Each message's context carries the
// transaction too, with what the message's context carried and its key
// for [IdempotencyKey].
//
// It returns nil when every effect is written, a [BatchErrors] naming
// the messages that failed, or any other error for the batch as a whole.
// Either way the batch's transaction is rolled back: messages named in a
// BatchErrors are counted as failed attempts, and their mates run again
// without them. A batch-wide error or a panic is blamed on no one while
// the batch holds more than one message: the batch is split in halves,
// each run again in a transaction of its own, until the failure is met
// by a message that runs alone, and only that message is counted.
//
// The transaction is the inbox's: it commits it, with the messages' done
// marks, when fn returns nil, and rolls it back otherwise. fn must not
// commit or roll it back itself: on PostgreSQL (pgx) those calls are
// refused with dedup.ErrTxOwned, which, returned, dead-letters the
// messages with [ErrTxEnded]; a store whose transaction cannot refuse
// them fails the batch with [ErrTxEnded].
type BatchFunc func(ctx context.Context, msgs []*message.Message) error

// BatchErrors is what a [BatchFunc] returns to fail some messages of its
// batch and not others: their errors, by message UUID (msg.UUID, not the
// idempotency key). A nil error, or a UUID not in the call, fails no
// message. A BatchErrors that fails none of the call's messages (empty,
// keyed by something else than their UUIDs, or naming them with nil
// errors only) accounts for none of them: it is an error of the whole
// call, [ErrBatchErrorsFailNone], which says why, on a batch and on a
// message that runs alone alike. Return nil when every effect is
// written.
type BatchErrors map[string]error

// ErrBatchErrorsFailNone is wrapped by the error of a [BatchFunc] call
// whose [BatchErrors] fails none of the call's messages: a failure of
// each message of the call, counted, retried and in the end
// dead-lettered as a handler's error is. What the BatchFunc returned is
// in its text only: the errors of a BatchErrors that names none of the
// call's messages belong to no message, so their class ([Permanent],
// [Unavailable]) is not taken for the call's.
var ErrBatchErrorsFailNone = errors.New("middleware: the BatchFunc returned a BatchErrors that fails none of its messages")

// maxNamed is how many of a BatchErrors' unknown UUIDs an error quotes.
const maxNamed = 3

// failsNone returns nil when be, which err wraps, fails one of msgs;
// otherwise the error of the whole call, wrapping
// [ErrBatchErrorsFailNone], that says why be accounts for none, with
// err's text.
func failsNone(err error, be BatchErrors, msgs []*message.Message) error {
	in := make(map[string]bool, len(msgs))
	for _, msg := range msgs {
		if be[msg.UUID] != nil {
			return nil
		}
		in[msg.UUID] = true
	}
	var why []string
	if len(be) == 0 {
		why = append(why, "it is empty")
	}
	var unknown []string
	named := 0
	for _, id := range slices.Sorted(maps.Keys(be)) {
		if in[id] {
			named++
			continue
		}
		unknown = append(unknown, id)
	}
	if len(unknown) > 0 {
		quoted := make([]string, 0, maxNamed)
		for _, id := range unknown[:min(len(unknown), maxNamed)] {
			quoted = append(quoted, fmt.Sprintf("%q", delivery.Bound(id)))
		}
		if len(unknown) > maxNamed {
			quoted = append(quoted, fmt.Sprintf("and %d more", len(unknown)-maxNamed))
		}
		why = append(why, fmt.Sprintf("it names %s, none of them the UUID of a message of the call: key it by msg.UUID, not by the idempotency key or another field",
			strings.Join(quoted, ", ")))
	}
	if named > 0 {
		why = append(why, fmt.Sprintf("it names %d of the call's messages with a nil error only: it lists the failed messages, a nil error fails none", named))
	}
	return fmt.Errorf("%w (%s): %s; return nil when every effect is written, a BatchErrors naming the failed messages by msg.UUID, or another error to fail the call as a whole (it returned %q)",
		ErrBatchErrorsFailNone, callOf(len(msgs)), strings.Join(why, "; "), err.Error())
}

// callOf names a BatchFunc call of n messages in an error.
func callOf(n int) string {
	if n == 1 {
		return "a call of 1 message"
	}
	return fmt.Sprintf("a call of %d messages", n)
}

func (e BatchErrors) Error() string {
	var b strings.Builder
	for i, id := range slices.Sorted(maps.Keys(e)) {
		if i > 0 {
			b.WriteString("; ")
		}
		fmt.Fprintf(&b, "message %s: %v", id, e[id])
	}
	return b.String()
}

// Unwrap returns the messages' errors, for errors.Is and errors.As.
func (e BatchErrors) Unwrap() []error {
	errs := make([]error, 0, len(e))
	for _, id := range slices.Sorted(maps.Keys(e)) {
		errs = append(errs, e[id])
	}
	return errs
}

// BatchHandler turns fn into a handler to add with
// router.AddConsumerHandler behind an inbox's middleware. With
// [InboxTuning.Batch] on, the inbox hands fn the new messages of each
// batch at once, after their duplicates were dropped, in the batch's
// transaction; every other delivery (batching off, a store without it, a
// key retried after a failure, which runs alone) calls fn with its one
// message, in its own transaction. A message is acked when its batch
// commits, as with any handler.
//
// The batch's context ends at the earliest deadline among its messages
// (Watermill's Timeout middleware), counted from when fn starts; a batch
// cut short by it is split like a failed one, so that only a message
// that overruns its deadline alone is counted.
//
// It needs no inbox to be made: the inbox that runs it tells it, through
// the message's context, that it runs in a batch. A nil fn panics here,
// where it is written, rather than fail every message at run time.
func BatchHandler(fn BatchFunc) message.NoPublishHandlerFunc {
	if fn == nil {
		panic(errors.New("middleware: BatchHandler needs a BatchFunc, got nil"))
	}
	bh := &batchHandler{fn: fn}
	return func(msg *message.Message) error {
		if c, ok := msg.Context().Value(collectCtxKey{}).(*batchCollect); ok {
			// In a batch: fn runs once for the batch, after every
			// handler of it was called (batchCollect.run).
			c.add(bh, msg)
			return nil
		}
		msgs := []*message.Message{msg}
		err := fn(msg.Context(), msgs)
		var be BatchErrors
		if !errors.As(err, &be) {
			return err
		}
		if e := be[msg.UUID]; e != nil {
			return e
		}
		return failsNone(err, be, msgs)
	}
}

type batchHandler struct{ fn BatchFunc }

type collectCtxKey struct{}

// batchCollect gathers, while the handlers of a batch are called, the
// messages whose handler is a BatchHandler, by handler, in order.
type batchCollect struct {
	groups []*batchGroup
}

type batchGroup struct {
	bh   *batchHandler
	msgs map[*message.Message]bool
}

func (c *batchCollect) add(bh *batchHandler, msg *message.Message) {
	for _, g := range c.groups {
		if g.bh == bh {
			g.msgs[msg] = true
			return
		}
	}
	c.groups = append(c.groups, &batchGroup{bh: bh, msgs: map[*message.Message]bool{msg: true}})
}

// runBatchFuncs runs the BatchFuncs whose messages c gathered from the
// handlers of held, in tx. It returns false when each returned nil: the
// caller commits. Otherwise it has ended the batch: tx rolled back, the
// failed messages counted, their mates run again by runBatch.
func (in *Inbox) runBatchFuncs(store dedupdriver.BatchClaimer, tx dedup.InboxTx, held []*queued, c *batchCollect) bool {
	for _, g := range c.groups {
		var qs []*queued
		for _, q := range held {
			if g.msgs[q.msg] {
				qs = append(qs, q)
			}
		}
		if len(qs) == 0 {
			continue
		}
		err, panicked := in.callBatch(tx, g.bh.fn, qs)
		if err == nil {
			continue
		}
		in.batchFailed(store, tx, held, qs, err, panicked)
		return true
	}
	return false
}

// callBatch calls fn with the messages of qs in tx, on the first one's
// drain and the earliest of their deadlines, counted from now.
func (in *Inbox) callBatch(tx dedup.InboxTx, fn BatchFunc, qs []*queued) (err error, panicked bool) {
	ctx := qs[0].drain
	var budget time.Duration
	for _, q := range qs {
		if q.budget > 0 && (budget == 0 || q.budget < budget) {
			budget = q.budget
		}
	}
	if budget > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, budget)
		defer cancel()
	}
	ctx = tx.WithTx(ctx)
	msgs := make([]*message.Message, len(qs))
	for i, q := range qs {
		msgs[i] = q.msg
		orig := q.msg.Context()
		// Its own drain keeps what its context carried (a trace span, say).
		q.msg.SetContext(context.WithValue(tx.WithTx(q.drain), keyCtxKey{}, q.key.Key))
		defer q.msg.SetContext(orig)
	}
	var began time.Time
	if qs[0].o.hooks != nil {
		began = time.Now()
	}
	func() {
		defer func() {
			if r := recover(); r != nil {
				err, panicked = panicError(r), true
			}
		}()
		err = txOwned(fn(ctx, msgs))
	}()
	if qs[0].o.hooks != nil {
		for _, q := range qs {
			q.o.handler += time.Since(began)
		}
	}
	cut := ctx.Err() != nil
	if isAborted, ended := txState(tx); ended != nil {
		fnErr := err
		// Not the inbox's to commit or roll back any more: nothing of it
		// can be looked at, and the store must not be asked to classify
		// the error through it.
		err = fmt.Errorf("%w: the BatchFunc committed or rolled back the batch's transaction (%s; the store could not look at it: %v); "+
			"the inbox commits it, with the messages' done marks, when the function returns: write through it and return nil, or return an error to roll it back",
			ErrTxEnded, callOf(len(qs)), ended)
		if fnErr != nil {
			// Its text only: whatever it says, the batch failed for
			// the function's mistake, not for an outage.
			err = fmt.Errorf("%w (it returned %q)", err, fnErr.Error())
		}
		in.cfg.Logger.Error("BatchFunc ended the batch's transaction", err, watermill.LogFields{"messages": len(qs)})
		return err, panicked
	} else if err == nil && isAborted {
		err = fmt.Errorf("%w (a batch of %d messages)", ErrTxAborted, len(qs))
	}
	var be BatchErrors
	if !panicked && errors.As(err, &be) {
		if e := failsNone(err, be, msgs); e != nil {
			err = e
		}
	}
	if err != nil && !cut && !panicked {
		err = classifyTx(tx, err)
	}
	return err, panicked
}

// batchFailed ends a batch whose BatchFunc, called with the messages of
// qs (some of held), failed with err: it rolls tx back, counts the
// messages err names, or the one message of qs, and runs the others
// again; a failure of the whole batch of more messages splits qs in
// halves, each run again with the mates of held that are not in qs going
// with the first.
func (in *Inbox) batchFailed(store dedupdriver.BatchClaimer, tx dedup.InboxTx, held, qs []*queued, err error, panicked bool) {
	ctx, cancel := in.finishContext(held[0].msg.Context())
	defer cancel()
	err = errors.Join(err, in.rollback(ctx, tx))
	for _, q := range held {
		q.produced, q.o.outcome = nil, ""
	}
	for _, q := range held {
		if stopping(q.msg.Context()) {
			for _, r := range held {
				r.err = in.endUncounted(ctx, r, err)
			}
			return
		}
	}

	// The messages at fault: those a BatchErrors names, or the batch's
	// only message.
	culprits := map[*queued]error{}
	var be BatchErrors
	if errors.As(err, &be) {
		for _, q := range qs {
			if e := be[q.msg.UUID]; e != nil {
				culprits[q] = e
			}
		}
	}
	switch {
	case len(culprits) > 0:
	case IsInfrastructure(err):
		// An outage: no message is at fault, none is counted.
		for _, q := range held {
			in.infra.Add(1)
			q.o.outcome = observe.Unavailable
			q.err = in.unstart(ctx, q.key, q.o, err)
		}
		return
	case errors.Is(err, dedup.ErrConflict):
		// Lost to another transaction: each runs alone, where a conflict
		// is run again at once.
		for _, q := range held {
			q.err = in.unstart(ctx, q.key, q.o, nil)
			q.single = q.err == nil
		}
		return
	case len(qs) == 1:
		culprits[qs[0]] = err
	default:
		// Who is at fault is unknown: bisect.
		half := len(qs) / 2
		first := slices.DeleteFunc(slices.Clone(held), func(q *queued) bool { return slices.Contains(qs[half:], q) })
		in.runBatch(store, first, true)
		in.runBatch(store, slices.Clone(qs[half:]), true)
		return
	}
	var rest []*queued
	for _, q := range held {
		e, ok := culprits[q]
		if !ok {
			rest = append(rest, q)
			continue
		}
		if panicked {
			in.panicked.Add(1)
			q.o.panicked = true
			in.cfg.Logger.Error("Batch handler panicked", e, logFields(q.msg, q.key))
		}
		q.err = in.endFailed(ctx, q, e)
	}
	if len(rest) > 0 {
		in.runBatch(store, rest, true)
	}
}
