package middleware_test

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	wmmiddleware "github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/dedup"
	"github.com/oncemill/oncemill/dedup/memory"
	"github.com/oncemill/oncemill/dedup/postgres"
	dlv "github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/internal/testing/pgtest"
	"github.com/oncemill/oncemill/middleware"
	"github.com/oncemill/oncemill/observe"
)

// seenAttempt is what a test compares of an inbox attempt the recorder
// kept: its labels, its outcome and whether the handler ran. The times
// and the error are checked apart.
type seenAttempt struct {
	Consumer, Topic string
	Outcome         observe.Outcome
	Ran             bool
}

// seen returns copies of what rec was told.
func (r *recorder) seen() ([]seenAttempt, []observe.DeadLetter, []observe.BloomCheck, []observe.Out) {
	r.mu.Lock()
	defer r.mu.Unlock()
	var attempts []seenAttempt
	for _, a := range r.attempts {
		attempts = append(attempts, seenAttempt{Consumer: a.Consumer, Topic: a.Topic, Outcome: a.Outcome, Ran: a.Handler > 0})
	}
	return attempts,
		append([]observe.DeadLetter(nil), r.dead...),
		append([]observe.BloomCheck(nil), r.checks...),
		append([]observe.Out(nil), r.out...)
}

// errs returns the errors of the attempts rec kept, in order.
func (r *recorder) errs() []error {
	r.mu.Lock()
	defer r.mu.Unlock()
	var errs []error
	for _, a := range r.attempts {
		errs = append(errs, a.Err)
	}
	return errs
}

// hookChain is a poison middleware (MaxAttempts maxAttempts) in front of
// mws and the inbox of cfg, both reporting to one recorder, dead-lettering
// into a sink, as the README lays them out; the handler's runs are
// counted.
type hookChain struct {
	rec   *recorder
	sink  *deadSink
	inbox *middleware.Inbox
	runs  atomic.Int32
	h     message.HandlerFunc
}

func newHookChain(t *testing.T, cfg middleware.InboxConfig, maxAttempts int, handler message.HandlerFunc, mws ...message.HandlerMiddleware) *hookChain {
	t.Helper()
	c := &hookChain{rec: &recorder{}, sink: &deadSink{}}
	cfg.Consumer, cfg.Hooks = "billing", []observe.Hook{c.rec}
	var err error
	c.inbox, err = middleware.NewInbox(cfg)
	require.NoError(t, err)
	poison, err := middleware.NewPoison(middleware.PoisonConfig{
		Publisher: c.sink, Topic: "payments.dlq", MaxAttempts: maxAttempts, Consumer: "billing",
		InitialBackoff: time.Millisecond, MaxBackoff: time.Millisecond, Hooks: []observe.Hook{c.rec},
		// Each run is one delivery and one attempt: a failure or an
		// outage is nacked at once, for the test to deliver again.
		InProcessRetries: middleware.NoInProcessRetries, OutageHold: time.Nanosecond,
	})
	require.NoError(t, err)
	h := c.inbox.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		c.runs.Add(1)
		return handler(msg)
	})
	for i := len(mws) - 1; i >= 0; i-- {
		h = mws[i](h)
	}
	c.h = poison.Middleware(h)
	return c
}

func (c *hookChain) run(msg *message.Message) ([]*message.Message, error) { return c.h(msg) }

// deadLetters returns copies of the dead letters the sink got.
func (c *hookChain) deadLetters() []*message.Message {
	c.sink.mu.Lock()
	defer c.sink.mu.Unlock()
	return append([]*message.Message(nil), c.sink.msgs...)
}

// TestHooksSeeInFlightOncePerDelivery: while one delivery holds a key's
// lease, each other delivery of the key is nacked (not dead-lettered, not
// run) and the hooks see it in flight once; the holder is then applied and
// a later copy is a duplicate.
func TestHooksSeeInFlightOncePerDelivery(t *testing.T) {
	t.Parallel()
	leaseStores(t, func(t *testing.T, store dedup.LeaseStore) {
		entered, release := make(chan struct{}), make(chan struct{})
		var once sync.Once
		c := newHookChain(t, middleware.InboxConfig{LeaseStore: store, Tuning: middleware.InboxTuning{InFlightDelay: 10 * time.Millisecond}}, 1,
			func(msg *message.Message) ([]*message.Message, error) {
				once.Do(func() { close(entered) })
				<-release
				return []*message.Message{message.NewMessage("receipt-1", nil)}, nil
			})
		holder := make(chan error, 1)
		go func() {
			_, err := c.run(hookMsg("pay-1"))
			holder <- err
		}()
		<-entered

		const copies = 2
		for i := range copies {
			_, err := c.run(hookMsg("pay-1"))
			require.ErrorIs(t, err, middleware.ErrInFlight, "copy %d is nacked", i)
			attempts, _, _, _ := c.rec.seen()
			require.Len(t, attempts, i+1, "one report per in-flight copy")
			require.Equal(t, seenAttempt{Consumer: "billing", Topic: "payments", Outcome: observe.InFlight}, attempts[i])
		}
		close(release)
		require.NoError(t, <-holder)
		out, err := c.run(hookMsg("pay-1"))
		require.NoError(t, err)
		require.Len(t, out, 1)
		require.Equal(t, "receipt-1", out[0].UUID)

		attempts, dead, _, outs := c.rec.seen()
		require.Equal(t, []seenAttempt{
			{Consumer: "billing", Topic: "payments", Outcome: observe.InFlight},
			{Consumer: "billing", Topic: "payments", Outcome: observe.InFlight},
			{Consumer: "billing", Topic: "payments", Outcome: observe.Applied, Ran: true},
			{Consumer: "billing", Topic: "payments", Outcome: observe.Duplicate},
		}, attempts)
		errs := c.rec.errs()
		require.ErrorIs(t, errs[0], middleware.ErrInFlight)
		require.ErrorIs(t, errs[1], middleware.ErrInFlight)
		require.NoError(t, errs[2])
		require.NoError(t, errs[3])
		require.Empty(t, dead, "an in-flight copy is never dead-lettered")
		require.Empty(t, outs)
		require.Empty(t, c.deadLetters())
		require.Equal(t, int32(1), c.runs.Load(), "only the holder ran")
		require.Equal(t, middleware.InboxStats{Applied: 1, Duplicates: 1, InFlight: copies}, c.inbox.Stats())
	})
}

// TestHooksSeeBloomFalsePositive: the prefilter is warmed with a key whose
// record is then swept; a new delivery of it finds the filter saying
// "maybe seen" and the store saying new, and the hooks see a false
// positive, then the inbox applying it. A key the store still holds is a
// duplicate (no false positive), and a key never seen is surely new.
func TestHooksSeeBloomFalsePositive(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pgtest.Pool(t, 4)
	schema := pgtest.Schema(t, pool)
	b := postgresBackendIn(t, pool, schema)
	rec := &recorder{}
	inbox, err := middleware.NewInbox(middleware.InboxConfig{TxStore: b.store, Consumer: "ship", Hooks: []observe.Hook{rec}})
	require.NoError(t, err)
	var runs atomic.Int32
	handler := inbox.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		runs.Add(1)
		ctx := msg.Context()
		return nil, b.effect(ctx, middleware.IdempotencyKey(ctx))
	})
	// Applied before this instance started.
	for _, key := range []string{"o-swept", "o-kept"} {
		_, err := handler(hookMsg(key))
		require.NoError(t, err)
	}
	bloom, err := middleware.NewBloom(middleware.BloomConfig{Store: b.store.(*postgres.Store), Consumer: "ship", ExpectedKeys: 1000, Hooks: []observe.Hook{rec}})
	require.NoError(t, err)
	n, err := bloom.Warm(ctx)
	require.NoError(t, err)
	require.Equal(t, 2, n)
	// o-swept's window passes: the janitor deletes its record, and the
	// filter still has it.
	tag, err := pool.Exec(ctx, `DELETE FROM "`+schema+`".inbox WHERE consumer = 'ship' AND key = 'o-swept'`)
	require.NoError(t, err)
	require.Equal(t, int64(1), tag.RowsAffected())

	chain := bloom.Middleware(handler)
	for _, key := range []string{"o-swept", "o-kept", "o-new"} {
		_, err := chain(hookMsg(key))
		require.NoError(t, err)
	}

	attempts, dead, checks, _ := rec.seen()
	require.Equal(t, []observe.BloomCheck{
		{Consumer: "ship", Topic: "payments", FalsePositive: true},
		{Consumer: "ship", Topic: "payments"},
		{Consumer: "ship", Topic: "payments", SurelyNew: true},
	}, checks)
	require.Equal(t, []seenAttempt{
		{Consumer: "ship", Topic: "payments", Outcome: observe.Applied, Ran: true}, // o-swept, before the filter
		{Consumer: "ship", Topic: "payments", Outcome: observe.Applied, Ran: true}, // o-kept, before the filter
		{Consumer: "ship", Topic: "payments", Outcome: observe.Applied, Ran: true}, // o-swept, the false positive
		{Consumer: "ship", Topic: "payments", Outcome: observe.Duplicate},          // o-kept, answered by the filter's read
		{Consumer: "ship", Topic: "payments", Outcome: observe.Applied, Ran: true}, // o-new
	}, attempts)
	require.Empty(t, dead)
	require.Equal(t, int32(4), runs.Load(), "the swept key ran again, the kept one did not")
	require.Equal(t, 4, b.effects(t))
	require.Equal(t, "done", b.status(t, "ship", "o-swept"))
	require.Equal(t, middleware.BloomStats{Checks: 3, SurelyNew: 1, MaybeSeen: 2, Duplicates: 1, FalsePositives: 1}, bloom.Stats())
}

// TestHooksSeeDeadlineDeadLetter: a handler that overruns Watermill's
// Timeout middleware, placed between the poison middleware and the inbox,
// fails its attempt; with MaxAttempts 1 it is dead-lettered, and the hooks
// see the failed attempt and a dead letter for the deadline.
func TestHooksSeeDeadlineDeadLetter(t *testing.T) {
	t.Parallel()
	txBackends(t, 4, func(t *testing.T, b txBackend) {
		c := newHookChain(t, middleware.InboxConfig{TxStore: b.store}, 1, func(msg *message.Message) ([]*message.Message, error) {
			ctx := msg.Context()
			if err := b.effect(ctx, middleware.IdempotencyKey(ctx)); err != nil {
				return nil, err
			}
			<-ctx.Done() // the card network never answers
			return nil, fmt.Errorf("card network: %w", ctx.Err())
		}, wmmiddleware.Timeout(50*time.Millisecond))

		_, err := c.run(hookMsg("order-slow"))
		require.NoError(t, err, "dead-lettered and acked")

		attempts, dead, _, outs := c.rec.seen()
		require.Equal(t, []seenAttempt{{Consumer: "billing", Topic: "payments", Outcome: observe.Failed, Ran: true}}, attempts)
		require.ErrorIs(t, c.rec.errs()[0], context.DeadlineExceeded)
		require.Equal(t, []observe.DeadLetter{{Consumer: "billing", Topic: "payments", Reason: observe.ReasonDeadline, Attempts: 1}}, dead)
		require.Equal(t, []observe.Out{observe.OutDeadLetter}, outs)
		letters := c.deadLetters()
		require.Len(t, letters, 1)
		md := letters[0].Metadata
		require.Contains(t, md.Get(dlv.DeadError), "deadline exceeded")
		require.Equal(t, "false", md.Get(dlv.DeadPermanent))
		require.Equal(t, "billing", md.Get(dlv.DeadConsumer))
		require.Equal(t, "order-slow", md.Get(dlv.DeadKey))
		require.Equal(t, "1", md.Get(dlv.DeadAttempts))
		require.Equal(t, int32(1), c.runs.Load())
		require.Zero(t, b.effects(t), "the overrun attempt is rolled back")
		require.Equal(t, "dead", b.status(t, "billing", "order-slow"))
	})
}

// TestHooksSeeUndecodableDeadLetter: a message its adapter could not
// decode goes to the dead-letter queue without reaching the inbox; the
// hooks see a dead letter for it and no inbox attempt.
func TestHooksSeeUndecodableDeadLetter(t *testing.T) {
	t.Parallel()
	store := memory.New()
	c := newHookChain(t, middleware.InboxConfig{LeaseStore: store}, 3, func(*message.Message) ([]*message.Message, error) {
		return nil, nil
	})
	msg := hookMsg("order-garbled")
	msg.Metadata.Set(dlv.DecodeError, "proto: cannot parse invalid wire-format data")
	_, err := c.run(msg)
	require.NoError(t, err, "dead-lettered and acked")

	attempts, dead, _, outs := c.rec.seen()
	require.Empty(t, attempts, "the inbox never saw it")
	require.Equal(t, []observe.DeadLetter{{Consumer: "billing", Topic: "payments", Reason: observe.ReasonUndecodable, Attempts: 1}}, dead)
	require.Equal(t, []observe.Out{observe.OutDeadLetter}, outs)
	letters := c.deadLetters()
	require.Len(t, letters, 1)
	md := letters[0].Metadata
	require.Contains(t, md.Get(dlv.DeadError), middleware.ErrUndecodable.Error())
	require.Contains(t, md.Get(dlv.DeadError), "invalid wire-format data")
	require.Equal(t, "true", md.Get(dlv.DeadPermanent))
	require.Equal(t, "billing", md.Get(dlv.DeadConsumer))
	require.Equal(t, "payments", md.Get(dlv.DeadTopic))
	require.Equal(t, "order-garbled", md.Get(dlv.DeadKey))
	require.Zero(t, c.runs.Load(), "the handler never ran")
	require.Zero(t, store.Len(), "the store was never touched")
}

// TestHooksSeeCrashLoopDeadLetter: the inbox's records show MaxAttempts
// attempts of a key that started and never finished (their process died);
// the next delivery is dead-lettered without running the handler, and the
// hooks see a crash loop, from the inbox and as the dead letter's reason.
func TestHooksSeeCrashLoopDeadLetter(t *testing.T) {
	t.Parallel()
	txBackends(t, 4, func(t *testing.T, b txBackend) {
		key := dedup.Key{Consumer: "billing", Key: "order-oom"}
		for range 3 {
			_, err := b.store.InboxStart(context.Background(), key, time.Hour)
			require.NoError(t, err)
		}
		c := newHookChain(t, middleware.InboxConfig{TxStore: b.store}, 3, func(msg *message.Message) ([]*message.Message, error) {
			ctx := msg.Context()
			return nil, b.effect(ctx, middleware.IdempotencyKey(ctx))
		})
		_, err := c.run(hookMsg(key.Key))
		require.NoError(t, err, "dead-lettered and acked")

		attempts, dead, _, outs := c.rec.seen()
		require.Equal(t, []seenAttempt{{Consumer: "billing", Topic: "payments", Outcome: observe.CrashLoop}}, attempts)
		require.ErrorIs(t, c.rec.errs()[0], middleware.ErrCrashLoop)
		require.Equal(t, []observe.DeadLetter{{Consumer: "billing", Topic: "payments", Reason: observe.ReasonCrashLoop, Attempts: 3}}, dead)
		require.Equal(t, []observe.Out{observe.OutDeadLetter}, outs)
		letters := c.deadLetters()
		require.Len(t, letters, 1)
		md := letters[0].Metadata
		require.Contains(t, md.Get(dlv.DeadError), middleware.ErrCrashLoop.Error())
		require.Equal(t, "true", md.Get(dlv.DeadPermanent))
		require.Equal(t, "3", md.Get(dlv.DeadAttempts))
		require.Equal(t, key.Key, md.Get(dlv.DeadKey))
		require.Zero(t, c.runs.Load(), "the handler never ran")
		require.Zero(t, b.effects(t))
		require.Equal(t, "dead", b.status(t, key.Consumer, key.Key))
		require.Equal(t, int64(1), c.inbox.Stats().CrashLooped)
	})
}

// TestHooksSeeReplayForOtherConsumer: a replay from the dead-letter queue
// meant for another consumer of the topic is acked without running, and
// the hooks see it as another consumer's; the same replay meant for this
// consumer runs.
func TestHooksSeeReplayForOtherConsumer(t *testing.T) {
	t.Parallel()
	txBackends(t, 4, func(t *testing.T, b txBackend) {
		c := newHookChain(t, middleware.InboxConfig{TxStore: b.store}, 3, func(msg *message.Message) ([]*message.Message, error) {
			ctx := msg.Context()
			return nil, b.effect(ctx, middleware.IdempotencyKey(ctx))
		})
		// ledger-b dead-lettered pay-r in the same store, and its replay
		// was granted.
		buryIn(t, b.store, dedup.Key{Consumer: "ledger-b", Key: "pay-r"})
		grant, err := dedup.NewReplayGrant()
		require.NoError(t, err)
		granted, err := b.store.InboxGrantReplay(context.Background(), dedup.Key{Consumer: "ledger-b", Key: "pay-r"}, grant)
		require.NoError(t, err)
		require.True(t, granted)
		replay := func(consumer string) *message.Message {
			msg := hookMsg("pay-r")
			msg.Metadata.Set(dlv.Replay, grant)
			msg.Metadata.Set(dlv.ReplayConsumer, consumer)
			return msg
		}
		_, err = c.run(replay("ledger-b"))
		require.NoError(t, err, "acked")
		require.Zero(t, c.runs.Load(), "another consumer's replay does not run")
		require.Zero(t, b.effects(t))
		require.Empty(t, b.status(t, "billing", "pay-r"), "nor does it reach the store")

		_, err = c.run(replay("billing"))
		require.NoError(t, err)

		attempts, dead, _, outs := c.rec.seen()
		require.Equal(t, []seenAttempt{
			{Consumer: "billing", Topic: "payments", Outcome: observe.OtherConsumer},
			{Consumer: "billing", Topic: "payments", Outcome: observe.Applied, Ran: true},
		}, attempts)
		require.NoError(t, c.rec.errs()[0])
		require.Empty(t, dead)
		require.Empty(t, outs)
		require.Empty(t, c.deadLetters())
		require.Equal(t, int32(1), c.runs.Load(), "this consumer's replay runs")
		require.Equal(t, 1, b.effects(t))
		require.Equal(t, "done", b.status(t, "billing", "pay-r"))
		require.Equal(t, int64(1), c.inbox.Stats().OthersReplays)
	})
}
