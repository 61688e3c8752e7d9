package twotier_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/jackc/pgx/v5/pgxpool"
	goredis "github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/oncemill/oncemill/dedup"
	"github.com/oncemill/oncemill/dedup/postgres"
	"github.com/oncemill/oncemill/dedup/redis"
	"github.com/oncemill/oncemill/dedup/twotier"
	"github.com/oncemill/oncemill/internal/pgtest"
	"github.com/oncemill/oncemill/internal/redistest"
	"github.com/oncemill/oncemill/middleware"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// bundle is a two-tier store on real Redis and real PostgreSQL, each with
// a namespace of its own (key prefix, schema) that goes when the test ends.
type bundle struct {
	redis  *goredis.Client
	prefix string
	lock   *redis.Store
	pool   *pgxpool.Pool
	schema string
	record *postgres.Store
	store  *twotier.Store
}

type options struct {
	maxConns int32
	lease    time.Duration
	logger   watermill.LoggerAdapter
	// server, when set, is the Redis server of the lock instead of the
	// shared one.
	server *redistest.Server
}

func setup(t *testing.T, o options) bundle {
	t.Helper()
	if o.maxConns == 0 {
		o.maxConns = 4
	}
	var b bundle
	if o.server != nil {
		b.redis = o.server.Client(t)
		b.prefix = "t:"
	} else {
		b.redis = redistest.Client(t)
		b.prefix = redistest.Prefix(t, b.redis)
	}
	var err error
	b.lock, err = redis.New(redis.Config{Client: b.redis, Prefix: b.prefix})
	require.NoError(t, err)

	b.pool = pgtest.Pool(t, o.maxConns)
	b.schema = pgtest.Schema(t, b.pool)
	b.record, err = postgres.New(b.pool, postgres.Config{Schema: b.schema})
	require.NoError(t, err)
	_, err = b.pool.Exec(context.Background(), `CREATE TABLE "`+b.schema+`".effects (key text NOT NULL)`)
	require.NoError(t, err)

	b.store, err = twotier.New(twotier.Config{Lock: b.lock, Record: b.record, Lease: o.lease, Logger: o.logger})
	require.NoError(t, err)
	return b
}

// effect writes one effect row for key in the inbox's transaction.
func (b bundle) effect(ctx context.Context, key string) error {
	tx := postgres.Tx(ctx)
	if tx == nil {
		return errors.New("no postgres transaction in the handler's context")
	}
	_, err := tx.Exec(ctx, `INSERT INTO "`+b.schema+`".effects (key) VALUES ($1)`, key)
	return err
}

// effects counts committed effect rows per key.
func (b bundle) effects(t *testing.T) map[string]int {
	t.Helper()
	rows, err := b.pool.Query(context.Background(), `SELECT key, count(*) FROM "`+b.schema+`".effects GROUP BY key`)
	require.NoError(t, err)
	defer rows.Close()
	out := map[string]int{}
	for rows.Next() {
		var (
			k string
			n int
		)
		require.NoError(t, rows.Scan(&k, &n))
		out[k] = n
	}
	require.NoError(t, rows.Err())
	return out
}

func (b bundle) totalEffects(t *testing.T) int {
	t.Helper()
	n := 0
	for _, c := range b.effects(t) {
		n += c
	}
	return n
}

// recordRow reads the PostgreSQL record's status and attempts, or "" and
// -1 when there is none.
func (b bundle) recordRow(t *testing.T, key dedup.Key) (string, int) {
	t.Helper()
	status, attempts := "", -1
	err := b.pool.QueryRow(context.Background(), `SELECT status, attempts FROM "`+b.schema+`".inbox WHERE consumer = $1 AND key = $2`,
		key.Consumer, key.Key).Scan(&status, &attempts)
	if err != nil {
		require.ErrorContains(t, err, "no rows")
	}
	return status, attempts
}

// lockRecord reads the lock's hash for key (a consumer that needs no
// escaping).
func (b bundle) lockRecord(t *testing.T, key dedup.Key) map[string]string {
	t.Helper()
	h, err := b.redis.HGetAll(context.Background(), b.prefix+"{"+key.Consumer+"}:"+key.Key).Result()
	require.NoError(t, err)
	return h
}

// acquires is how many connections the pool has handed out: every
// database round trip of the inbox takes one.
func (b bundle) acquires() int64 { return b.pool.Stat().AcquireCount() }

// delivery returns a new delivery (its own UUID) of the message with key.
func delivery(key string) *message.Message {
	msg := message.NewMessage(watermill.NewUUID(), []byte(key))
	msg.Metadata.Set(middleware.IdempotencyKeyMetadata, key)
	return msg
}

func newInbox(t *testing.T, store dedup.TxStore, consumer string) *middleware.Inbox {
	t.Helper()
	in, err := middleware.NewInbox(middleware.InboxConfig{TxStore: store, Consumer: consumer, InFlightDelay: 5 * time.Millisecond})
	require.NoError(t, err)
	return in
}

// harness runs the inbox in transactional mode under a real Watermill
// router on a GoChannel: several handlers of one consumer, each on a topic
// of its own, so that copies of one key published to different topics are
// delivered concurrently. A nacked message is redelivered.
type harness struct {
	t      *testing.T
	pubSub *gochannel.GoChannel
	inbox  *middleware.Inbox
	topics []string
	runs   atomic.Int64

	acked, inFlight, otherErrs atomic.Int64
	firstOther                 atomic.Value

	// gate is held for reading by every delivery while it runs, and for
	// writing by pause.
	gate sync.RWMutex
}

func newHarness(t *testing.T, b bundle, handlers int) *harness {
	t.Helper()
	logger := watermill.NopLogger{}
	h := &harness{t: t, pubSub: gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 1024}, logger)}
	h.inbox = newInbox(t, b.store, "orders")
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, logger)
	require.NoError(t, err)
	router.AddMiddleware(h.observe, h.inbox.Middleware)
	for i := 0; i < handlers; i++ {
		topic := fmt.Sprintf("orders-%d", i)
		h.topics = append(h.topics, topic)
		router.AddConsumerHandler(topic, topic, h.pubSub, func(msg *message.Message) error {
			h.runs.Add(1)
			return b.effect(msg.Context(), middleware.IdempotencyKey(msg.Context()))
		})
	}
	ctx, cancel := context.WithCancel(context.Background())
	routerDone := make(chan error, 1)
	go func() { routerDone <- router.Run(ctx) }()
	<-router.Running()
	t.Cleanup(func() {
		cancel()
		require.NoError(t, <-routerDone)
		require.NoError(t, router.Close())
		require.NoError(t, h.pubSub.Close())
	})
	return h
}

// observe counts how each delivery ended; a failed one pauses a little
// before its nack, as a retry middleware would.
func (h *harness) observe(next message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		h.gate.RLock()
		out, err := next(msg)
		h.gate.RUnlock()
		switch {
		case err == nil:
			h.acked.Add(1)
			return out, nil
		case errors.Is(err, middleware.ErrInFlight):
			h.inFlight.Add(1)
		default:
			h.otherErrs.Add(1)
			h.firstOther.CompareAndSwap(nil, err.Error())
		}
		time.Sleep(2 * time.Millisecond)
		return nil, err
	}
}

// pause waits until no delivery runs and holds new ones back until resume.
func (h *harness) pause() { h.gate.Lock() }

// resume lets deliveries run again.
func (h *harness) resume() { h.gate.Unlock() }

// publish publishes copies deliveries of each key, copy c to handler c
// (modulo the number of handlers).
func (h *harness) publish(keys []string, copies int) {
	h.t.Helper()
	for c := 0; c < copies; c++ {
		topic := h.topics[c%len(h.topics)]
		for _, k := range keys {
			require.NoError(h.t, h.pubSub.Publish(topic, delivery(k)))
		}
	}
}

func (h *harness) waitAcked(n int64) {
	h.t.Helper()
	waitFor(h.t, fmt.Sprintf("%d acked deliveries", n), func() bool { return h.acked.Load() >= n })
}

func (h *harness) requireNoOtherErrors() {
	h.t.Helper()
	require.Zero(h.t, h.otherErrs.Load(), "unexpected handler error: %v", h.firstOther.Load())
}

// waitFor polls cond until it holds, failing the test after a minute: a
// liveness bound, not a measurement.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(time.Minute)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func keys(prefix string, n int) []string {
	out := make([]string, n)
	for i := range out {
		out[i] = fmt.Sprintf("%s-%d", prefix, i)
	}
	return out
}
