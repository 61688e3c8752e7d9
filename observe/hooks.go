package observe

import (
	"context"

	"github.com/ThreeDotsLabs/watermill/message"
)

// Hooks is a list of hooks sorted by the interfaces they implement, once,
// so that a component calls each event's hooks without a type assertion
// per event. The zero value calls none. Components build one from their
// config's hook list with [New]; a hook author does not need it.
type Hooks struct {
	inbox      []InboxHook
	inboxTrace []InboxTraceHook
	dead       []DeadLetterHook
	retry      []RetryHook
	bloom      []BloomHook
	relay      []RelayHook
	lag        []OutboxLagHook
	out        []MessageOutHook
}

// New sorts hooks by the interfaces they implement; nil hooks and hooks
// that implement none are left out.
func New(hooks ...Hook) Hooks {
	var s Hooks
	for _, h := range hooks {
		if x, ok := h.(InboxHook); ok {
			s.inbox = append(s.inbox, x)
		}
		if x, ok := h.(InboxTraceHook); ok {
			s.inboxTrace = append(s.inboxTrace, x)
		}
		if x, ok := h.(DeadLetterHook); ok {
			s.dead = append(s.dead, x)
		}
		if x, ok := h.(RetryHook); ok {
			s.retry = append(s.retry, x)
		}
		if x, ok := h.(BloomHook); ok {
			s.bloom = append(s.bloom, x)
		}
		if x, ok := h.(RelayHook); ok {
			s.relay = append(s.relay, x)
		}
		if x, ok := h.(OutboxLagHook); ok {
			s.lag = append(s.lag, x)
		}
		if x, ok := h.(MessageOutHook); ok {
			s.out = append(s.out, x)
		}
	}
	return s
}

// ObservesInbox reports whether any hook wants inbox attempts or their
// traces, so that the inbox measures times only then.
func (s Hooks) ObservesInbox() bool { return len(s.inbox) > 0 || len(s.inboxTrace) > 0 }

// InboxAttempt calls every [InboxHook].
func (s Hooks) InboxAttempt(ctx context.Context, a InboxAttempt) {
	for _, h := range s.inbox {
		h.OnInboxAttempt(ctx, a)
	}
}

// StartInboxAttempt calls every [InboxTraceHook]'s StartInboxAttempt, each
// with the context the previous one returned, and returns the last.
func (s Hooks) StartInboxAttempt(ctx context.Context, consumer, topic string, msg *message.Message) context.Context {
	for _, h := range s.inboxTrace {
		ctx = h.StartInboxAttempt(ctx, consumer, topic, msg)
	}
	return ctx
}

// InboxStep calls every [InboxTraceHook]'s OnInboxStep.
func (s Hooks) InboxStep(ctx context.Context, step Step) {
	for _, h := range s.inboxTrace {
		h.OnInboxStep(ctx, step)
	}
}

// DeadLetter calls every [DeadLetterHook].
func (s Hooks) DeadLetter(ctx context.Context, d DeadLetter) {
	for _, h := range s.dead {
		h.OnDeadLetter(ctx, d)
	}
}

// Retry calls every [RetryHook].
func (s Hooks) Retry(ctx context.Context, r Retry) {
	for _, h := range s.retry {
		h.OnRetry(ctx, r)
	}
}

// BloomCheck calls every [BloomHook].
func (s Hooks) BloomCheck(ctx context.Context, c BloomCheck) {
	for _, h := range s.bloom {
		h.OnBloomCheck(ctx, c)
	}
}

// RelayBatch calls every [RelayHook].
func (s Hooks) RelayBatch(ctx context.Context, b RelayBatch) {
	for _, h := range s.relay {
		h.OnRelayBatch(ctx, b)
	}
}

// ObservesLag reports whether any hook wants the outbox's backlog.
func (s Hooks) ObservesLag() bool { return len(s.lag) > 0 }

// OutboxLag calls every [OutboxLagHook].
func (s Hooks) OutboxLag(ctx context.Context, l OutboxLag) {
	for _, h := range s.lag {
		h.OnOutboxLag(ctx, l)
	}
}

// MessageOut calls every [MessageOutHook].
func (s Hooks) MessageOut(ctx context.Context, kind Out, msg *message.Message) {
	for _, h := range s.out {
		h.OnMessageOut(ctx, kind, msg)
	}
}
