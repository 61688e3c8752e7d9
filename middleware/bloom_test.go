package middleware_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/dedup/dedupdriver"
	"github.com/oncemill/oncemill/dedup/memory"
	"github.com/oncemill/oncemill/dedup/postgres"
	dlv "github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/internal/testing/pgtest"
	"github.com/oncemill/oncemill/middleware"
)

// TestBloomSizing: each generation uses within 10% of the optimal bits per
// key for its target rate, and the measured false-positive rate of a full
// generation is near the target.
func TestBloomSizing(t *testing.T) {
	t.Parallel()
	for _, p := range []float64{0.01, 0.001, 0.05} {
		b, err := middleware.NewBloom(middleware.BloomConfig{Store: memory.New(), ExpectedKeys: 100_000, FalsePositiveRate: p})
		require.NoError(t, err)
		opt := middleware.OptimalBitsPerKey(p)
		require.InDelta(t, opt, middleware.BitsPerKey(b), 0.10*opt, "rate %g", p)
	}
	require.InDelta(t, 9.585, middleware.OptimalBitsPerKey(0.01), 0.001)

	// Measured: 20,000 keys in, 20,000 others tested, through the
	// middleware with a store that knows nothing (every maybe-seen answer
	// is a false positive).
	const n = 20_000
	b, err := middleware.NewBloom(middleware.BloomConfig{Store: memory.New(), ExpectedKeys: n, Consumer: "c"})
	require.NoError(t, err)
	// The never-seen keys fail, so that the filter does not learn them.
	h := b.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		if strings.HasPrefix(string(msg.Payload), "never-") {
			return nil, errors.New("not remembered")
		}
		return nil, nil
	})
	for i := range n {
		_, err := h(keyed(fmt.Sprintf("seen-%d", i)))
		require.NoError(t, err)
	}
	before := b.Stats()
	for i := range n {
		_, err := h(keyed(fmt.Sprintf("never-%d", i)))
		require.Error(t, err)
	}
	fp := b.Stats().FalsePositives - before.FalsePositives
	rate := float64(fp) / n
	t.Logf("measured false-positive rate %.4f at %.2f bits/key", rate, middleware.BitsPerKey(b))
	require.Less(t, rate, 0.015, "target 1%%")
	require.Equal(t, int64(2*n), b.Stats().Checks)
}

func keyed(key string) *message.Message {
	msg := message.NewMessage(watermill.NewUUID(), []byte(key))
	msg.Metadata.Set(dlv.IdempotencyKey, key)
	return msg
}

// countingTracer counts the statements sent to PostgreSQL, BEGIN and
// COMMIT included: round trips.
type countingTracer struct {
	mu    sync.Mutex
	stmts map[string]int
	total atomic.Int64
}

func (c *countingTracer) TraceQueryStart(ctx context.Context, _ *pgx.Conn, data pgx.TraceQueryStartData) context.Context {
	word := strings.ToLower(strings.Fields(data.SQL)[0])
	c.mu.Lock()
	c.stmts[word]++
	c.mu.Unlock()
	c.total.Add(1)
	return ctx
}

func (*countingTracer) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

func (c *countingTracer) reset() map[string]int {
	c.mu.Lock()
	defer c.mu.Unlock()
	s := c.stmts
	c.stmts = map[string]int{}
	c.total.Store(0)
	return s
}

// tracedPool is a pool on a fresh migrated schema whose statements are
// counted.
func tracedPool(t *testing.T) (*pgxpool.Pool, string, *countingTracer) {
	t.Helper()
	setup := pgtest.Pool(t, 2)
	schema := pgtest.Schema(t, setup)
	cfg, err := pgxpool.ParseConfig(pgtest.URL())
	require.NoError(t, err)
	tr := &countingTracer{stmts: map[string]int{}}
	cfg.ConnConfig.Tracer = tr
	cfg.MaxConns = 4
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	return pool, schema, tr
}

// TestBloomRoundTrips: in front of the PostgreSQL inbox, a new key costs
// exactly what it costs without the filter (no extra round trip), and a
// duplicate costs one read: no transaction, no handler.
func TestBloomRoundTrips(t *testing.T) {
	t.Parallel()
	pool, schema, tr := tracedPool(t)
	ctx := context.Background()
	store, err := postgres.New(pool, postgres.Config{Schema: schema})
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `CREATE TABLE "`+schema+`".effects (key text PRIMARY KEY)`)
	require.NoError(t, err)
	// Statements counted one by one: the inbox sends each alone (its
	// pipelined round trips are counted on the wire in
	// TestPipelineAutoFollowsDuplicates).
	inbox := newInbox(t, middleware.InboxConfig{TxStore: store, Consumer: "ship", Tuning: middleware.InboxTuning{Pipeline: middleware.PipelineNever}})
	var runs atomic.Int32
	handler := func(msg *message.Message) ([]*message.Message, error) {
		runs.Add(1)
		ctx := msg.Context()
		_, err := postgres.Tx(ctx).Exec(ctx, `INSERT INTO "`+schema+`".effects VALUES ($1)`, middleware.IdempotencyKey(ctx))
		out := message.NewMessage("shipped-"+middleware.IdempotencyKey(ctx), nil)
		return []*message.Message{out}, err
	}
	plain := inbox.Middleware(handler)
	b, err := middleware.NewBloom(middleware.BloomConfig{Store: store, Consumer: "ship", ExpectedKeys: 1000})
	require.NoError(t, err)
	filtered := b.Middleware(inbox.Middleware(handler))

	// Baseline: a new key through the plain inbox.
	tr.reset()
	_, err = plain(keyed("base-1"))
	require.NoError(t, err)
	newKeyCost := tr.reset()

	// A new key through the filter costs the same statements.
	_, err = filtered(keyed("order-1"))
	require.NoError(t, err)
	require.Equal(t, newKeyCost, tr.reset(), "a surely-new key adds no round trip")

	// A duplicate through the plain inbox: the attempt-start statement
	// reads the done key, and no transaction begins.
	_, err = plain(keyed("base-1"))
	require.NoError(t, err)
	require.Equal(t, map[string]int{"with": 1}, tr.reset(), "one statement per duplicate, no transaction")

	// A duplicate through the filter: one read, the stored result back.
	out, err := filtered(keyed("order-1"))
	require.NoError(t, err)
	dupCost := tr.reset()
	require.Equal(t, map[string]int{"select": 1}, dupCost, "one read per duplicate, no transaction")
	require.Len(t, out, 1)
	require.Equal(t, "shipped-order-1", out[0].UUID, "the stored result is returned")
	require.Equal(t, int32(2), runs.Load())
	require.Equal(t, middleware.BloomStats{Checks: 2, SurelyNew: 1, MaybeSeen: 1, Duplicates: 1}, b.Stats())
}

// TestBloomNeverTheRecord: keys the filter never saw (another instance
// applied them) are caught by the inbox; a maybe-seen key whose record is
// gone (swept after its window) is a false positive: one read, then the
// handler runs; a failed key is not remembered.
func TestBloomNeverTheRecord(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t, 8)
	schema := pgtest.Schema(t, pool)
	b := postgresBackendIn(t, pool, schema)
	peeker := b.store.(dedupdriver.Peeker)
	inbox := newInbox(t, middleware.InboxConfig{TxStore: b.store, Consumer: "ship"})
	fail := atomic.Bool{}
	handler := inbox.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		if fail.Load() {
			return nil, errors.New("carrier API down")
		}
		return nil, b.effect(msg.Context(), middleware.IdempotencyKey(msg.Context()))
	})
	other, err := middleware.NewBloom(middleware.BloomConfig{Store: peeker, Consumer: "ship"})
	require.NoError(t, err)
	this, err := middleware.NewBloom(middleware.BloomConfig{Store: peeker, Consumer: "ship"})
	require.NoError(t, err)
	h := this.Middleware(handler)

	_, err = other.Middleware(handler)(keyed("k1"))
	require.NoError(t, err)
	_, err = h(keyed("k1"))
	require.NoError(t, err)
	require.Equal(t, 1, b.effects(t), "the inbox caught what the filter never saw")
	require.Equal(t, int64(1), inbox.Stats().Duplicates)
	require.Equal(t, middleware.BloomStats{Checks: 1, SurelyNew: 1}, this.Stats())

	_, err = h(keyed("k2"))
	require.NoError(t, err)
	_, err = pool.Exec(context.Background(), `DELETE FROM "`+schema+`".inbox WHERE key = 'k2'`)
	require.NoError(t, err)
	_, err = h(keyed("k2"))
	require.NoError(t, err)
	require.Equal(t, int64(1), this.Stats().FalsePositives)
	require.Equal(t, 3, b.effects(t), "k2's record was gone, so it was applied again")

	fail.Store(true)
	_, err = h(keyed("k3"))
	require.Error(t, err)
	fail.Store(false)
	_, err = h(keyed("k3"))
	require.NoError(t, err)
	require.Equal(t, middleware.BloomStats{Checks: 5, SurelyNew: 4, MaybeSeen: 1, FalsePositives: 1}, this.Stats(),
		"k3 failed, so it was not remembered: surely new again")
	require.Equal(t, 4, b.effects(t))
}

// TestBloomWarm: a restarted instance loads the window's done keys from
// the store and answers their duplicates with one read from the start.
func TestBloomWarm(t *testing.T) {
	t.Parallel()
	txBackends(t, 8, testBloomWarm)
}

func testBloomWarm(t *testing.T, b txBackend) {
	inbox := newInbox(t, middleware.InboxConfig{TxStore: b.store, Consumer: "ship"})
	handler := inbox.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		return nil, b.effect(msg.Context(), middleware.IdempotencyKey(msg.Context()))
	})
	const n = 3000
	for i := range n {
		_, err := handler(keyed(fmt.Sprintf("order-%d", i)))
		require.NoError(t, err)
	}
	// Another consumer's keys are not loaded.
	otherInbox := newInbox(t, middleware.InboxConfig{TxStore: b.store, Consumer: "audit"})
	_, err := otherInbox.Middleware(func(*message.Message) ([]*message.Message, error) { return nil, nil })(keyed("order-x"))
	require.NoError(t, err)

	restarted, err := middleware.NewBloom(middleware.BloomConfig{Store: b.store.(dedupdriver.Peeker), Consumer: "ship", ExpectedKeys: n})
	require.NoError(t, err)
	loaded, err := restarted.Warm(context.Background())
	require.NoError(t, err)
	require.Equal(t, n, loaded)
	h := restarted.Middleware(handler)
	for i := range n {
		_, err := h(keyed(fmt.Sprintf("order-%d", i)))
		require.NoError(t, err)
	}
	require.Equal(t, middleware.BloomStats{Checks: n, MaybeSeen: n, Duplicates: n}, restarted.Stats())
	require.Equal(t, n, b.effects(t))

	// No consumer name: a clear error.
	noName, err := middleware.NewBloom(middleware.BloomConfig{Store: b.store.(dedupdriver.Peeker)})
	require.NoError(t, err)
	_, err = noName.Warm(context.Background())
	require.ErrorContains(t, err, "BloomConfig.Consumer")
}

// TestBloomRotation: keys are remembered for one window at least and age
// out after two.
func TestBloomRotation(t *testing.T) {
	t.Parallel()
	store := memory.New()
	b, err := middleware.NewBloom(middleware.BloomConfig{Store: store, Consumer: "c", Window: time.Hour})
	require.NoError(t, err)
	now := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	middleware.SetBloomClock(b, func() time.Time { return now })
	h := b.Middleware(func(*message.Message) ([]*message.Message, error) { return nil, nil })
	run := func(key string) {
		_, err := h(keyed(key))
		require.NoError(t, err)
	}
	run("a") // surely new, added
	now = now.Add(59 * time.Minute)
	run("a") // maybe seen (the memory store has no record: a false positive)
	require.Equal(t, int64(1), b.Stats().MaybeSeen)
	now = now.Add(2 * time.Minute) // rotation: "a" is in the previous generation
	run("a")
	require.Equal(t, int64(2), b.Stats().MaybeSeen)
	require.Equal(t, int64(1), b.Stats().Rotations)
	now = now.Add(61 * time.Minute) // second rotation: "a" was re-added last window
	run("b")
	require.Equal(t, int64(2), b.Stats().Rotations)
	now = now.Add(3 * time.Hour) // idle for more than a window: all gone
	run("a")
	require.Equal(t, int64(2), b.Stats().MaybeSeen, "aged out: surely new again")
}

func TestBloomConfigValidate(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		cfg  middleware.BloomConfig
		want string
	}{
		{middleware.BloomConfig{}, "BloomConfig.Store"},
		{middleware.BloomConfig{Store: memory.New(), FalsePositiveRate: 0.7}, "BloomConfig.FalsePositiveRate"},
		{middleware.BloomConfig{Store: memory.New(), FalsePositiveRate: -1}, "BloomConfig.FalsePositiveRate"},
		{middleware.BloomConfig{Store: memory.New(), Window: time.Second}, "BloomConfig.Window"},
		{middleware.BloomConfig{Store: memory.New(), ExpectedKeys: 1 << 40}, "BloomConfig.ExpectedKeys"},
	} {
		_, err := middleware.NewBloom(tc.cfg)
		require.ErrorContains(t, err, tc.want)
	}
}
