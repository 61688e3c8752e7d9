package middleware

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/oncemill/oncemill/dedup"
	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/observe"
)

// InboxConfig configures an [Inbox]. Exactly one of TxStore and LeaseStore
// must be set; it chooses the mode.
type InboxConfig struct {
	// TxStore claims keys in the transaction that holds the handler's
	// effect (transactional mode). The handler reads the transaction from
	// the message context with the store package's accessor, e.g.
	// postgres.Tx(msg.Context()).
	TxStore dedup.TxStore
	// LeaseStore claims keys as fenced leases (lease mode), for effects
	// outside the database. The handler passes IdempotencyKey(ctx) to the
	// effect's own idempotency mechanism where it has one.
	LeaseStore dedup.LeaseStore

	// Key extracts the key from a message. Defaults to [DefaultKey].
	Key KeyFunc
	// Consumer scopes keys, so that two consumers of one topic keep
	// separate records. Defaults to the router handler's name.
	Consumer string
	// Window is how long a key is remembered; it must exceed the longest
	// time in which the broker may redeliver. Defaults to 72 hours.
	Window time.Duration
	// Lease is how long a lease-mode claim holds the key before another
	// delivery may take it over. While the handler runs, the inbox renews
	// the lease every Lease/3; when it cannot, the handler's context is
	// cancelled before the lease ends, and the attempt is recorded only if
	// the handler finished all the same and its token is still current
	// (the completion is fenced). It must be shorter than Window. Lease mode only. Defaults
	// to 30 seconds.
	Lease time.Duration
	// FinishTimeout bounds the commit, complete or release that ends an
	// attempt whose handler has returned. It runs on a context detached
	// from the message's, so that work finished when the consumer begins
	// to shut down is committed, not rolled back; keep DrainTimeout plus
	// this within the router's CloseTimeout, and that within the
	// platform's grace period. Defaults to 5 seconds.
	FinishTimeout time.Duration
	// DrainTimeout is how long a handler that is running when the
	// consumer begins to shut down keeps a live context. Watermill's
	// router cancels every in-flight message's context the moment it
	// closes; the inbox hands the handler a context that ignores that
	// cancellation for DrainTimeout, so that work in flight at a SIGTERM
	// finishes and is committed and acked, and only then cancels it (the
	// attempt is rolled back and not counted). A deadline on the message's
	// context (Watermill's Timeout middleware) still applies. With the
	// defaults, 20 s of drain and 5 s of FinishTimeout fit the router's
	// CloseTimeout (30 s by default) and Kubernetes'
	// terminationGracePeriodSeconds (30 s by default). Defaults to 20
	// seconds.
	DrainTimeout time.Duration
	// InFlightDelay is how long a delivery whose key is held by another
	// live lease waits before it is nacked, so that it is not redelivered
	// in a tight loop. It is cut short when the lease ends sooner, and
	// when the holder finishes meanwhile (stores that implement
	// dedup.Peeker) the delivery is answered as a duplicate. Used in
	// lease mode, and with transactional stores that keep a lock in front
	// of their record (dedup/twotier). Defaults to 1 second.
	InFlightDelay time.Duration
	// SkipAttemptRecord leaves out the statement that records each
	// attempt before the handler's transaction begins (transactional mode;
	// a lease claim records it by itself). That statement is what counts
	// an attempt whose process dies (an OOM kill, os.Exit, a crash in
	// cgo), so that such a message is dead-lettered after MaxAttempts
	// instead of looping forever on Kafka, and it also answers a
	// duplicate in one round trip, without a transaction. Skipping it
	// saves a round trip per new key (measured in bench-dedup: 25–35 %
	// more new keys per second when the effect is one INSERT, less the
	// more the handler does), at the price of both: a message that kills
	// the process is stopped only by the broker's own limit (RabbitMQ's
	// delivery_limit, an SQS redrive policy), and a duplicate costs
	// three round trips. Defaults to false.
	SkipAttemptRecord bool
	// PipelineClaim sends the BEGIN and the claim in one round trip, and
	// the attempt record with them, with stores that can
	// (dedup.StartClaimer and dedup.BeginClaimer: the PostgreSQL store on
	// a pool). With the attempt record a new key then costs three round
	// trips with a one-statement effect (the pipeline, the effect, the
	// COMMIT) instead of five, and a duplicate two instead of one, since
	// the transaction is open before the record says the key is done.
	// With SkipAttemptRecord a new key costs three instead of four, fewer
	// than the naive BEGIN, claim, effect, COMMIT, and a duplicate two
	// instead of three. bench-dedup measures both. Transactional mode.
	// Defaults to false.
	PipelineClaim bool
	// Batch groups deliveries of different keys into one transaction
	// (group commit); see [BatchConfig]. Transactional mode, with a store
	// that implements dedup.BatchClaimer. Off unless Batch.MaxMessages is
	// above 1.
	Batch BatchConfig

	// Outbox, when set, writes the messages the handler produced into an
	// outbox inside the inbox's transaction (the consumer outbox), instead
	// of returning them to the router: consume, update and produce then
	// commit as one step, and a relay publishes them. The context it gets
	// carries the transaction. Transactional mode only. See
	// forwarder.InboxOutbox for the PostgreSQL outbox.
	Outbox func(ctx context.Context, produced []*message.Message) error

	// Hooks receive each delivery's outcome and timings
	// (observe.InboxHook) and trace its steps (observe.InboxTraceHook):
	// observe/prom and observe/tracing implement them. The inbox measures
	// times only when a hook wants them.
	Hooks []observe.Hook

	// Logger receives a line for every duplicate dropped (at Debug),
	// failures and state changes. Defaults to watermill.NopLogger.
	Logger watermill.LoggerAdapter
}

func (c *InboxConfig) setDefaults() {
	if c.Key == nil {
		c.Key = DefaultKey
	}
	if c.Window == 0 {
		c.Window = dedup.DefaultWindow
	}
	if c.Lease == 0 {
		c.Lease = 30 * time.Second
	}
	if c.FinishTimeout == 0 {
		c.FinishTimeout = 5 * time.Second
	}
	if c.InFlightDelay == 0 {
		c.InFlightDelay = time.Second
	}
	if c.DrainTimeout == 0 {
		c.DrainTimeout = DefaultDrainTimeout
	}
	c.Batch.setDefaults()
	if c.Logger == nil {
		c.Logger = watermill.NopLogger{}
	}
}

// Validate reports the first field that is missing or out of range.
func (c InboxConfig) Validate() error {
	switch {
	case c.TxStore == nil && c.LeaseStore == nil:
		return errors.New("middleware: InboxConfig: set TxStore (transactional mode) or LeaseStore (lease mode)")
	case c.TxStore != nil && c.LeaseStore != nil:
		return errors.New("middleware: InboxConfig: set only one of TxStore and LeaseStore")
	case c.Window < time.Minute:
		return fmt.Errorf("middleware: InboxConfig.Window must be at least 1m, got %s", c.Window)
	case c.Lease < 10*time.Millisecond:
		return fmt.Errorf("middleware: InboxConfig.Lease must be at least 10ms, got %s", c.Lease)
	case c.Lease >= c.Window:
		return fmt.Errorf("middleware: InboxConfig.Lease (%s) must be shorter than Window (%s): a record must outlive its lease", c.Lease, c.Window)
	case c.FinishTimeout < 0:
		return fmt.Errorf("middleware: InboxConfig.FinishTimeout must not be negative, got %s", c.FinishTimeout)
	case c.PipelineClaim && c.TxStore == nil:
		return errors.New("middleware: InboxConfig.PipelineClaim needs TxStore: it pipelines the claim with its transaction's BEGIN")
	case c.Outbox != nil && c.TxStore == nil:
		return errors.New("middleware: InboxConfig.Outbox needs TxStore: the outbox is written in the claim's transaction")
	case c.InFlightDelay < 0:
		return fmt.Errorf("middleware: InboxConfig.InFlightDelay must not be negative, got %s", c.InFlightDelay)
	case c.DrainTimeout < 0:
		return fmt.Errorf("middleware: InboxConfig.DrainTimeout must not be negative, got %s", c.DrainTimeout)
	case c.Batch.enabled() && !isBatchClaimer(c.TxStore):
		return errors.New("middleware: InboxConfig.Batch needs a TxStore that implements dedup.BatchClaimer (the PostgreSQL store)")
	}
	return c.Batch.validate()
}

func isBatchClaimer(s dedup.TxStore) bool {
	_, ok := s.(dedup.BatchClaimer)
	return ok
}

// InboxStats counts what an [Inbox] did since it was made.
type InboxStats struct {
	// Applied counts handler runs whose effect was committed.
	Applied int64
	// Duplicates counts deliveries dropped because their key was done.
	Duplicates int64
	// InFlight counts deliveries nacked because another held the key.
	InFlight int64
	// Failed counts handler runs that returned an error or panicked.
	Failed int64
	// Panicked counts handler runs that panicked (counted in Failed too).
	Panicked int64
	// Abandoned counts attempts cut short by shutdown: rolled back and
	// not counted toward the poison middleware's MaxAttempts.
	Abandoned int64
	// CrashLooped counts deliveries stopped before the handler ran because
	// the key's earlier attempts all started and never finished.
	CrashLooped int64
	// DeadCopies counts deliveries of a dead-lettered key acked without
	// running.
	DeadCopies int64
	// OthersReplays counts replays from the dead-letter queue meant for
	// another consumer of the topic, acked without running: those whose
	// grant the store holds on that consumer's record of the key.
	OthersReplays int64
	// Infrastructure counts attempts that ended for the infrastructure's
	// fault (the store unavailable, a commit whose outcome is unknown,
	// conflicts that kept losing): nacked and not counted.
	Infrastructure int64
	// ConflictRetries counts transactions run again at once after losing
	// a conflict (serialization failure, deadlock).
	ConflictRetries int64
}

// Inbox is a router middleware that applies each message key's effect
// exactly once per consumer. In lease mode each attempt runs one goroutine
// that renews its lease, ended before the attempt returns; the inbox
// starts no other.
type Inbox struct {
	cfg   InboxConfig
	hooks observe.Hooks

	applied, duplicates, inFlight, failed         atomic.Int64
	panicked, abandonedN, crashLooped, deadCopies atomic.Int64
	infra, conflictRetries, othersReplays         atomic.Int64

	debts   debts
	batcher *batcher // nil unless batching
}

// NewInbox returns an inbox for cfg; cfg is copied, defaulted and validated.
func NewInbox(cfg InboxConfig) (*Inbox, error) {
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	in := &Inbox{cfg: cfg, hooks: observe.New(cfg.Hooks...)}
	if cfg.Batch.enabled() {
		in.batcher = newBatcher(in, cfg.TxStore.(dedup.BatchClaimer))
	}
	return in, nil
}

// Stats returns the inbox's counters.
func (in *Inbox) Stats() InboxStats {
	return InboxStats{
		Applied:    in.applied.Load(),
		Duplicates: in.duplicates.Load(),
		InFlight:   in.inFlight.Load(),
		Failed:     in.failed.Load(),
		Panicked:   in.panicked.Load(),
		Abandoned:  in.abandonedN.Load(),

		CrashLooped:     in.crashLooped.Load(),
		DeadCopies:      in.deadCopies.Load(),
		OthersReplays:   in.othersReplays.Load(),
		Infrastructure:  in.infra.Load(),
		ConflictRetries: in.conflictRetries.Load(),
	}
}

type keyCtxKey struct{}

// IdempotencyKey returns the key of the message being handled, for passing
// to an effect's own idempotency mechanism (a payment provider's
// Idempotency-Key header, say). It is empty outside an inbox.
func IdempotencyKey(ctx context.Context) string {
	k, _ := ctx.Value(keyCtxKey{}).(string)
	return k
}

type tokenCtxKey struct{}

// LeaseToken returns the fencing token of the lease under which the
// message is being handled (lease mode), for fencing the effect
// downstream: a system that remembers the highest token it accepted for a
// key can refuse a zombie whose lease was taken over. Tokens grow for a
// key and are never issued twice. It is 0 outside a lease-mode inbox.
func LeaseToken(ctx context.Context) int64 {
	t, _ := ctx.Value(tokenCtxKey{}).(int64)
	return t
}

func withToken(ctx context.Context, token int64) context.Context {
	return context.WithValue(ctx, tokenCtxKey{}, token)
}

// Middleware wraps h: add it with router.AddMiddleware or to one handler.
//
// A new key runs h and commits (or completes) its effect with the messages h
// produced; a done key returns those stored messages without running h, so
// that a crash between commit and publish loses nothing; an error from h is
// recorded as a failed attempt and returned, so that the message is nacked.
func (in *Inbox) Middleware(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		if !in.hooks.ObservesInbox() {
			var o attemptObs
			return in.handle(msg, h, &o)
		}
		return in.observed(msg, h)
	}
}

// handle runs one delivery through the inbox; o gathers what the hooks are
// told.
func (in *Inbox) handle(msg *message.Message, h message.HandlerFunc, o *attemptObs) ([]*message.Message, error) {
	key, err := in.keyOf(msg)
	if err != nil {
		o.outcome = observe.Rejected
		return nil, err
	}
	o.consumer = key.Consumer
	if owner := msg.Metadata.Get(delivery.ReplayConsumer); owner != "" && owner != key.Consumer {
		// A replay published to the topic reaches every consumer of it;
		// it belongs to the one that dead-lettered it, and running it here
		// would apply again an effect whose done key has expired. It is
		// acked without running only when the store confirms it: the
		// owner's record of the key holds the grant the message carries,
		// which the operator's replay wrote there and no producer knows.
		// Metadata alone never makes a consumer skip a message: a forged
		// or forwarded marker, or an owner whose record is in another
		// store, leaves the message to be handled as any copy is.
		othersReplay, err := in.othersReplay(msg.Context(), owner, key, msg.Metadata.Get(delivery.Replay))
		if err != nil {
			return nil, err
		}
		if othersReplay {
			in.othersReplays.Add(1)
			o.outcome = observe.OtherConsumer
			in.cfg.Logger.Debug("Replay for another consumer acked without running",
				logFields(msg, key).Add(watermill.LogFields{"replay_consumer": owner}))
			return nil, nil
		}
		in.cfg.Logger.Info("Replay marker for another consumer without its grant, handled as a plain copy",
			logFields(msg, key).Add(watermill.LogFields{"replay_consumer": owner}))
	}
	if slot := slotOf(msg.Context()); slot != nil {
		// The poison middleware in front dead-letters through this
		// inbox, with its key and consumer.
		slot.inbox, slot.key = in, key
	}
	if in.batcher != nil {
		if produced, ok, err := in.batcher.handle(msg, key, h, o); ok {
			return produced, err
		}
	}
	if in.cfg.TxStore != nil {
		return in.handleTx(msg, key, h, false, o)
	}
	return in.handleLease(msg, key, h, false, o)
}

// observed is handle with the hooks told: the trace hooks start the
// attempt's span before it and every hook gets its outcome and times
// after.
func (in *Inbox) observed(msg *message.Message, h message.HandlerFunc) ([]*message.Message, error) {
	began := time.Now()
	base := msg.Context()
	topic := topicOf(msg)
	consumer := in.cfg.Consumer
	if consumer == "" {
		consumer = message.HandlerNameFromCtx(base)
	}
	ctx := in.hooks.StartInboxAttempt(base, consumer, topic, msg)
	msg.SetContext(ctx)
	o := attemptObs{hooks: &in.hooks, consumer: consumer}
	produced, err := in.handle(msg, h, &o)
	msg.SetContext(base)
	if o.outcome == "" {
		switch {
		case err == nil:
			o.outcome = observe.Applied
		case IsInfrastructure(err):
			o.outcome = observe.Unavailable
		default:
			o.outcome = observe.Failed
		}
	}
	in.hooks.InboxAttempt(ctx, observe.InboxAttempt{
		Consumer: o.consumer, Topic: topic, Outcome: o.outcome,
		Handler: o.handler, Store: max(time.Since(began)-o.handler, 0), Err: err,
	})
	return produced, err
}

// attemptObs is what one delivery tells the hooks: set where the inbox
// counts the outcome. With no hooks it costs a few stores on the stack.
type attemptObs struct {
	hooks    *observe.Hooks // nil: no hook observes
	consumer string
	outcome  observe.Outcome
	handler  time.Duration
	panicked bool
}

// failed notes a failed attempt: panicked when the handler panicked.
func (o *attemptObs) failed(error) {
	if o.panicked {
		o.outcome = observe.Panicked
		return
	}
	o.outcome = observe.Failed
}

// step reports a step of the attempt to the trace hooks.
func (o *attemptObs) step(ctx context.Context, s observe.Step) {
	if o.hooks != nil {
		o.hooks.InboxStep(ctx, s)
	}
}

func (in *Inbox) keyOf(msg *message.Message) (dedup.Key, error) {
	consumer := in.cfg.Consumer
	if consumer == "" {
		consumer = message.HandlerNameFromCtx(msg.Context())
	}
	if consumer == "" {
		return dedup.Key{}, Permanent(ErrNoConsumer)
	}
	k, err := keyOf(in.cfg.Key, msg)
	if err != nil {
		return dedup.Key{}, err
	}
	return dedup.Key{Consumer: consumer, Key: k}, nil
}

func (in *Inbox) handleTx(msg *message.Message, key dedup.Key, h message.HandlerFunc, reopened bool, o *attemptObs) ([]*message.Message, error) {
	base := msg.Context()
	var (
		start dedup.Claim
		// pre is the transaction a dedup.StartClaimer opened and claimed
		// in with the start, for the first run; preErr its failure.
		pre      dedup.InboxTx
		preClaim dedup.Claim
		preErr   error
	)
	if !in.cfg.SkipAttemptRecord {
		in.debts.pay(base, in.cfg.TxStore, key)
		var err error
		if sc, ok := in.cfg.TxStore.(dedup.StartClaimer); ok && in.cfg.PipelineClaim {
			start, pre, preClaim, err = sc.InboxStartClaim(base, key, in.cfg.Window)
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
					return nil, in.unstart(base, key, err)
				}
				pre, preErr = nil, nil
			}
			var err error
			if start, err = in.settle(base, key); err != nil {
				return nil, err
			}
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
			err = in.claimFailed(base, key, preErr)
		case try == 1 && pre != nil:
			produced, err = in.attemptClaimed(msg, key, h, start, pre, preClaim, o)
		default:
			produced, err = in.attemptTx(msg, key, h, start, o)
		}
		if !errors.Is(err, dedup.ErrConflict) {
			return produced, err
		}
		// A serialization failure or deadlock: the transaction lost to
		// another one, which says nothing about the message. Run it again
		// at once, a few times, then nack without counting.
		if try >= maxConflictRetries || stopping(base) || !sleepCtx(base, time.Duration(try)*conflictBackoff) {
			return nil, in.unstart(base, key, err)
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

// attemptTx runs one transaction of an attempt: claim, handler, commit. An
// error wrapping dedup.ErrConflict leaves the attempt's count for the
// caller, which runs it again.
func (in *Inbox) attemptTx(msg *message.Message, key dedup.Key, h message.HandlerFunc, start dedup.Claim, o *attemptObs) ([]*message.Message, error) {
	base := msg.Context()
	store := in.cfg.TxStore
	if bc, ok := store.(dedup.BeginClaimer); ok && in.cfg.PipelineClaim {
		// Nothing is held after an error: the claim failed, or BEGIN did.
		tx, claim, err := bc.InboxBeginClaim(base, key, in.cfg.Window)
		if err != nil {
			return nil, in.claimFailed(base, key, err)
		}
		return in.attemptClaimed(msg, key, h, start, tx, claim, o)
	}
	tx, err := store.InboxBegin(base)
	if err != nil {
		return nil, in.unstart(base, key, err)
	}
	claim, err := tx.InboxClaim(base, key, in.cfg.Window)
	if err != nil {
		return nil, in.claimFailed(base, key, errors.Join(err, in.rollback(base, tx)))
	}
	return in.attemptClaimed(msg, key, h, start, tx, claim, o)
}

// claimFailed ends an attempt whose claim failed, its transaction ended:
// a conflict is left for the caller to run again, anything else takes the
// attempt's count back.
func (in *Inbox) claimFailed(base context.Context, key dedup.Key, err error) error {
	if errors.Is(err, dedup.ErrConflict) {
		return err
	}
	return in.unstart(base, key, err)
}

// attemptClaimed runs the rest of an attempt whose key tx claimed: the
// handler and the commit.
func (in *Inbox) attemptClaimed(msg *message.Message, key dedup.Key, h message.HandlerFunc, start dedup.Claim, tx dedup.InboxTx, claim dedup.Claim, o *attemptObs) ([]*message.Message, error) {
	base := msg.Context()
	if in.cfg.SkipAttemptRecord {
		start.Attempts = claim.Attempts // the failed attempts, this one included
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
		return in.deadCopy(msg, key, h, true, o)
	case dedup.StateInFlight:
		// A store with a lock in front of its record (two-tier) answers
		// this when another delivery holds the key right now.
		if err := in.unstart(base, key, in.rollback(base, tx)); err != nil {
			return nil, err
		}
		return in.awaitInFlight(msg, key, claim, o)
	}
	o.step(base, observe.StepClaimed)

	drain, endDrain := drainContext(base, in.cfg.DrainTimeout)
	produced, err := in.runOn(tx, drain, msg, key, h, o)
	endDrain()

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

// runOn runs h in tx on drain (the handler's context: see drainContext),
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
		return in.unstart(ctx, key, err)
	}
	in.failed.Add(1)
	o.failed(err)
	f := dedup.Failure{Err: err.Error(), At: time.Now()}
	failErr := in.cfg.TxStore.InboxFail(ctx, key, f, in.cfg.Window)
	return attempted(errors.Join(err, failErr), counted, f.At)
}

// classifyTx lets tx mark the infrastructure's errors among those the
// handler returned after writing through it (dedup.Classifier).
func classifyTx(tx dedup.InboxTx, err error) error {
	if c, ok := tx.(dedup.Classifier); ok {
		return c.InboxClassify(err)
	}
	return err
}

func (in *Inbox) handleLease(msg *message.Message, key dedup.Key, h message.HandlerFunc, reopened bool, o *attemptObs) ([]*message.Message, error) {
	base := msg.Context()
	store := in.cfg.LeaseStore
	claim, err := store.LeaseClaim(base, key, in.cfg.Lease, in.cfg.Window)
	if err != nil {
		return nil, err
	}
	switch claim.State {
	case dedup.StateDone:
		return in.duplicate(msg, key, claim, o)
	case dedup.StateDead:
		return in.deadCopy(msg, key, h, reopened, o)
	case dedup.StateInFlight:
		return in.awaitInFlight(msg, key, claim, o)
	}
	if err := in.crashLoop(msg, key, claim, o); err != nil {
		// Free the key for the dead-lettering, which claims it again.
		finish, cancel := in.finishContext(base)
		defer cancel()
		f := dedup.Failure{Err: err.Error(), At: time.Now()}
		return nil, errors.Join(err, ignoreLost(store.LeaseRelease(finish, key, claim.Token, f)))
	}

	o.step(base, observe.StepClaimed)
	hctx, endDrain := drainContext(base, in.cfg.DrainTimeout)
	held, release := in.holdLease(hctx, key, claim)
	produced, err := in.run(withToken(held, claim.Token), msg, key, h, o)
	lost := release()
	endDrain()

	finish, cancel := in.finishContext(base)
	defer cancel()
	if lost != nil {
		// The lease could not be renewed and may belong to another
		// delivery now. A handler that finished all the same is recorded
		// if its token is still the current one (the completion is
		// fenced); anything else is left to the next delivery.
		if err == nil {
			result, rerr := encodeResult(produced)
			if rerr == nil && in.complete(finish, key, claim.Token, result) == nil {
				in.applied.Add(1)
				o.outcome = observe.Applied
				o.step(base, observe.StepCommitted)
				return produced, nil
			}
		}
		return nil, errors.Join(lost, err)
	}
	if err != nil {
		if stopping(base) {
			relErr := ignoreLost(store.LeaseRelease(finish, key, claim.Token, dedup.Failure{Abandoned: true}))
			return nil, in.abandoned(finish, msg, key, errors.Join(err, relErr), o)
		}
		if IsInfrastructure(err) {
			// The handler said a dependency is down (Unavailable): give
			// the key up with the attempt's count taken back.
			in.infra.Add(1)
			o.outcome = observe.Unavailable
			relErr := ignoreLost(store.LeaseRelease(finish, key, claim.Token, dedup.Failure{Abandoned: true}))
			return nil, errors.Join(err, relErr)
		}
		in.failed.Add(1)
		o.failed(err)
		f := dedup.Failure{Err: err.Error(), At: time.Now()}
		relErr := store.LeaseRelease(finish, key, claim.Token, f)
		return nil, attempted(errors.Join(err, relErr), claim, f.At)
	}
	result, err := encodeResult(produced)
	if err == nil {
		err = in.complete(finish, key, claim.Token, result)
	}
	if err != nil {
		// With ErrLeaseLost another delivery took the key over: nack, and
		// the redelivery finds it done or in flight.
		return nil, err
	}
	in.applied.Add(1)
	o.outcome = observe.Applied
	o.step(base, observe.StepCommitted)
	return produced, nil
}

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
// holder's transaction to end; this one is rolled back), then takes this
// attempt's count back and counts it again.
func (in *Inbox) settle(base context.Context, key dedup.Key) (dedup.Claim, error) {
	store := in.cfg.TxStore
	tx, err := store.InboxBegin(base)
	if err == nil {
		_, err = tx.InboxClaim(base, key, in.cfg.Window)
		err = errors.Join(err, in.rollback(base, tx))
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
	if in.cfg.TxStore != nil && !in.cfg.SkipAttemptRecord {
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
	if in.cfg.SkipAttemptRecord {
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

func (in *Inbox) rollback(base context.Context, tx dedup.InboxTx) error {
	ctx, cancel := in.finishContext(base)
	defer cancel()
	return tx.Rollback(ctx)
}

// finishContext is what ends an attempt whose handler has returned:
// detached from the message's cancellation (a shutdown must not throw
// finished work away), bounded by FinishTimeout (a hung store must not
// hang the shutdown).
func (in *Inbox) finishContext(base context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.WithoutCancel(base), in.cfg.FinishTimeout)
}

// callOutbox writes produced into the outbox, a panic in it being a failure
// like the handler's.
func (in *Inbox) callOutbox(ctx context.Context, produced []*message.Message) (err error) {
	defer func() {
		if r := recover(); r != nil {
			err = panicError(r)
		}
	}()
	return in.cfg.Outbox(ctx, produced)
}

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
	in.cfg.Logger.Debug("Copy of a dead-lettered key acked without running", logFields(msg, key))
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

// complete marks the lease done. The effect has happened by now, so a
// transient failure is retried a few times within ctx, which the message's
// cancellation does not end: a nack here lets the effect run again once
// the lease expires.
func (in *Inbox) complete(ctx context.Context, key dedup.Key, token int64, result []byte) error {
	var err error
	for i := range 4 {
		if i > 0 && !sleepCtx(ctx, time.Duration(25<<i)*time.Millisecond) {
			break
		}
		err = in.cfg.LeaseStore.LeaseComplete(ctx, key, token, result)
		if err == nil || errors.Is(err, dedup.ErrLeaseLost) {
			return err
		}
		in.cfg.Logger.Error("Lease complete failed after the effect, retrying", err, watermill.LogFields{"consumer": key.Consumer, "key": key.Key})
	}
	return err
}

// run calls h with the message's context replaced by ctx plus the key, and
// puts the original context back afterwards: the transaction in it is dead
// once the inbox commits. A panic in h is recovered here and returned as an
// error wrapping [ErrPanicked], so that the attempt is rolled back and
// counted like any failure: Watermill's router would recover it too, but
// only to nack, and the message would come back forever.
func (in *Inbox) run(ctx context.Context, msg *message.Message, key dedup.Key, h message.HandlerFunc, o *attemptObs) (produced []*message.Message, err error) {
	orig := msg.Context()
	msg.SetContext(context.WithValue(ctx, keyCtxKey{}, key.Key))
	defer msg.SetContext(orig)
	var began time.Time
	if o.hooks != nil {
		began = time.Now()
	}
	defer func() {
		if r := recover(); r != nil {
			in.panicked.Add(1)
			o.panicked = true
			produced, err = nil, panicError(r)
			in.cfg.Logger.Error("Handler panicked", err, logFields(msg, key))
		}
		if o.hooks != nil {
			o.handler = time.Since(began)
			o.step(orig, observe.StepHandled)
		}
	}()
	return h(msg)
}

func (in *Inbox) duplicate(msg *message.Message, key dedup.Key, claim dedup.Claim, o *attemptObs) ([]*message.Message, error) {
	produced, err := decodeResult(claim.Result)
	if err != nil {
		o.outcome = observe.Rejected
		return nil, Permanent(fmt.Errorf("consumer %q key %q: %w", key.Consumer, key.Key, err))
	}
	in.duplicates.Add(1)
	o.outcome = observe.Duplicate
	in.cfg.Logger.Debug("Duplicate message dropped", logFields(msg, key).Add(watermill.LogFields{
		"attempts":          claim.Attempts,
		"replayed_messages": len(produced),
	}))
	return produced, nil
}

// awaitInFlight handles a key another delivery holds. It waits up to
// InFlightDelay (less if the lease ends sooner) so that the broker does not
// redeliver in a tight loop, and, when the store can be read without a
// claim (dedup.Peeker), looks every few milliseconds whether the holder
// finished: then this delivery is a plain duplicate, answered with the
// stored result and acked. Otherwise it is nacked, never acked: acking it
// could commit an offset past a message whose effect is not yet durable.
func (in *Inbox) awaitInFlight(msg *message.Message, key dedup.Key, claim dedup.Claim, o *attemptObs) ([]*message.Message, error) {
	ctx := msg.Context()
	in.inFlight.Add(1)
	o.outcome = observe.InFlight
	wait := in.cfg.InFlightDelay
	if left := time.Until(claim.Until); left > 0 && left < wait {
		wait = left
	}
	peeker, _ := in.store().(dedup.Peeker)
	deadline := time.Now().Add(wait)
	for step := 5 * time.Millisecond; ; step = min(2*step, 100*time.Millisecond) {
		left := time.Until(deadline)
		if left <= 0 || !sleepCtx(ctx, min(step, left)) {
			break
		}
		if peeker == nil {
			continue
		}
		if c, err := peeker.InboxPeek(ctx, key); err == nil && c.State == dedup.StateDone {
			in.inFlight.Add(-1)
			return in.duplicate(msg, key, c, o)
		}
	}
	return nil, fmt.Errorf("%w: consumer %q key %q is leased until %s", ErrInFlight, key.Consumer, key.Key, claim.Until.Format(time.RFC3339Nano))
}

// store is the configured store, of either mode.
func (in *Inbox) store() any {
	if in.cfg.TxStore != nil {
		return in.cfg.TxStore
	}
	return in.cfg.LeaseStore
}

func logFields(msg *message.Message, key dedup.Key) watermill.LogFields {
	return watermill.LogFields{"message_uuid": msg.UUID, "consumer": key.Consumer, "key": key.Key}
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
			return undo(buryAlreadyDead, nil)
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
		return buryAlreadyDead, nil
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
