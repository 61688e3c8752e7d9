package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wjetstream "github.com/ThreeDotsLabs/watermill-nats/v2/pkg/jetstream"
	wnats "github.com/ThreeDotsLabs/watermill-nats/v2/pkg/nats"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	natsgo "github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/oncemill/oncemill/adapters/nats"
	"github.com/oncemill/oncemill/adapters/nats/embedded"
	"github.com/oncemill/oncemill/benchmarks/internal/benchutil"
	"github.com/oncemill/oncemill/dedup/postgres"
	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/middleware"
	"github.com/oncemill/oncemill/sqlschema"
)

// The subscribers compared, in report order; these short names select
// them with -systems.
const (
	// sysStock is watermill-nats's pkg/nats subscriber with JetStream: a
	// durable push consumer in a queue group.
	sysStock = "stock"
	// sysStockJS is watermill-nats's pkg/jetstream subscriber (beta): a
	// durable pull consumer read with nats.go's Consume.
	sysStockJS = "stock-jetstream"
	// sysSerial is oncemill's subscriber with one message in flight, its
	// default.
	sysSerial = "oncemill"
	// sysParallel is oncemill's subscriber with Config.MaxInFlight
	// messages in flight.
	sysParallel = "oncemill-parallel"
)

// systems lists every subscriber row, in report order.
func systems() []string { return []string{sysStock, sysStockJS, sysSerial, sysParallel} }

// stock reports whether sys is one of watermill-nats's subscribers.
func stock(sys string) bool { return sys == sysStock || sys == sysStockJS }

// The measurements.
const (
	kindThroughput = "throughput"
	kindLatency    = "latency"
	kindInProgress = "in progress"
)

// handlerName is the router handler's name, and so the inbox's consumer.
const handlerName = "payments"

// publishedAtHeader carries a latency run's publish time, in Unix
// nanoseconds.
const publishedAtHeader = "bench_published_at"

// throughputAckWait is the consumers' AckWait outside the in-progress
// runs: JetStream's default, and watermill-nats's.
const throughputAckWait = 30 * time.Second

// Sample is what one run of one subscriber measured.
type Sample struct {
	System, Kind string
	Rep          int
	// N is the messages published; Elapsed the time from the router's
	// start to the last of them handled; MsgsPerSec is N over Elapsed.
	N          int
	Elapsed    time.Duration
	MsgsPerSec float64
	// Deliveries counts handler-chain calls, redeliveries included;
	// InProgress counts the deliveries of a message while an earlier
	// delivery of it was still in the handler chain.
	Deliveries, InProgress int64
	// P50, P99 and Max are the latency run's publish-to-effect times.
	P50, P99, Max time.Duration
	// Effects is what the effects table holds afterwards.
	Effects effectCounts
	// Inbox is the inbox's counters; Errors the errors logged.
	Inbox  middleware.InboxStats
	Errors int64
}

// effectCounts is what the effects table holds at the end of a run.
type effectCounts struct {
	// Rows counts effect rows and Keys the distinct idempotency keys
	// among them; Doubled counts keys with more than one row and Lost the
	// published keys with none.
	Rows, Keys, Doubled, Lost int
}

func (c effectCounts) ok() bool { return c.Doubled == 0 && c.Lost == 0 }

// event is one payment message: its idempotency key is the payment id,
// and a duplicate has a UUID (and Nats-Msg-Id) of its own.
type event struct {
	UUID, Key string
	Payload   []byte
	Dup       bool
}

// events generates n events, round(n×ratio) of them duplicates, each a
// copy of a payment drawn uniformly from those before it. The same
// arguments give the same events.
func events(n int, ratio float64, seed uint64) (evs []event, keys int) {
	rng := rand.New(rand.NewPCG(seed, math.Float64bits(ratio)))
	dups := min(int(math.Round(float64(n)*ratio)), max(n-1, 0))
	isDup := make([]bool, n)
	for _, p := range rng.Perm(max(n-1, 0))[:dups] {
		isDup[p+1] = true
	}
	evs = make([]event, n)
	var fresh []int
	for i := range evs {
		uuid := benchutil.SeededUUID(rng)
		if isDup[i] {
			orig := evs[fresh[rng.IntN(len(fresh))]]
			evs[i] = event{UUID: uuid, Key: orig.Key, Payload: orig.Payload, Dup: true}
			continue
		}
		key := fmt.Sprintf("pay-%07d", keys)
		evs[i] = event{UUID: uuid, Key: key, Payload: fmt.Appendf(nil, `{"payment_id":%q,"amount_cents":%d}`, key, 100+rng.Int64N(100000))}
		fresh = append(fresh, i)
		keys++
	}
	return evs, keys
}

// natsMsg is ev as a producer publishes it, in the format both
// watermill-nats and oncemill read: the UUID in _watermill_message_uuid,
// the key in the idempotency_key header, the UUID as Nats-Msg-Id (so that
// JetStream keeps the duplicates, as it does for a retry after its
// duplicate window).
func (ev event) natsMsg(subject string) *natsgo.Msg {
	m := natsgo.NewMsg(subject)
	m.Data = ev.Payload
	m.Header.Set(nats.UUIDHeader, ev.UUID)
	m.Header.Set(delivery.IdempotencyKey, ev.Key)
	m.Header.Set(natsgo.MsgIdHdr, ev.UUID)
	return m
}

// env is what every run shares: the pool, the NATS server and a JetStream
// client of it, the run's random ID.
type env struct {
	cfg     Config
	pool    *pgxpool.Pool
	url     string
	nc      *natsgo.Conn
	js      jetstream.JetStream
	legacy  natsgo.JetStreamContext
	version string
	runID   string
	seq     int
}

// poolSize is the pool's connections: a connection per message in flight
// in the parallel row, and some for the inbox's duplicates that wait on a
// row lock in the in-progress runs.
func poolSize(cfg Config) int32 { return int32(cfg.MaxInFlight + 8) }

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
	pcfg, err := pgxpool.ParseConfig(cfg.DSN)
	if err != nil {
		return nil, nil, fmt.Errorf("parse PostgreSQL URL: %w", err)
	}
	pcfg.MaxConns = poolSize(cfg)
	if e.pool, err = pgxpool.NewWithConfig(ctx, pcfg); err != nil {
		return nil, nil, fmt.Errorf("connect to PostgreSQL: %w", err)
	}
	closers = append(closers, e.pool.Close)
	conns := make([]*pgxpool.Conn, 0, pcfg.MaxConns)
	for range pcfg.MaxConns {
		c, err := e.pool.Acquire(ctx)
		if err != nil {
			return nil, nil, fmt.Errorf("warm PostgreSQL connections: %w", err)
		}
		conns = append(conns, c)
	}
	for _, c := range conns {
		c.Release()
	}

	e.url = cfg.Server
	if cfg.Server == "embedded" {
		srv, err := embedded.Start(embedded.Config{})
		if err != nil {
			return nil, nil, fmt.Errorf("start embedded NATS: %w", err)
		}
		closers = append(closers, func() { _ = srv.Close() })
		e.url = srv.URL()
	}
	if e.nc, err = natsgo.Connect(e.url, natsgo.Timeout(10*time.Second)); err != nil {
		return nil, nil, fmt.Errorf("connect to NATS at %s: %w", e.url, err)
	}
	closers = append(closers, e.nc.Close)
	if e.js, err = jetstream.New(e.nc); err != nil {
		return nil, nil, fmt.Errorf("JetStream: %w", err)
	}
	if e.legacy, err = e.nc.JetStream(); err != nil {
		return nil, nil, fmt.Errorf("JetStream: %w", err)
	}
	if _, err := e.js.AccountInfo(ctx); err != nil {
		return nil, nil, fmt.Errorf("JetStream at %s (start nats-server with -js): %w", e.url, err)
	}
	e.version = "nats-server " + e.nc.ConnectedServerVersion()
	if cfg.Server == "embedded" {
		e.version += " (embedded)"
	}
	return e, closeFn, nil
}

// fixture is what one run owns, fresh for it and gone after it: a
// PostgreSQL schema (the inbox table, the effects table) and a stream
// whose name is its topic, with the group's consumer in it.
type fixture struct {
	e      *env
	schema string
	topic  string
	group  string
	insert string
}

func (e *env) newFixture(ctx context.Context) (_ *fixture, err error) {
	e.seq++
	id := fmt.Sprintf("%s_%03d", e.runID, e.seq)
	f := &fixture{e: e, schema: "bench_nats_" + id, topic: "bench_nats_" + id, group: "bench_nats_" + id}
	defer func() {
		if err != nil {
			err = errors.Join(err, f.close(context.WithoutCancel(ctx)))
		}
	}()
	if err := sqlschema.Migrate(ctx, e.pool, sqlschema.Config{Schema: f.schema}); err != nil {
		return nil, fmt.Errorf("migrate schema %s: %w", f.schema, err)
	}
	effects := pgx.Identifier{f.schema, "effects"}.Sanitize()
	if _, err := e.pool.Exec(ctx, `CREATE TABLE `+effects+` (
	id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
	idem_key text NOT NULL,
	amount_cents bigint NOT NULL,
	applied_at timestamptz NOT NULL DEFAULT clock_timestamp()
)`); err != nil {
		return nil, fmt.Errorf("create effects table: %w", err)
	}
	f.insert = `INSERT INTO ` + effects + ` (idem_key, amount_cents) VALUES ($1, $2)`
	if _, err := e.js.CreateStream(ctx, jetstream.StreamConfig{
		Name: f.topic, Subjects: []string{f.topic}, Storage: jetstream.FileStorage, Duplicates: 2 * time.Minute,
	}); err != nil {
		return nil, fmt.Errorf("create stream %s: %w", f.topic, err)
	}
	return f, nil
}

// close drops the schema and the stream, its consumers with it.
func (f *fixture) close(ctx context.Context) error {
	var errs []error
	if _, err := f.e.pool.Exec(ctx, `DROP SCHEMA IF EXISTS `+pgx.Identifier{f.schema}.Sanitize()+` CASCADE`); err != nil {
		errs = append(errs, fmt.Errorf("drop schema %s: %w", f.schema, err))
	}
	if err := f.e.js.DeleteStream(ctx, f.topic); err != nil && !errors.Is(err, jetstream.ErrStreamNotFound) {
		errs = append(errs, fmt.Errorf("delete stream %s: %w", f.topic, err))
	}
	return errors.Join(errs...)
}

// publishAll publishes evs to the fixture's stream and waits for every
// ack.
func (f *fixture) publishAll(ctx context.Context, evs []event) error {
	js, err := jetstream.New(f.e.nc, jetstream.WithPublishAsyncMaxPending(512))
	if err != nil {
		return err
	}
	acks := make([]jetstream.PubAckFuture, 0, len(evs))
	for _, ev := range evs {
		a, err := js.PublishMsgAsync(ev.natsMsg(f.topic), jetstream.WithExpectStream(f.topic))
		if err != nil {
			return fmt.Errorf("publish: %w", err)
		}
		acks = append(acks, a)
	}
	for _, a := range acks {
		select {
		case <-a.Ok():
		case err := <-a.Err():
			return fmt.Errorf("publish: %w", err)
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	return nil
}

// publishPaced publishes evs at rate messages a second, each with its
// publish time in publishedAtHeader, until done or ctx ends.
func (f *fixture) publishPaced(ctx context.Context, evs []event, rate int) error {
	tick := time.NewTicker(time.Second / time.Duration(rate))
	defer tick.Stop()
	for _, ev := range evs {
		select {
		case <-tick.C:
		case <-ctx.Done():
			return ctx.Err()
		}
		m := ev.natsMsg(f.topic)
		m.Header.Set(publishedAtHeader, strconv.FormatInt(time.Now().UnixNano(), 10))
		if _, err := f.e.js.PublishMsg(ctx, m, jetstream.WithExpectStream(f.topic)); err != nil {
			return fmt.Errorf("publish: %w", err)
		}
	}
	return nil
}

// countEffects reads the effects table.
func (f *fixture) countEffects(ctx context.Context, keys int) (effectCounts, error) {
	var c effectCounts
	effects := pgx.Identifier{f.schema, "effects"}.Sanitize()
	err := f.e.pool.QueryRow(ctx, `SELECT
	(SELECT count(*) FROM `+effects+`)::int,
	(SELECT count(DISTINCT idem_key) FROM `+effects+`)::int,
	(SELECT count(*) FROM (SELECT 1 FROM `+effects+` GROUP BY idem_key HAVING count(*) > 1) AS d)::int`).Scan(&c.Rows, &c.Keys, &c.Doubled)
	if err != nil {
		return c, fmt.Errorf("count effects: %w", err)
	}
	c.Lost = keys - c.Keys
	return c, nil
}

// settled reports whether the group's consumer has delivered every
// message and had each acked. It asks through nats.go's older JetStream
// API, whose consumer info takes push consumers too.
func (f *fixture) settled(ctx context.Context) (bool, error) {
	info, err := f.e.legacy.ConsumerInfo(f.topic, f.group, natsgo.Context(ctx))
	if err != nil {
		return false, err
	}
	return info.NumPending == 0 && info.NumAckPending == 0, nil
}

// newSubscriber returns sys's subscriber of the fixture's group, whose
// consumer has ackWait.
func (e *env) newSubscriber(ctx context.Context, sys string, f *fixture, ackWait time.Duration, logger watermill.LoggerAdapter) (message.Subscriber, error) {
	switch sys {
	case sysStock:
		// The configuration of watermill-nats's own JetStream tests
		// (DeliverAll, AckExplicit, synchronous acks), durable in a queue
		// group, with the consumer's AckWait and the subscriber's ack
		// timeout both ackWait.
		return wnats.NewSubscriber(wnats.SubscriberConfig{
			URL:              e.url,
			QueueGroupPrefix: f.group,
			SubscribersCount: 1,
			AckWaitTimeout:   ackWait,
			CloseTimeout:     10 * time.Second,
			Unmarshaler:      &wnats.NATSMarshaler{},
			JetStream: wnats.JetStreamConfig{
				SubscribeOptions: []natsgo.SubOpt{natsgo.DeliverAll(), natsgo.AckExplicit(), natsgo.AckWait(ackWait)},
				DurablePrefix:    f.group,
			},
		}, logger)
	case sysStockJS:
		// GroupedConsumer's durable consumer, with the AckWait.
		return wjetstream.NewSubscriber(wjetstream.SubscriberConfig{
			URL:            e.url,
			Logger:         logger,
			AckWaitTimeout: ackWait,
			ResourceInitializer: func(ctx context.Context, js jetstream.JetStream, topic string) (jetstream.Consumer, func(context.Context, watermill.LoggerAdapter), error) {
				s, err := js.Stream(ctx, topic)
				if err != nil {
					return nil, nil, err
				}
				c, err := s.CreateOrUpdateConsumer(ctx, jetstream.ConsumerConfig{Durable: f.group, AckPolicy: jetstream.AckExplicitPolicy, AckWait: ackWait})
				return c, nil, err
			},
		})
	case sysSerial, sysParallel:
		inFlight := 1
		if sys == sysParallel {
			inFlight = e.cfg.MaxInFlight
		}
		return nats.NewSubscriber(ctx, nats.SubscriberConfig{
			Config:        nats.Config{URL: e.url, Logger: logger},
			ConsumerGroup: f.group,
			AckWait:       ackWait,
			MaxInFlight:   inFlight,
			MaxAckPending: max(inFlight, nats.DefaultMaxAckPending),
		})
	}
	return nil, fmt.Errorf("unknown subscriber %q", sys)
}

// tracker counts a run's deliveries, notices when every message has been
// handled, and keeps each message's latency when it carries its publish
// time.
type tracker struct {
	n          int
	start      time.Time
	deliveries atomic.Int64
	inProgress atomic.Int64
	mu         sync.Mutex
	running    map[string]int // UUID → handler-chain calls under way
	handled    map[string]struct{}
	latencies  []time.Duration
	last       time.Time
	done       chan struct{}
}

func newTracker(n int) *tracker {
	return &tracker{n: n, running: map[string]int{}, handled: make(map[string]struct{}, n), done: make(chan struct{})}
}

// middleware wraps the whole handler chain, the inbox included: a message
// counts as handled when the chain returned without error, once the inbox
// committed its effect or dropped it as a duplicate.
func (t *tracker) middleware(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		t.deliveries.Add(1)
		t.mu.Lock()
		if t.running[msg.UUID] > 0 {
			t.inProgress.Add(1)
		}
		t.running[msg.UUID]++
		t.mu.Unlock()
		out, err := h(msg)
		now := time.Now()
		t.mu.Lock()
		defer t.mu.Unlock()
		t.running[msg.UUID]--
		if err != nil {
			return out, err
		}
		if _, seen := t.handled[msg.UUID]; seen {
			return out, nil
		}
		t.handled[msg.UUID] = struct{}{}
		if ns, perr := strconv.ParseInt(msg.Metadata.Get(publishedAtHeader), 10, 64); perr == nil {
			t.latencies = append(t.latencies, now.Sub(time.Unix(0, ns)))
		}
		if len(t.handled) == t.n {
			t.last = now
			close(t.done)
		}
		return out, nil
	}
}

func (t *tracker) progress() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	return len(t.handled)
}

// effectHandler is the handler every row runs: it decodes the payment and
// inserts its effect in the inbox's transaction, then works for work, if
// any, or until its context ends.
func effectHandler(insert string, work time.Duration) message.NoPublishHandlerFunc {
	return func(msg *message.Message) error {
		ctx := msg.Context()
		var p struct {
			AmountCents int64 `json:"amount_cents"`
		}
		if err := json.Unmarshal(msg.Payload, &p); err != nil {
			return fmt.Errorf("decode payment %s: %w", msg.UUID, err)
		}
		tx := postgres.Tx(ctx)
		if tx == nil {
			return errors.New("no inbox transaction in the message context")
		}
		if _, err := tx.Exec(ctx, insert, middleware.IdempotencyKey(ctx), p.AmountCents); err != nil {
			return fmt.Errorf("insert effect: %w", err)
		}
		if work <= 0 {
			return nil
		}
		t := time.NewTimer(work)
		defer t.Stop()
		select {
		case <-t.C:
			return nil
		case <-ctx.Done():
			return context.Cause(ctx)
		}
	}
}

// run measures one subscriber in one kind of run on a fresh fixture.
func (e *env) run(ctx context.Context, sys, kind string, rep int) (_ Sample, err error) {
	smp := Sample{System: sys, Kind: kind, Rep: rep}
	var (
		evs     []event
		keys    int
		ackWait = throughputAckWait
		work    time.Duration
	)
	switch kind {
	case kindThroughput:
		evs, keys = events(e.cfg.N, e.cfg.DupRatio, e.cfg.Seed)
	case kindLatency:
		evs, keys = events(int(float64(e.cfg.Rate)*e.cfg.PacedFor.Seconds()), e.cfg.DupRatio, e.cfg.Seed+1)
	case kindInProgress:
		evs, keys = events(e.cfg.Slow, 0, e.cfg.Seed+2)
		ackWait, work = e.cfg.SlowAckWait, e.cfg.SlowWork
	}
	smp.N = len(evs)
	f, err := e.newFixture(ctx)
	if err != nil {
		return smp, err
	}
	defer func() { err = errors.Join(err, f.close(context.WithoutCancel(ctx))) }()
	if kind != kindLatency {
		if err := f.publishAll(ctx, evs); err != nil {
			return smp, err
		}
	}

	logger := benchutil.NewCountingLogger(e.cfg.Out, sys, 3)
	sub, err := e.newSubscriber(ctx, sys, f, ackWait, logger)
	if err != nil {
		return smp, fmt.Errorf("subscriber: %w", err)
	}
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 30 * time.Second}, logger)
	if err != nil {
		return smp, errors.Join(fmt.Errorf("router: %w", err), sub.Close())
	}
	store, err := postgres.New(e.pool, postgres.Config{Schema: f.schema})
	if err != nil {
		return smp, errors.Join(fmt.Errorf("postgres store: %w", err), sub.Close())
	}
	inbox, err := middleware.NewInbox(middleware.InboxConfig{TxStore: store, Logger: logger})
	if err != nil {
		return smp, errors.Join(fmt.Errorf("inbox: %w", err), sub.Close())
	}
	t := newTracker(len(evs))
	h := router.AddConsumerHandler(handlerName, f.topic, sub, effectHandler(f.insert, work))
	h.AddMiddleware(t.middleware, inbox.Middleware)

	runCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	ran := make(chan error, 1)
	t.start = time.Now()
	go func() { ran <- router.Run(runCtx) }()
	published := make(chan error, 1)
	if kind == kindLatency {
		select {
		case <-router.Running():
		case err := <-ran:
			return smp, fmt.Errorf("router stopped at start: %w", err)
		}
		go func() { published <- f.publishPaced(runCtx, evs, e.cfg.Rate) }()
	} else {
		published <- nil
	}

	timeout := time.NewTimer(e.cfg.RunTimeout)
	defer timeout.Stop()
	var waitErr error
	select {
	case <-t.done:
		if err := <-published; err != nil {
			waitErr = err
		}
	case err := <-published:
		if err != nil {
			waitErr = err
			break
		}
		select {
		case <-t.done:
		case err := <-ran:
			waitErr = fmt.Errorf("router stopped early (%d of %d handled): %w", t.progress(), len(evs), err)
		case <-timeout.C:
			waitErr = fmt.Errorf("timed out after %s: %d of %d messages handled", e.cfg.RunTimeout, t.progress(), len(evs))
		}
	case err := <-ran:
		waitErr = fmt.Errorf("router stopped early (%d of %d handled): %w", t.progress(), len(evs), err)
	case <-timeout.C:
		waitErr = fmt.Errorf("timed out after %s: %d of %d messages handled", e.cfg.RunTimeout, t.progress(), len(evs))
	case <-ctx.Done():
		waitErr = ctx.Err()
	}
	if waitErr == nil && kind == kindInProgress {
		// The redeliveries JetStream has yet to make, before the
		// consumer has every message acked.
		waitErr = e.waitSettled(ctx, f, timeout.C)
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
	smp.Deliveries, smp.InProgress = t.deliveries.Load(), t.inProgress.Load()
	if len(t.latencies) > 0 {
		slices.Sort(t.latencies)
		smp.P50, smp.P99, smp.Max = quantile(t.latencies, 0.50), quantile(t.latencies, 0.99), t.latencies[len(t.latencies)-1]
	}
	smp.Inbox, smp.Errors = inbox.Stats(), logger.Errors()
	if smp.Effects, err = f.countEffects(ctx, keys); err != nil {
		return smp, err
	}
	return smp, nil
}

// waitSettled waits until the fixture's consumer has every message acked,
// or timeout fires.
func (e *env) waitSettled(ctx context.Context, f *fixture, timeout <-chan time.Time) error {
	for {
		ok, err := f.settled(ctx)
		if err != nil {
			return fmt.Errorf("consumer info: %w", err)
		}
		if ok {
			return nil
		}
		select {
		case <-timeout:
			return errors.New("timed out waiting for the consumer to have every message acked")
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// quantile returns the q-quantile of sorted (nearest rank).
func quantile(sorted []time.Duration, q float64) time.Duration {
	i := int(math.Ceil(q*float64(len(sorted)))) - 1
	return sorted[min(max(i, 0), len(sorted)-1)]
}
