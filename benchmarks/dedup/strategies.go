package main

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	wmw "github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/oncemill/oncemill/dedup"
	"github.com/oncemill/oncemill/dedup/dedupdriver"
	"github.com/oncemill/oncemill/dedup/memory"
	"github.com/oncemill/oncemill/dedup/postgres"
	"github.com/oncemill/oncemill/dedup/sqlite"
	"github.com/oncemill/oncemill/dedup/sqlstore"
	"github.com/oncemill/oncemill/dedup/twotier"
	dlv "github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/middleware"
	"github.com/oncemill/oncemill/observe"
	"github.com/oncemill/oncemill/observe/prom"
)

// Strategy names, as they appear in the report.
const (
	stNone      = "none"
	stWatermill = "watermill-deduplicator"
	stMemory    = "memory-lease"
	stRedis     = "redis-lease"
	stPostgres  = "postgres-inbox"
	// stPGBrokerCount is the postgres inbox, defaults unchanged, on a
	// stream that stamps delivery.Attempts on each delivery as the adapter
	// of a broker that counts deliveries does (RabbitMQ quorum, SQS,
	// JetStream): a first delivery (Attempts 1) goes without the attempt
	// record, a redelivery keeps it.
	stPGBrokerCount = "postgres-inbox-broker-counted"
	// stPGMarked is the postgres inbox, defaults unchanged, behind a
	// subscriber that keeps a hand-out mark in the store
	// (kafka.SubscriberConfig.HandOutMarks): one durable write raises
	// the mark ahead of markAhead deliveries, a first delivery goes out
	// with delivery.Attempts 1 and a redelivery marked
	// delivery.Redelivered, so the crash-loop count stays on.
	stPGMarked = "postgres-inbox-marked"
	// stPGNoStart is the postgres inbox without the attempt-start record
	// that counts attempts whose process died: what the crash-loop
	// protection costs is the gap between the two.
	stPGNoStart = "postgres-inbox-no-start"
	// stPGNever is the postgres inbox with PipelineNever: every statement
	// on its own, what the default's pipelining saves is the gap.
	stPGNever = "postgres-inbox-unpipelined"
	// stPGPipe is the postgres inbox with PipelineAlways: the attempt
	// record, BEGIN and the claim in one round trip.
	stPGPipe = "postgres-inbox-pipelined"
	// stPGPipeNoStart is PipelineAlways without the attempt record: BEGIN
	// and the claim in one round trip, no crash-loop count.
	stPGPipeNoStart = "postgres-inbox-pipelined-no-start"
	// stPGBatch is the postgres inbox with group commit (InboxConfig.Tuning.Batch):
	// deliveries of different keys that arrive together share one start,
	// one claim and one commit. The attempt record stays on.
	stPGBatch = "postgres-inbox-batched"
	// stPGBatchNoStart is group commit without the attempt record: what
	// the crash-loop count costs a batch is the gap between the two.
	stPGBatchNoStart = "postgres-inbox-batched-no-start"
	// stPGBatchBulk is group commit with a middleware.BatchHandler: the
	// effects of a batch's new messages written by one multi-row INSERT.
	stPGBatchBulk = "postgres-inbox-batched-bulk"
	// stPGBatchBulkX is stPGBatchBulk with each worker holding
	// rawBatchSize deliveries in flight, as a consumer with a prefetch of
	// that many does: as many messages in flight as raw-sql-batched holds.
	stPGBatchBulkX = "postgres-inbox-batched-bulk-x32"
	// stPGProm is the postgres inbox with observe/prom's hooks on: what
	// the metrics cost is the gap between the two.
	stPGProm  = "postgres-inbox+prom"
	stBloom   = "postgres+bloom"
	stTwoTier = "redis+postgres"
	stSQLite  = "sqlite-inbox"
	// stRaw is the raw-SQL baseline of the speed runs: one claim+effect
	// transaction through pgx, no middleware.
	stRaw = "raw-sql"
	// stRawBatched is the raw-SQL floor of group commit: the raw
	// baseline's statements for rawBatchSize messages in one transaction.
	stRawBatched = "raw-sql-batched"
	// stSQLStorePG is the inbox on dedup/sqlstore, dialect Postgres,
	// through database/sql on pgx's stdlib driver; stRawStdlib is its
	// baseline, raw-sql's statements through the same driver.
	stSQLStorePG = "sqlstore-postgres"
	stRawStdlib  = "raw-sql-stdlib"
	// stSQLStoreMy is the inbox on dedup/sqlstore, dialect MySQL, on
	// MariaDB through go-sql-driver/mysql; stRawMySQL is its baseline,
	// the same claim and effect hand-written for MySQL on the same pool.
	stSQLStoreMy = "sqlstore-mysql"
	// stSQLStorePGMarked and stSQLStoreMyMarked are the sqlstore rows
	// behind a subscriber with a hand-out mark, as stPGMarked.
	stSQLStorePGMarked = "sqlstore-postgres-marked"
	stSQLStoreMyMarked = "sqlstore-mysql-marked"
	stRawMySQL         = "raw-sql-mysql"
)

// Group commit, as the batched strategies and the batched raw floor run
// it: the inbox's Batch.MaxMessages and the raw floor's messages per
// transaction. Batch.Parallel keeps the library's default (4), Linger its
// 0. With one delivery per worker, c workers put at most c deliveries in
// flight, so an inbox batch holds about c/Parallel of them and
// MaxMessages 32 is a cap that 8 and 32 workers rarely reach. Parallel
// 1, 2 and 4 were measured on new keys (-strategies
// postgres-inbox-batched,postgres-inbox-batched-no-start -concurrency 8,32
// -dups 0 -skip-correctness -n 4000, one run each on 2 shared cores), in
// msgs/s at 8 / 32 workers, with the attempt record: 1173 / 2283,
// 1785 / 2866, 2228 / 3047; without it: 4835 / 6614, 4086 / 7620,
// 5409 / 7620. 4 was the fastest with the record and as fast as any
// without it; its batches averaged 2.6 and 4.0 messages per COMMIT.
const (
	batchMax     = 32
	rawBatchSize = batchMax
)

// batchConfig is the Batch setting of the batched strategies.
func batchConfig(o procOptions, minFill int) middleware.BatchConfig {
	return middleware.BatchConfig{MaxMessages: batchMax, Linger: o.Linger, MinFill: minFill}
}

// consumer scopes every key the inboxes write.
const consumer = "bench"

// effectKind says where and how a strategy's handler writes its effect.
type effectKind int

const (
	// effectPool autocommits the effect through the PostgreSQL pool, outside
	// any claim: the effect of lease mode and of the baselines.
	effectPool effectKind = iota + 1
	// effectPGTx writes it in the inbox's PostgreSQL transaction.
	effectPGTx
	// effectSQLiteTx writes it in the inbox's SQLite transaction.
	effectSQLiteTx
	// effectSQLTx writes it in dedup/sqlstore's *sql.Tx (sqlstore.Tx),
	// into the database of the strategy's store.
	effectSQLTx
	// effectPGBulk writes the effects of a batch in the inbox's PostgreSQL
	// transaction with one multi-row INSERT (middleware.BatchHandler).
	effectPGBulk
)

// strategyDef describes one way of deduplicating.
type strategyDef struct {
	Name string
	// What is a one-line description for the report.
	What string
	// Baseline marks strategies that are measured for comparison and do
	// not promise exactly-once effects across crashes.
	Baseline bool
	// ExactlyOnce marks the strategies expected to show 0 double and 0 lost
	// effects under every fault.
	ExactlyOnce bool
	// NoStart marks the inbox strategies that skip the attempt-start
	// record (SkipAttemptRecord): no crash-loop protection.
	NoStart bool
	// BrokerCount stamps each delivery with the broker's count of the
	// message's deliveries (delivery.Attempts: 1, then one more on each
	// redelivery, across restarts), as RabbitMQ quorum, SQS and JetStream
	// adapters do.
	BrokerCount bool
	// HandOutMark stamps each delivery as the Kafka subscriber does with
	// a hand-out mark: a first delivery delivery.Attempts 1, under a mark
	// written in the store ahead of it, one write per markAhead
	// deliveries; a redelivery delivery.Redelivered.
	HandOutMark bool
	// Postgres, Redis and SQLite say which durable state it needs.
	Postgres, Redis, SQLite bool
	// Stdlib says it reaches PostgreSQL through database/sql on pgx's
	// stdlib driver (a pool of its own); MySQL that its state and effect
	// live in MariaDB or MySQL.
	Stdlib, MySQL bool
	// Raw names the raw-SQL baseline its "× raw" compares with, the one on
	// its database and driver. Defaults to raw-sql.
	Raw    string
	Effect effectKind
	// InFlight is how many deliveries each worker holds at once, as a
	// subscriber with that prefetch does. Defaults to 1.
	InFlight int
}

// raw is the baseline d's ratio compares with.
func (d strategyDef) raw() string {
	if d.Raw == "" {
		return stRaw
	}
	return d.Raw
}

// strategies lists every strategy, in report order.
func strategies() []strategyDef {
	return []strategyDef{
		{Name: stNone, Baseline: true, Postgres: true, Effect: effectPool,
			What: "baseline: the handler alone, no deduplication"},
		{Name: stWatermill, Baseline: true, Postgres: true, Effect: effectPool,
			What: "baseline: Watermill's middleware.Deduplicator, in-memory expiring repository, keyed by idempotency_key"},
		{Name: stMemory, Baseline: true, Postgres: true, Effect: effectPool,
			What: "baseline: Inbox lease mode on dedup/memory (forgets on restart)"},
		{Name: stRedis, Redis: true, Postgres: true, Effect: effectPool,
			What: "Inbox lease mode on dedup/redis; the effect is outside any transaction"},
		{Name: stPostgres, ExactlyOnce: true, Postgres: true, Effect: effectPGTx,
			What: "Inbox transactional mode on dedup/postgres, its defaults (PipelineAuto: the attempt record, BEGIN and the claim in one round trip while duplicates are rare; the record alone, answering each duplicate in one, once they pass 1 in 20)"},
		{Name: stPGBrokerCount, ExactlyOnce: true, BrokerCount: true, Postgres: true, Effect: effectPGTx,
			What: "the postgres inbox, defaults unchanged, behind a broker that counts deliveries (delivery.Attempts stamped as RabbitMQ quorum, SQS and JetStream adapters do): a first delivery goes without the attempt record, a redelivery keeps it, so the crash-loop count stays on"},
		{Name: stPGMarked, ExactlyOnce: true, HandOutMark: true, Postgres: true, Effect: effectPGTx,
			What: "the postgres inbox, defaults unchanged, behind a subscriber that keeps a hand-out mark in the store, as the Kafka subscriber does with HandOutMarks: one mark write per 256 deliveries, a first delivery without the attempt record, a redelivery with it, so the crash-loop count stays on"},
		{Name: stPGNoStart, ExactlyOnce: true, NoStart: true, Postgres: true, Effect: effectPGTx,
			What: "the postgres inbox with SkipAttemptRecord: no statement before the transaction, so no crash-loop count, and duplicates go through BEGIN, claim, ROLLBACK"},
		{Name: stPGNever, ExactlyOnce: true, Postgres: true, Effect: effectPGTx,
			What: "the postgres inbox with PipelineNever: the attempt record, BEGIN, the claim, the effect and COMMIT each in a round trip of its own (a duplicate costs one)"},
		{Name: stPGPipe, ExactlyOnce: true, Postgres: true, Effect: effectPGTx,
			What: "the postgres inbox with PipelineAlways: attempt record, BEGIN and claim in one round trip whatever the duplicates (a duplicate costs two)"},
		{Name: stPGPipeNoStart, ExactlyOnce: true, NoStart: true, Postgres: true, Effect: effectPGTx,
			What: "the postgres inbox with PipelineAlways and SkipAttemptRecord: BEGIN and claim in one round trip, no crash-loop count (a duplicate costs two)"},
		{Name: stPGBatch, ExactlyOnce: true, Postgres: true, Effect: effectPGTx,
			What: fmt.Sprintf("the postgres inbox with group commit, Batch{MaxMessages: %d} (Parallel 4 and Linger 0, the defaults): deliveries of different keys that arrive together share one attempt record, one BEGIN + claim of all their keys and one COMMIT; the crash-loop count stays on", batchMax)},
		{Name: stPGBatchNoStart, ExactlyOnce: true, NoStart: true, Postgres: true, Effect: effectPGTx,
			What: "postgres-inbox-batched with SkipAttemptRecord: no attempt record before the batch's transaction, so no crash-loop count"},
		{Name: stPGBatchBulk, ExactlyOnce: true, Postgres: true, Effect: effectPGBulk,
			What: "postgres-inbox-batched with its handler a middleware.BatchHandler: the effects of a batch's new messages in one INSERT … SELECT unnest($1, $2); the crash-loop count stays on"},
		{Name: stPGBatchBulkX, ExactlyOnce: true, Postgres: true, Effect: effectPGBulk, InFlight: rawBatchSize,
			What: fmt.Sprintf("postgres-inbox-batched-bulk with each worker holding %d deliveries in flight (a subscriber's prefetch), as many as raw-sql-batched takes per transaction", rawBatchSize)},
		{Name: stPGProm, ExactlyOnce: true, Postgres: true, Effect: effectPGTx,
			What: "the postgres inbox with observe/prom's Prometheus hooks (a fresh registry): every delivery counted and timed"},
		{Name: stBloom, ExactlyOnce: true, Postgres: true, Effect: effectPGTx,
			What: "middleware.Bloom (warmed from the store) in front of the postgres inbox"},
		{Name: stTwoTier, ExactlyOnce: true, Redis: true, Postgres: true, Effect: effectPGTx,
			What: "Inbox transactional mode on dedup/twotier: Redis lock, PostgreSQL record"},
		{Name: stSQLite, ExactlyOnce: true, SQLite: true, Effect: effectSQLiteTx,
			What: "Inbox transactional mode on dedup/sqlite (a temp file, WAL, synchronous=FULL)"},
		{Name: stSQLStorePG, ExactlyOnce: true, Postgres: true, Stdlib: true, Raw: stRawStdlib, Effect: effectSQLTx,
			What: "Inbox transactional mode on dedup/sqlstore, dialect Postgres, through database/sql on pgx's stdlib driver; the effect through sqlstore.Tx; × raw is to raw-sql-stdlib"},
		{Name: stSQLStoreMy, ExactlyOnce: true, MySQL: true, Raw: stRawMySQL, Effect: effectSQLTx,
			What: "Inbox transactional mode on dedup/sqlstore, dialect MySQL, on MariaDB through go-sql-driver/mysql; the effect through sqlstore.Tx into MariaDB; × raw is to raw-sql-mysql"},
		{Name: stSQLStorePGMarked, ExactlyOnce: true, HandOutMark: true, Postgres: true, Stdlib: true, Raw: stRawStdlib, Effect: effectSQLTx,
			What: "sqlstore-postgres behind a subscriber that keeps a hand-out mark in the store (one mark write per 256 deliveries): a first delivery without the attempt record"},
		{Name: stSQLStoreMyMarked, ExactlyOnce: true, HandOutMark: true, MySQL: true, Raw: stRawMySQL, Effect: effectSQLTx,
			What: "sqlstore-mysql behind a subscriber that keeps a hand-out mark in the store (one mark write per 256 deliveries): a first delivery without the attempt record"},
	}
}

// rawDef is the raw-SQL baseline, run like a strategy in the speed runs.
func rawDef() strategyDef {
	return strategyDef{Name: stRaw, Baseline: true, Postgres: true, Effect: effectPool,
		What: "BEGIN; INSERT INTO keys … ON CONFLICT DO NOTHING RETURNING; if new INSERT effect; COMMIT — through pgx, no middleware"}
}

// rawBatchedDef is the raw-SQL floor of group commit, run like rawDef.
func rawBatchedDef() strategyDef {
	return strategyDef{Name: stRawBatched, Baseline: true, Postgres: true, Effect: effectPool,
		What: fmt.Sprintf("the raw-sql statements for up to %d messages in one transaction: each worker takes up to %d messages off the queue, BEGIN; per message, in key order, INSERT INTO keys … ON CONFLICT DO NOTHING RETURNING and, if new, INSERT effect; COMMIT — through pgx, no middleware", rawBatchSize, rawBatchSize)}
}

// baselineDefs are the raw-SQL baselines on pgx every speed cell of the
// pgx strategies runs first.
func baselineDefs() []strategyDef { return []strategyDef{rawDef(), rawBatchedDef()} }

// sqlBaselineDefs are the raw-SQL baselines of the database/sql
// strategies: raw-sql's transaction through pgx's stdlib driver, and the
// same on MySQL. A speed cell runs one first when its strategy runs.
func sqlBaselineDefs() []strategyDef {
	return []strategyDef{
		{Name: stRawStdlib, Baseline: true, Postgres: true, Stdlib: true, Effect: effectPool,
			What: "raw-sql's BEGIN; INSERT INTO keys … ON CONFLICT DO NOTHING RETURNING; if new INSERT effect; COMMIT — through database/sql on pgx's stdlib driver, the pool sqlstore-postgres uses"},
		{Name: stRawMySQL, Baseline: true, MySQL: true, Effect: effectPool,
			What: "the same on MariaDB through go-sql-driver/mysql, the pool sqlstore-mysql uses: BEGIN; INSERT IGNORE INTO keys; if a row was inserted INSERT effect; COMMIT"},
	}
}

// allDefs is every strategy and baseline.
func allDefs() []strategyDef {
	return append(append(baselineDefs(), sqlBaselineDefs()...), strategies()...)
}

// lookupStrategies returns the baselines and the strategies a run
// measures, each in report order. With no names it is all of them; names
// may name strategies and baselines. A strategy brings the baseline its
// ratio compares with: raw-sql (and raw-sql-batched) for the pgx ones,
// raw-sql-stdlib and raw-sql-mysql for the database/sql ones.
func lookupStrategies(names []string) (baselines, defs []strategyDef, err error) {
	for _, n := range names {
		if !slices.ContainsFunc(allDefs(), func(d strategyDef) bool { return d.Name == n }) {
			return nil, nil, fmt.Errorf("unknown strategy %q", n)
		}
	}
	if len(names) == 0 {
		return append(baselineDefs(), sqlBaselineDefs()...), strategies(), nil
	}
	for _, d := range strategies() {
		if slices.Contains(names, d.Name) {
			defs = append(defs, d)
		}
	}
	wanted := func(name string) bool {
		return slices.Contains(names, name) || slices.ContainsFunc(defs, func(d strategyDef) bool { return d.raw() == name })
	}
	if wanted(stRaw) || wanted(stRawBatched) {
		baselines = baselineDefs()
	}
	for _, d := range sqlBaselineDefs() {
		if wanted(d.Name) {
			baselines = append(baselines, d)
		}
	}
	return baselines, defs, nil
}

// errCrashed is what a dead process answers: nothing runs in it any more.
var errCrashed = errors.New("process crashed")

// errTransient is the handler's error in the "handler error" fault.
var errTransient = errors.New("transient handler failure (injected)")

// procOptions shape one process.
type procOptions struct {
	// Lease is the lease of lease-mode inboxes and of the two-tier lock;
	// zero keeps the library's default (30 s).
	Lease time.Duration
	// Crashable wraps the stores so that a dead process can no longer
	// reach them (speed runs leave them unwrapped).
	Crashable bool
	// ExpectedKeys sizes the Bloom filter.
	ExpectedKeys uint
	// Logger receives the middlewares' and stores' log lines.
	Logger watermill.LoggerAdapter
	// Linger is the batched inboxes' Batch.Linger; zero keeps the
	// library's default (none).
	Linger time.Duration
}

// process is one consumer process: the strategy's in-memory state and its
// handler chain over the fixture's durable state. A crash kills it; a
// restart is a new process on the same fixture.
type process struct {
	f *fixture
	// brokerCount stamps delivery.Attempts on each message (see
	// strategyDef.BrokerCount).
	brokerCount bool
	// handOutMark stamps each message as a subscriber with a hand-out
	// mark does (see strategyDef.HandOutMark).
	handOutMark bool
	handler     message.HandlerFunc
	ctx         context.Context
	cancel      context.CancelFunc

	mu   sync.Mutex // orders crash against ack
	dead atomic.Bool

	inbox *middleware.Inbox
	bloom *middleware.Bloom
	tt    *twotier.Store
}

// start builds a process of strategy d: fresh in-memory state (a new memory
// store, a new Watermill repository, a new Bloom filter warmed from the
// store), as a process that starts, or restarts after a crash, would have.
func (f *fixture) start(ctx context.Context, d strategyDef, o procOptions) (*process, error) {
	p := &process{f: f, brokerCount: d.BrokerCount, handOutMark: d.HandOutMark}
	p.ctx, p.cancel = context.WithCancel(ctx)
	if o.Logger == nil {
		o.Logger = watermill.NopLogger{}
	}
	effect := p.effectHandler(d.Effect)
	newInbox := func(cfg middleware.InboxConfig) (message.HandlerFunc, error) {
		cfg.Consumer, cfg.Lease, cfg.Logger = consumer, o.Lease, o.Logger
		in, err := middleware.NewInbox(cfg)
		if err != nil {
			return nil, fmt.Errorf("new inbox: %w", err)
		}
		p.inbox = in
		return in.Middleware(effect), nil
	}
	var err error
	switch d.Name {
	case stNone:
		p.handler = effect
	case stRaw:
		p.handler = p.rawHandler()
	case stRawBatched:
		// driveBatches runs it through p.rawBatch; no handler chain.
	case stWatermill:
		// The repository starts a cleanup goroutine that nothing stops
		// (Watermill v1.5.1); a restart leaves the old one behind.
		repo, rerr := wmw.NewMapExpiringKeyRepository(dedup.DefaultWindow)
		if rerr != nil {
			err = fmt.Errorf("watermill repository: %w", rerr)
			break
		}
		dd := &wmw.Deduplicator{
			KeyFactory: wmw.NewMessageHasherFromMetadataField(dlv.IdempotencyKey),
			Repository: repo,
			Timeout:    time.Minute,
		}
		p.handler = dd.Middleware(effect)
	case stMemory:
		p.handler, err = newInbox(middleware.InboxConfig{LeaseStore: p.lease(o, memory.New())})
	case stRedis:
		p.handler, err = newInbox(middleware.InboxConfig{LeaseStore: p.lease(o, f.redis)})
	case stPostgres, stPGBrokerCount, stPGMarked:
		p.handler, err = newInbox(middleware.InboxConfig{TxStore: p.tx(o, f.pg)})
	case stPGNoStart:
		p.handler, err = newInbox(middleware.InboxConfig{TxStore: p.tx(o, f.pg), Tuning: middleware.InboxTuning{SkipAttemptRecord: true}})
	case stPGNever:
		p.handler, err = newInbox(middleware.InboxConfig{TxStore: p.tx(o, f.pg), Tuning: middleware.InboxTuning{Pipeline: middleware.PipelineNever}})
	case stPGPipe:
		p.handler, err = newInbox(middleware.InboxConfig{TxStore: p.tx(o, f.pg), Tuning: middleware.InboxTuning{Pipeline: middleware.PipelineAlways}})
	case stPGPipeNoStart:
		p.handler, err = newInbox(middleware.InboxConfig{TxStore: p.tx(o, f.pg), Tuning: middleware.InboxTuning{Pipeline: middleware.PipelineAlways, SkipAttemptRecord: true}})
	case stPGBatch:
		p.handler, err = newInbox(middleware.InboxConfig{TxStore: p.tx(o, f.pg), Tuning: middleware.InboxTuning{Batch: batchConfig(o, f.e.cfg.BatchMinFill)}})
	case stPGBatchBulk, stPGBatchBulkX:
		p.handler, err = newInbox(middleware.InboxConfig{TxStore: p.tx(o, f.pg), Tuning: middleware.InboxTuning{Batch: batchConfig(o, f.e.cfg.BatchMinFill)}})
	case stPGBatchNoStart:
		p.handler, err = newInbox(middleware.InboxConfig{TxStore: p.tx(o, f.pg), Tuning: middleware.InboxTuning{Batch: batchConfig(o, f.e.cfg.BatchMinFill), SkipAttemptRecord: true}})
	case stPGProm:
		metrics, merr := prom.New(prom.Config{Registerer: prometheus.NewRegistry()})
		if merr != nil {
			err = fmt.Errorf("prometheus hooks: %w", merr)
			break
		}
		p.handler, err = newInbox(middleware.InboxConfig{TxStore: p.tx(o, f.pg), Hooks: []observe.Hook{metrics}})
	case stBloom:
		var inner message.HandlerFunc
		if inner, err = newInbox(middleware.InboxConfig{TxStore: p.tx(o, f.pg)}); err != nil {
			break
		}
		p.bloom, err = middleware.NewBloom(middleware.BloomConfig{
			Store: f.pg, Consumer: consumer, ExpectedKeys: o.ExpectedKeys, Logger: o.Logger,
		})
		if err != nil {
			err = fmt.Errorf("new bloom: %w", err)
			break
		}
		if _, werr := p.bloom.Warm(ctx); werr != nil {
			err = fmt.Errorf("warm bloom: %w", werr)
			break
		}
		p.handler = p.bloom.Middleware(inner)
	case stTwoTier:
		p.tt, err = twotier.New(twotier.Config{Lock: p.lease(o, f.redis), Record: p.tx(o, f.pg), Lease: o.Lease, Logger: o.Logger})
		if err != nil {
			err = fmt.Errorf("new twotier: %w", err)
			break
		}
		p.handler, err = newInbox(middleware.InboxConfig{TxStore: p.tt})
	case stSQLite:
		p.handler, err = newInbox(middleware.InboxConfig{TxStore: p.tx(o, f.sqlite)})
	case stSQLStorePG, stSQLStoreMy, stSQLStorePGMarked, stSQLStoreMyMarked:
		p.handler, err = newInbox(middleware.InboxConfig{TxStore: p.tx(o, f.sqlStore)})
	case stRawStdlib, stRawMySQL:
		p.handler = p.rawSQLHandler(d.MySQL)
	default:
		err = fmt.Errorf("unknown strategy %q", d.Name)
	}
	if err != nil {
		p.cancel()
		return nil, fmt.Errorf("%s: start process: %w", d.Name, err)
	}
	return p, nil
}

// stop ends the process's context.
func (p *process) stop() { p.cancel() }

// crash kills the process: nothing it runs reaches a store or the database
// any more, its in-flight calls are cancelled (an open transaction dies with
// its connection), and nothing more is acked.
func (p *process) crash() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.dead.CompareAndSwap(false, true) {
		p.cancel()
	}
}

// ack calls fn, the ack, unless the process died first; crash and ack are
// ordered, so that a delivery is either acked or redelivered.
func (p *process) ack(fn func()) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.dead.Load() {
		return false
	}
	fn()
	return true
}

// effectHandler returns the business handler: one INSERT of (key, payload)
// into the effects table, with the delivery's fault, if any, injected.
func (p *process) effectHandler(kind effectKind) message.HandlerFunc {
	if kind == effectPGBulk {
		return p.bulkHandler()
	}
	f := p.f
	return func(msg *message.Message) ([]*message.Message, error) {
		ctx := msg.Context()
		d := deliveryOf(ctx)
		switch {
		case d.fault == faultAfterClaim:
			p.crash()
			return nil, errCrashed
		case d.fault == faultHandlerError:
			return nil, errTransient
		case p.dead.Load():
			return nil, errCrashed
		}
		key := msg.Metadata.Get(dlv.IdempotencyKey)
		var err error
		switch kind {
		case effectPool:
			_, err = f.e.pool.Exec(ctx, f.insertEffect, key, []byte(msg.Payload))
		case effectSQLTx:
			tx := sqlstore.Tx(ctx)
			if tx == nil {
				return nil, errors.New("effect: no database/sql transaction in the context")
			}
			_, err = tx.ExecContext(ctx, f.insertEffect, key, []byte(msg.Payload))
		case effectPGTx:
			tx := postgres.Tx(ctx)
			if tx == nil {
				return nil, errors.New("effect: no PostgreSQL transaction in the context")
			}
			_, err = tx.Exec(ctx, f.insertEffect, key, []byte(msg.Payload))
		case effectSQLiteTx:
			tx := sqlite.Tx(ctx)
			if tx == nil {
				return nil, errors.New("effect: no SQLite transaction in the context")
			}
			_, err = tx.ExecContext(ctx, sqliteInsertEffect, key, []byte(msg.Payload))
		}
		if err != nil {
			return nil, fmt.Errorf("effect: %w", err)
		}
		if d.fault == faultAfterEffect {
			p.crash()
			return nil, errCrashed
		}
		return nil, nil
	}
}

// rawHandler is the raw-SQL baseline: the claim and the effect of the
// transactional inbox, written by hand.
func (p *process) rawHandler() message.HandlerFunc {
	f := p.f
	return func(msg *message.Message) ([]*message.Message, error) {
		ctx := msg.Context()
		key := msg.Metadata.Get(dlv.IdempotencyKey)
		tx, err := f.e.pool.Begin(ctx)
		if err != nil {
			return nil, fmt.Errorf("raw: begin: %w", err)
		}
		defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
		var got string
		err = tx.QueryRow(ctx, f.rawClaim, key).Scan(&got)
		switch {
		case err == nil:
			if _, err := tx.Exec(ctx, f.insertEffect, key, []byte(msg.Payload)); err != nil {
				return nil, fmt.Errorf("raw: effect: %w", err)
			}
		case !isNoRows(err):
			return nil, fmt.Errorf("raw: claim: %w", err)
		}
		if err := tx.Commit(ctx); err != nil {
			return nil, fmt.Errorf("raw: commit: %w", err)
		}
		return nil, nil
	}
}

// rawSQLHandler is rawHandler through database/sql, on the fixture's
// pool: pgx's stdlib driver, or MySQL, whose claim is INSERT IGNORE
// (no RETURNING) and tells a new key by the row it inserted. Like
// ON CONFLICT DO NOTHING, INSERT IGNORE waits on a concurrent
// transaction's uncommitted row of the same key and then ignores it.
func (p *process) rawSQLHandler(mysql bool) message.HandlerFunc {
	f := p.f
	return func(msg *message.Message) ([]*message.Message, error) {
		ctx := msg.Context()
		key := msg.Metadata.Get(dlv.IdempotencyKey)
		tx, err := f.sqlDB.BeginTx(ctx, nil)
		if err != nil {
			return nil, fmt.Errorf("raw: begin: %w", err)
		}
		defer func() { _ = tx.Rollback() }()
		var claimed bool
		if mysql {
			var res sql.Result
			if res, err = tx.ExecContext(ctx, f.rawClaim, key); err == nil {
				var n int64
				n, err = res.RowsAffected()
				claimed = n == 1
			}
		} else {
			var got string
			err = tx.QueryRowContext(ctx, f.rawClaim, key).Scan(&got)
			claimed = err == nil
			if errors.Is(err, sql.ErrNoRows) {
				err = nil
			}
		}
		if err != nil {
			return nil, fmt.Errorf("raw: claim: %w", err)
		}
		if claimed {
			if _, err := tx.ExecContext(ctx, f.insertEffect, key, []byte(msg.Payload)); err != nil {
				return nil, fmt.Errorf("raw: effect: %w", err)
			}
		}
		if err := tx.Commit(); err != nil {
			return nil, fmt.Errorf("raw: commit: %w", err)
		}
		return nil, nil
	}
}

// rawBatch is the batched raw-SQL floor: rawHandler's statements for
// every message of msgs in one transaction. The messages go in key order
// (stable, so a key's copies keep theirs), as a hand-written batch would
// take its row locks, so that two batches holding copies of the same
// keys wait for each other instead of deadlocking. BEGIN and COMMIT go
// out with the first message's context, each claim and effect with its
// own message's, so that the round trips are counted per delivery as the
// inbox's batches count them.
func (p *process) rawBatch(msgs []*message.Message) error {
	f := p.f
	msgs = slices.Clone(msgs)
	keyOf := func(m *message.Message) string { return m.Metadata.Get(dlv.IdempotencyKey) }
	slices.SortStableFunc(msgs, func(a, b *message.Message) int { return strings.Compare(keyOf(a), keyOf(b)) })
	ctx := msgs[0].Context()
	tx, err := f.e.pool.Begin(ctx)
	if err != nil {
		return fmt.Errorf("raw batch: begin: %w", err)
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	for _, m := range msgs {
		mctx, key := m.Context(), keyOf(m)
		var got string
		err := tx.QueryRow(mctx, f.rawClaim, key).Scan(&got)
		switch {
		case err == nil:
			if _, err := tx.Exec(mctx, f.insertEffect, key, []byte(m.Payload)); err != nil {
				return fmt.Errorf("raw batch: effect: %w", err)
			}
		case !isNoRows(err):
			return fmt.Errorf("raw batch: claim: %w", err)
		}
	}
	if err := tx.Commit(ctx); err != nil {
		return fmt.Errorf("raw batch: commit: %w", err)
	}
	return nil
}

// lease returns s, behind the crash gate when o.Crashable.
func (p *process) lease(o procOptions, s dedup.LeaseStore) dedup.LeaseStore {
	if !o.Crashable {
		return s
	}
	return gatedLease{LeaseStore: s, p: p}
}

// tx returns s, behind the crash gate when o.Crashable.
func (p *process) tx(o procOptions, s dedup.TxStore) dedup.TxStore {
	if !o.Crashable {
		return s
	}
	g := gatedTx{TxStore: s, p: p}
	if _, ok := s.(interface {
		dedupdriver.StartClaimer
		dedupdriver.BeginClaimer
	}); ok {
		if _, ok := s.(dedupdriver.BatchClaimer); ok {
			return gatedBatchTx{gatedPipelineTx{g}}
		}
		return gatedPipelineTx{g}
	}
	return g
}

// gatedLease is a lease store as seen from a process that may die: once it
// is dead no call reaches the store (a dead process completes and releases
// nothing; its leases stay until they expire).
type gatedLease struct {
	dedup.LeaseStore
	p *process
}

func (g gatedLease) LeaseClaim(ctx context.Context, key dedup.Key, lease, window time.Duration) (dedup.Claim, error) {
	if g.p.dead.Load() {
		return dedup.Claim{}, errCrashed
	}
	return g.LeaseStore.LeaseClaim(ctx, key, lease, window)
}

func (g gatedLease) LeaseComplete(ctx context.Context, key dedup.Key, token int64, result []byte) error {
	if g.p.dead.Load() {
		return errCrashed
	}
	return g.LeaseStore.LeaseComplete(ctx, key, token, result)
}

func (g gatedLease) LeaseExtend(ctx context.Context, key dedup.Key, token int64, lease time.Duration) (time.Time, error) {
	if g.p.dead.Load() {
		return time.Time{}, errCrashed
	}
	return g.LeaseStore.LeaseExtend(ctx, key, token, lease)
}

func (g gatedLease) LeaseRelease(ctx context.Context, key dedup.Key, token int64, f dedup.Failure) error {
	if g.p.dead.Load() {
		return errCrashed
	}
	return g.LeaseStore.LeaseRelease(ctx, key, token, f)
}

// gatedTx is a transactional store as seen from a process that may die:
// once it is dead nothing is claimed, completed, committed or recorded; an
// open transaction is rolled back, as the database does when the
// connection of a dead process goes.
type gatedTx struct {
	dedup.TxStore
	p *process
}

func (g gatedTx) InboxBegin(ctx context.Context) (dedup.InboxTx, error) {
	if g.p.dead.Load() {
		return nil, errCrashed
	}
	tx, err := g.TxStore.InboxBegin(ctx)
	if err != nil {
		return nil, err
	}
	return gatedInboxTx{InboxTx: tx, p: g.p}, nil
}

func (g gatedTx) InboxStart(ctx context.Context, key dedup.Key, window time.Duration) (dedup.Claim, error) {
	if g.p.dead.Load() {
		return dedup.Claim{}, errCrashed
	}
	return g.TxStore.InboxStart(ctx, key, window)
}

func (g gatedTx) InboxFail(ctx context.Context, key dedup.Key, f dedup.Failure, window time.Duration) error {
	if g.p.dead.Load() {
		return errCrashed
	}
	return g.TxStore.InboxFail(ctx, key, f, window)
}

// gatedPipelineTx is a gatedTx over a store that pipelines its claims,
// so that the pipelined strategies crash in their own code paths.
type gatedPipelineTx struct{ gatedTx }

func (g gatedPipelineTx) InboxStartClaim(ctx context.Context, key dedup.Key, window time.Duration) (dedup.Claim, dedup.InboxTx, dedup.Claim, error) {
	if g.p.dead.Load() {
		return dedup.Claim{}, nil, dedup.Claim{}, errCrashed
	}
	start, tx, claim, err := g.TxStore.(dedupdriver.StartClaimer).InboxStartClaim(ctx, key, window)
	if tx != nil {
		tx = gatedInboxTx{InboxTx: tx, p: g.p}
	}
	return start, tx, claim, err
}

func (g gatedPipelineTx) InboxBeginClaim(ctx context.Context, key dedup.Key, window time.Duration, hint dedupdriver.ClaimHint) (dedup.InboxTx, dedup.Claim, error) {
	if g.p.dead.Load() {
		return nil, dedup.Claim{}, errCrashed
	}
	tx, claim, err := g.TxStore.(dedupdriver.BeginClaimer).InboxBeginClaim(ctx, key, window, hint)
	if tx != nil {
		tx = gatedInboxTx{InboxTx: tx, p: g.p}
	}
	return tx, claim, err
}

// gatedBatchTx is a gatedPipelineTx over a store that also claims in
// batches, so that the batched strategies crash in their own code paths:
// a dead process counts no batch's attempts and begins no batch.
type gatedBatchTx struct{ gatedPipelineTx }

func (g gatedBatchTx) InboxStartBatch(ctx context.Context, consumer string, keys []string, window time.Duration) ([]dedup.Claim, error) {
	if g.p.dead.Load() {
		return nil, errCrashed
	}
	return g.TxStore.(dedupdriver.BatchClaimer).InboxStartBatch(ctx, consumer, keys, window)
}

func (g gatedBatchTx) InboxBeginClaimBatch(ctx context.Context, consumer string, keys []string, window time.Duration) (dedup.InboxTx, []dedup.Claim, error) {
	if g.p.dead.Load() {
		return nil, nil, errCrashed
	}
	tx, claims, err := g.TxStore.(dedupdriver.BatchClaimer).InboxBeginClaimBatch(ctx, consumer, keys, window)
	if tx != nil {
		tx = gatedInboxTx{InboxTx: tx, p: g.p}
	}
	return tx, claims, err
}

type gatedInboxTx struct {
	dedup.InboxTx
	p *process
}

func (t gatedInboxTx) InboxClaim(ctx context.Context, key dedup.Key, window time.Duration) (dedup.Claim, error) {
	if t.p.dead.Load() {
		return dedup.Claim{}, errors.Join(errCrashed, t.InboxTx.Rollback(context.WithoutCancel(ctx)))
	}
	return t.InboxTx.InboxClaim(ctx, key, window)
}

func (t gatedInboxTx) InboxComplete(ctx context.Context, key dedup.Key, result []byte) error {
	if t.p.dead.Load() {
		return errors.Join(errCrashed, t.InboxTx.Rollback(context.WithoutCancel(ctx)))
	}
	return t.InboxTx.InboxComplete(ctx, key, result)
}

func (t gatedInboxTx) Commit(ctx context.Context) error {
	if t.p.dead.Load() {
		return errors.Join(errCrashed, t.InboxTx.Rollback(context.WithoutCancel(ctx)))
	}
	return t.InboxTx.Commit(ctx)
}

// Rollback always rolls back: the database does it for a dead process.
func (t gatedInboxTx) Rollback(ctx context.Context) error {
	return t.InboxTx.Rollback(ctx)
}

// bulkHandler is effectHandler for a batch: a middleware.BatchHandler
// that writes the effects of its messages with one INSERT, the faults of
// its deliveries injected as effectHandler injects them (a handler error
// fails its message alone, through middleware.BatchErrors).
func (p *process) bulkHandler() message.HandlerFunc {
	f := p.f
	h := middleware.BatchHandler(func(ctx context.Context, msgs []*message.Message) error {
		keys := make([]string, 0, len(msgs))
		payloads := make([][]byte, 0, len(msgs))
		var failed middleware.BatchErrors
		crashAfter := false
		for _, msg := range msgs {
			d := deliveryOf(msg.Context())
			switch {
			case d.fault == faultAfterClaim:
				p.crash()
				return errCrashed
			case d.fault == faultHandlerError:
				if failed == nil {
					failed = middleware.BatchErrors{}
				}
				failed[msg.UUID] = errTransient
				continue
			case p.dead.Load():
				return errCrashed
			}
			crashAfter = crashAfter || d.fault == faultAfterEffect
			keys = append(keys, msg.Metadata.Get(dlv.IdempotencyKey))
			payloads = append(payloads, []byte(msg.Payload))
		}
		if failed != nil {
			return failed
		}
		tx := postgres.Tx(ctx)
		if tx == nil {
			return errors.New("effect: no PostgreSQL transaction in the context")
		}
		if _, err := tx.Exec(ctx, f.insertEffects, keys, payloads); err != nil {
			return fmt.Errorf("effect: %w", err)
		}
		if crashAfter {
			p.crash()
			return errCrashed
		}
		return nil
	})
	return func(msg *message.Message) ([]*message.Message, error) { return nil, h(msg) }
}
