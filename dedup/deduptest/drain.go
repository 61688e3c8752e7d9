package deduptest

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/dedup"
	"github.com/oncemill/oncemill/dedup/dedupdriver"
	"github.com/oncemill/oncemill/middleware"
)

// txDrain: a handler that is running when its Watermill router closes
// finishes under the inbox middleware, and what it did is committed: the
// effect is there once, the key is done and the message is acked, not
// nacked for a redelivery. Watermill cancels every in-flight message's
// context when the router closes, and database/sql rolls back a
// transaction whose context ends: the store's transaction must outlive the
// message's cancellation for the drain (middleware.InboxConfig.DrainTimeout)
// to keep its promise. Each of the inbox's paths to a transaction is run:
// with the attempt record, without it, and pipelined when the store can.
func txDrain(t *testing.T, x txSubject) {
	_, startClaimer := x.s.(dedupdriver.StartClaimer)
	_, beginClaimer := x.s.(dedupdriver.BeginClaimer)
	for _, v := range []struct {
		name      string
		cfg       middleware.InboxConfig
		pipelined bool
	}{
		{name: "AttemptRecord", cfg: middleware.InboxConfig{Tuning: middleware.InboxTuning{Pipeline: middleware.PipelineNever}}},
		{name: "SkipAttemptRecord", cfg: middleware.InboxConfig{Tuning: middleware.InboxTuning{SkipAttemptRecord: true, Pipeline: middleware.PipelineNever}}},
		{name: "PipelineAuto"},
		{name: "PipelineAlways", cfg: middleware.InboxConfig{Tuning: middleware.InboxTuning{Pipeline: middleware.PipelineAlways}}, pipelined: true},
		{name: "PipelineAlwaysSkipAttemptRecord", cfg: middleware.InboxConfig{Tuning: middleware.InboxTuning{Pipeline: middleware.PipelineAlways, SkipAttemptRecord: true}}, pipelined: true},
	} {
		t.Run(v.name, func(t *testing.T) {
			if v.pipelined && !startClaimer && !beginClaimer {
				t.Skipf("%T implements neither dedupdriver.StartClaimer nor dedupdriver.BeginClaimer", x.s)
			}
			x.drainOnce(t, v.cfg, dedup.Key{Consumer: "drain-" + v.name, Key: "order-" + v.name})
		})
	}
}

// drainOnce delivers one message of k to a router whose inbox has cfg,
// closes the router while the handler runs, and lets the handler write
// its effect only once the message's own context has ended.
func (x txSubject) drainOnce(t *testing.T, cfg middleware.InboxConfig, k dedup.Key) {
	cfg.TxStore, cfg.Consumer, cfg.DrainTimeout = x.s, k.Consumer, patience
	in, err := middleware.NewInbox(cfg)
	require.NoError(t, err)

	sub := &heldSubscriber{in: make(chan *message.Message, 1), closed: make(chan struct{})}
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 2 * patience}, watermill.NopLogger{})
	require.NoError(t, err)
	router.AddMiddleware(in.Middleware)
	running := make(chan struct{})
	var handlerErr error
	router.AddConsumerHandler(k.Consumer, "deduptest-drain", sub, func(msg *message.Message) error {
		close(running)
		select {
		case <-sub.delivered(msg).Done():
			// The router is closing: the message's own context ended.
		case <-msg.Context().Done():
			handlerErr = context.Cause(msg.Context())
			return handlerErr // the drain ended before the router closed
		case <-time.After(patience):
			handlerErr = errors.New("deduptest: the router did not cancel the message's context")
			return handlerErr
		}
		if err := msg.Context().Err(); err != nil {
			handlerErr = err
			return err
		}
		handlerErr = x.b.Effect(msg.Context(), carriedTx{}, k.Key)
		return handlerErr
	})
	ran := make(chan error, 1)
	go func() { ran <- router.Run(context.WithoutCancel(t.Context())) }()
	t.Cleanup(func() { _ = router.Close() })
	select {
	case <-router.Running():
	case <-time.After(patience):
		t.Fatal("the router did not start")
	}

	msg := message.NewMessage(watermill.NewUUID(), []byte("drain"))
	msg.Metadata.Set("idempotency_key", k.Key)
	sub.in <- msg
	select {
	case <-running:
	case <-time.After(patience):
		t.Fatal("the handler did not run")
	}
	began := time.Now()
	require.NoError(t, router.Close(), "the router closed within its CloseTimeout")
	require.NoError(t, <-ran)
	took := time.Since(began)

	require.NoError(t, handlerErr, "the handler's context and transaction outlived the message's cancellation")
	require.Equal(t, 1, x.effects(t, k), "the effect of the handler that ran through the close is committed")
	x.requireState(t, k, dedup.StateDone, "the key is done")
	select {
	case <-msg.Acked():
	case <-msg.Nacked():
		t.Fatal("the message was nacked: it would be redelivered")
	default:
		t.Fatal("the message was neither acked nor nacked")
	}
	st := in.Stats()
	require.Equal(t, int64(1), st.Applied, "applied: %+v", st)
	require.Zero(t, st.Abandoned, "abandoned: %+v", st)
	require.Less(t, took, patience, "the close waited for the handler, not for the drain budget")
}

// carriedTx stands for the transaction that a handler's context carries
// already, for [TxBundle.Effect] called from a handler: its WithTx returns
// the context as it is. It has no other method.
type carriedTx struct{ dedup.InboxTx }

func (carriedTx) WithTx(ctx context.Context) context.Context { return ctx }

// heldSubscriber is a message.Subscriber of one subscription that hands
// out the messages sent to in, each with the subscription's context, as
// the broker adapters do: the router cancels it when it closes. The test
// keeps the messages to see whether they were acked. It starts one
// goroutine per subscription, which ends with the subscription's context
// or Close.
type heldSubscriber struct {
	in chan *message.Message

	mu     sync.Mutex
	ctxs   map[*message.Message]context.Context
	closed chan struct{}
	once   sync.Once
}

func (s *heldSubscriber) Subscribe(ctx context.Context, _ string) (<-chan *message.Message, error) {
	out := make(chan *message.Message)
	go func() {
		defer close(out)
		for {
			select {
			case <-ctx.Done():
				return
			case <-s.closed:
				return
			case msg := <-s.in:
				s.mu.Lock()
				if s.ctxs == nil {
					s.ctxs = map[*message.Message]context.Context{}
				}
				s.ctxs[msg] = ctx
				s.mu.Unlock()
				msg.SetContext(ctx)
				select {
				case out <- msg:
				case <-ctx.Done():
					return
				case <-s.closed:
					return
				}
			}
		}
	}()
	return out, nil
}

// delivered returns the context msg was delivered with. The router hands
// the handler a message of the same UUID; the inbox replaces its context.
func (s *heldSubscriber) delivered(msg *message.Message) context.Context {
	s.mu.Lock()
	defer s.mu.Unlock()
	for m, ctx := range s.ctxs {
		if m.UUID == msg.UUID {
			return ctx
		}
	}
	return context.Background()
}

func (s *heldSubscriber) Close() error {
	s.once.Do(func() { close(s.closed) })
	return nil
}
