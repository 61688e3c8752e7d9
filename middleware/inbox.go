package middleware

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/oncemill/oncemill/dedup"
	"github.com/oncemill/oncemill/dedup/dedupdriver"
	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/internal/typednil"
	"github.com/oncemill/oncemill/observe"
)

// InboxConfig configures an [Inbox]. Exactly one of TxStore and LeaseStore
// must be set; it chooses the mode. The first fields are the ones most
// consumers set; [InboxTuning] holds the performance knobs.
type InboxConfig struct {
	// TxStore claims keys in the handler's own transaction (transactional mode);
	// the handler reads it with the store's accessor, e.g.
	// postgres.Tx(msg.Context()).
	TxStore dedup.TxStore
	// LeaseStore claims keys as fenced leases (lease mode), for effects outside
	// the database; the handler passes IdempotencyKey(ctx) to the effect.
	LeaseStore dedup.LeaseStore
	// Key extracts the key from a message. Defaults to [DefaultKey].
	Key KeyFunc
	// Window is how long a key is remembered; it must exceed the longest time in
	// which the broker may redeliver. Defaults to 72 hours.
	Window time.Duration
	// Logger receives duplicates dropped (Debug), copies of dead keys dropped
	// (Info), failures and state changes (Error); watermill.NopLogger{} silences
	// it. Defaults to watermill.NewSlogLogger(nil), slog.Default() when the inbox
	// is built.
	Logger watermill.LoggerAdapter

	// Consumer scopes keys, so that two consumers of one topic keep separate
	// records. Defaults to the router handler's name.
	Consumer string
	// Lease is how long a lease-mode claim holds the key, renewed every Lease/3
	// while the handler runs; it must be shorter than Window. Lease mode only.
	// Defaults to 30 seconds.
	Lease time.Duration
	// FinishTimeout bounds the commit, complete or release that ends an attempt,
	// on a context detached from the message's (docs/guarantee.md, shutdown).
	// Defaults to 5 seconds.
	FinishTimeout time.Duration
	// DrainTimeout is how long a handler running at shutdown keeps a live context
	// before it is cancelled and rolled back (docs/guarantee.md, shutdown).
	// Defaults to 20 seconds.
	DrainTimeout time.Duration
	// Outbox, when set, writes the handler's produced messages into an outbox in
	// the inbox's transaction instead of returning them (forwarder.InboxOutbox).
	// Transactional mode only. Defaults to nil (returned to the router).
	Outbox func(ctx context.Context, produced []*message.Message) error
	// Hooks receive each delivery's outcome, timings and trace steps
	// (observe.InboxHook, observe.InboxTraceHook; observe/prom, observe/tracing).
	// Defaults to none.
	Hooks []observe.Hook

	// Tuning holds the performance knobs; their costs are measured in
	// docs/stores.md and docs/benchmarks.md. Defaults to the zero value.
	Tuning InboxTuning
}

// InboxTuning holds an [Inbox]'s performance knobs. Each trades a round
// trip, a wait or a guarantee for throughput; docs/stores.md ("Round trips
// per delivery") counts what each one costs and saves.
type InboxTuning struct {
	// SkipAttemptRecord leaves out the attempt record before the transaction for
	// every delivery, not only a broker-counted first one: one round trip less per
	// new key, but no crash-loop count and two round trips per duplicate.
	// Transactional mode. Defaults to false.
	SkipAttemptRecord bool
	// Pipeline says when the attempt record, BEGIN and the claim go out in one
	// round trip ([PipelineMode]). Transactional mode. Defaults to
	// PipelineAuto.
	Pipeline PipelineMode
	// Batch groups deliveries of different keys into one transaction (group
	// commit; [BatchConfig]), with a store that implements
	// dedupdriver.BatchClaimer. Defaults to off (Batch.MaxMessages 0).
	Batch BatchConfig
	// InFlightDelay is how long a delivery whose key another live claim holds
	// waits before it is nacked, cut short when that claim ends (lease mode and
	// dedup/twotier). Defaults to 1 second.
	InFlightDelay time.Duration
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
	if c.Tuning.InFlightDelay == 0 {
		c.Tuning.InFlightDelay = time.Second
	}
	if c.DrainTimeout == 0 {
		c.DrainTimeout = defaultDrainTimeout
	}
	c.Tuning.Batch.setDefaults()
	if c.Logger == nil {
		c.Logger = watermill.NewSlogLogger(nil)
	}
}

// Validate reports the first field that is missing or out of range.
func (c InboxConfig) Validate() error {
	c.setDefaults()
	switch {
	case c.TxStore != nil && typednil.Is(c.TxStore):
		return fmt.Errorf("middleware: InboxConfig.TxStore holds a nil %T: pass a store made by its New", c.TxStore)
	case c.LeaseStore != nil && typednil.Is(c.LeaseStore):
		return fmt.Errorf("middleware: InboxConfig.LeaseStore holds a nil %T: pass a store made by its New", c.LeaseStore)
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
	case !c.Tuning.Pipeline.valid():
		return fmt.Errorf("middleware: InboxConfig.Tuning.Pipeline is %s: use PipelineAuto, PipelineAlways or PipelineNever", c.Tuning.Pipeline)
	case c.Tuning.Pipeline != PipelineAuto && c.TxStore == nil:
		return fmt.Errorf("middleware: InboxConfig.Tuning.Pipeline %s needs TxStore: it pipelines the claim with its transaction's BEGIN; leave it PipelineAuto in lease mode", c.Tuning.Pipeline)
	case c.Outbox != nil && c.TxStore == nil:
		return errors.New("middleware: InboxConfig.Outbox needs TxStore: the outbox is written in the claim's transaction")
	case c.Tuning.InFlightDelay < 0:
		return fmt.Errorf("middleware: InboxConfig.Tuning.InFlightDelay must not be negative, got %s", c.Tuning.InFlightDelay)
	case c.DrainTimeout < 0:
		return fmt.Errorf("middleware: InboxConfig.DrainTimeout must not be negative, got %s", c.DrainTimeout)
	case c.Tuning.SkipAttemptRecord && c.TxStore == nil:
		return errors.New("middleware: InboxConfig.Tuning.SkipAttemptRecord needs TxStore: a lease-mode claim records no attempt to skip; leave it false")
	case c.Tuning.Batch.enabled() && !isBatchClaimer(c.TxStore):
		return errors.New("middleware: InboxConfig.Tuning.Batch needs a TxStore that implements dedupdriver.BatchClaimer (the PostgreSQL store)")
	}
	if err := checkConsumerName("InboxConfig.Consumer", c.Consumer); err != nil {
		return err
	}
	return c.Tuning.Batch.validate()
}

// MaxConsumerBytes is the longest consumer name an inbox or a poison
// middleware takes: what every table that stores one can index as it is
// (MySQL's inbox column holds 255 bytes).
const MaxConsumerBytes = 255

// checkConsumerName refuses a consumer name that the tables cannot store
// as it is: a NUL or another control character, invalid UTF-8, more than
// MaxConsumerBytes. The name scopes every key and is written with every
// attempt and dead letter, so that such a name would fail every delivery
// at run time; empty is allowed (the router handler's name).
func checkConsumerName(field, name string) error {
	switch {
	case len(name) > MaxConsumerBytes:
		return fmt.Errorf("middleware: %s is %d bytes long, more than %d: give a short name (the router handler's, say)", field, len(name), MaxConsumerBytes)
	case !utf8.ValidString(name):
		return fmt.Errorf("middleware: %s %q is not valid UTF-8: give a name of printable text", field, name)
	}
	for _, r := range name {
		if unicode.IsControl(r) {
			return fmt.Errorf("middleware: %s %q holds the control character %U: give a name of printable text", field, name, r)
		}
	}
	return nil
}

func isBatchClaimer(s dedup.TxStore) bool {
	_, ok := s.(dedupdriver.BatchClaimer)
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
//
// In transactional mode ([InboxConfig.TxStore]) the key is claimed in a
// database transaction that the handler also writes its effect through
// (postgres.Tx(msg.Context()) or sqlite.Tx(msg.Context())); claim, effect,
// produced messages and the done mark commit together. In lease mode
// ([InboxConfig.LeaseStore]) the key is claimed as a fenced lease for
// effects outside the database: [IdempotencyKey] hands the key to the
// effect, [LeaseToken] its fencing token, and the lease is renewed while
// the handler runs. A duplicate of a done key does not run the handler: the
// inbox returns the messages the first run produced, with their UUIDs, so
// that a crash between commit and publish loses nothing and the next
// consumer can deduplicate.
//
// A panic is recovered and counted as a failed attempt wrapping
// [ErrPanicked]; a deadline exceeded, such as Watermill's Timeout
// middleware sets, is counted too. Only the consumer shutting down is not
// ([ErrShutdown]): work that finished is committed on a context detached
// from the message's cancellation and bounded by
// [InboxConfig.FinishTimeout], and an attempt cut short is rolled back
// without counting. Each attempt is recorded before its handler runs, so a
// message whose deliveries kill the process is stopped after MaxAttempts
// without running again ([ErrCrashLoop]); a broker-counted first delivery
// is left to the broker's count (see [InboxTuning.SkipAttemptRecord]). A
// key that the poison
// middleware dead-lettered is recorded dead: its later copies are acked
// without running until the dead letter is replayed.
type Inbox struct {
	cfg   InboxConfig
	hooks observe.Hooks

	applied, duplicates, inFlight, failed         atomic.Int64
	panicked, abandonedN, crashLooped, deadCopies atomic.Int64
	infra, conflictRetries, othersReplays         atomic.Int64

	debts   debts
	running running
	turns   turns
	batcher *batcher // nil unless batching
	dups    dupRate
}

// NewInbox returns an inbox for cfg; cfg is copied, defaulted and validated.
func NewInbox(cfg InboxConfig) (*Inbox, error) {
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	in := &Inbox{cfg: cfg, hooks: observe.New(cfg.Hooks...)}
	if cfg.Tuning.Batch.enabled() {
		in.batcher = newBatcher(in, cfg.TxStore.(dedupdriver.BatchClaimer))
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
	if slot := slotOf(msg.Context()); slot != nil {
		slot.keyed = true
	}
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

// store is the configured store, of either mode.
func (in *Inbox) store() any {
	if in.cfg.TxStore != nil {
		return in.cfg.TxStore
	}
	return in.cfg.LeaseStore
}

func logFields(msg *message.Message, key dedup.Key) watermill.LogFields {
	return watermill.LogFields{"message_uuid": delivery.Bound(msg.UUID), "consumer": key.Consumer, "key": key.Key}
}
