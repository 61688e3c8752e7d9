package middleware_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/dedup"
	"github.com/oncemill/oncemill/dedup/postgres"
	dlv "github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/internal/testing/netfault"
	"github.com/oncemill/oncemill/internal/testing/pgtest"
	"github.com/oncemill/oncemill/middleware"
)

// batchKeys records the keys of every batch a PostgreSQL store claims.
type batchKeys struct {
	*postgres.Store
	mu      sync.Mutex
	batches [][]string
}

func (s *batchKeys) InboxBeginClaimBatch(ctx context.Context, consumer string, keys []string, window time.Duration) (dedup.InboxTx, []dedup.Claim, error) {
	s.mu.Lock()
	s.batches = append(s.batches, slices.Clone(keys))
	s.mu.Unlock()
	return s.Store.InboxBeginClaimBatch(ctx, consumer, keys, window)
}

// claimed returns the batches claimed so far.
func (s *batchKeys) claimed() [][]string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.batches)
}

// largest is the size of the largest batch claimed so far.
func (s *batchKeys) largest() int {
	n := 0
	for _, b := range s.claimed() {
		n = max(n, len(b))
	}
	return n
}

// errNoEffect, returned by a batchRig's handler, makes the rig's handler
// return nil without writing the key's effect.
var errNoEffect = errors.New("no effect")

// batchRig is a Poison middleware in front of a batching PostgreSQL inbox,
// called as a router calls them, with the deliveries of many keys at once:
// a delivery is a message with the key's own UUID, so that a redelivery is
// the same message again, as a broker redelivers it.
type batchRig struct {
	b      txBackend
	store  *batchKeys
	inbox  *middleware.Inbox
	poison *middleware.Poison
	h      message.HandlerFunc

	mu   sync.Mutex
	dead []*message.Message
	runs map[string]int // handler runs by key
	ids  map[string]string
}

// newBatchRig wires poison in front of an inbox configured by icfg (its
// TxStore set to b's store, recorded) around handler, which runs after
// the rig has counted the run and before it writes the key's effect.
func newBatchRig(t *testing.T, b txBackend, pcfg middleware.PoisonConfig, icfg middleware.InboxConfig, handler func(key string, run int, msg *message.Message) error) *batchRig {
	t.Helper()
	rig := &batchRig{b: b, store: &batchKeys{Store: b.store.(*postgres.Store)}, runs: map[string]int{}, ids: map[string]string{}}
	pcfg.Publisher = publisherFunc(func(_ string, msgs ...*message.Message) error {
		rig.mu.Lock()
		rig.dead = append(rig.dead, msgs...)
		rig.mu.Unlock()
		return nil
	})
	pcfg.Topic = deadTopic
	if pcfg.InitialBackoff == 0 {
		pcfg.InitialBackoff, pcfg.MaxBackoff = time.Millisecond, 5*time.Millisecond
	}
	if pcfg.InProcessRetries == 0 {
		// Each delivery the rig hands the chain is one attempt: a failure
		// is nacked, and the rig delivers it again with its batch mates.
		pcfg.InProcessRetries = middleware.NoInProcessRetries
	}
	if pcfg.OutageHold == 0 {
		// An outage the rig simulates is waited for in process this long,
		// then the delivery is nacked and the rig delivers it again.
		pcfg.OutageHold = 50 * time.Millisecond
	}
	var err error
	rig.poison, err = middleware.NewPoison(pcfg)
	require.NoError(t, err)
	icfg.TxStore = rig.store
	if icfg.Consumer == "" {
		icfg.Consumer = "charge"
	}
	rig.inbox = newInbox(t, icfg)
	rig.h = rig.poison.Middleware(rig.inbox.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		ctx := msg.Context()
		key := middleware.IdempotencyKey(ctx)
		rig.mu.Lock()
		rig.runs[key]++
		run := rig.runs[key]
		rig.mu.Unlock()
		if err := handler(key, run, msg); errors.Is(err, errNoEffect) {
			return nil, nil
		} else if err != nil {
			return nil, err
		}
		return nil, b.effect(ctx, key)
	}))
	return rig
}

// deliver hands one delivery of each key to the chain, all at once, and
// returns what the chain returned for each: nil acks it, an error nacks it.
func (r *batchRig) deliver(keys []string) map[string]error {
	var (
		mu   sync.Mutex
		errs = map[string]error{}
		wg   sync.WaitGroup
	)
	for _, key := range keys {
		r.mu.Lock()
		id, ok := r.ids[key]
		if !ok {
			id = watermill.NewUUID()
			r.ids[key] = id
		}
		r.mu.Unlock()
		wg.Go(func() {
			msg := message.NewMessage(id, []byte("charge "+key))
			msg.Metadata.Set(dlv.IdempotencyKey, key)
			_, err := r.h(msg)
			mu.Lock()
			errs[key] = err
			mu.Unlock()
		})
	}
	wg.Wait()
	return errs
}

// deliverUntilAcked redelivers every key that was nacked, all together,
// until each is acked, and returns how many deliveries it took in all.
func (r *batchRig) deliverUntilAcked(t *testing.T, keys []string) int {
	t.Helper()
	deliveries := 0
	for round := 0; len(keys) > 0; round++ {
		require.Less(t, round, 50, "keys %v still nacked after 50 rounds", keys)
		deliveries += len(keys)
		var nacked []string
		for key, err := range r.deliver(keys) {
			if err != nil {
				nacked = append(nacked, key)
			}
		}
		keys = nacked
	}
	return deliveries
}

func (r *batchRig) deadLetters() []*message.Message {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.dead)
}

func (r *batchRig) runsOf(key string) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.runs[key]
}

// effectsOf counts the committed effects of key.
func effectsOf(t *testing.T, pool *pgxpool.Pool, schema, key string) int {
	t.Helper()
	var n int
	require.NoError(t, pool.QueryRow(context.Background(), `SELECT count(*) FROM "`+schema+`".effects WHERE key = $1`, key).Scan(&n))
	return n
}

func orderKeys(n int) []string {
	keys := make([]string, n)
	for i := range keys {
		keys[i] = fmt.Sprintf("order-%d", i)
	}
	return keys
}

// TestBatchCommitAnswerLostIsNotCounted: the COMMIT of a batch of eight
// reaches the server and commits, and the answer is lost on the way back
// (a proxy cuts the connection), so that the inbox cannot know the
// outcome. Every delivery of the batch is held for the infrastructure,
// none counted: MaxAttempts 1 dead-letters none of them. Tried again in
// process, each finds its key done: each is a duplicate and acked, each
// effect committed once, each handler run once.
func TestBatchCommitAnswerLostIsNotCounted(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t, 4)
	schema := pgtest.Schema(t, pool)
	b := postgresBackendIn(t, pool, schema)
	server := testServer(t)
	proxy := netfault.CutAtCommit(t, server)
	// Through the proxy until it has cut a COMMIT, then direct.
	via := testPool(t, dialing(10*time.Second, func() string {
		select {
		case <-proxy.Cut():
			return server
		default:
			return proxy.Addr()
		}
	}))
	store, err := postgres.New(via, postgres.Config{Schema: schema})
	require.NoError(t, err)
	b.store = store
	const n = 8
	rig := newBatchRig(t, b, middleware.PoisonConfig{MaxAttempts: 1},
		middleware.InboxConfig{Tuning: middleware.InboxTuning{Batch: middleware.BatchConfig{MaxMessages: n, Parallel: 1, Linger: 300 * time.Millisecond}}},
		func(string, int, *message.Message) error { return nil })
	keys := orderKeys(n)

	// The batch's outcome is unknown: each delivery is held, not counted,
	// and tried again in process, where it finds its key done.
	for key, err := range rig.deliver(keys) {
		require.NoError(t, err, "%s: held through the lost answer, then acked as a duplicate", key)
	}
	select {
	case <-proxy.Cut():
	default:
		t.Fatal("the COMMIT's answer was not cut")
	}
	require.Equal(t, [][]string{keys}, sortedBatches(rig.store.claimed()), "the eight shared one transaction")
	is, ps := rig.inbox.Stats(), rig.poison.Stats()
	require.Equal(t, int64(n), is.Infrastructure, "each delivery of the batch held for the infrastructure")
	require.Zero(t, is.Failed)
	require.Zero(t, is.Applied, "not known to be applied")
	require.Equal(t, int64(n), is.Duplicates, "each try again finds its key done")
	require.Equal(t, int64(n), ps.Infrastructure)
	require.Zero(t, ps.Retried, "none counted")
	require.Zero(t, ps.DeadLettered)
	require.Equal(t, n, b.effects(t), "each effect committed once")
	for _, key := range keys {
		require.Equal(t, 1, effectsOf(t, pool, schema, key), key)
		require.Equal(t, "done", b.status(t, "charge", key))
		require.Equal(t, 1, b.attempts(t, "charge", key))
		require.Equal(t, 0, b.starts(t, "charge", key), "no start left counted")
		require.Equal(t, 1, rig.runsOf(key), "%s: its handler ran once", key)
	}
	require.Empty(t, rig.deadLetters())
	t.Logf("commit answer lost: %d deliveries held uncounted, %d duplicates when tried again, %d effects, 0 dead letters; batches %v",
		is.Infrastructure, rig.inbox.Stats().Duplicates, b.effects(t), rig.store.claimed())
}

// sortedBatches sorts the keys of each batch.
func sortedBatches(batches [][]string) [][]string {
	out := make([][]string, len(batches))
	for i, b := range batches {
		out[i] = slices.Sorted(slices.Values(b))
	}
	return out
}

// TestBatchPoisonKeyAmongGoodOnes: with MaxAttempts 3, one key of a batch
// of eight fails every run, after writing its effect: by an error, or by a
// panic. It is retried, each failure recorded for it alone, and
// dead-lettered once after three runs with the reason; its effect never
// commits. The seven good keys of its batch are applied once each and
// never counted for the failures of their batch mate.
func TestBatchPoisonKeyAmongGoodOnes(t *testing.T) {
	t.Parallel()
	for name, fail := range map[string]func() error{
		"error": func() error { return errors.New("card declined") },
		"panic": func() error { panic("ledger: negative balance") },
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			const n, maxAttempts, poisonKey = 8, 3, "order-3"
			pool := pgtest.Pool(t, 8)
			schema := pgtest.Schema(t, pool)
			b := postgresBackendIn(t, pool, schema)
			rig := newBatchRig(t, b, middleware.PoisonConfig{MaxAttempts: maxAttempts},
				middleware.InboxConfig{Tuning: middleware.InboxTuning{Batch: middleware.BatchConfig{MaxMessages: n, Parallel: 1, Linger: 300 * time.Millisecond}}},
				func(key string, _ int, msg *message.Message) error {
					if key != poisonKey {
						return nil
					}
					if err := b.effect(msg.Context(), key); err != nil {
						return err
					}
					return fail()
				})
			keys := orderKeys(n)

			// The first delivery of each: one batch; the poison key's
			// failure is recorded alone, the others applied.
			for key, err := range rig.deliver(keys) {
				if key == poisonKey {
					require.Error(t, err)
					attempts, _, ok := middleware.StoredAttempts(err)
					require.True(t, ok, "a counted attempt")
					require.Equal(t, 1, attempts)
					continue
				}
				require.NoError(t, err, key)
			}
			require.Equal(t, n, rig.store.largest(), "the eight shared the first transaction")
			require.Equal(t, "failed", b.status(t, "charge", poisonKey))
			require.Equal(t, 1, b.attempts(t, "charge", poisonKey))
			require.Equal(t, n-1, b.effects(t), "the seven good keys, once each")

			// Redelivered with more good keys, until acked.
			more := append([]string{poisonKey}, orderKeysFrom(n, 2*n)...)
			rig.deliverUntilAcked(t, more)

			dead := rig.deadLetters()
			require.Len(t, dead, 1, "dead-lettered once")
			require.Equal(t, poisonKey, dead[0].Metadata.Get(dlv.IdempotencyKey))
			require.Equal(t, fmt.Sprint(maxAttempts), dead[0].Metadata.Get(dlv.DeadAttempts))
			reason := dead[0].Metadata.Get(dlv.DeadError)
			if name == "panic" {
				require.Contains(t, reason, middleware.ErrPanicked.Error())
				require.Contains(t, reason, "negative balance")
				require.Equal(t, int64(maxAttempts), rig.inbox.Stats().Panicked)
			} else {
				require.Contains(t, reason, "card declined")
			}
			require.Equal(t, maxAttempts, rig.runsOf(poisonKey), "run MaxAttempts times, then dead-lettered")
			require.Equal(t, "dead", b.status(t, "charge", poisonKey))
			require.Zero(t, effectsOf(t, pool, schema, poisonKey), "the poison key's effect never committed")

			all := orderKeysFrom(0, 2*n)
			require.Equal(t, len(all)-1, b.effects(t), "every good key applied once")
			for _, key := range all {
				if key == poisonKey {
					continue
				}
				require.Equal(t, 1, effectsOf(t, pool, schema, key), key)
				require.Equal(t, "done", b.status(t, "charge", key), key)
				require.Equal(t, 1, b.attempts(t, "charge", key), "%s: never counted for its batch mate", key)
			}
			is, ps := rig.inbox.Stats(), rig.poison.Stats()
			require.Equal(t, int64(maxAttempts), is.Failed, "the poison key's runs, and no other")
			require.Equal(t, int64(len(all)-1), is.Applied)
			require.Equal(t, int64(1), ps.DeadLettered)
			require.Equal(t, int64(maxAttempts-1), ps.Retried)
			require.Zero(t, is.Infrastructure)
			t.Logf("poison key by %s: %d runs, dead-lettered with %q; %d good keys applied once, in batches %v",
				name, rig.runsOf(poisonKey), firstLineOf(reason), len(all)-1, rig.store.claimed())
		})
	}
}

func orderKeysFrom(from, to int) []string {
	var keys []string
	for i := from; i < to; i++ {
		keys = append(keys, fmt.Sprintf("order-%d", i))
	}
	return keys
}

func firstLineOf(s string) string {
	for i, c := range s {
		if c == '\n' {
			return s[:i]
		}
	}
	return s
}

// TestBatchStoreOutageMidBatch: with MaxAttempts 2, the inbox loses its
// database in the middle of a batch of eight three times (every connection
// cut, new ones refused; the server stays up): in the first handler of the
// batch, in its last (so that the commit fails) and in the middle. Each
// time, the database stays out of reach until every delivery of the batch
// has ended, so that the inbox cannot take the counts back then. Every
// delivery is nacked for the infrastructure, none counted, none
// dead-lettered; once the database answers again, each key is applied
// once with one attempt recorded.
func TestBatchStoreOutageMidBatch(t *testing.T) {
	t.Parallel()
	const n = 8
	admin := pgtest.Pool(t, 2)
	schema := pgtest.Schema(t, admin)
	server, closed := testServer(t), closedPort(t)
	var down atomic.Bool
	app := pgtest.Name(t)
	pool := testPool(t, func(cfg *pgxpool.Config) {
		dialing(time.Second, func() string {
			if down.Load() {
				return closed
			}
			return server
		})(cfg)
		cfg.MaxConns = 8
		cfg.ConnConfig.RuntimeParams["application_name"] = app
	})
	b := postgresBackendIn(t, pool, schema)
	var runs atomic.Int32
	var cutAt atomic.Int32
	rig := newBatchRig(t, b, middleware.PoisonConfig{MaxAttempts: 2},
		middleware.InboxConfig{Tuning: middleware.InboxTuning{Batch: middleware.BatchConfig{MaxMessages: n, Parallel: 1, Linger: 300 * time.Millisecond}}},
		func(_ string, _ int, _ *message.Message) error {
			if runs.Add(1) == cutAt.Load() {
				// The effect that follows fails, and so would the COMMIT.
				down.Store(true)
				if _, err := admin.Exec(context.Background(),
					`SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = $1`, app); err != nil {
					t.Errorf("cut the inbox's connections: %v", err)
				}
			}
			return nil
		})
	keys := orderKeys(n)

	// The runs of each outage's batch before the cut: the first, the last
	// (eight runs), the middle. The batch stops at the cut, its mates not
	// run.
	for i, at := range []int32{1, 1 + n, 1 + n + n/2} {
		cutAt.Store(at)
		for key, err := range rig.deliver(keys) {
			require.Error(t, err, "outage %d: %s nacked", i+1, key)
			require.True(t, middleware.IsInfrastructure(err), "outage %d: %s: the infrastructure's fault: %v", i+1, key, err)
		}
		require.Equal(t, at, runs.Load(), "outage %d: the batch stopped at the cut", i+1)
		require.True(t, down.Load())
		require.Equal(t, n, rig.store.largest(), "the eight shared a transaction")
		down.Store(false)
		require.Zero(t, b.effects(t), "outage %d: nothing committed", i+1)
	}
	rig.deliverUntilAcked(t, keys)

	require.Equal(t, n, b.effects(t), "each key applied once")
	for _, key := range keys {
		require.Equal(t, 1, effectsOf(t, admin, schema, key), key)
		require.Equal(t, "done", b.status(t, "charge", key))
		require.Equal(t, 1, b.attempts(t, "charge", key), "%s: only the attempt that applied it counted", key)
		require.Equal(t, 0, b.starts(t, "charge", key), "%s: no start left counted", key)
	}
	require.Empty(t, rig.deadLetters(), "never dead-lettered")
	is, ps := rig.inbox.Stats(), rig.poison.Stats()
	require.Zero(t, is.CrashLooped)
	require.Zero(t, is.Failed)
	require.Zero(t, ps.Retried, "never counted")
	require.Zero(t, ps.DeadLettered)
	require.GreaterOrEqual(t, ps.Infrastructure, int64(3*n), "every delivery of each outage nacked for it")
	require.Equal(t, int64(n), is.Applied)
	t.Logf("store outage mid-batch: 3 outages, %d deliveries nacked for the infrastructure, %d handler runs, %d effects, 0 dead letters",
		ps.Infrastructure, runs.Load(), b.effects(t))
}

// drainProbe is a router middleware, outermost, that notes when each
// delivery's own context is cancelled (the router closing) and keeps the
// delivery to tell later whether it was acked or nacked.
type drainProbe struct {
	mu        sync.Mutex
	cancelled map[string]time.Time // by message UUID
	msgs      []*message.Message
}

func (p *drainProbe) middleware(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		p.mu.Lock()
		p.msgs = append(p.msgs, msg)
		p.mu.Unlock()
		uuid := msg.UUID
		stop := context.AfterFunc(msg.Context(), func() {
			p.mu.Lock()
			p.cancelled[uuid] = time.Now()
			p.mu.Unlock()
		})
		defer stop()
		return h(msg)
	}
}

// TestBatchCloseDrainsInFlightBatch: the router closes while a batch of
// six runs its handlers, one after the other, each working on its
// message's context. Within the drain budget the handlers keep a live
// context: all six finish, their batch commits, and all six are acked with
// one attempt each. With a budget shorter than the batch's work, the
// handlers keep a live context for the budget and no longer: no handler
// starts its work with a live context once the budget has passed since
// the close, so the batch is rolled back, each delivery nacked, none
// counted, and nothing committed.
func TestBatchCloseDrainsInFlightBatch(t *testing.T) {
	t.Parallel()
	const n = 6
	const work = 250 * time.Millisecond
	for name, c := range map[string]struct {
		drain   time.Duration
		applied int
	}{
		"within the budget": {drain: 20 * time.Second, applied: n},
		"past the budget":   {drain: 300 * time.Millisecond, applied: 0},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			b := postgresBackend(t, 8)
			store := &batchKeys{Store: b.store.(*postgres.Store)}
			in := newInbox(t, middleware.InboxConfig{TxStore: store, Consumer: "charge", DrainTimeout: c.drain,
				Tuning: middleware.InboxTuning{Batch: middleware.BatchConfig{MaxMessages: n, Parallel: 1, Linger: 500 * time.Millisecond}}})
			pubSub := gochannel.NewGoChannel(gochannel.Config{Persistent: true}, watermill.NopLogger{})
			t.Cleanup(func() { require.NoError(t, pubSub.Close()) })
			router, err := message.NewRouter(message.RouterConfig{CloseTimeout: time.Minute}, watermill.NopLogger{})
			require.NoError(t, err)
			probe := &drainProbe{cancelled: map[string]time.Time{}}
			router.AddMiddleware(probe.middleware, in.Middleware)

			type run struct {
				uuid    string
				started time.Time
				live    bool // the context was live when the work started
				err     error
			}
			var (
				mu      sync.Mutex
				runs    []run
				running = make(chan struct{}, n)
			)
			// One subscription per topic: GoChannel hands a subscription
			// one message at a time, and the batch needs them together.
			for i := range n {
				topic := fmt.Sprintf("orders-%d", i)
				router.AddConsumerHandler(fmt.Sprintf("charge-%d", i), topic, pubSub, func(msg *message.Message) error {
					ctx := msg.Context()
					r := run{uuid: msg.UUID, started: time.Now(), live: ctx.Err() == nil}
					running <- struct{}{}
					select {
					case <-time.After(work):
					case <-ctx.Done():
						r.err = ctx.Err()
					}
					mu.Lock()
					runs = append(runs, r)
					mu.Unlock()
					if r.err != nil {
						return r.err
					}
					return b.effect(ctx, middleware.IdempotencyKey(ctx))
				})
			}
			done := make(chan error, 1)
			go func() { done <- router.Run(context.Background()) }()
			<-router.Running()
			for i := range n {
				require.NoError(t, pubSub.Publish(fmt.Sprintf("orders-%d", i), delivery(fmt.Sprintf("order-%d", i), "charge")))
			}
			<-running // the batch's first handler works
			require.NoError(t, router.Close())
			require.NoError(t, <-done)

			require.Equal(t, n, store.largest(), "the six shared one transaction")
			probe.mu.Lock()
			defer probe.mu.Unlock()
			mu.Lock()
			defer mu.Unlock()
			for _, r := range runs {
				cancelled, ok := probe.cancelled[r.uuid]
				require.True(t, ok, "the router cancelled the delivery's context")
				if r.live {
					require.False(t, r.started.After(cancelled.Add(c.drain)),
						"a handler started its work with a live context %s after the close, past the drain budget of %s",
						r.started.Sub(cancelled).Round(time.Millisecond), c.drain)
				}
			}
			require.Equal(t, c.applied, b.effects(t))
			st := in.Stats()
			require.Len(t, probe.msgs, n)
			for _, msg := range probe.msgs {
				key := msg.Metadata.Get(dlv.IdempotencyKey)
				if c.applied == n {
					requireClosed(t, msg.Acked(), "%s acked", key)
					require.Equal(t, 1, b.attempts(t, "charge", key))
				} else {
					requireClosed(t, msg.Nacked(), "%s nacked", key)
					require.Equal(t, -1, b.attempts(t, "charge", key), "%s: rolled back, no record", key)
					require.Equal(t, 0, b.starts(t, "charge", key), "%s: not counted", key)
				}
			}
			if c.applied == n {
				require.Equal(t, int64(n), st.Applied)
				require.Len(t, runs, n, "each handler ran once")
				for _, r := range runs {
					require.True(t, r.live, "the handler's context stayed live")
					require.NoError(t, r.err)
				}
			} else {
				require.Zero(t, st.Applied)
				require.Equal(t, int64(n), st.Abandoned, "rolled back, not counted")
				require.Zero(t, st.Failed)
			}
			t.Logf("close %s: %d handler runs, %d effects, stats %+v", name, len(runs), b.effects(t), st)
		})
	}
}

func requireClosed(t *testing.T, ch <-chan struct{}, msgAndArgs ...any) {
	t.Helper()
	select {
	case <-ch:
	default:
		require.Fail(t, "not closed", msgAndArgs...)
	}
}

// TestBatchNeverHoldsOneKeyTwice: four copies of each of 30 keys, the
// first copies all at once, the others while the first batch runs: no
// batch holds two deliveries of one key, every
// key is applied once, its handler run once, and the other copies are
// duplicates.
func TestBatchNeverHoldsOneKeyTwice(t *testing.T) {
	t.Parallel()
	b := postgresBackend(t, 8)
	const keys, copies = 30, 4
	rig := newBatchRig(t, b, middleware.PoisonConfig{MaxAttempts: 3},
		middleware.InboxConfig{Tuning: middleware.InboxTuning{Batch: middleware.BatchConfig{MaxMessages: 16, Parallel: 1, Linger: 100 * time.Millisecond}}},
		func(string, int, *message.Message) error { return nil })
	var (
		wg   sync.WaitGroup
		mu   sync.Mutex
		errs []error
	)
	for c := range copies {
		wg.Go(func() {
			// Each copy is a delivery of its own (a producer's retry).
			for key, err := range rig.deliverCopies(orderKeys(keys)) {
				if err != nil {
					mu.Lock()
					errs = append(errs, fmt.Errorf("%s copy %d: %w", key, c, err))
					mu.Unlock()
				}
			}
		})
		if c == 0 {
			// The other copies come while the first batch runs and the
			// rest of the first copies wait for theirs.
			require.Eventually(t, func() bool { return len(rig.store.claimed()) > 0 }, 30*time.Second, time.Millisecond)
		}
	}
	wg.Wait()
	require.Empty(t, errs)
	batches := rig.store.claimed()
	for _, batch := range batches {
		require.Len(t, slices.Compact(slices.Sorted(slices.Values(batch))), len(batch), "a batch held one key twice: %v", batch)
	}
	require.Greater(t, rig.store.largest(), 1, "deliveries shared transactions")
	require.Equal(t, keys, b.effects(t))
	for _, key := range orderKeys(keys) {
		require.Equal(t, 1, rig.runsOf(key), key)
		require.Equal(t, 1, b.attempts(t, "charge", key))
	}
	st := rig.inbox.Stats()
	require.Equal(t, int64(keys), st.Applied)
	require.Equal(t, int64(keys*(copies-1)), st.Duplicates)
	t.Logf("%d deliveries of %d keys in %d batches (largest %d)", keys*copies, keys, len(batches), rig.store.largest())
}

// deliverCopies is deliver with a new message (its own UUID) per key.
func (r *batchRig) deliverCopies(keys []string) map[string]error {
	var (
		mu   sync.Mutex
		errs = map[string]error{}
		wg   sync.WaitGroup
	)
	for _, key := range keys {
		wg.Go(func() {
			_, err := r.h(delivery(key, "charge "+key))
			mu.Lock()
			errs[key] = err
			mu.Unlock()
		})
	}
	wg.Wait()
	return errs
}
