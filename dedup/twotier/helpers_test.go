package twotier_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"
	goredis "github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/oncemill/oncemill/dedup"
	"github.com/oncemill/oncemill/dedup/postgres"
	"github.com/oncemill/oncemill/dedup/redis"
	"github.com/oncemill/oncemill/dedup/twotier"
	dlv "github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/internal/testing/msgtest"
	"github.com/oncemill/oncemill/internal/testing/pgtest"
	"github.com/oncemill/oncemill/internal/testing/redistest"
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
	// breakerProbe is the store's Config.BreakerProbe.
	breakerProbe time.Duration
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

	b.store, err = twotier.New(twotier.Config{Lock: b.lock, Record: b.record, Lease: o.lease, Logger: o.logger, BreakerProbe: o.breakerProbe})
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
	err := b.pool.QueryRow(context.Background(), `SELECT i.status, COALESCE(f.attempts, CASE WHEN i.status = 'done' THEN 1 ELSE 0 END) FROM "`+b.schema+`".inbox i
		LEFT JOIN "`+b.schema+`".inbox_failures f USING (consumer, key) WHERE consumer = $1 AND key = $2`,
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
	msg.Metadata.Set(dlv.IdempotencyKey, key)
	return msg
}

func newInbox(t *testing.T, store dedup.TxStore, consumer string) *middleware.Inbox {
	t.Helper()
	in, err := middleware.NewInbox(middleware.InboxConfig{TxStore: store, Consumer: consumer, Tuning: middleware.InboxTuning{InFlightDelay: 5 * time.Millisecond}})
	require.NoError(t, err)
	return in
}

// harness runs the inbox in transactional mode under a real Watermill
// router (see msgtest.Harness) and counts the handler's runs.
type harness struct {
	*msgtest.Harness
	inbox *middleware.Inbox
	runs  atomic.Int64
}

func newHarness(t *testing.T, b bundle, handlers int) *harness {
	t.Helper()
	return newHarnessOn(t, b.store, b, handlers)
}

// newHarnessOn is newHarness on store, which writes its effects into b's
// effects table through a postgres transaction.
func newHarnessOn(t *testing.T, store dedup.TxStore, b bundle, handlers int) *harness {
	t.Helper()
	h := &harness{inbox: newInbox(t, store, "orders")}
	h.Harness = msgtest.StartHarness(t, msgtest.HarnessConfig{
		Name:        "orders",
		Handlers:    handlers,
		Middlewares: []message.HandlerMiddleware{h.inbox.Middleware},
		Expected:    []error{middleware.ErrInFlight},
		Handler: func(msg *message.Message) error {
			h.runs.Add(1)
			return b.effect(msg.Context(), middleware.IdempotencyKey(msg.Context()))
		},
	})
	return h
}

// deadCopies reads the PostgreSQL record's count of dead copies.
func (b bundle) deadCopies(t *testing.T, key dedup.Key) int {
	t.Helper()
	var n int
	require.NoError(t, b.pool.QueryRow(context.Background(), `SELECT dead_copies FROM "`+b.schema+`".inbox_failures WHERE consumer = $1 AND key = $2`,
		key.Consumer, key.Key).Scan(&n))
	return n
}

// claim opens a transaction of b's store and claims key in it.
func (b bundle) claim(t *testing.T, key dedup.Key) (dedup.InboxTx, dedup.Claim) {
	t.Helper()
	ctx := context.Background()
	tx, err := b.store.InboxBegin(ctx)
	require.NoError(t, err)
	c, err := tx.InboxClaim(ctx, key, time.Hour)
	require.NoError(t, err)
	return tx, c
}

// countCalls counts the commands b's Redis client sends from now on.
func (b bundle) countCalls() *redistest.CallCounter {
	c := &redistest.CallCounter{}
	b.redis.AddHook(c)
	return c
}

// postgresOnly is a store of PostgreSQL alone, in a schema of its own
// with an effects table, for comparison with the two-tier store.
func postgresOnly(t *testing.T, b bundle) (*postgres.Store, bundle) {
	t.Helper()
	pb := bundle{pool: b.pool, schema: pgtest.Schema(t, b.pool)}
	store, err := postgres.New(pb.pool, postgres.Config{Schema: pb.schema})
	require.NoError(t, err)
	_, err = pb.pool.Exec(context.Background(), `CREATE TABLE "`+pb.schema+`".effects (key text NOT NULL)`)
	require.NoError(t, err)
	pb.record = store
	return store, pb
}

// waitBreakerClosed makes calls that may probe the lock, a start of a key
// already done, until the store's breaker is closed, and returns how long
// that took; it fails the test after within.
func waitBreakerClosed(t *testing.T, store *twotier.Store, key dedup.Key, within time.Duration) time.Duration {
	t.Helper()
	start := time.Now()
	require.Eventually(t, func() bool {
		c, err := store.InboxStart(context.Background(), key, time.Hour)
		if err != nil || c.State != dedup.StateDone {
			t.Errorf("start of the done key %s: state %s, error %v; want done, lock or not", key.Key, c.State, err)
		}
		return !store.Stats().BreakerOpen
	}, within, 10*time.Millisecond, "the breaker closes once the lock answers a probe")
	return time.Since(start)
}
