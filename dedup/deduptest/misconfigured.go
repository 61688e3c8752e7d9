package deduptest

import (
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/dedup"
	"github.com/oncemill/oncemill/middleware"
)

// misconfiguredDeliveries is how many deliveries of one message the
// Misconfigured subtest makes while the store is broken: more than the
// poison middleware's MaxAttempts, so that a count would dead-letter it.
const misconfiguredDeliveries = 5

// txMisconfigured: a store that cannot use its own tables (missing, not
// granted to its user, read only) fails for the infrastructure's fault,
// not the message's: every call's error wraps dedup.ErrUnavailable. Under
// the inbox and the poison middleware (MaxAttempts 2) a message delivered
// again and again meanwhile is held for PoisonConfig.OutageHold and then
// nacked every time, never dead-lettered and
// never counted, and once the store is repaired it is applied once.
func txMisconfigured(t *testing.T, x txSubject) {
	if len(x.b.Misconfigure) == 0 {
		t.Skip("the bundle has no Misconfigure")
	}
	for name, breakStore := range x.b.Misconfigure {
		t.Run(name, func(t *testing.T) {
			x.misconfigured(t, breakStore, dedup.Key{Consumer: "misconfigured-" + name, Key: "order-" + name})
		})
	}
}

func (x txSubject) misconfigured(t *testing.T, breakStore func(t *testing.T) (repair func(t *testing.T)), k dedup.Key) {
	ctx := t.Context()
	repair := breakStore(t)

	_, err := x.s.InboxStart(ctx, k, window)
	assert.ErrorIs(t, err, dedup.ErrUnavailable, "InboxStart on a store that cannot use its tables: %v", err)
	if tx, err := x.s.InboxBegin(ctx); err != nil {
		assert.ErrorIs(t, err, dedup.ErrUnavailable, "InboxBegin: %v", err)
	} else {
		_, err = tx.InboxClaim(ctx, k, window)
		assert.ErrorIs(t, err, dedup.ErrUnavailable, "InboxClaim: %v", err)
		require.NoError(t, tx.Rollback(ctx))
	}
	err = x.s.InboxFail(ctx, k, dedup.Failure{Err: "deduptest", At: time.Now()}, window)
	assert.ErrorIs(t, err, dedup.ErrUnavailable, "InboxFail: %v", err)

	in, err := middleware.NewInbox(middleware.InboxConfig{TxStore: x.s, Consumer: k.Consumer})
	require.NoError(t, err)
	var dead atomic.Int64
	poison, err := middleware.NewPoison(middleware.PoisonConfig{
		Inbox: in, MaxAttempts: 2, Topic: "deduptest-dead",
		Publisher:      publisherFunc(func(string, ...*message.Message) error { dead.Add(1); return nil }),
		InitialBackoff: time.Millisecond, MaxBackoff: time.Millisecond,
		// Each delivery is held in process while the store is broken,
		// then nacked once: a short hold keeps the subtest quick.
		OutageHold: 50 * time.Millisecond,
	})
	require.NoError(t, err)
	var runs atomic.Int64
	h := poison.Middleware(in.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		runs.Add(1)
		return nil, x.b.Effect(msg.Context(), carriedTx{}, k.Key)
	}))
	msg := message.NewMessage(watermill.NewUUID(), []byte("misconfigured"))
	msg.Metadata.Set("idempotency_key", k.Key)
	deliver := func() error {
		d := msg.Copy()
		d.SetContext(ctx)
		_, err := h(d)
		return err
	}

	nacked := 0
	for i := range misconfiguredDeliveries {
		err := deliver()
		if err != nil {
			nacked++
		}
		assert.True(t, middleware.IsInfrastructure(err), "delivery %d: the store's fault, not the message's: %v", i+1, err)
	}
	assert.Equal(t, misconfiguredDeliveries, nacked, "every delivery on the broken store is nacked")
	assert.Zero(t, dead.Load(), "dead letters while the store was broken")
	assert.Zero(t, runs.Load(), "the handler never ran")
	assert.Zero(t, in.Stats().Failed, "no attempt failed for the message's fault")
	ps := poison.Stats()
	assert.Zero(t, ps.DeadLetterFailed, "no dead-lettering was tried: %+v", ps)
	assert.GreaterOrEqual(t, ps.Infrastructure, int64(misconfiguredDeliveries), "every delivery failed as the infrastructure's fault (each held delivery's tries count): %+v", ps)

	repair(t)
	c, err := x.s.InboxStart(ctx, k, window)
	require.NoError(t, err)
	t.Logf("%d deliveries on the broken store: %d nacked, %d as the infrastructure's, %d dead-letterings tried and failed, %d dead letters, %d attempts counted by the store",
		misconfiguredDeliveries, nacked, ps.Infrastructure, ps.DeadLetterFailed, dead.Load(), c.Attempts-1)
	require.Zero(t, dead.Load(), "dead letters while the store was broken")
	require.Equal(t, dedup.StateNew, c.State)
	require.Equal(t, 1, c.Attempts, "none of the nacked deliveries was counted")
	require.NoError(t, x.s.InboxUnstart(ctx, k))
	require.NoError(t, deliver(), "the repaired store applies the message")
	require.NoError(t, deliver(), "and answers its copy as a duplicate")
	require.Equal(t, 1, x.effects(t, k), "applied once")
	require.Zero(t, dead.Load(), "dead letters")
	x.requireState(t, k, dedup.StateDone)
}

// publisherFunc is a message.Publisher that calls itself.
type publisherFunc func(topic string, msgs ...*message.Message) error

func (f publisherFunc) Publish(topic string, msgs ...*message.Message) error {
	return f(topic, msgs...)
}
func (publisherFunc) Close() error { return nil }
