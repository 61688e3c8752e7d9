package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	wkafka "github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/oncemill/oncemill/adapters/kafka"
	"github.com/oncemill/oncemill/adapters/kafka/embedded"
	"github.com/oncemill/oncemill/benchmarks/internal/benchutil"
	"github.com/oncemill/oncemill/dedup/postgres"
	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/middleware"
	"github.com/oncemill/oncemill/sqlschema"
)

// The subscribers compared, in report order; these short names select
// them with -systems.
const (
	// sysStock is watermill-kafka's own subscriber, consumer group, its
	// default Sarama config but for the initial offset.
	sysStock = "stock"
	// sysSerial is oncemill's subscriber with MaxInFlightPerPartition 1,
	// which is watermill-kafka's loop with oncemill's config.
	sysSerial = "serial"
	// sysParallel is oncemill's key-parallel subscriber.
	sysParallel = "parallel"
	// sysPipelined is the key-parallel subscriber with the inbox's
	// PipelineAlways: the attempt record, BEGIN and the claim in one round
	// trip whatever the duplicates, the same guarantees.
	sysPipelined = "parallel-pipelined"
	// sysBatched is the key-parallel subscriber with the inbox's group
	// commit (InboxConfig.Tuning.Batch): the deliveries in flight share
	// transactions, the same guarantees.
	sysBatched = "parallel-batched"
	// sysBatchHandler is the batched row with a middleware.BatchHandler:
	// the batch's new payments written by one multi-row INSERT in the
	// batch's transaction, the same guarantees.
	sysBatchHandler = "batch-handler"
	// sysNoInbox is the key-parallel subscriber with the same handler and
	// no inbox: the effect is autocommitted, deduplicated by a unique
	// index (INSERT … ON CONFLICT DO NOTHING).
	sysNoInbox = "no-inbox"
)

// pipelineOf is the inbox's Pipeline of system sys.
func pipelineOf(sys string) middleware.PipelineMode {
	if sys == sysPipelined {
		return middleware.PipelineAlways
	}
	return middleware.PipelineAuto
}

// batchConfig is the group commit of the batched rows.
var batchConfig = middleware.BatchConfig{MaxMessages: 32}

// systems lists every subscriber row, in report order.
func systems() []string {
	return []string{sysStock, sysSerial, sysParallel, sysPipelined, sysBatched, sysBatchHandler, sysNoInbox}
}

// usesInbox reports whether sys runs the handler under the inbox.
func usesInbox(sys string) bool { return sys != sysNoInbox }

// batches reports whether sys runs the inbox's group commit.
func batches(sys string) bool { return sys == sysBatched || sys == sysBatchHandler }

// handlerName is the router handler's name, and so the inbox's consumer.
const handlerName = "payments"

// Sample is what one run of one subscriber measured.
type Sample struct {
	System     string
	Partitions int
	Rep        int
	// N is the messages published; Elapsed the time from the router's
	// start (which subscribes) to the last of them handled; MsgsPerSec is
	// N over Elapsed.
	N          int
	Elapsed    time.Duration
	MsgsPerSec float64
	// FirstMsg is the time from the router's start to the first delivery:
	// the group join and the first fetch.
	FirstMsg time.Duration
	// Deliveries counts handler calls, redeliveries included;
	// PeakInFlight is the most handler calls that ran at once.
	Deliveries   int64
	PeakInFlight int64
	// Effects is what the effects table holds afterwards.
	Effects effectCounts
	// Inbox is the inbox's counters; zero without one.
	Inbox middleware.InboxStats
	// Errors counts the errors logged (router, subscriber).
	Errors int64
}

// effectCounts is what the effects table holds at the end of a run.
type effectCounts struct {
	// Rows counts effect rows and Keys the distinct idempotency keys
	// among them; Doubled counts keys with more than one row and Lost
	// the stream's keys with none.
	Rows, Keys, Doubled, Lost int
	// OrderViolations counts effect rows whose seq is lower than that of
	// an earlier-applied row (lower id) of the same order.
	OrderViolations int
}

// ok reports whether the effects are exactly the stream's, in order.
func (c effectCounts) ok() bool {
	return c.Doubled == 0 && c.Lost == 0 && c.OrderViolations == 0
}

// env is what every run shares: the pool, the embedded broker with an
// admin client and a publisher, and the run's random ID.
type env struct {
	cfg     Config
	pool    *pgxpool.Pool
	conns   int32
	cluster *embedded.Cluster // nil on a real cluster
	brokers []string
	admin   sarama.ClusterAdmin
	pub     *kafka.Publisher
	runID   string
	seq     int
}

// newEnv connects to PostgreSQL, sizes and fills the pool, starts the
// embedded broker and connects an admin client and the publisher. close
// undoes all of it.
func newEnv(ctx context.Context, cfg Config) (e *env, closeFn func(), err error) {
	e = &env{cfg: cfg, runID: benchutil.RandomID()}
	var closers []func()
	closeFn = func() {
		for i := len(closers) - 1; i >= 0; i-- {
			closers[i]()
		}
	}
	defer func() {
		if err != nil {
			closeFn()
		}
	}()

	if e.conns, err = poolSize(ctx, cfg); err != nil {
		return nil, nil, err
	}
	pcfg, err := pgxpool.ParseConfig(cfg.DSN)
	if err != nil {
		return nil, nil, fmt.Errorf("parse PostgreSQL URL: %w", err)
	}
	pcfg.MaxConns = e.conns
	if e.pool, err = pgxpool.NewWithConfig(ctx, pcfg); err != nil {
		return nil, nil, fmt.Errorf("connect to PostgreSQL: %w", err)
	}
	closers = append(closers, e.pool.Close)
	if err := warmConnections(ctx, e.pool, int(e.conns)); err != nil {
		return nil, nil, err
	}

	e.brokers = cfg.Brokers
	if len(e.brokers) == 0 {
		if e.cluster, err = embedded.Start(embedded.Config{DisableAutoCreateTopics: true}); err != nil {
			return nil, nil, fmt.Errorf("start embedded Kafka: %w", err)
		}
		closers = append(closers, func() { _ = e.cluster.Close() })
		e.brokers = e.cluster.Addrs()
	}
	sc := sarama.NewConfig()
	sc.Version = sarama.V2_3_0_0 // below 2.4 against the embedded broker, see package embedded
	if e.admin, err = sarama.NewClusterAdmin(e.brokers, sc); err != nil {
		return nil, nil, fmt.Errorf("Kafka admin client: %w", err)
	}
	closers = append(closers, func() { _ = e.admin.Close() })
	if e.pub, err = kafka.NewPublisher(kafka.PublisherConfig{Brokers: e.brokers}, nil); err != nil {
		return nil, nil, fmt.Errorf("Kafka publisher: %w", err)
	}
	closers = append(closers, func() { _ = e.pub.Close() })
	return e, closeFn, nil
}

// poolSize is the pool's connection count: the most messages in flight
// (MaxInFlightPerPartition times the most partitions), capped at
// cfg.MaxConns and at what PostgreSQL has left, with a margin, beside the
// connections already open.
func poolSize(ctx context.Context, cfg Config) (int32, error) {
	conn, err := pgx.Connect(ctx, cfg.DSN)
	if err != nil {
		return 0, fmt.Errorf("connect to PostgreSQL: %w", err)
	}
	defer func() { _ = conn.Close(context.Background()) }()
	var maxConns, reserved, inUse int
	if err := conn.QueryRow(ctx, `SELECT current_setting('max_connections')::int, current_setting('superuser_reserved_connections')::int,
(SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend')::int`).Scan(&maxConns, &reserved, &inUse); err != nil {
		return 0, fmt.Errorf("read max_connections: %w", err)
	}
	want := cfg.maxInFlight() * maxInts(cfg.Partitions)
	room := maxConns - reserved - inUse - connMargin
	size := min(want, cfg.MaxConns, room)
	if size < 4 {
		return 0, fmt.Errorf("PostgreSQL has room for %d more connections (max_connections %d, %d reserved, %d in use, margin %d); the benchmark needs at least 4",
			room, maxConns, reserved, inUse, connMargin)
	}
	fmt.Fprintf(cfg.Out, "pool: %d connections (in flight at most %d; -max-conns %d; PostgreSQL max_connections %d, %d reserved, %d in use, margin %d)\n",
		size, want, cfg.MaxConns, maxConns, reserved, inUse, connMargin)
	return int32(size), nil
}

// connMargin is how many of PostgreSQL's connections the benchmark leaves
// to others.
const connMargin = 16

// warmConnections makes sure the pool holds n connections before any
// clock starts, so that no run pays for dialling.
func warmConnections(ctx context.Context, pool *pgxpool.Pool, n int) error {
	conns := make([]*pgxpool.Conn, 0, n)
	defer func() {
		for _, c := range conns {
			c.Release()
		}
	}()
	for range n {
		c, err := pool.Acquire(ctx)
		if err != nil {
			return fmt.Errorf("warm PostgreSQL connections: %w", err)
		}
		conns = append(conns, c)
	}
	return nil
}

// fixture is what one run owns, fresh for it and gone after it: a
// PostgreSQL schema (the inbox table, the effects table), a topic and a
// consumer group.
type fixture struct {
	e          *env
	schema     string
	topic      string
	group      string
	partitions int
	// insert is the handler's effect statement; bulkInsert the batch
	// handler's, one row per element of its four arrays.
	insert, bulkInsert string
}

// newFixture creates the schema, its tables and the topic of a run of sys
// on partitions partitions. close removes them again.
func (e *env) newFixture(ctx context.Context, sys string, partitions int) (_ *fixture, err error) {
	e.seq++
	id := fmt.Sprintf("%s_%03d", e.runID, e.seq)
	f := &fixture{e: e, schema: "bench_kafka_" + id, topic: "bench-kafka-" + id, group: "bench-kafka-" + id, partitions: partitions}
	defer func() {
		if err != nil {
			err = errors.Join(err, f.close(context.WithoutCancel(ctx)))
		}
	}()
	if err := sqlschema.Migrate(ctx, e.pool, sqlschema.Config{Schema: f.schema}); err != nil {
		return nil, fmt.Errorf("migrate schema %s: %w", f.schema, err)
	}
	effects := pgx.Identifier{f.schema, "effects"}.Sanitize()
	ddl := `CREATE TABLE ` + effects + ` (
	id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
	idem_key text NOT NULL,
	order_id text NOT NULL,
	seq int NOT NULL,
	amount_cents bigint NOT NULL,
	applied_at timestamptz NOT NULL DEFAULT clock_timestamp()
)`
	f.insert = `INSERT INTO ` + effects + ` (idem_key, order_id, seq, amount_cents) VALUES ($1, $2, $3, $4)`
	f.bulkInsert = `INSERT INTO ` + effects + ` (idem_key, order_id, seq, amount_cents)
SELECT * FROM unnest($1::text[], $2::text[], $3::int[], $4::bigint[])`
	if !usesInbox(sys) {
		// The baseline deduplicates by itself; with the inbox, a double
		// effect must be a second row, so there is no such index.
		ddl += `;
CREATE UNIQUE INDEX ON ` + effects + ` (idem_key)`
		f.insert += ` ON CONFLICT (idem_key) DO NOTHING`
	}
	if _, err := e.pool.Exec(ctx, ddl); err != nil {
		return nil, fmt.Errorf("create effects table: %w", err)
	}
	if e.cluster != nil {
		err = e.cluster.CreateTopic(ctx, f.topic, int32(partitions))
	} else {
		err = e.admin.CreateTopic(f.topic, &sarama.TopicDetail{NumPartitions: int32(partitions), ReplicationFactor: 1}, false)
	}
	if err != nil {
		return nil, fmt.Errorf("create topic: %w", err)
	}
	return f, nil
}

// close drops the schema, the topic and the consumer group.
func (f *fixture) close(ctx context.Context) error {
	var errs []error
	if _, err := f.e.pool.Exec(ctx, `DROP SCHEMA IF EXISTS `+pgx.Identifier{f.schema}.Sanitize()+` CASCADE`); err != nil {
		errs = append(errs, fmt.Errorf("drop schema %s: %w", f.schema, err))
	}
	if err := f.e.admin.DeleteConsumerGroup(f.group); err != nil && !errors.Is(err, sarama.ErrGroupIDNotFound) {
		errs = append(errs, fmt.Errorf("delete consumer group %s: %w", f.group, err))
	}
	if err := f.e.admin.DeleteTopic(f.topic); err != nil {
		errs = append(errs, fmt.Errorf("delete topic %s: %w", f.topic, err))
	}
	return errors.Join(errs...)
}

// publishBatch is how many messages one Publish call sends.
const publishBatch = 1000

// publish writes the stream to the fixture's topic, before any consumer
// starts.
func (f *fixture) publish(s *stream) error {
	batch := make([]*message.Message, 0, publishBatch)
	for i, ev := range s.Events {
		batch = append(batch, ev.message())
		if len(batch) == publishBatch || i == len(s.Events)-1 {
			if err := f.e.pub.Publish(f.topic, batch...); err != nil {
				return fmt.Errorf("publish: %w", err)
			}
			batch = batch[:0]
		}
	}
	return nil
}

// countEffects reads the effects table: rows, distinct keys, doubled keys,
// keys lost out of the stream's, and order violations. Application order
// is the identity column: a key's next message is handed out only after
// the previous one was acked, so after its effect committed, and its
// INSERT draws a higher id.
func (f *fixture) countEffects(ctx context.Context, s *stream) (effectCounts, error) {
	var c effectCounts
	effects := pgx.Identifier{f.schema, "effects"}.Sanitize()
	err := f.e.pool.QueryRow(ctx, `SELECT
	(SELECT count(*) FROM `+effects+`)::int,
	(SELECT count(DISTINCT idem_key) FROM `+effects+`)::int,
	(SELECT count(*) FROM (SELECT 1 FROM `+effects+` GROUP BY idem_key HAVING count(*) > 1) AS d)::int,
	(SELECT count(*) FROM (SELECT seq < max(seq) OVER (PARTITION BY order_id ORDER BY id ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS back
		FROM `+effects+`) AS o WHERE back)::int`).Scan(&c.Rows, &c.Keys, &c.Doubled, &c.OrderViolations)
	if err != nil {
		return c, fmt.Errorf("count effects: %w", err)
	}
	c.Lost = s.Keys - c.Keys
	return c, nil
}

// tracker counts a run's deliveries and notices when every message of
// the stream has been handled.
type tracker struct {
	n          int
	start      time.Time
	deliveries atomic.Int64
	first      atomic.Int64 // ns after start of the first delivery, +1
	running    atomic.Int64
	peak       atomic.Int64
	mu         sync.Mutex
	handled    map[string]struct{}
	last       time.Time
	done       chan struct{}
}

func newTracker(n int) *tracker {
	return &tracker{n: n, handled: make(map[string]struct{}, n), done: make(chan struct{})}
}

// middleware wraps the whole handler chain (the inbox included): a
// message counts as handled when the chain returned without error, that
// is once the inbox committed its effect or dropped it as a duplicate.
func (t *tracker) middleware(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		t.deliveries.Add(1)
		t.first.CompareAndSwap(0, int64(time.Since(t.start))+1)
		n := t.running.Add(1)
		for p := t.peak.Load(); n > p && !t.peak.CompareAndSwap(p, n); p = t.peak.Load() {
		}
		out, err := h(msg)
		t.running.Add(-1)
		if err == nil {
			t.handledOne(msg.UUID)
		}
		return out, err
	}
}

func (t *tracker) handledOne(uuid string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if _, seen := t.handled[uuid]; seen {
		return
	}
	t.handled[uuid] = struct{}{}
	if len(t.handled) == t.n {
		t.last = time.Now()
		close(t.done)
	}
}

func (t *tracker) progress() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	return len(t.handled)
}

// effectHandler is the handler of every row but the batch handler's: it
// decodes the payment and inserts its effect. Under the inbox it uses
// only the inbox's transaction; without one (direct set) it autocommits
// on the pool.
func effectHandler(insert string, direct *pgxpool.Pool) message.NoPublishHandlerFunc {
	return func(msg *message.Message) error {
		ctx := msg.Context()
		key, p, err := decodePayment(msg)
		if err != nil {
			return err
		}
		var db interface {
			Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
		}
		if direct != nil {
			db = direct
		} else if tx := postgres.Tx(ctx); tx != nil {
			db = tx
		} else {
			return errors.New("no inbox transaction in the message context")
		}
		if _, err := db.Exec(ctx, insert, key, p.OrderID, p.Seq, p.AmountCents); err != nil {
			return fmt.Errorf("insert effect of %s: %w", key, err)
		}
		return nil
	}
}

// batchEffectHandler is the batch handler's: it decodes the batch's
// payments, as effectHandler does each, and inserts their effects with
// one statement (bulkInsert) in the batch's transaction. A payment that
// does not decode fails alone; its mates run again without it.
func batchEffectHandler(bulkInsert string) message.NoPublishHandlerFunc {
	return middleware.BatchHandler(func(ctx context.Context, msgs []*message.Message) error {
		tx := postgres.Tx(ctx)
		if tx == nil {
			return errors.New("no inbox transaction in the batch's context")
		}
		keys, orders := make([]string, 0, len(msgs)), make([]string, 0, len(msgs))
		seqs, amounts := make([]int32, 0, len(msgs)), make([]int64, 0, len(msgs))
		bad := middleware.BatchErrors{}
		for _, msg := range msgs {
			key, p, err := decodePayment(msg)
			if err != nil {
				bad[msg.UUID] = err
				continue
			}
			keys, orders = append(keys, key), append(orders, p.OrderID)
			seqs, amounts = append(seqs, int32(p.Seq)), append(amounts, p.AmountCents)
		}
		if len(bad) > 0 {
			return bad
		}
		if _, err := tx.Exec(ctx, bulkInsert, keys, orders, seqs, amounts); err != nil {
			return fmt.Errorf("insert the effects of %d payments: %w", len(keys), err)
		}
		return nil
	})
}

// decodePayment returns msg's idempotency key and payment.
func decodePayment(msg *message.Message) (string, payment, error) {
	var p payment
	if err := json.Unmarshal(msg.Payload, &p); err != nil {
		return "", p, fmt.Errorf("decode payment %s: %w", msg.UUID, err)
	}
	return msg.Metadata.Get(delivery.IdempotencyKey), p, nil
}

// newSubscriber returns the subscriber of sys for the fixture's group;
// marks, the inbox's store for the rows with an inbox, keeps oncemill's
// subscriber's hand-out marks (SubscriberConfig.HandOutMarks), as a
// consumer with the inbox sets it.
func (e *env) newSubscriber(sys, group string, marks delivery.HandOutMarks, logger watermill.LoggerAdapter) (message.Subscriber, error) {
	brokers := e.brokers
	switch sys {
	case sysStock:
		sc := wkafka.DefaultSaramaSubscriberConfig() // Version 1.0.0.0: below 2.4, as the embedded broker needs
		// The only change: the stream was published before the group
		// first joins, and Sarama's default starts at the newest offset.
		sc.Consumer.Offsets.Initial = sarama.OffsetOldest
		sub, err := wkafka.NewSubscriber(wkafka.SubscriberConfig{
			Brokers:               brokers,
			Unmarshaler:           kafka.Marshaler{},
			OverwriteSaramaConfig: sc,
			ConsumerGroup:         group,
		}, logger)
		if err != nil {
			return nil, fmt.Errorf("watermill-kafka subscriber: %w", err)
		}
		return sub, nil
	case sysSerial:
		return kafka.NewSubscriber(kafka.SubscriberConfig{Brokers: brokers, ConsumerGroup: group, MaxInFlightPerPartition: 1}, logger)
	case sysParallel, sysPipelined, sysBatched, sysBatchHandler, sysNoInbox:
		return kafka.NewSubscriber(kafka.SubscriberConfig{Brokers: brokers, ConsumerGroup: group, MaxInFlightPerPartition: e.cfg.MaxInFlight,
			HandOutMarks: marks}, logger)
	}
	return nil, fmt.Errorf("unknown subscriber %q", sys)
}

// run measures one subscriber on a fresh fixture: publish the stream,
// start the router, wait until every message is handled, stop, count.
func (e *env) run(ctx context.Context, sys string, partitions, rep int, s *stream) (_ Sample, err error) {
	smp := Sample{System: sys, Partitions: partitions, Rep: rep, N: len(s.Events)}
	f, err := e.newFixture(ctx, sys, partitions)
	if err != nil {
		return smp, err
	}
	defer func() { err = errors.Join(err, f.close(context.WithoutCancel(ctx))) }()
	if err := f.publish(s); err != nil {
		return smp, err
	}

	logger := benchutil.NewCountingLogger(e.cfg.Out, sys, 3)
	var store *postgres.Store
	if usesInbox(sys) {
		if store, err = postgres.New(e.pool, postgres.Config{Schema: f.schema}); err != nil {
			return smp, fmt.Errorf("postgres store: %w", err)
		}
	}
	var marks delivery.HandOutMarks
	if store != nil {
		marks = store
	}
	sub, err := e.newSubscriber(sys, f.group, marks, logger)
	if err != nil {
		return smp, err
	}
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, logger)
	if err != nil {
		return smp, errors.Join(fmt.Errorf("router: %w", err), sub.Close())
	}
	var (
		inbox  *middleware.Inbox
		direct *pgxpool.Pool
	)
	if usesInbox(sys) {
		icfg := middleware.InboxConfig{TxStore: store, Logger: logger, Tuning: middleware.InboxTuning{Pipeline: pipelineOf(sys)}}
		if batches(sys) {
			icfg.Tuning.Batch = batchConfig
		}
		if inbox, err = middleware.NewInbox(icfg); err != nil {
			return smp, errors.Join(fmt.Errorf("inbox: %w", err), sub.Close())
		}
	} else {
		direct = e.pool
	}
	t := newTracker(len(s.Events))
	handler := effectHandler(f.insert, direct)
	if sys == sysBatchHandler {
		handler = batchEffectHandler(f.bulkInsert)
	}
	h := router.AddConsumerHandler(handlerName, f.topic, sub, handler)
	h.AddMiddleware(t.middleware)
	if inbox != nil {
		h.AddMiddleware(inbox.Middleware)
	}

	runCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	ran := make(chan error, 1)
	t.start = time.Now()
	go func() { ran <- router.Run(runCtx) }()

	timeout := time.NewTimer(e.cfg.RunTimeout)
	defer timeout.Stop()
	var waitErr error
	select {
	case <-t.done:
	case err := <-ran:
		waitErr = fmt.Errorf("router stopped early (%d of %d handled): %w", t.progress(), len(s.Events), err)
	case <-timeout.C:
		waitErr = fmt.Errorf("timed out after %s: %d of %d messages handled", e.cfg.RunTimeout, t.progress(), len(s.Events))
	case <-ctx.Done():
		waitErr = ctx.Err()
	}
	closeErr := router.Close()
	if waitErr == nil {
		if err := <-ran; err != nil {
			closeErr = errors.Join(closeErr, fmt.Errorf("router: %w", err))
		}
	}
	if waitErr != nil || closeErr != nil {
		return smp, errors.Join(waitErr, closeErr)
	}

	smp.Elapsed = t.last.Sub(t.start)
	smp.MsgsPerSec = float64(smp.N) / smp.Elapsed.Seconds()
	smp.FirstMsg = time.Duration(t.first.Load() - 1)
	smp.Deliveries = t.deliveries.Load()
	smp.PeakInFlight = t.peak.Load()
	if inbox != nil {
		smp.Inbox = inbox.Stats()
	}
	smp.Errors = logger.Errors()
	if smp.Effects, err = f.countEffects(ctx, s); err != nil {
		return smp, err
	}
	return smp, nil
}

func maxInts(xs []int) int {
	m := 0
	for _, x := range xs {
		m = max(m, x)
	}
	return m
}
