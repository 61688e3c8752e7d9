package middleware

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/oncemill/oncemill/dedup"
	"github.com/oncemill/oncemill/dedup/dedupdriver"
	"github.com/oncemill/oncemill/observe"
)

// BatchConfig groups the deliveries of different keys that arrive
// together into one database transaction (group commit): one start that
// counts their attempts, one claim of all their keys, their handlers one
// after the other in the transaction, one commit. What a delivery costs
// the database is then mostly its own effect. Transactional mode, with a
// store that implements dedupdriver.BatchClaimer (the PostgreSQL store on a
// pool).
//
// The handlers are unchanged: postgres.Tx(msg.Context()) is the batch's
// transaction. A handler's failure does not fail its batch mates: the
// transaction is rolled back, the failure recorded for its message alone,
// and the others run again in a new transaction. No message is acked
// before its batch commits; a crash mid-batch acks none of them. Two
// messages of one key are never in one batch, and never in two batches
// at once. A delivery that finds anything unusual on the way (a dead
// key, a failed key being retried, a key another transaction holds, a
// crash loop) takes the single-message path.
//
// What it costs in latency: a delivery waits for the batch it is in, so
// for the handlers before it in the batch and the commit, and, when every
// batch slot is busy (or, with MinFill above 1, fewer than MinFill of its
// consumer wait while one of its batches runs), for a running batch to
// end. Linger adds to
// that only when no batch is full. bench-dedup measures p50 and p99 at a
// steady 1,000 msgs/s, with and without a Linger, against the unbatched
// inbox (benchmarks/RESULTS.md).
type BatchConfig struct {
	// MaxMessages is the most deliveries one batch holds; 0 or 1 turns
	// batching off. Defaults to 0 (off).
	MaxMessages int
	// Linger is how long a batch that is not full waits for more
	// deliveries before it starts. Under load batches fill while the
	// slots are busy, so that a linger only adds latency when the
	// consumer is idle. Defaults to 0: a batch starts as soon as a slot
	// is free.
	Linger time.Duration
	// Parallel is the most batches that run at once, each on a
	// connection of its own. Defaults to 4.
	Parallel int
	// MinFill is how many deliveries of a consumer must be waiting
	// before a batch of theirs takes a free slot while another batch of
	// that consumer runs. Until then they wait for a running batch to
	// end, and its slot takes them, so that at a moderate number of
	// deliveries in flight they gather into fuller batches instead of
	// spreading one or two to each of Parallel slots: the batches that
	// run at once grow with the queue, up to Parallel. A consumer with no
	// batch running starts one at once. 1 starts a batch whenever a slot
	// is free, so that Parallel batches run as soon as Parallel
	// deliveries are in flight. In short runs on 2 shared cores, 4 filled
	// batches of about four messages at 8 deliveries in flight (against
	// under two with 1) but was not faster in every row, so it is not the
	// default yet (docs/stores.md). Defaults to 1.
	MinFill int
}

func (c BatchConfig) enabled() bool { return c.MaxMessages > 1 }

func (c *BatchConfig) setDefaults() {
	if c.Parallel == 0 {
		c.Parallel = 4
	}
	if c.MinFill == 0 {
		c.MinFill = 1
	}
}

func (c BatchConfig) validate() error {
	switch {
	case c.MaxMessages < 0:
		return fmt.Errorf("middleware: InboxConfig.Tuning.Batch.MaxMessages must not be negative, got %d", c.MaxMessages)
	case c.Linger < 0:
		return fmt.Errorf("middleware: InboxConfig.Tuning.Batch.Linger must not be negative, got %s", c.Linger)
	case c.Parallel < 1:
		return fmt.Errorf("middleware: InboxConfig.Tuning.Batch.Parallel must be at least 1, got %d", c.Parallel)
	case c.MinFill < 1:
		return fmt.Errorf("middleware: InboxConfig.Tuning.Batch.MinFill must be at least 1 (1 starts a batch whenever a slot is free), got %d", c.MinFill)
	}
	return nil
}

// queued is one delivery waiting for its batch.
type queued struct {
	msg *message.Message
	key dedup.Key
	h   message.HandlerFunc
	o   *attemptObs
	seq uint64 // arrival order, across consumers

	wake chan struct{} // a token: done, or asked to lead
	// drain is the context its handler runs on (with the batch's
	// transaction added): its drain budget starts when the delivery's
	// context is cancelled, not when its turn in the batch comes. It has
	// no deadline of its own: see budget.
	drain context.Context
	// budget is what was left of the delivery's deadline (Watermill's
	// Timeout middleware) when it arrived; each run of its handler gets
	// that much from when it starts, so that the time it waited for its
	// batch and its mates' handlers is not charged to it. 0: no deadline.
	budget time.Duration
	// Set under the batcher's lock.
	lead bool
	done bool
	// The outcome, set before done.
	produced []*message.Message
	err      error
	single   bool // run it on the single-message path
	// start is the attempt's count once the batch's start counted it.
	start dedup.Claim
}

// batcher forms batches from the deliveries that call it and runs them
// in the callers' own goroutines: a caller that finds a slot free leads,
// runs batches of its consumer until its own delivery is done, then hands
// its slot to the delivery that has waited longest, of whichever
// consumer, or frees it. It starts no goroutine.
//
// A slot is never lost: leaders counts the deliveries that hold one, and
// a delivery asked to lead after another leader finished it passes the
// slot on at once. An idle batcher holds none.
//
// A free slot goes only to a consumer that may start a batch (see
// startable): one with no batch running, or with MinFill deliveries
// waiting. The others wait for their running batches, whose leaders take
// them next. None waits for ever: the last of its consumer's batches to
// end makes it startable, and that batch's slot, freed then, is handed
// to the startable delivery that has waited longest. So whenever a slot
// is free no startable delivery waits: each change that makes one
// startable (its arrival, its consumer's last batch ending, a slot
// freed) hands it a slot.
type batcher struct {
	in    *Inbox
	store dedupdriver.BatchClaimer

	mu      sync.Mutex
	queues  map[string][]*queued // by consumer, in arrival order
	running map[dedup.Key]bool   // keys in a batch that runs
	leaders int                  // slots taken
	// leadersOf counts the slots taken, by the consumer whose batches
	// they run.
	leadersOf map[string]int
	linger    map[string]time.Time // when the oldest queued delivery arrived, by consumer
	seq       uint64
}

func newBatcher(in *Inbox, store dedupdriver.BatchClaimer) *batcher {
	return &batcher{in: in, store: store, queues: map[string][]*queued{}, running: map[dedup.Key]bool{},
		leadersOf: map[string]int{}, linger: map[string]time.Time{}}
}

// startable reports whether a free slot may start a batch of consumer's
// queued deliveries: none of its batches runs, or MinFill of them wait.
// Called with b.mu held.
func (b *batcher) startable(consumer string) bool {
	return b.leaders < b.in.cfg.Tuning.Batch.Parallel &&
		(b.leadersOf[consumer] == 0 || len(b.queues[consumer]) >= b.in.cfg.Tuning.Batch.MinFill)
}

// takeSlot gives a slot to a delivery of consumer. Called with b.mu held.
func (b *batcher) takeSlot(consumer string) {
	b.leaders++
	b.leadersOf[consumer]++
}

// handle runs one delivery through a batch and returns its outcome; ok
// is false when it must take the single-message path instead (nothing of
// it is counted then).
func (b *batcher) handle(msg *message.Message, key dedup.Key, h message.HandlerFunc, o *attemptObs) ([]*message.Message, bool, error) {
	q := &queued{msg: msg, key: key, h: h, o: o, wake: make(chan struct{}, 1)}
	if d, ok := msg.Context().Deadline(); ok {
		// A budget already spent still cuts the handler short at once.
		q.budget = max(time.Until(d), time.Nanosecond)
	}
	// The drain's own context has neither the message's cancellation nor
	// its deadline: see budget.
	d := newDrain(msg.Context(), b.in.cfg.DrainTimeout)
	defer d.end()
	q.drain = d.ctx
	b.mu.Lock()
	for _, other := range b.queues[key.Consumer] {
		if other.key == key {
			// Another delivery of the key waits: order them on the
			// single-message path, where the claim serialises them.
			b.mu.Unlock()
			return nil, false, nil
		}
	}
	if len(b.queues[key.Consumer]) == 0 {
		b.linger[key.Consumer] = time.Now()
	}
	b.seq++
	q.seq = b.seq
	b.queues[key.Consumer] = append(b.queues[key.Consumer], q)
	lead := b.startable(key.Consumer)
	if lead {
		b.takeSlot(key.Consumer)
	}
	b.mu.Unlock()
	if lead {
		b.lead(q)
	}
	for {
		b.mu.Lock()
		done, asked := q.done, q.lead
		q.lead = false
		b.mu.Unlock()
		if asked {
			// Even when another leader finished q meanwhile: lead passes
			// the slot on.
			b.lead(q)
			continue
		}
		if done {
			return q.produced, !q.single, q.err
		}
		<-q.wake
	}
}

// lead runs batches of self's consumer until self is done, then passes
// its slot on.
func (b *batcher) lead(self *queued) {
	consumer := self.key.Consumer
	for {
		b.mu.Lock()
		if self.done {
			b.passSlot(consumer)
			b.mu.Unlock()
			return
		}
		b.mu.Unlock()
		batch := b.take(consumer)
		if len(batch) == 0 {
			// self is queued behind keys that run in other batches.
			time.Sleep(time.Millisecond)
			continue
		}
		b.runSafely(batch)
		b.finish(batch)
	}
}

// runSafely runs batch and, should anything in it panic (a store's call
// on a transaction that a handler ended, say), gives every delivery of
// the batch the panic as its error: each is nacked and comes back, where
// a key that did commit is found done, instead of waiting for ever for
// an outcome that its leader, gone with the panic, would not give.
func (b *batcher) runSafely(batch []*queued) {
	defer func() {
		r := recover()
		if r == nil {
			return
		}
		err := fmt.Errorf("a batch of %d messages ended in a panic: %w", len(batch), panicError(r))
		b.in.cfg.Logger.Error("Batch panicked, its deliveries are nacked", err, watermill.LogFields{"messages": len(batch)})
		for _, q := range batch {
			q.produced, q.single, q.err = nil, false, err
		}
	}()
	b.in.runBatch(b.store, batch, false)
}

// passSlot frees the slot of a leader of consumer and hands it to the
// queued delivery that has waited longest, of any startable consumer,
// that is not asked to lead already. Called with b.mu held.
func (b *batcher) passSlot(consumer string) {
	b.leaders--
	if b.leadersOf[consumer]--; b.leadersOf[consumer] == 0 {
		delete(b.leadersOf, consumer)
	}
	var next *queued
	for c, queue := range b.queues {
		if !b.startable(c) {
			continue
		}
		for _, q := range queue {
			if !q.lead {
				if next == nil || q.seq < next.seq {
					next = q
				}
				break
			}
		}
	}
	if next == nil {
		return
	}
	b.takeSlot(next.key.Consumer)
	next.lead = true
	signal(next)
}

// slots reports how many batch slots are taken, for the tests' check that
// an idle inbox holds none.
func (b *batcher) slots() int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.leaders
}

// take removes the next batch of consumer from its queue: up to
// MaxMessages deliveries of distinct keys that no running batch holds,
// after the linger when the batch would not be full.
func (b *batcher) take(consumer string) []*queued {
	cfg := b.in.cfg.Tuning.Batch
	if cfg.Linger > 0 {
		b.mu.Lock()
		n, since := len(b.queues[consumer]), b.linger[consumer]
		b.mu.Unlock()
		if wait := cfg.Linger - time.Since(since); n < cfg.MaxMessages && wait > 0 {
			time.Sleep(wait)
		}
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	queue := b.queues[consumer]
	var batch, rest []*queued
	for _, q := range queue {
		if len(batch) < cfg.MaxMessages && !b.running[q.key] {
			b.running[q.key] = true
			batch = append(batch, q)
			continue
		}
		rest = append(rest, q)
	}
	if len(rest) == 0 {
		delete(b.queues, consumer)
		delete(b.linger, consumer)
	} else {
		b.queues[consumer] = rest
		b.linger[consumer] = time.Now()
	}
	return batch
}

// finish marks the deliveries of a batch done and wakes them.
func (b *batcher) finish(batch []*queued) {
	b.mu.Lock()
	for _, q := range batch {
		delete(b.running, q.key)
		q.done = true
	}
	b.mu.Unlock()
	for _, q := range batch {
		signal(q)
	}
}

func signal(q *queued) {
	select {
	case q.wake <- struct{}{}:
	default:
	}
}

// runBatch runs one batch: counts its attempts (unless counted, when it
// runs again after a batch mate failed), claims its keys, runs the
// handlers in the transaction and commits. Every delivery of batch ends
// with an outcome or with single set.
func (in *Inbox) runBatch(store dedupdriver.BatchClaimer, batch []*queued, counted bool) {
	consumer := batch[0].key.Consumer
	// The batch's own statements run detached from any one message's
	// cancellation, each bounded by FinishTimeout: a delivery whose
	// context ends must not fail its batch mates.
	base := batch[0].msg.Context()

	if !counted {
		// Broker-counted first deliveries go unrecorded (brokerFirst);
		// the others are counted in one start.
		var recorded []*queued
		for _, q := range batch {
			q.o.unrecorded = in.cfg.Tuning.SkipAttemptRecord || brokerFirst(q.msg)
			if !q.o.unrecorded {
				recorded = append(recorded, q)
			}
		}
		var starts []dedup.Claim
		if len(recorded) > 0 {
			ctx, cancel := in.finishContext(base)
			for _, q := range recorded {
				in.debts.pay(ctx, in.cfg.TxStore, q.key)
			}
			var err error
			starts, err = store.InboxStartBatch(ctx, consumer, keysOf(recorded), in.cfg.Window)
			cancel()
			if err != nil {
				for _, q := range batch {
					if !q.o.unrecorded && errors.Is(err, dedupdriver.ErrMaybeCounted) {
						in.debts.owe(q.key)
					}
					q.err = err
				}
				return
			}
		}
		out := map[*queued]bool{} // answered, or sent to the single-message path
		for i, q := range recorded {
			q.start = withBrokerCount(q.msg, starts[i])
			out[q] = true
			switch {
			case starts[i].State == dedup.StateDone:
				q.produced, q.err = in.duplicate(q.msg, q.key, starts[i], q.o)
			case starts[i].State != dedup.StateNew:
				q.single = true // a dead key: nothing was counted
			case q.start.Attempts > 1:
				// An earlier attempt failed or died with its process: the
				// key runs alone, so that a message that kills the process
				// is not counted against batch mates again, and a crash
				// loop is judged on the single-message path.
				q.err = in.unstart(q.msg.Context(), q.key, q.o, nil)
				q.single = q.err == nil
			default:
				out[q] = false
			}
		}
		var keep []*queued // in arrival order
		for _, q := range batch {
			if !out[q] {
				keep = append(keep, q)
			}
		}
		batch = keep
	}
	if len(batch) == 0 {
		return
	}

	ctx, cancel := in.finishContext(base)
	tx, claims, err := store.InboxBeginClaimBatch(ctx, consumer, keysOf(batch), in.cfg.Window)
	cancel()
	if err != nil {
		for _, q := range batch {
			if errors.Is(err, dedup.ErrConflict) {
				// A key is held elsewhere: each waits for its own key.
				q.err = in.unstart(q.msg.Context(), q.key, q.o, nil)
				q.single = q.err == nil
				continue
			}
			if IsInfrastructure(err) {
				in.infra.Add(1)
				q.o.outcome = observe.Unavailable
			}
			q.err = in.unstart(q.msg.Context(), q.key, q.o, err)
		}
		return
	}
	var held []*queued
	for i, q := range batch {
		if claims[i].State != dedup.StateNew {
			// A record exists already (a failed key retried, done or dead
			// meanwhile): the single-message path knows what to do.
			q.err = in.unstart(q.msg.Context(), q.key, q.o, nil)
			q.single = q.err == nil
			continue
		}
		if q.o.unrecorded {
			q.start.Attempts = claims[i].Attempts
		}
		held = append(held, q)
	}
	if len(held) == 0 {
		ctx, cancel := in.finishContext(base)
		_ = in.rollback(ctx, tx)
		cancel()
		return
	}

	c := &batchCollect{}
	for i, q := range held {
		err := in.runInBatch(tx, q, c)
		if err == nil {
			continue
		}
		// q failed: its transaction mates lose what they wrote with it.
		// Roll back and end q's attempt alone; the others are not at
		// fault, whatever q's failure was (its own error, a dependency
		// it found unavailable, a conflict its statements lost, its
		// connection lost): they run again, in a new transaction, unless
		// the consumer is shutting down.
		ctx, cancel := in.finishContext(q.msg.Context())
		err = errors.Join(err, in.rollback(ctx, tx))
		if errors.Is(err, dedup.ErrConflict) && !stopping(q.msg.Context()) {
			// Lost to another transaction: nothing is known against q. It
			// runs alone, where a conflict is run again at once.
			q.produced, q.o.outcome = nil, ""
			q.err = in.unstart(ctx, q.key, q.o, nil)
			q.single = q.err == nil
		} else {
			q.err = in.endFailed(ctx, q, err)
		}
		rest := append(append([]*queued(nil), held[:i]...), held[i+1:]...)
		for _, r := range rest {
			r.produced, r.o.outcome = nil, ""
		}
		if stopping(q.msg.Context()) {
			for _, r := range rest {
				r.err = in.endUncounted(ctx, r, fmt.Errorf("batch mate %s failed: %w", q.msg.UUID, err))
			}
			cancel()
			return
		}
		cancel()
		if len(rest) > 0 {
			in.runBatch(store, rest, true)
		}
		return
	}

	if in.runBatchFuncs(store, tx, held, c) {
		return
	}

	// Every handler succeeded: store their results and commit once.
	ctx, cancel = in.finishContext(base)
	defer cancel()
	for _, q := range held {
		result, rerr := encodeResult(q.produced)
		if rerr == nil {
			rerr = tx.InboxComplete(ctx, q.key, result)
		}
		if rerr != nil {
			err = rerr
			break
		}
	}
	if err == nil {
		err = tx.Commit(ctx)
	}
	if err != nil {
		err = errors.Join(err, in.rollback(ctx, tx))
		for _, q := range held {
			q.produced = nil
			if IsInfrastructure(err) {
				// An outage, or a commit whose outcome is unknown: the
				// redeliveries find their keys done, or apply them once.
				in.infra.Add(1)
				q.o.outcome = observe.Unavailable
				q.err = in.unstart(ctx, q.key, q.o, err)
				continue
			}
			// The commit itself refused (a deferred constraint, say):
			// which message is at fault is unknown, so each runs alone.
			q.o.outcome = ""
			q.err = in.unstart(ctx, q.key, q.o, nil)
			q.single = q.err == nil
		}
		return
	}
	for _, q := range held {
		in.applied.Add(1)
		q.o.outcome = observe.Applied
		q.o.step(q.msg.Context(), observe.StepCommitted)
	}
}

// endUncounted ends the attempt of q, rolled back with its batch for a
// batch mate's outage or shutdown, without counting it.
func (in *Inbox) endUncounted(ctx context.Context, q *queued, err error) error {
	q.produced = nil
	if stopping(q.msg.Context()) {
		return in.abandoned(ctx, q.msg, q.key, err, q.o)
	}
	in.infra.Add(1)
	q.o.outcome = observe.Unavailable
	return in.unstart(ctx, q.key, q.o, fmt.Errorf("%w: %w", dedup.ErrUnavailable, err))
}

// runInBatch runs q's handler in the batch's transaction, and its outbox
// write; it keeps what the handler produced in q. The handler's deadline,
// if the delivery has one, counts from now. A handler that returns nil
// but leaves the transaction aborted (it swallowed the failure of one of
// its statements) failed: [ErrTxAborted]. A BatchHandler adds its
// message to c instead of running.
func (in *Inbox) runInBatch(tx dedup.InboxTx, q *queued, c *batchCollect) error {
	q.o.step(q.msg.Context(), observe.StepClaimed)
	drain := context.WithValue(q.drain, collectCtxKey{}, c)
	if q.budget > 0 {
		var cancel context.CancelFunc
		drain, cancel = context.WithTimeout(drain, q.budget)
		defer cancel()
	}
	produced, err := in.runOn(tx, drain, q.msg, q.key, q.h, q.o)
	if err == nil {
		switch isAborted, ended := txState(tx); {
		case ended != nil:
			produced, err = nil, fmt.Errorf("%w: the handler committed or rolled back the batch's transaction (message %s; the store could not look at it: %v); "+
				"the inbox commits it, with the message's done mark, when the handler returns: write through it and return nil, or return an error to roll it back",
				ErrTxEnded, q.msg.UUID, ended)
		case isAborted:
			produced, err = nil, fmt.Errorf("%w (message %s)", ErrTxAborted, q.msg.UUID)
		}
	}
	q.produced = produced
	return err
}

// aborted reports whether tx says a statement in it failed
// (dedupdriver.AbortReporter).
func aborted(tx dedup.InboxTx) bool {
	a, ok := tx.(dedupdriver.AbortReporter)
	return ok && a.InboxAborted()
}

// ErrTxEnded is wrapped by the error of a batch whose handler or
// [BatchFunc] committed or rolled back the transaction it was handed,
// logged at Error and returned for a message that runs alone; and,
// permanent, by the error of a handler that returns dedup.ErrTxOwned
// (the pgx store refuses the call). The
// transaction is the inbox's: it commits the effects with the messages'
// done marks, or rolls both back. A function that ends it itself fails
// its batch, which is run again as any failed batch is: its deliveries
// are run again or nacked, none waits. Rolled back, nothing of the batch
// stays; committed, the done marks of every message the batch claimed
// went with it, also of those whose handler had not run yet, so that
// their redeliveries find them done: do not end it.
var ErrTxEnded = errors.New("middleware: the inbox's transaction was ended by the code it was handed to")

// txState looks at the batch's transaction after a handler or BatchFunc
// wrote through it: whether a statement of it failed, and, when ended is
// not nil, that it cannot be looked at any more because that code ended
// it: the PostgreSQL store gives a transaction's connection back to the
// pool when it is committed or rolled back, and its look at a connection
// given back panics. Nothing of such a transaction may be asked of the
// store again but its rollback, which ends nothing twice.
func txState(tx dedup.InboxTx) (isAborted bool, ended error) {
	defer func() {
		if r := recover(); r != nil {
			isAborted, ended = false, fmt.Errorf("%v", r)
		}
	}()
	return aborted(tx), nil
}

// endFailed ends the attempt of q, whose transaction failed with err and
// is rolled back, as the single-message path does.
func (in *Inbox) endFailed(ctx context.Context, q *queued, err error) error {
	q.produced = nil
	return in.failAttempt(ctx, q.msg, q.key, q.o, dedup.Claim{Attempts: q.start.Attempts, FirstFailedAt: q.start.FirstFailedAt}, err)
}

func keysOf(batch []*queued) []string {
	keys := make([]string, len(batch))
	for i, q := range batch {
		keys[i] = q.key.Key
	}
	return keys
}
