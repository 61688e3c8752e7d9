// Package observe is how oncemill's parts report what they do, for metrics
// and traces, without depending on a metrics or tracing library.
//
// A hook is any value that implements one or more of the interfaces below.
// The middlewares (InboxConfig.Hooks, PoisonConfig.Hooks,
// BloomConfig.Hooks) and the outbox (RelayConfig.Hooks, and
// forwarder.WithHooks for TxPublisher and InboxOutbox) take a list of
// hooks and call, for each event, the hooks that implement its interface,
// in the order given: the shape of franz-go's kgo.Hook. Give the same
// hooks to the Bloom prefilter and the inbox: a duplicate the prefilter
// answers is reported as the inbox's, so that it is counted once either
// way. Package observe/prom turns them into Prometheus
// metrics and package observe/tracing into OpenTelemetry spans.
//
// Hooks are called synchronously on the message's path: they must be
// cheap, must not block, and must be safe for concurrent use. The events
// are passed by value; a hook that keeps one keeps a copy. Labels taken
// from events (consumer, topic, outcome, reason) have bounded cardinality;
// keys and UUIDs are never part of an event.
package observe

import (
	"context"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
)

// Hook is a value implementing one or more of this package's hook
// interfaces. A hook implementing none of them is ignored.
type Hook any

// Outcome is what became of one delivery through the inbox.
type Outcome string

// The outcomes of a delivery through the inbox.
const (
	// Applied: the handler ran and its effect committed (transactional
	// mode) or was recorded complete (lease mode).
	Applied Outcome = "applied"
	// Duplicate: the key was done; the handler did not run and the
	// message was acked with the stored result.
	Duplicate Outcome = "duplicate"
	// InFlight: another delivery held the key; the message was nacked
	// (or answered as a duplicate once the holder finished).
	InFlight Outcome = "in_flight"
	// Failed: the handler (or its commit) failed for the message's fault;
	// the attempt was counted and the message nacked.
	Failed Outcome = "failed"
	// Panicked: the handler panicked; counted like Failed.
	Panicked Outcome = "panicked"
	// Dead: the key was dead-lettered before; the copy was acked without
	// running the handler.
	Dead Outcome = "dead"
	// CrashLoop: every recent attempt died with its process; the message
	// goes to the dead-letter queue without running the handler.
	CrashLoop Outcome = "crash_loop"
	// Abandoned: the consumer shut down during the attempt, which was
	// rolled back and not counted.
	Abandoned Outcome = "abandoned"
	// Unavailable: the store (or the infrastructure) failed; nothing was
	// counted and the message was nacked.
	Unavailable Outcome = "unavailable"
	// Rejected: the message had no usable key or consumer; it was
	// returned as a permanent error without reaching the store.
	Rejected Outcome = "rejected"
	// OtherConsumer: a replay from the dead-letter queue meant for another
	// consumer of the topic; acked without running the handler.
	OtherConsumer Outcome = "other_consumer"
)

// InboxAttempt describes one delivery through the inbox, once it is over.
type InboxAttempt struct {
	// Consumer is the inbox's consumer name; Topic the topic the message
	// came from (empty when the router does not say).
	Consumer, Topic string
	// Outcome is what became of the delivery.
	Outcome Outcome
	// Handler is how long the handler ran; zero when it did not run.
	Handler time.Duration
	// Store is the time spent in the inbox outside the handler: the
	// store's statements (attempt record, begin, claim, complete, commit
	// or rollback) and, for InFlight, the wait for the other delivery.
	Store time.Duration
	// Err is the error the delivery ended with, if any.
	Err error
}

// InboxHook is told about every delivery through the inbox. ctx is the
// message's context as the attempt left it (with the span an
// [InboxTraceHook] started).
type InboxHook interface {
	OnInboxAttempt(ctx context.Context, a InboxAttempt)
}

// InboxTraceHook starts the trace of a delivery through the inbox: it
// returns the context the attempt runs with (the handler sees it), and it
// is told of each step. The attempt's end is reported to
// [InboxHook.OnInboxAttempt] with a context derived from the one it
// returned, so a hook that implements both ends there what it started.
type InboxTraceHook interface {
	StartInboxAttempt(ctx context.Context, consumer, topic string, msg *message.Message) context.Context
	// OnInboxStep reports a step of the attempt: [StepClaimed],
	// [StepHandled], [StepCommitted].
	OnInboxStep(ctx context.Context, step Step)
}

// Step is a step of an inbox attempt.
type Step string

// The steps of an inbox attempt.
const (
	StepClaimed   Step = "claimed"
	StepHandled   Step = "handled"
	StepCommitted Step = "committed"
)

// Reason classifies why a message was dead-lettered.
type Reason string

// The reasons a message is dead-lettered.
const (
	// ReasonError: the handler returned an error MaxAttempts times.
	ReasonError Reason = "error"
	// ReasonPanic: the last attempt panicked.
	ReasonPanic Reason = "panic"
	// ReasonDeadline: the last attempt ran out of time.
	ReasonDeadline Reason = "deadline"
	// ReasonCrashLoop: every recent attempt died with its process.
	ReasonCrashLoop Reason = "crash_loop"
	// ReasonPermanent: the handler said the message can never succeed
	// (middleware.Permanent), or its key was unusable.
	ReasonPermanent Reason = "permanent"
	// ReasonUndecodable: the adapter could not decode the message.
	ReasonUndecodable Reason = "undecodable"
)

// DeadLetter describes a message the poison middleware dead-lettered.
type DeadLetter struct {
	Consumer, Topic string
	Reason          Reason
	// Attempts is the number of attempts counted.
	Attempts int
}

// DeadLetterHook is told about every message dead-lettered, once the
// dead-letter publish succeeded.
type DeadLetterHook interface {
	OnDeadLetter(ctx context.Context, d DeadLetter)
}

// Retry is a message a poison middleware parked for a delayed retry
// (PoisonConfig.Retries).
type Retry struct {
	// Consumer and Topic are the consumer and topic it is parked for.
	Consumer, Topic string
	// Attempts is how many attempts of it failed; 0 when Behind.
	Attempts int
	// Delay is how long it waits before it may be handed back.
	Delay time.Duration
	// Behind is true for a message that did not fail itself: it waits
	// behind a parked message of its ordering key.
	Behind bool
}

// RetryHook is told of every message parked for a delayed retry.
type RetryHook interface {
	OnRetry(ctx context.Context, r Retry)
}

// BloomCheck describes one message through the Bloom prefilter.
type BloomCheck struct {
	Consumer, Topic string
	// SurelyNew: the filter proved the key new, and the pre-check was
	// skipped.
	SurelyNew bool
	// FalsePositive: the filter said the key may be known, and the store
	// found it new.
	FalsePositive bool
}

// BloomHook is told about every message through the Bloom prefilter.
type BloomHook interface {
	OnBloomCheck(ctx context.Context, c BloomCheck)
}

// RelayBatch describes one batch of the outbox relay.
type RelayBatch struct {
	// Outbox is the outbox table as schema.table, unquoted (for example
	// oncemill.outbox): the outbox label of the Prometheus metrics.
	Outbox string
	// Rows is how many rows were published and deleted; zero for an
	// empty or failed batch.
	Rows int
	// Duration is how long the batch took, publish included.
	Duration time.Duration
	// Err is the batch's error, if it failed.
	Err error
}

// RelayHook is told about every batch of the relay that took rows or
// failed (not about empty looks).
type RelayHook interface {
	OnRelayBatch(ctx context.Context, b RelayBatch)
}

// OutboxLag is the relay's backlog, measured now and then.
type OutboxLag struct {
	// Outbox is the outbox table as schema.table, unquoted, as in
	// [RelayBatch].
	Outbox string
	// Pending rows, of which Waiting wait on an open transaction.
	Pending, Waiting int
	// OldestAge is the age of the oldest pending row.
	OldestAge time.Duration
	// Scheduled counts the rows written with a due time that wait in
	// the outbox's scheduled table, not among Pending.
	Scheduled int
}

// OutboxLagHook is told the relay's backlog every RelayConfig.LagInterval.
type OutboxLagHook interface {
	OnOutboxLag(ctx context.Context, l OutboxLag)
}

// MessageOutHook sees every message oncemill sends on: an event written to
// the outbox (ctx is the writer's), a row the relay publishes (ctx is the
// relay's; the row's own trace context, if any, is in the message's
// metadata), a dead letter (ctx is the delivery's). It may add metadata,
// such as trace context; it must not remove any.
type MessageOutHook interface {
	OnMessageOut(ctx context.Context, kind Out, msg *message.Message)
}

// Out is the kind of message a [MessageOutHook] sees.
type Out string

// The kinds of message a MessageOutHook sees.
const (
	OutOutboxWrite Out = "outbox_write"
	OutRelay       Out = "relay"
	// OutDeadLetter: a dead letter. A replay (dlq.Store.Replay, a
	// dlq.ReplaySubscriber) rebuilds the message from the dead letter's
	// metadata, so the trace context put there goes on with it.
	OutDeadLetter Out = "dead_letter"
)
