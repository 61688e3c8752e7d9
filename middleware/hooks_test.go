package middleware_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/dedup/postgres"
	dlv "github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/middleware"
	"github.com/oncemill/oncemill/observe"
)

// recorder is a hook of every kind that keeps what it is told.
type recorder struct {
	mu        sync.Mutex
	attempts  []observe.InboxAttempt
	traced    []string // per attempt: the steps, in order
	dead      []observe.DeadLetter
	checks    []observe.BloomCheck
	out       []observe.Out
	unmatched int // attempts ended with a context the trace hook did not start
}

type traceKey struct{}

// trace is what the recorder's StartInboxAttempt puts in the context.
type trace struct{ steps []string }

func (r *recorder) StartInboxAttempt(ctx context.Context, consumer, topic string, msg *message.Message) context.Context {
	return context.WithValue(ctx, traceKey{}, &trace{})
}

func (r *recorder) OnInboxStep(ctx context.Context, step observe.Step) {
	if tr, ok := ctx.Value(traceKey{}).(*trace); ok {
		r.mu.Lock()
		tr.steps = append(tr.steps, string(step))
		r.mu.Unlock()
	}
}

func (r *recorder) OnInboxAttempt(ctx context.Context, a observe.InboxAttempt) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.attempts = append(r.attempts, a)
	tr, ok := ctx.Value(traceKey{}).(*trace)
	if !ok {
		r.unmatched++
		r.traced = append(r.traced, "")
		return
	}
	steps := ""
	for i, s := range tr.steps {
		if i > 0 {
			steps += ","
		}
		steps += s
	}
	r.traced = append(r.traced, steps)
}

func (r *recorder) OnDeadLetter(_ context.Context, d observe.DeadLetter) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.dead = append(r.dead, d)
}

func (r *recorder) OnBloomCheck(_ context.Context, c observe.BloomCheck) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.checks = append(r.checks, c)
}

func (r *recorder) OnMessageOut(_ context.Context, kind observe.Out, msg *message.Message) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.out = append(r.out, kind)
	msg.Metadata.Set("seen_by_hook", string(kind))
}

func (r *recorder) last() observe.InboxAttempt {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.attempts[len(r.attempts)-1]
}

// deadSink is a dead-letter publisher that keeps what it is given.
type deadSink struct {
	mu   sync.Mutex
	msgs []*message.Message
}

func (s *deadSink) Publish(_ string, msgs ...*message.Message) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.msgs = append(s.msgs, msgs...)
	return nil
}

func (s *deadSink) Close() error { return nil }

func hookMsg(key string) *message.Message {
	m := message.NewMessage(watermill.NewUUID(), []byte(key))
	m.Metadata.Set(dlv.IdempotencyKey, key) // present but empty: a key error
	m.Metadata.Set(dlv.Topic, "payments")
	m.SetContext(context.Background())
	return m
}

// TestHooksSeeEveryOutcome: the inbox tells its hooks each delivery's
// outcome, with the consumer and topic, the handler's and the store's
// time, and the steps of the attempt on the context the trace hook
// started; the poison middleware tells them each dead letter's reason and
// shows them the copy before it is published.
func TestHooksSeeEveryOutcome(t *testing.T) {
	txBackends(t, 4, func(t *testing.T, b txBackend) {
		rec := &recorder{}
		sink := &deadSink{}
		inbox, err := middleware.NewInbox(middleware.InboxConfig{TxStore: b.store, Consumer: "billing", Hooks: []observe.Hook{rec}})
		require.NoError(t, err)
		poison, err := middleware.NewPoison(middleware.PoisonConfig{
			Publisher: sink, Topic: "payments.dlq", MaxAttempts: 1, Consumer: "billing", Hooks: []observe.Hook{rec},
		})
		require.NoError(t, err)
		chain := poison.Middleware(inbox.Middleware(func(msg *message.Message) ([]*message.Message, error) {
			ctx := msg.Context()
			if _, ok := ctx.Value(traceKey{}).(*trace); !ok {
				return nil, errors.New("the handler does not see the trace hook's context")
			}
			switch key := middleware.IdempotencyKey(ctx); key {
			case "declined":
				return nil, errors.New("card declined")
			case "crash":
				panic("ledger crashed")
			default:
				time.Sleep(2 * time.Millisecond)
				return nil, b.effect(ctx, key)
			}
		}))
		run := func(key string) error {
			_, err := chain(hookMsg(key))
			return err
		}

		require.NoError(t, run("paid"))
		a := rec.last()
		require.Equal(t, observe.Applied, a.Outcome)
		require.Equal(t, "billing", a.Consumer)
		require.Equal(t, "payments", a.Topic)
		require.GreaterOrEqual(t, a.Handler, 2*time.Millisecond)
		require.Positive(t, a.Store)
		require.NoError(t, a.Err)

		require.NoError(t, run("paid"))
		require.Equal(t, observe.Duplicate, rec.last().Outcome)
		require.Zero(t, rec.last().Handler, "the handler did not run")

		require.NoError(t, run("declined"), "dead-lettered and acked")
		require.Equal(t, observe.Failed, rec.last().Outcome)
		require.ErrorContains(t, rec.last().Err, "card declined")
		require.NoError(t, run("declined"))
		require.Equal(t, observe.Dead, rec.last().Outcome)

		require.NoError(t, run("crash"))
		require.Equal(t, observe.Panicked, rec.last().Outcome)

		require.NoError(t, run(""), "a message with an empty key is dead-lettered as permanent")
		require.Equal(t, observe.Rejected, rec.last().Outcome)

		rec.mu.Lock()
		defer rec.mu.Unlock()
		require.Zero(t, rec.unmatched, "every attempt ends on the context its trace started")
		require.Equal(t, []string{"claimed,handled,committed", "", "claimed,handled", "", "claimed,handled", ""}, rec.traced)
		require.Equal(t, []observe.DeadLetter{
			{Consumer: "billing", Topic: "payments", Reason: observe.ReasonError, Attempts: 1},
			{Consumer: "billing", Topic: "payments", Reason: observe.ReasonPanic, Attempts: 1},
			{Consumer: "billing", Topic: "payments", Reason: observe.ReasonPermanent, Attempts: 1},
		}, rec.dead)
		require.Equal(t, []observe.Out{observe.OutDeadLetter, observe.OutDeadLetter, observe.OutDeadLetter}, rec.out)
		require.Len(t, sink.msgs, 3)
		require.Equal(t, string(observe.OutDeadLetter), sink.msgs[0].Metadata.Get("seen_by_hook"), "the hook saw the copy before it was published")
	})
}

// TestBloomHooksCountEachDuplicateOnce: with the same hooks on the Bloom
// prefilter and the inbox, a duplicate is reported once, by whichever of
// the two answered it, and every check says whether the key was surely
// new.
func TestBloomHooksCountEachDuplicateOnce(t *testing.T) {
	b := postgresBackend(t, 4)
	rec := &recorder{}
	inbox, err := middleware.NewInbox(middleware.InboxConfig{TxStore: b.store, Consumer: "ship", Hooks: []observe.Hook{rec}})
	require.NoError(t, err)
	bloom, err := middleware.NewBloom(middleware.BloomConfig{Store: b.store.(*postgres.Store), Consumer: "ship", ExpectedKeys: 1000, Hooks: []observe.Hook{rec}})
	require.NoError(t, err)
	chain := bloom.Middleware(inbox.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		ctx := msg.Context()
		return nil, b.effect(ctx, middleware.IdempotencyKey(ctx))
	}))
	for _, key := range []string{"o-1", "o-1", "o-2", "o-1"} {
		_, err := chain(hookMsg(key))
		require.NoError(t, err)
	}
	rec.mu.Lock()
	defer rec.mu.Unlock()
	var outcomes []observe.Outcome
	for _, a := range rec.attempts {
		outcomes = append(outcomes, a.Outcome)
	}
	require.Equal(t, []observe.Outcome{observe.Applied, observe.Duplicate, observe.Applied, observe.Duplicate}, outcomes)
	var surelyNew int
	for _, c := range rec.checks {
		require.Equal(t, "ship", c.Consumer)
		require.Equal(t, "payments", c.Topic)
		if c.SurelyNew {
			surelyNew++
		}
	}
	require.Len(t, rec.checks, 4)
	require.Equal(t, 2, surelyNew)
}
