package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"maps"
	"slices"
	"sort"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/oncemill/oncemill/adapters"
	"github.com/oncemill/oncemill/adapters/kafka"
	"github.com/oncemill/oncemill/adapters/kafka/embedded"
	"github.com/oncemill/oncemill/benchmarks/internal/benchutil"
)

const (
	systemOurs  = "oncemill relay"
	systemStock = "Watermill forwarder"
	systemRaw   = "raw relay"
	brokerGo    = "GoChannel"
	brokerKafka = "Kafka (embedded)"
	txSize      = 50 // events per transaction when pre-writing
	writers     = 8  // goroutines writing transactions
)

// Scenario is one system with a number of instances, publishing to one
// broker.
type Scenario struct {
	System    string
	Instances int
	Broker    string
}

func (s Scenario) String() string {
	return fmt.Sprintf("%s ×%d → %s", s.System, s.Instances, s.Broker)
}

// Result holds a scenario's figures.
type Result struct {
	Scenario
	// Throughput run.
	N          int
	Delivered  int
	Elapsed    time.Duration
	Throughput float64 // msgs/s
	TimedOut   bool
	// Latency run.
	Sent       int
	SentRate   float64
	LatArrived int
	P50, P99   time.Duration
	P99Missing bool // p99 falls among events that never arrived
	P50Missing bool
	Dups       int
}

// env is what all scenarios share.
type env struct {
	cfg    Config
	pool   *pgxpool.Pool
	kafka  *embedded.Cluster
	logger watermill.LoggerAdapter
	quiet  atomic.Bool
}

// system is one outbox implementation under test.
type system interface {
	// write writes msgs to topic as outbox rows in tx.
	write(ctx context.Context, tx pgx.Tx, topic string, msgs []*message.Message) error
	// start starts n instances publishing to pub; stop stops them.
	start(ctx context.Context, n int, pub message.Publisher) (stop func() error, err error)
	// cleanup drops the system's tables.
	cleanup(ctx context.Context) error
}

// Report is everything one run measured; a stage that did not run leaves
// its field empty.
type Report struct {
	// Relay compares oncemill's relay with Watermill's forwarder:
	// throughput and latency per scenario.
	Relay []Result
	// Floor sets the relay against the raw relay.
	Floor []FloorResult
	// Writers is the writer throughput, outbox against baseline.
	Writers []WriterResult
	// Idle is the idle relay's statement rate; nil when not measured.
	Idle *IdleResult
	// Scheduled is the scheduled messages' lateness; nil when not
	// measured.
	Scheduled *ScheduledResult
	// Triggers lists the user triggers of a freshly migrated outbox
	// table, "" when it has none.
	Triggers string
}

// Run runs every stage and scenario selected by cfg and returns their
// results.
func Run(ctx context.Context, cfg Config) (Report, error) {
	var rep Report
	cfg = cfg.withDefaults()
	pcfg, err := pgxpool.ParseConfig(cfg.DSN)
	if err != nil {
		return rep, fmt.Errorf("parse DSN: %w", err)
	}
	pcfg.MaxConns = 32
	pool, err := pgxpool.NewWithConfig(ctx, pcfg)
	if err != nil {
		return rep, fmt.Errorf("connect: %w", err)
	}
	defer pool.Close()
	if err := pool.Ping(ctx); err != nil {
		return rep, fmt.Errorf("ping PostgreSQL: %w", err)
	}
	e := &env{cfg: cfg, pool: pool}
	e.logger = errorLogger{out: cfg.Out, quiet: &e.quiet}
	if rep.Triggers, err = e.outboxTriggers(ctx); err != nil {
		return rep, err
	}
	fmt.Fprintf(cfg.Out, "outbox table triggers: %q\n", rep.Triggers)
	if slices.Contains(cfg.Brokers, brokerKafka) && (cfg.runs(StageRelay) || cfg.runs(StageFloor)) {
		kc, err := embedded.Start(embedded.Config{DefaultPartitions: 4})
		if err != nil {
			return rep, fmt.Errorf("start embedded Kafka: %w", err)
		}
		defer kc.Close()
		e.kafka = kc
	}

	if cfg.runs(StageRelay) {
		if rep.Relay, err = e.relayStage(ctx); err != nil {
			return rep, err
		}
	}
	if cfg.runs(StageFloor) {
		if rep.Floor, err = e.floorStage(ctx); err != nil {
			return rep, fmt.Errorf("raw floor: %w", err)
		}
	}
	if cfg.runs(StageWriters) {
		if rep.Writers, err = e.writerStage(ctx); err != nil {
			return rep, fmt.Errorf("writer throughput: %w", err)
		}
	}
	if cfg.runs(StageIdle) {
		idle, err := e.idleStage(ctx)
		if err != nil {
			return rep, fmt.Errorf("idle relay: %w", err)
		}
		rep.Idle = &idle
	}
	if cfg.runs(StageScheduled) {
		s, err := e.scheduledStage(ctx)
		if err != nil {
			return rep, fmt.Errorf("scheduled messages: %w", err)
		}
		rep.Scheduled = &s
	}
	return rep, nil
}

// outboxTriggers migrates a throwaway schema and lists its outbox table's
// triggers.
func (e *env) outboxTriggers(ctx context.Context) (string, error) {
	o, err := newOurs(ctx, e, benchutil.RandomID())
	if err != nil {
		return "", fmt.Errorf("migrate: %w", err)
	}
	defer func() {
		if err := o.cleanup(context.WithoutCancel(ctx)); err != nil {
			e.logger.Error("drop schema", err, nil)
		}
	}()
	return tableTriggers(ctx, e.pool, o.names().Outbox)
}

// relayStage runs every scenario of the config: throughput and latency of
// each system, instance count and broker.
func (e *env) relayStage(ctx context.Context) ([]Result, error) {
	cfg := e.cfg
	var results []Result
	for _, sys := range cfg.Systems {
		for _, n := range cfg.Instances {
			for _, b := range cfg.Brokers {
				sc := Scenario{System: sys, Instances: n, Broker: b}
				r, err := e.scenario(ctx, sc)
				if err != nil {
					return results, fmt.Errorf("%s: %w", sc, err)
				}
				fmt.Fprintf(cfg.Out, "%-45s throughput %8.0f msgs/s (%d/%d in %s)   latency p50 %s p99 %s (%d/%d arrived, %.0f/s written)\n",
					sc.String(), r.Throughput, r.Delivered, r.N, r.Elapsed.Round(time.Millisecond),
					fmtLat(r.P50, r.P50Missing), fmtLat(r.P99, r.P99Missing), r.LatArrived, r.Sent, r.SentRate)
				results = append(results, r)
			}
		}
	}
	return results, nil
}

func (e *env) scenario(ctx context.Context, sc Scenario) (Result, error) {
	r := Result{Scenario: sc}
	if err := e.throughput(ctx, sc, &r); err != nil {
		return r, fmt.Errorf("throughput: %w", err)
	}
	if err := e.latency(ctx, sc, &r); err != nil {
		return r, fmt.Errorf("latency: %w", err)
	}
	return r, nil
}

// newSystem returns a fresh instance of sc's system, with its own tables.
func (e *env) newSystem(ctx context.Context, sc Scenario, id string) (system, error) {
	switch sc.System {
	case systemOurs:
		return newOurs(ctx, e, id)
	case systemStock:
		return newStock(ctx, e, id)
	case systemRaw:
		return newRaw(ctx, e, id)
	}
	return nil, fmt.Errorf("unknown system %q", sc.System)
}

// run is one measurement: a fresh system, a fresh destination topic, a sink.
type run struct {
	sys   system
	sink  *sink
	topic string
}

func (e *env) open(ctx context.Context, sc Scenario) (*run, func(), error) {
	id := benchutil.RandomID()
	sys, err := e.newSystem(ctx, sc, id)
	if err != nil {
		return nil, nil, err
	}
	topic := "bench_dest_" + id
	sk, err := e.newSink(ctx, sc.Broker, topic)
	if err != nil {
		_ = sys.cleanup(context.WithoutCancel(ctx))
		return nil, nil, err
	}
	closeFn := func() {
		if err := sk.close(); err != nil {
			e.logger.Error("close sink", err, nil)
		}
		if err := sys.cleanup(context.WithoutCancel(ctx)); err != nil {
			e.logger.Error("drop tables", err, nil)
		}
	}
	return &run{sys: sys, sink: sk, topic: topic}, closeFn, nil
}

func (e *env) throughput(ctx context.Context, sc Scenario, r *Result) error {
	n := e.cfg.NOurs
	if sc.System == systemStock {
		n = e.cfg.NStock
	}
	r.N = n
	ru, closeFn, err := e.open(ctx, sc)
	if err != nil {
		return err
	}
	defer closeFn()

	// Pre-write n events in transactions of txSize, from several writers.
	jobs := make(chan int)
	errc := make(chan error, writers)
	var wg sync.WaitGroup
	for range writers {
		wg.Go(func() {
			for first := range jobs {
				msgs := make([]*message.Message, 0, txSize)
				for i := first; i < min(first+txSize, n); i++ {
					msgs = append(msgs, newEvent(i))
				}
				if err := e.inTx(ctx, func(tx pgx.Tx) error { return ru.sys.write(ctx, tx, ru.topic, msgs) }); err != nil {
					errc <- err
					return
				}
			}
		})
	}
feed:
	for i := 0; i < n; i += txSize {
		select {
		case jobs <- i:
		case err = <-errc:
			break feed
		}
	}
	close(jobs)
	wg.Wait()
	if err != nil {
		return fmt.Errorf("pre-write: %w", err)
	}
	select {
	case err := <-errc:
		return fmt.Errorf("pre-write: %w", err)
	default:
	}

	start := time.Now()
	stop, err := ru.sys.start(ctx, sc.Instances, ru.sink.pub)
	if err != nil {
		return err
	}
	last, ok := ru.sink.rec.waitFor(ctx, n, e.cfg.Timeout)
	if err := stop(); err != nil {
		return fmt.Errorf("stop: %w", err)
	}
	r.Delivered = ru.sink.rec.count()
	r.TimedOut = !ok
	if ok {
		r.Elapsed = last.Sub(start)
	} else {
		r.Elapsed = e.cfg.Timeout
	}
	r.Throughput = float64(min(r.Delivered, n)) / r.Elapsed.Seconds()
	return ctx.Err()
}

func (e *env) latency(ctx context.Context, sc Scenario, r *Result) error {
	ru, closeFn, err := e.open(ctx, sc)
	if err != nil {
		return err
	}
	defer closeFn()

	stop, err := ru.sys.start(ctx, sc.Instances, ru.sink.pub)
	if err != nil {
		return err
	}
	defer func() {
		if stop != nil {
			_ = stop()
		}
	}()

	// Warm up: a few events, so that topics exist and the instances run.
	const warm = 20
	warmMsgs := make([]*message.Message, warm)
	for i := range warmMsgs {
		warmMsgs[i] = newEvent(-1 - i)
	}
	if err := e.inTx(ctx, func(tx pgx.Tx) error { return ru.sys.write(ctx, tx, ru.topic, warmMsgs) }); err != nil {
		return fmt.Errorf("warm-up: %w", err)
	}
	if _, ok := ru.sink.rec.waitFor(ctx, warm, 10*time.Second); !ok {
		return errors.New("warm-up events did not arrive within 10s")
	}

	// Steady load: every 10ms, Rate/100 transactions of one event each.
	var (
		mu      sync.Mutex
		commits = make(map[string]time.Time)
		jobs    = make(chan int, e.cfg.Rate)
		errc    = make(chan error, writers)
		wg      sync.WaitGroup
	)
	for range writers {
		wg.Go(func() {
			for i := range jobs {
				m := newEvent(i)
				if err := e.inTx(ctx, func(tx pgx.Tx) error {
					return ru.sys.write(ctx, tx, ru.topic, []*message.Message{m})
				}); err != nil {
					errc <- err
					return
				}
				t := time.Now()
				mu.Lock()
				commits[m.UUID] = t
				mu.Unlock()
			}
		})
	}
	perTick := max(e.cfg.Rate/100, 1)
	tick := time.NewTicker(10 * time.Millisecond)
	began := time.Now()
	seq := 0
load:
	for time.Since(began) < e.cfg.Duration {
		select {
		case <-tick.C:
			for range perTick {
				select {
				case jobs <- seq:
					seq++
				case err = <-errc:
					break load
				}
			}
		case err = <-errc:
			break load
		case <-ctx.Done():
			err = ctx.Err()
			break load
		}
	}
	tick.Stop()
	close(jobs)
	wg.Wait()
	wrote := time.Since(began)
	if err != nil {
		return fmt.Errorf("write: %w", err)
	}
	select {
	case err := <-errc:
		return fmt.Errorf("write: %w", err)
	default:
	}
	r.Sent = len(commits)
	r.SentRate = float64(r.Sent) / wrote.Seconds()
	ru.sink.rec.waitFor(ctx, warm+r.Sent, e.cfg.Drain)
	err = stop()
	stop = nil
	if err != nil {
		return fmt.Errorf("stop: %w", err)
	}

	arrivals, dups := ru.sink.rec.snapshot()
	r.Dups = dups
	lats := make([]time.Duration, 0, len(commits))
	for id, c := range commits {
		if a, ok := arrivals[id]; ok {
			lats = append(lats, a.Sub(c))
		}
	}
	r.LatArrived = len(lats)
	sort.Slice(lats, func(i, j int) bool { return lats[i] < lats[j] })
	r.P50, r.P50Missing = percentile(lats, r.Sent, 0.50)
	r.P99, r.P99Missing = percentile(lats, r.Sent, 0.99)
	return ctx.Err()
}

// percentile returns the q-quantile of total samples of which sorted holds
// the ones that arrived; the others count as infinitely late, reported by
// missing.
func percentile(sorted []time.Duration, total int, q float64) (d time.Duration, missing bool) {
	if total == 0 {
		return 0, true
	}
	i := int(float64(total)*q+0.999999) - 1
	i = max(i, 0)
	if i >= len(sorted) {
		return 0, true
	}
	return sorted[i], false
}

func (e *env) inTx(ctx context.Context, f func(pgx.Tx) error) error {
	tx, err := e.pool.Begin(ctx)
	if err != nil {
		return err
	}
	if err := f(tx); err != nil {
		_ = tx.Rollback(context.WithoutCancel(ctx))
		return err
	}
	return tx.Commit(ctx)
}

func newEvent(i int) *message.Message {
	return message.NewMessage(watermill.NewUUID(), []byte(`{"seq":`+strconv.Itoa(i)+`,"kind":"order_placed"}`))
}

// recorder keeps the first arrival time of each message UUID.
type recorder struct {
	mu       sync.Mutex
	arrivals map[string]time.Time
	last     time.Time
	dups     int
	changed  chan struct{} // closed and replaced on every new arrival
}

func newRecorder() *recorder {
	return &recorder{arrivals: make(map[string]time.Time), changed: make(chan struct{})}
}

func (r *recorder) record(uuid string, t time.Time) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if _, ok := r.arrivals[uuid]; ok {
		r.dups++
		return
	}
	r.arrivals[uuid] = t
	r.last = t
	close(r.changed)
	r.changed = make(chan struct{})
}

func (r *recorder) count() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.arrivals)
}

func (r *recorder) snapshot() (map[string]time.Time, int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return maps.Clone(r.arrivals), r.dups
}

// waitFor waits until n messages have arrived, for at most timeout, and
// returns the time the n-th arrived.
func (r *recorder) waitFor(ctx context.Context, n int, timeout time.Duration) (time.Time, bool) {
	deadline := time.NewTimer(timeout)
	defer deadline.Stop()
	for {
		r.mu.Lock()
		got, last, ch := len(r.arrivals), r.last, r.changed
		r.mu.Unlock()
		if got >= n {
			return last, true
		}
		select {
		case <-ch:
		case <-deadline.C:
			return time.Time{}, false
		case <-ctx.Done():
			return time.Time{}, false
		}
	}
}

// sink is the broker side of a run: pub is what the relays publish to, rec
// what arrived.
type sink struct {
	pub   message.Publisher
	rec   *recorder
	close func() error
}

func (e *env) newSink(ctx context.Context, broker, topic string) (*sink, error) {
	rec := newRecorder()
	switch broker {
	case brokerGo:
		gc := adapters.NewGoChannel(gochannel.Config{OutputChannelBuffer: 1024}, watermill.NopLogger{})
		msgs, err := gc.Subscribe(ctx, topic)
		if err != nil {
			return nil, err
		}
		var wg sync.WaitGroup
		wg.Go(func() {
			for m := range msgs {
				rec.record(m.UUID, time.Now())
				m.Ack()
			}
		})
		return &sink{pub: measuredSink{gc}, rec: rec, close: func() error {
			err := gc.Close()
			wg.Wait()
			return err
		}}, nil
	case brokerKafka:
		kp, err := kafka.NewPublisher(kafka.PublisherConfig{Brokers: e.kafka.Addrs()}, watermill.NopLogger{})
		if err != nil {
			return nil, err
		}
		return &sink{pub: countingPublisher{kp, rec}, rec: rec, close: kp.Close}, nil
	}
	return nil, fmt.Errorf("unknown broker %q", broker)
}

// measuredSink hands the relays a GoChannel that lives in this process on
// purpose: the benchmark measures the relay, and the subscriber is here.
// forwarder.NewRelay refuses a bare non-persistent GoChannel
// (adapters.CheckDurable), which a production relay must not be given;
// the wrapper says that this one is meant.
type measuredSink struct{ message.Publisher }

// countingPublisher publishes through the Kafka publisher as it was called
// (a relay's batch is one Publish, sent as one Kafka batch; Watermill's
// forwarder publishes one message per call) and records, for every message,
// the time its Publish returned: the broker had acknowledged it then.
type countingPublisher struct {
	message.Publisher
	rec *recorder
}

func (p countingPublisher) Publish(topic string, msgs ...*message.Message) error {
	if err := p.Publisher.Publish(topic, msgs...); err != nil {
		return err
	}
	now := time.Now()
	for _, m := range msgs {
		p.rec.record(m.UUID, now)
	}
	return nil
}

// Close is the sink's; the relays must not close the shared producer.
func (p countingPublisher) Close() error { return nil }

// errorLogger prints errors only.
// While quiet is set (instances shutting down), it prints nothing: the
// Watermill forwarder logs its cancelled queries then.
type errorLogger struct {
	out    io.Writer
	quiet  *atomic.Bool
	fields watermill.LogFields
}

func (l errorLogger) Error(msg string, err error, fields watermill.LogFields) {
	if l.quiet != nil && l.quiet.Load() {
		return
	}
	fmt.Fprintf(l.out, "ERROR %s: %v %v\n", msg, err, l.fields.Add(fields))
}
func (errorLogger) Info(string, watermill.LogFields)  {}
func (errorLogger) Debug(string, watermill.LogFields) {}
func (errorLogger) Trace(string, watermill.LogFields) {}
func (l errorLogger) With(fields watermill.LogFields) watermill.LoggerAdapter {
	return errorLogger{out: l.out, quiet: l.quiet, fields: l.fields.Add(fields)}
}
