package middleware_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	wmw "github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/dedup/postgres"
	dlv "github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/internal/testing/pgtest"
	"github.com/oncemill/oncemill/middleware"
)

// bulkRig is a batchRig whose handler is a BatchHandler writing the
// effects of a batch with one COPY into bulk_effects, a table that
// refuses the key poison (a CHECK constraint): the COPY of a batch that
// holds it fails as a whole, with nothing in the error to say which row.
type bulkRig struct {
	*batchRig
	pool  *pgxpool.Pool
	table string

	mu    sync.Mutex
	calls [][]string // the keys of each call of the BatchFunc
}

func newBulkRig(t *testing.T, maxAttempts int, poison string, fail func(ctx context.Context, msgs []*message.Message) error) *bulkRig {
	t.Helper()
	pool := pgtest.Pool(t, 8)
	schema := pgtest.Schema(t, pool)
	b := postgresBackendIn(t, pool, schema)
	table := `"` + schema + `".bulk_effects`
	_, err := pool.Exec(context.Background(), `CREATE TABLE `+table+` (key text NOT NULL CHECK (key <> '`+poison+`'), payload text NOT NULL)`)
	require.NoError(t, err)
	r := &bulkRig{pool: pool, table: table}
	r.batchRig = newBatchRig(t, b, middleware.PoisonConfig{MaxAttempts: maxAttempts},
		middleware.InboxConfig{Tuning: middleware.InboxTuning{Batch: middleware.BatchConfig{MaxMessages: 32, Parallel: 1, Linger: 300 * time.Millisecond}}},
		func(string, int, *message.Message) error { return nil })
	bulk := middleware.BatchHandler(func(ctx context.Context, msgs []*message.Message) error {
		keys := make([]string, len(msgs))
		rows := make([][]any, len(msgs))
		for i, msg := range msgs {
			keys[i] = middleware.IdempotencyKey(msg.Context())
			rows[i] = []any{keys[i], string(msg.Payload)}
		}
		r.mu.Lock()
		r.calls = append(r.calls, keys)
		r.mu.Unlock()
		if fail != nil {
			if err := fail(ctx, msgs); err != nil {
				return err
			}
		}
		_, err := postgres.Tx(ctx).CopyFrom(ctx, pgx.Identifier{schema, "bulk_effects"}, []string{"key", "payload"}, pgx.CopyFromRows(rows))
		return err
	})
	r.h = r.poison.Middleware(r.inbox.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		return nil, bulk(msg)
	}))
	return r
}

func (r *bulkRig) callsOf() [][]string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.calls)
}

// handedTo counts how many calls of the BatchFunc were handed key.
func (r *bulkRig) handedTo(key string) int {
	n := 0
	for _, call := range r.callsOf() {
		if slices.Contains(call, key) {
			n++
		}
	}
	return n
}

func (r *bulkRig) rows(t *testing.T, key string) int {
	t.Helper()
	var n int
	q := `SELECT count(*) FROM ` + r.table
	args := []any{}
	if key != "" {
		q += ` WHERE key = $1`
		args = append(args, key)
	}
	require.NoError(t, r.pool.QueryRow(context.Background(), q, args...).Scan(&n))
	return n
}

// TestBatchHandlerPoisonAmongGoodOnes: 32 deliveries reach a BatchHandler
// whose effect is one COPY; one of them can never be written. By the
// database refusing the COPY (no one named), by the BatchFunc panicking
// when the poison is among its messages, or by a BatchErrors naming it:
// the 31 good messages commit in bulk at their first delivery, each
// counted once and never for their mate; the poison message is counted
// alone, run MaxAttempts times and dead-lettered once; the table holds
// exactly 31 rows.
func TestBatchHandlerPoisonAmongGoodOnes(t *testing.T) {
	t.Parallel()
	const n, maxAttempts, poisonKey = 32, 3, "order-13"
	isPoison := func(msgs []*message.Message) *message.Message {
		for _, msg := range msgs {
			if msg.Metadata.Get(dlv.IdempotencyKey) == poisonKey {
				return msg
			}
		}
		return nil
	}
	for name, c := range map[string]struct {
		fail   func(ctx context.Context, msgs []*message.Message) error
		reason string
	}{
		"copy refused": {reason: "bulk_effects_key_check"},
		"panic": {reason: "ledger: negative balance", fail: func(_ context.Context, msgs []*message.Message) error {
			if isPoison(msgs) != nil {
				panic("ledger: negative balance")
			}
			return nil
		}},
		"batch errors": {reason: "card declined", fail: func(_ context.Context, msgs []*message.Message) error {
			if m := isPoison(msgs); m != nil {
				return middleware.BatchErrors{m.UUID: errors.New("card declined")}
			}
			return nil
		}},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			rig := newBulkRig(t, maxAttempts, poisonKey, c.fail)
			keys := orderKeys(n)

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
			calls := rig.callsOf()
			require.Len(t, calls[0], n, "the first call held the 32")
			require.Equal(t, n-1, rig.rows(t, ""), "the 31 good messages committed at their first delivery")
			largest := 0
			for _, call := range calls[1:] {
				if !slices.Contains(call, poisonKey) {
					largest = max(largest, len(call))
				}
			}
			if name == "batch errors" {
				require.Len(t, calls, 2, "named: the 31 ran again at once, together")
				require.Equal(t, n-1, largest)
			} else {
				require.GreaterOrEqual(t, largest, n/2, "bisected: the poison's half-batch mates committed in bulk")
			}

			rig.deliverUntilAcked(t, []string{poisonKey})
			dead := rig.deadLetters()
			require.Len(t, dead, 1, "dead-lettered once")
			require.Equal(t, poisonKey, dead[0].Metadata.Get(dlv.IdempotencyKey))
			require.Equal(t, fmt.Sprint(maxAttempts), dead[0].Metadata.Get(dlv.DeadAttempts))
			require.Contains(t, dead[0].Metadata.Get(dlv.DeadError), c.reason)
			require.Equal(t, "dead", rig.b.status(t, "charge", poisonKey))

			require.Equal(t, n-1, rig.rows(t, ""), "exactly 31 rows")
			require.Zero(t, rig.rows(t, poisonKey))
			for _, key := range keys {
				if key == poisonKey {
					continue
				}
				require.Equal(t, 1, rig.rows(t, key), key)
				require.Equal(t, "done", rig.b.status(t, "charge", key), key)
				require.Equal(t, 1, rig.b.attempts(t, "charge", key), "%s: never counted for its mate", key)
			}
			is, ps := rig.inbox.Stats(), rig.poison.Stats()
			require.Equal(t, int64(maxAttempts), is.Failed, "the poison message's attempts, and no other")
			require.Equal(t, int64(n-1), is.Applied)
			require.Equal(t, int64(1), ps.DeadLettered)
			require.Equal(t, int64(maxAttempts-1), ps.Retried)
			require.Zero(t, is.Infrastructure)
			if name == "panic" {
				require.Equal(t, int64(maxAttempts), is.Panicked, "counted only when it panicked alone")
			} else {
				require.Zero(t, is.Panicked)
			}
			sizes := make([]int, len(calls))
			for i, call := range calls {
				sizes[i] = len(call)
			}
			t.Logf("%s: %d rows, poison handed %d times and dead-lettered; BatchFunc calls by size %v",
				name, rig.rows(t, ""), rig.handedTo(poisonKey), sizes)
		})
	}
}

// TestBatchHandlerNeverSeesDuplicates: 16 keys delivered and applied,
// then delivered again with 16 new ones. The BatchFunc is handed each key
// once in all: the copies are dropped as duplicates before it, each
// effect row written once.
func TestBatchHandlerNeverSeesDuplicates(t *testing.T) {
	t.Parallel()
	rig := newBulkRig(t, 3, "none", nil)
	first := orderKeys(16)
	for key, err := range rig.deliver(first) {
		require.NoError(t, err, key)
	}
	all := orderKeysFrom(0, 32)
	for key, err := range rig.deliver(all) {
		require.NoError(t, err, key)
	}
	for _, key := range all {
		require.Equal(t, 1, rig.handedTo(key), "%s: handed to the BatchFunc once", key)
		require.Equal(t, 1, rig.rows(t, key), key)
	}
	require.Equal(t, 32, rig.rows(t, ""))
	is := rig.inbox.Stats()
	require.Equal(t, int64(16), is.Duplicates)
	require.Equal(t, int64(32), is.Applied)
	for _, call := range rig.callsOf()[1:] {
		for _, key := range call {
			require.NotContains(t, first, key, "a duplicate reached the BatchFunc")
		}
	}
	t.Logf("BatchFunc calls %d, duplicates dropped %d, rows %d", len(rig.callsOf()), is.Duplicates, rig.rows(t, ""))
}

// TestBatchHandlerWithoutBatching: with batching off, on PostgreSQL and
// SQLite alike, a BatchHandler is called with one message at a time in
// its own transaction, reads it with the store's accessor, and a
// BatchErrors naming its message fails it.
func TestBatchHandlerWithoutBatching(t *testing.T) {
	t.Parallel()
	txBackends(t, 4, func(t *testing.T, b txBackend) {
		inbox := newInbox(t, middleware.InboxConfig{TxStore: b.store, Consumer: "charge"})
		var sizes []int
		h := middleware.BatchHandler(func(ctx context.Context, msgs []*message.Message) error {
			sizes = append(sizes, len(msgs))
			for _, msg := range msgs {
				if string(msg.Payload) == "declined" {
					return middleware.BatchErrors{msg.UUID: errors.New("card declined")}
				}
				if err := b.effect(ctx, middleware.IdempotencyKey(msg.Context())); err != nil {
					return err
				}
			}
			return nil
		})
		mw := inbox.Middleware(func(msg *message.Message) ([]*message.Message, error) { return nil, h(msg) })
		deliver := func(key, payload string) error {
			msg := message.NewMessage(key+"-uuid", []byte(payload))
			msg.Metadata.Set(dlv.IdempotencyKey, key)
			_, err := mw(msg)
			return err
		}
		require.NoError(t, deliver("a", "ok"))
		require.NoError(t, deliver("b", "ok"))
		require.NoError(t, deliver("a", "ok"), "a duplicate")
		err := deliver("c", "declined")
		require.ErrorContains(t, err, "card declined")
		require.Equal(t, []int{1, 1, 1}, sizes, "one message a call; the duplicate not handed")
		require.Equal(t, 2, b.effects(t))
		require.Equal(t, "failed", b.status(t, "charge", "c"))
		require.Equal(t, int64(1), inbox.Stats().Failed)
	})
}

// TestBatchHandlerDeadlineIsolated: eight deliveries behind Watermill's
// Timeout middleware (400 ms); the BatchFunc never returns while one of
// them is in its call, until the call's context ends. The batch is split
// until the slow message runs alone: it alone is counted, with the
// deadline in its error; the seven others are applied, each once.
func TestBatchHandlerDeadlineIsolated(t *testing.T) {
	t.Parallel()
	const n, slowKey = 8, "order-5"
	rig := newBulkRig(t, 3, "none", func(ctx context.Context, msgs []*message.Message) error {
		for _, msg := range msgs {
			if msg.Metadata.Get(dlv.IdempotencyKey) == slowKey {
				<-ctx.Done()
				return ctx.Err()
			}
		}
		return nil
	})
	rig.h = wmw.Timeout(400 * time.Millisecond)(rig.h)
	keys := orderKeys(n)
	for key, err := range rig.deliver(keys) {
		if key == slowKey {
			require.ErrorIs(t, err, context.DeadlineExceeded)
			attempts, _, ok := middleware.StoredAttempts(err)
			require.True(t, ok, "a counted attempt")
			require.Equal(t, 1, attempts)
			continue
		}
		require.NoError(t, err, key)
	}
	require.Equal(t, n-1, rig.rows(t, ""))
	for _, key := range keys {
		if key == slowKey {
			require.Equal(t, "failed", rig.b.status(t, "charge", key))
			require.Equal(t, 1, rig.b.attempts(t, "charge", key))
			continue
		}
		require.Equal(t, 1, rig.rows(t, key), key)
		require.Equal(t, 1, rig.b.attempts(t, "charge", key), "%s: never counted for the slow one", key)
	}
	is := rig.inbox.Stats()
	require.Equal(t, int64(1), is.Failed)
	require.Equal(t, int64(n-1), is.Applied)
	t.Logf("deadline: %d applied, 1 failed; BatchFunc calls %d, the slow key in %d", is.Applied, len(rig.callsOf()), rig.handedTo(slowKey))
}
