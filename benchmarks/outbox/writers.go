package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/oncemill/oncemill/adapters"
	"github.com/oncemill/oncemill/benchmarks/internal/benchutil"
)

// What drains the outbox during the outbox rounds of a writer cell
// (WriterResult.Drain).
const (
	// drainNone: nothing; the rows the writers commit stay.
	drainNone = "none"
	// drainRelay: oncemill's relays, forwarder.Relay with its defaults.
	drainRelay = "relay"
	// drainRaw: the raw floor's workers (floor.go), one DELETE … FOR
	// UPDATE SKIP LOCKED … RETURNING, publish, commit per batch, none of
	// the relay's ordering.
	drainRaw = "raw"
)

// WriterResult is one cell of the writer-throughput measurement: Writers
// goroutines each committing one-event transactions in a loop, into the
// outbox (through forwarder.TxPublisher) or into the baseline table (the
// same INSERT, no trigger), with Relays drainers of kind Drain emptying
// the outbox during the outbox rounds.
type WriterResult struct {
	// Relays is the number of drainers: oncemill relays, or raw workers
	// when Drain is drainRaw; 0 when Drain is drainNone.
	Writers, Relays int
	// Drain is what drains the outbox: drainNone, drainRelay or drainRaw.
	Drain string
	// Baseline and Outbox hold the tx/s of each measured round, in the
	// order they ran; the two kinds alternate.
	Baseline, Outbox []float64
	// BaselineTPS and OutboxTPS are the medians of the rounds.
	BaselineTPS, OutboxTPS float64
	// Ratio is OutboxTPS / BaselineTPS.
	Ratio float64
	// PairMin and PairMax bound outbox/baseline over the interleaved pairs
	// of rounds.
	PairMin, PairMax float64
	// Backlog is the median count of rows left in the outbox when an
	// outbox round ended (with relays running: what they had not caught
	// up with; without: every row the round wrote).
	Backlog int
	// RelayQPS is the median rate of statements the drainers (relays or
	// raw workers) sent during the outbox rounds, all of them together; 0
	// without any.
	RelayQPS float64
}

// drainers describes r's drainers: "0 relays", "4 relays", "4 raw SKIP
// LOCKED workers".
func (r WriterResult) drainers() string {
	if r.Drain == drainRaw {
		return fmt.Sprintf("%d raw SKIP LOCKED workers", r.Relays)
	}
	return fmt.Sprintf("%d relays", r.Relays)
}

// writerBench is the shared state of the writer-throughput measurement:
// one schema with the outbox and its baseline table, a pool for the
// writers and one for the relays.
type writerBench struct {
	e         *env
	outbox    *ours
	baseline  string // quoted, schema-qualified baseline table
	insert    string // the baseline INSERT, the statement TxPublisher sends
	topic     string
	writers   *pgxpool.Pool
	raw       *raw // the raw floor's workers on the same outbox table
	relayPool *pgxpool.Pool
	relayStmt *queryCounter     // counts the statements on relayPool
	pub       message.Publisher // where the drainers publish: a drained GoChannel
}

// writerStage measures, for every writer count and relay count of the
// config, the commit rate of one-event transactions into the outbox and
// into the baseline table, in interleaved rounds; then, for every writer
// count, the same with as many raw SKIP LOCKED workers as the largest
// relay count in place of the relays.
func (e *env) writerStage(ctx context.Context) ([]WriterResult, error) {
	wb, closeFn, err := e.newWriterBench(ctx)
	if err != nil {
		return nil, err
	}
	defer closeFn()
	var results []WriterResult
	nRaw := slices.Max(e.cfg.WriterRelays)
	for _, w := range e.cfg.WriterCounts {
		type kind struct {
			n     int
			drain string
		}
		var kinds []kind
		for _, n := range e.cfg.WriterRelays {
			k := kind{n, drainRelay}
			if n == 0 {
				k.drain = drainNone
			}
			kinds = append(kinds, k)
		}
		if nRaw > 0 {
			kinds = append(kinds, kind{nRaw, drainRaw})
		}
		for _, k := range kinds {
			r, err := wb.cell(ctx, w, k.n, k.drain)
			if err != nil {
				return results, fmt.Errorf("%d writers, %s: %w", w, r.drainers(), err)
			}
			fmt.Fprintf(e.cfg.Out, "writers %2d, %-26s baseline %7.0f tx/s, outbox %7.0f tx/s, outbox/baseline %.2f (pairs %.2f–%.2f), outbox backlog at round end %d, drainer statements %.0f/s\n",
				w, r.drainers()+":", r.BaselineTPS, r.OutboxTPS, r.Ratio, r.PairMin, r.PairMax, r.Backlog, r.RelayQPS)
			results = append(results, r)
		}
	}
	return results, nil
}

// newWriterBench migrates a fresh outbox schema and creates the baseline
// table next to the outbox: LIKE … INCLUDING ALL copies the columns, their
// defaults and the generated lane column, the NOT NULL constraints and the
// indexes, never the triggers; the id column gets a sequence of its own.
func (e *env) newWriterBench(ctx context.Context) (*writerBench, func(), error) {
	id := benchutil.RandomID()
	o, err := newOurs(ctx, e, id)
	if err != nil {
		return nil, nil, fmt.Errorf("migrate: %w", err)
	}
	wb := &writerBench{e: e, outbox: o, raw: rawOn(o), topic: "bench_dest_" + id}
	var closers []func()
	closeFn := func() {
		for _, c := range slices.Backward(closers) {
			c()
		}
	}
	closers = append(closers, func() {
		if err := o.cleanup(context.WithoutCancel(ctx)); err != nil {
			e.logger.Error("drop schema", err, nil)
		}
	})

	names := o.names()
	base := names.OutboxName + "_baseline"
	wb.baseline = pgx.Identifier{o.schema.Schema, base}.Sanitize()
	seq := pgx.Identifier{o.schema.Schema, base + "_id_seq"}.Sanitize()
	for _, q := range []string{
		`CREATE TABLE ` + wb.baseline + ` (LIKE ` + names.Outbox + ` INCLUDING ALL)`,
		`CREATE SEQUENCE ` + seq + ` OWNED BY ` + wb.baseline + `.id`,
		`ALTER TABLE ` + wb.baseline + ` ALTER COLUMN id SET DEFAULT nextval('` + seq + `'::regclass)`,
	} {
		if _, err := e.pool.Exec(ctx, q); err != nil {
			closeFn()
			return nil, nil, fmt.Errorf("create baseline table: %w", err)
		}
	}
	trig, err := tableTriggers(ctx, e.pool, wb.baseline)
	if err == nil && trig != "" {
		err = fmt.Errorf("baseline table has triggers: %s", trig)
	}
	if err != nil {
		closeFn()
		return nil, nil, err
	}
	// The statement forwarder.TxPublisher sends for one message.
	wb.insert = `INSERT INTO ` + wb.baseline + ` (topic, uuid, partition_key, payload, metadata) VALUES ($1, $2, $3, $4, $5)`
	if err := wb.checkSameInsert(ctx, names.Outbox); err != nil {
		closeFn()
		return nil, nil, err
	}

	pcfg, err := pgxpool.ParseConfig(e.cfg.DSN)
	if err != nil {
		closeFn()
		return nil, nil, fmt.Errorf("parse DSN: %w", err)
	}
	wcfg := pcfg.Copy()
	wcfg.MaxConns = int32(max(slices.Max(e.cfg.WriterCounts), 1))
	if wb.writers, err = pgxpool.NewWithConfig(ctx, wcfg); err != nil {
		closeFn()
		return nil, nil, fmt.Errorf("connect writers: %w", err)
	}
	closers = append(closers, wb.writers.Close)
	// Each relay holds a connection for its batch transaction and may
	// hold one more while it waits; a raw worker holds one.
	rcfg := pcfg.Copy()
	wb.relayStmt = &queryCounter{}
	rcfg.ConnConfig.Tracer = wb.relayStmt
	rcfg.MaxConns = int32(max(2*slices.Max(e.cfg.WriterRelays)+2, 4))
	if wb.relayPool, err = pgxpool.NewWithConfig(ctx, rcfg); err != nil {
		closeFn()
		return nil, nil, fmt.Errorf("connect relays: %w", err)
	}
	closers = append(closers, wb.relayPool.Close)
	pub, closeDrain, err := newDrain(ctx, wb.topic)
	if err != nil {
		closeFn()
		return nil, nil, err
	}
	wb.pub = measuredSink{pub}
	closers = append(closers, func() {
		if err := closeDrain(); err != nil {
			e.logger.Error("close GoChannel", err, nil)
		}
	})
	return wb, closeFn, nil
}

// checkSameInsert has forwarder.TxPublisher write one message on a traced
// connection, in a transaction it rolls back, and checks that its INSERT,
// with the outbox's name in place of the baseline's, and its arguments are
// those writeBaseline sends for the same message.
func (wb *writerBench) checkSameInsert(ctx context.Context, outbox string) error {
	ccfg, err := pgx.ParseConfig(wb.e.cfg.DSN)
	if err != nil {
		return fmt.Errorf("parse DSN: %w", err)
	}
	capture := &insertCapture{}
	ccfg.Tracer = capture
	conn, err := pgx.ConnectConfig(ctx, ccfg)
	if err != nil {
		return fmt.Errorf("connect: %w", err)
	}
	defer func() { _ = conn.Close(context.WithoutCancel(ctx)) }()
	tx, err := conn.Begin(ctx)
	if err != nil {
		return fmt.Errorf("begin: %w", err)
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	m := newEvent(0)
	if err := wb.outbox.write(ctx, tx, wb.topic, []*message.Message{m}); err != nil {
		return fmt.Errorf("write through TxPublisher: %w", err)
	}
	if capture.n != 1 {
		return fmt.Errorf("TxPublisher sent %d INSERTs for one message, want 1", capture.n)
	}
	want := strings.Replace(wb.insert, wb.baseline, outbox, 1)
	if capture.sql != want {
		return fmt.Errorf("TxPublisher's INSERT is %q, the baseline's %q: update the baseline", capture.sql, want)
	}
	md, err := json.Marshal(m.Metadata)
	if err != nil {
		return fmt.Errorf("encode metadata: %w", err)
	}
	if got, want := fmt.Sprintf("%#v", capture.args), fmt.Sprintf("%#v", wb.baselineArgs(m, md)); got != want {
		return fmt.Errorf("TxPublisher's INSERT arguments are %s, the baseline's %s: update the baseline", got, want)
	}
	return nil
}

// queryCounter is a pgx.QueryTracer that counts statements.
type queryCounter struct{ n atomic.Int64 }

// TraceQueryStart counts the statement.
func (c *queryCounter) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	c.n.Add(1)
	return ctx
}

// TraceQueryEnd does nothing.
func (*queryCounter) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// insertCapture is a pgx.QueryTracer that keeps the INSERTs it sees.
type insertCapture struct {
	n    int
	sql  string
	args []any
}

// TraceQueryStart keeps the statement if it is an INSERT.
func (c *insertCapture) TraceQueryStart(ctx context.Context, _ *pgx.Conn, data pgx.TraceQueryStartData) context.Context {
	if strings.HasPrefix(strings.ToUpper(strings.TrimSpace(data.SQL)), "INSERT") {
		c.n++
		c.sql, c.args = data.SQL, data.Args
	}
	return ctx
}

// TraceQueryEnd does nothing.
func (*insertCapture) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// newDrain returns a GoChannel with a subscriber on topic that acks every
// message and keeps nothing, and a function that closes both.
func newDrain(ctx context.Context, topic string) (message.Publisher, func() error, error) {
	gc := adapters.NewGoChannel(gochannel.Config{OutputChannelBuffer: 1024}, watermill.NopLogger{})
	msgs, err := gc.Subscribe(ctx, topic)
	if err != nil {
		return nil, nil, errors.Join(fmt.Errorf("subscribe: %w", err), gc.Close())
	}
	var wg sync.WaitGroup
	wg.Go(func() {
		for m := range msgs {
			m.Ack()
		}
	})
	return gc, func() error {
		err := gc.Close()
		wg.Wait()
		return err
	}, nil
}

// cell measures writers writers with relays drainers of kind drain
// (drainNone, drainRelay or drainRaw): one short warm-up round of each
// kind, then WriterRepeats pairs of rounds, baseline and outbox, in
// alternating order.
func (wb *writerBench) cell(ctx context.Context, writers, relays int, drain string) (WriterResult, error) {
	r := WriterResult{Writers: writers, Relays: relays, Drain: drain}
	if (drain == drainNone) != (relays == 0) {
		return r, fmt.Errorf("drain %q with %d drainers", drain, relays)
	}
	cfg := wb.e.cfg
	warm := min(cfg.WriterRound/2, 250*time.Millisecond)
	if _, err := wb.round(ctx, writers, 0, drainNone, false, warm); err != nil {
		return r, fmt.Errorf("warm-up: %w", err)
	}
	if _, err := wb.round(ctx, writers, relays, drain, true, warm); err != nil {
		return r, fmt.Errorf("warm-up: %w", err)
	}
	var (
		backlogs []int
		qps      []float64
	)
	for rep := range cfg.WriterRepeats {
		order := []bool{false, true}
		if rep%2 == 1 {
			order = []bool{true, false}
		}
		for _, toOutbox := range order {
			rr, err := wb.round(ctx, writers, relays, drain, toOutbox, cfg.WriterRound)
			if err != nil {
				return r, err
			}
			if toOutbox {
				r.Outbox = append(r.Outbox, rr.tps)
				backlogs = append(backlogs, rr.backlog)
				qps = append(qps, rr.relayQPS)
			} else {
				r.Baseline = append(r.Baseline, rr.tps)
			}
		}
	}
	r.BaselineTPS, r.OutboxTPS = median(r.Baseline), median(r.Outbox)
	if r.BaselineTPS > 0 {
		r.Ratio = r.OutboxTPS / r.BaselineTPS
	}
	for i := range r.Baseline {
		if r.Baseline[i] <= 0 {
			continue
		}
		q := r.Outbox[i] / r.Baseline[i]
		if i == 0 || q < r.PairMin {
			r.PairMin = q
		}
		if i == 0 || q > r.PairMax {
			r.PairMax = q
		}
	}
	if len(backlogs) > 0 {
		slices.Sort(backlogs)
		r.Backlog = backlogs[len(backlogs)/2]
	}
	r.RelayQPS = median(qps)
	return r, nil
}

// roundResult is one round's commit rate and, for an outbox round, the
// rows left in the outbox when it ended and the drainers' statement rate.
type roundResult struct {
	tps      float64
	backlog  int
	relayQPS float64
}

// round empties both tables, starts relays drainers of kind drain if
// toOutbox, and runs writers goroutines for d, each committing one-event
// transactions in a loop; it returns the commits per second. The drainers
// are stopped before it returns.
func (wb *writerBench) round(ctx context.Context, writers, relays int, drain string, toOutbox bool, d time.Duration) (roundResult, error) {
	var rr roundResult
	if _, err := wb.e.pool.Exec(ctx, `TRUNCATE `+wb.baseline+`, `+wb.outbox.names().Outbox); err != nil {
		return rr, fmt.Errorf("truncate: %w", err)
	}
	write := wb.writeBaseline
	var stop func() error
	stopRelays := func() error {
		if stop == nil {
			return nil
		}
		err := stop()
		stop = nil
		return err
	}
	defer func() { _ = stopRelays() }()
	if toOutbox {
		write = wb.writeOutbox
		if relays > 0 {
			var err error
			if stop, err = wb.startDrain(ctx, drain, relays); err != nil {
				return rr, fmt.Errorf("start %s: %w", drain, err)
			}
		}
	}

	var (
		seq     atomic.Int64
		commits atomic.Int64
		wg      sync.WaitGroup
		errs    = make([]error, writers)
	)
	wctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stmts0 := wb.relayStmt.n.Load()
	start := time.Now()
	deadline := start.Add(d)
	for i := range writers {
		wg.Go(func() {
			for wctx.Err() == nil && time.Now().Before(deadline) {
				m := newEvent(int(seq.Add(1)))
				if err := wb.tx(wctx, func(tx pgx.Tx) error { return write(wctx, tx, m) }); err != nil {
					if wctx.Err() == nil {
						errs[i] = err
						cancel() // stop the others
					}
					return
				}
				commits.Add(1)
			}
		})
	}
	wg.Wait()
	elapsed := time.Since(start)
	if stop != nil {
		rr.relayQPS = float64(wb.relayStmt.n.Load()-stmts0) / elapsed.Seconds()
	}
	if err := errors.Join(errs...); err != nil {
		return rr, fmt.Errorf("write: %w", err)
	}
	if err := ctx.Err(); err != nil {
		return rr, err
	}
	rr.tps = float64(commits.Load()) / elapsed.Seconds()
	if toOutbox {
		if err := wb.e.pool.QueryRow(ctx, `SELECT count(*) FROM `+wb.outbox.names().Outbox).Scan(&rr.backlog); err != nil {
			return rr, fmt.Errorf("count backlog: %w", err)
		}
	}
	if err := stopRelays(); err != nil {
		return rr, fmt.Errorf("stop %s: %w", drain, err)
	}
	return rr, nil
}

// startDrain starts n drainers of kind drain on the relays' pool, where
// the statement counter sees them, publishing to the drained GoChannel;
// the function it returns stops them and waits for them.
func (wb *writerBench) startDrain(ctx context.Context, drain string, n int) (func() error, error) {
	switch drain {
	case drainRelay:
		return wb.outbox.startOn(ctx, wb.relayPool, n, wb.pub)
	case drainRaw:
		return wb.raw.startOn(ctx, wb.relayPool, n, wb.pub)
	}
	return nil, fmt.Errorf("unknown drain %q", drain)
}

// tx runs f in a transaction of the writers' pool: BEGIN, f, COMMIT.
func (wb *writerBench) tx(ctx context.Context, f func(pgx.Tx) error) error {
	tx, err := wb.writers.Begin(ctx)
	if err != nil {
		return fmt.Errorf("begin: %w", err)
	}
	if err := f(tx); err != nil {
		_ = tx.Rollback(context.WithoutCancel(ctx))
		return err
	}
	if err := tx.Commit(ctx); err != nil {
		return fmt.Errorf("commit: %w", err)
	}
	return nil
}

// writeOutbox writes m as an outbox row through forwarder.TxPublisher.
func (wb *writerBench) writeOutbox(ctx context.Context, tx pgx.Tx, m *message.Message) error {
	return wb.outbox.write(ctx, tx, wb.topic, []*message.Message{m})
}

// writeBaseline sends the INSERT TxPublisher would send for m (the same
// columns and values: the partition key is the UUID, the metadata its
// JSON), into the baseline table.
func (wb *writerBench) writeBaseline(ctx context.Context, tx pgx.Tx, m *message.Message) error {
	md, err := json.Marshal(m.Metadata)
	if err != nil {
		return fmt.Errorf("encode metadata: %w", err)
	}
	if _, err := tx.Exec(ctx, wb.insert, wb.baselineArgs(m, md)...); err != nil {
		return fmt.Errorf("insert baseline row: %w", err)
	}
	return nil
}

// baselineArgs are the arguments of the baseline INSERT for m, whose
// metadata encodes to md.
func (wb *writerBench) baselineArgs(m *message.Message, md []byte) []any {
	return []any{wb.topic, m.UUID, m.UUID, []byte(m.Payload), md}
}

// tableTriggers lists the user triggers of table (quoted and qualified),
// comma-separated; "" when it has none.
func tableTriggers(ctx context.Context, pool *pgxpool.Pool, table string) (string, error) {
	var s string
	err := pool.QueryRow(ctx, `SELECT COALESCE(string_agg(tgname, ', ' ORDER BY tgname), '')
FROM pg_trigger WHERE tgrelid = $1::regclass AND NOT tgisinternal`, table).Scan(&s)
	if err != nil {
		return "", fmt.Errorf("list triggers of %s: %w", table, err)
	}
	return s, nil
}

// median returns the median of xs (the mean of the middle two for an even
// count); 0 for none.
func median(xs []float64) float64 {
	if len(xs) == 0 {
		return 0
	}
	s := slices.Sorted(slices.Values(xs))
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}
