package main

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/oncemill/oncemill/benchmarks/internal/benchutil"
	dlv "github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/middleware"
)

// outcome is what became of one delivery.
type outcome int

const (
	// acked: the handler chain returned nil and the process acked.
	acked outcome = iota + 1
	// nackedInFlight: another delivery holds the key; redelivered later.
	nackedInFlight
	// nackedError: the handler chain failed; redelivered later.
	nackedError
	// unacked: the process died before the ack; redelivered to the next
	// process.
	unacked
)

// deliver hands spec to the process's handler chain as a fresh message,
// as a subscriber would, and acks it with ack unless the process died.
func (p *process) deliver(spec *msgSpec, d *delivery, ack func()) (outcome, error) {
	_, err := p.handler(p.message(spec, d))
	switch {
	case err == nil && d.fault == faultAfterCommit:
		p.crash()
		return unacked, nil
	case err == nil:
		if p.ack(ack) {
			return acked, nil
		}
		return unacked, nil
	case p.dead.Load():
		return unacked, err
	case errors.Is(err, middleware.ErrInFlight):
		return nackedInFlight, err
	}
	return nackedError, err
}

// message builds a fresh message of spec for delivery d, as a subscriber
// would, its context carrying d.
func (p *process) message(spec *msgSpec, d *delivery) *message.Message {
	msg := message.NewMessage(spec.UUID, spec.Payload)
	msg.Metadata.Set(dlv.IdempotencyKey, spec.Key)
	switch {
	case p.brokerCount:
		msg.Metadata.Set(dlv.Attempts, strconv.Itoa(p.f.delivered(spec.UUID)))
	case p.handOutMark:
		if p.f.delivered(spec.UUID) > 1 {
			msg.Metadata.Set(dlv.Redelivered, "true")
		} else if err := p.f.handOut(p.ctx); err == nil {
			msg.Metadata.Set(dlv.Attempts, "1")
		}
		// A mark not written: the delivery goes out unmarked, recorded.
	}
	msg.SetContext(context.WithValue(p.ctx, deliveryKey{}, d))
	return msg
}

// queue holds the stream positions waiting for delivery and those in
// flight, as a broker does: a nacked message goes to the back.
type queue struct {
	mu       sync.Mutex
	cond     *sync.Cond
	items    []int
	inflight map[int]int // position → deliveries of it in flight
	stopped  bool
}

func newQueue(items []int) *queue {
	q := &queue{items: items, inflight: map[int]int{}}
	q.cond = sync.NewCond(&q.mu)
	return q
}

// next returns the next position, waiting while the queue is empty but
// deliveries in flight may put messages back; false when there is no more
// work or the queue was stopped.
func (q *queue) next() (int, bool) {
	q.mu.Lock()
	defer q.mu.Unlock()
	for len(q.items) == 0 && len(q.inflight) > 0 && !q.stopped {
		q.cond.Wait()
	}
	if q.stopped || len(q.items) == 0 {
		return 0, false
	}
	pos := q.items[0]
	q.items = q.items[1:]
	q.inflight[pos]++
	return pos, true
}

// done ends a delivery of pos; requeue puts it at the back.
func (q *queue) done(pos int, requeue bool) {
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.inflight[pos]--; q.inflight[pos] == 0 {
		delete(q.inflight, pos)
	}
	if requeue {
		q.items = append(q.items, pos)
	}
	q.cond.Broadcast()
}

// nextN is next for up to n positions: it waits for the first as next
// does and takes as many more as are queued, up to n; nil when there is
// no more work or the queue was stopped.
func (q *queue) nextN(n int) []int {
	q.mu.Lock()
	defer q.mu.Unlock()
	for len(q.items) == 0 && len(q.inflight) > 0 && !q.stopped {
		q.cond.Wait()
	}
	if q.stopped || len(q.items) == 0 {
		return nil
	}
	k := min(n, len(q.items))
	out := slices.Clone(q.items[:k])
	q.items = q.items[k:]
	for _, pos := range out {
		q.inflight[pos]++
	}
	return out
}

func (q *queue) stop() {
	q.mu.Lock()
	defer q.mu.Unlock()
	q.stopped = true
	q.cond.Broadcast()
}

// unacked returns the positions queued or in flight.
func (q *queue) unacked() []int {
	q.mu.Lock()
	defer q.mu.Unlock()
	out := slices.Clone(q.items)
	for pos := range q.inflight {
		out = append(out, pos)
	}
	return out
}

// record receives every delivery's result, from the worker goroutine w.
type record func(w, pos int, d *delivery, o outcome, err error, took time.Duration)

// drive delivers positions of s to p from workers goroutines until every
// one is acked, the process dies, or ctx ends, and returns the positions
// not acked. faultFor chooses each delivery's fault.
//
// When the process dies drive returns at once: the deliveries in flight
// are dead with it (they reach no store and ack nothing any more) and are
// redelivered to the next process, while their goroutines run out in the
// background; join waits for them.
func drive(ctx context.Context, p *process, s *stream, positions []int, workers int,
	faultFor func(pos int) fault, rec record) (left []int, join func()) {
	q := newQueue(positions)
	stopOnCtx := context.AfterFunc(ctx, q.stop)
	stopOnDeath := context.AfterFunc(p.ctx, q.stop)
	var wg sync.WaitGroup
	for w := range workers {
		wg.Go(func() {
			for {
				// A dead process takes no more messages; the check is
				// synchronous, the queue's stop on death is not.
				if p.dead.Load() {
					return
				}
				pos, ok := q.next()
				if !ok {
					return
				}
				if p.dead.Load() {
					q.done(pos, true)
					return
				}
				d := &delivery{fault: faultFor(pos)}
				start := time.Now()
				acked := false
				o, err := p.deliver(&s.Msgs[pos], d, func() { acked = true; q.done(pos, false) })
				rec(w, pos, d, o, err, time.Since(start))
				if !acked {
					q.done(pos, true)
				}
			}
		})
	}
	all := make(chan struct{})
	go func() {
		wg.Wait()
		stopOnCtx()
		stopOnDeath()
		close(all)
	}()
	select {
	case <-all:
	case <-p.ctx.Done(): // died, or ctx ended
	}
	return q.unacked(), func() { <-all }
}

// driveBatches is drive for the batched raw floor: each of workers
// goroutines takes up to size positions off the queue at once and hands
// them to p.rawBatch, one transaction for all of them; every message of
// the batch is acked when it commits and put back when it fails. Each
// message's latency is its batch's. Speed runs only: nothing crashes.
func driveBatches(ctx context.Context, p *process, s *stream, positions []int, workers, size int, rec record) (left []int, join func()) {
	q := newQueue(positions)
	stopOnCtx := context.AfterFunc(ctx, q.stop)
	var wg sync.WaitGroup
	for w := range workers {
		wg.Go(func() {
			for {
				batch := q.nextN(size)
				if batch == nil {
					return
				}
				ds := make([]*delivery, len(batch))
				msgs := make([]*message.Message, len(batch))
				for i, pos := range batch {
					ds[i] = &delivery{}
					msgs[i] = p.message(&s.Msgs[pos], ds[i])
				}
				start := time.Now()
				err := p.rawBatch(msgs)
				took := time.Since(start)
				for i, pos := range batch {
					o := nackedError
					if err == nil && p.ack(func() { q.done(pos, false) }) {
						o = acked
					} else {
						q.done(pos, true)
					}
					rec(w, pos, ds[i], o, err, took)
				}
			}
		})
	}
	all := make(chan struct{})
	go func() {
		wg.Wait()
		stopOnCtx()
		close(all)
	}()
	<-all
	return q.unacked(), func() {}
}

// SpeedResult is one speed measurement.
type SpeedResult struct {
	Strategy    string
	DupPct      int
	Concurrency int
	// N messages, Keys distinct keys, Dups copies.
	N, Keys, Dups int
	Elapsed       time.Duration
	MsgsPerSec    float64
	// RatioRaw is MsgsPerSec over the raw-SQL baseline's at the same
	// concurrency and ratio; 0 when there is none.
	RatioRaw float64
	P50, P99 time.Duration
	// Round trips per message (PostgreSQL statements, Redis commands),
	// and per new-key message and per duplicate, both kinds summed.
	PGRT, RedisRT float64
	RTNew, RTDup  float64
	// Commits counts the COMMIT statements the deliveries sent: the
	// transactions that committed (or tried to).
	Commits int64
	// AllocPerMsg is TotalAlloc's growth over the run divided by N;
	// HeapInuse is the heap in use after the run (after a GC, with the
	// strategy's state still alive) and HeapGrowth its growth since
	// before the run (after a GC too).
	AllocPerMsg float64
	HeapInuse   uint64
	HeapGrowth  int64
	// Deliveries counts handler calls, redeliveries included; InFlight the
	// nacks for a key held by another delivery; Errors the other nacks.
	Deliveries, InFlight, Errors int
	FirstError                   string
	LoggedErrors                 int64
	// Effects in the table at the end.
	Effects effectCounts
	// Bloom and two-tier counters, when the strategy has them.
	BloomMaybeSeen, BloomFalsePositives, LockHits int64
}

// speed runs stream s through strategy d with c workers.
func (e *env) speed(ctx context.Context, d strategyDef, s *stream, c int) (r SpeedResult, err error) {
	r = SpeedResult{Strategy: d.Name, DupPct: pct(s.Ratio), Concurrency: c, N: len(s.Msgs), Keys: s.Keys, Dups: s.Dups}
	fx, err := e.newFixture(ctx, d)
	if err != nil {
		return r, err
	}
	defer func() { err = errors.Join(err, fx.close()) }()
	logger := benchutil.NewCountingLogger(e.cfg.Out, d.Name, 5)
	p, err := fx.start(ctx, d, procOptions{ExpectedKeys: uint(len(s.Msgs)), Logger: logger})
	if err != nil {
		return r, err
	}
	defer p.stop()
	if err := e.warmConnections(ctx, c, fx.sqlDB, d.Redis); err != nil {
		return r, err
	}

	type workerStats struct {
		lat                        []time.Duration
		rtNew, rtDup, pg, redis    int64
		commits                    int64
		deliveries, inFlight, errs int
		firstErr                   error
	}
	goroutines := c * max(d.InFlight, 1)
	ws := make([]workerStats, goroutines)
	for i := range ws {
		ws[i].lat = make([]time.Duration, 0, len(s.Msgs)*2/goroutines+16)
	}
	var rec record = func(w, pos int, dl *delivery, o outcome, err error, took time.Duration) {
		st := &ws[w]
		st.lat = append(st.lat, took)
		st.deliveries++
		pg, rd := dl.pg.Load(), dl.redis.Load()
		st.pg += pg
		st.redis += rd
		st.commits += dl.commits.Load()
		if s.Msgs[pos].Dup {
			st.rtDup += pg + rd
		} else {
			st.rtNew += pg + rd
		}
		switch o {
		case nackedInFlight:
			st.inFlight++
		case nackedError, unacked:
			st.errs++
			if st.firstErr == nil {
				st.firstErr = err
			}
		}
	}
	positions := make([]int, len(s.Msgs))
	for i := range positions {
		positions[i] = i
	}
	runCtx, cancel := context.WithTimeoutCause(ctx, e.cfg.RunTimeout, errTimeout)
	defer cancel()
	// A strategy that fails every delivery would loop until the timeout;
	// more failed deliveries than messages ends the run.
	var failed atomic.Int64
	inner := rec
	rec = func(w, pos int, dl *delivery, o outcome, err error, took time.Duration) {
		inner(w, pos, dl, o, err, took)
		if o == nackedError && failed.Add(1) > int64(len(s.Msgs)) {
			cancel()
		}
	}

	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	start := time.Now()
	var left []int
	var join func()
	if d.Name == stRawBatched {
		left, join = driveBatches(runCtx, p, s, positions, c, rawBatchSize, rec)
	} else {
		left, join = drive(runCtx, p, s, positions, goroutines, func(int) fault { return faultNone }, rec)
	}
	r.Elapsed = time.Since(start)
	join()
	runtime.ReadMemStats(&after)
	r.AllocPerMsg = float64(after.TotalAlloc-before.TotalAlloc) / float64(len(s.Msgs))
	runtime.GC()
	runtime.ReadMemStats(&after)
	r.HeapInuse = after.HeapInuse
	r.HeapGrowth = int64(after.HeapInuse) - int64(before.HeapInuse)
	runtime.KeepAlive(p)
	if len(left) > 0 {
		first := ""
		for _, st := range ws {
			if st.firstErr != nil {
				first = st.firstErr.Error()
				break
			}
		}
		return r, fmt.Errorf("%d of %d messages not acked (%v; first delivery error: %s)", len(left), len(s.Msgs), context.Cause(runCtx), first)
	}

	var lats []time.Duration
	var pg, rd, rtNew, rtDup int64
	for _, st := range ws {
		lats = append(lats, st.lat...)
		pg, rd, rtNew, rtDup = pg+st.pg, rd+st.redis, rtNew+st.rtNew, rtDup+st.rtDup
		r.Commits += st.commits
		r.Deliveries += st.deliveries
		r.InFlight += st.inFlight
		r.Errors += st.errs
		if st.firstErr != nil && r.FirstError == "" {
			r.FirstError = st.firstErr.Error()
		}
	}
	slices.Sort(lats)
	r.P50, r.P99 = quantile(lats, 0.50), quantile(lats, 0.99)
	n := float64(len(s.Msgs))
	r.MsgsPerSec = n / r.Elapsed.Seconds()
	r.PGRT, r.RedisRT = float64(pg)/n, float64(rd)/n
	if s.Keys > 0 {
		r.RTNew = float64(rtNew) / float64(s.Keys)
	}
	if s.Dups > 0 {
		r.RTDup = float64(rtDup) / float64(s.Dups)
	}
	r.LoggedErrors = logger.Errors()
	if p.bloom != nil {
		bs := p.bloom.Stats()
		r.BloomMaybeSeen, r.BloomFalsePositives = bs.MaybeSeen, bs.FalsePositives
	}
	if p.tt != nil {
		r.LockHits = p.tt.Stats().LockHits
	}
	if r.Effects, err = fx.countEffects(ctx); err != nil {
		return r, err
	}
	return r, nil
}

// CrashResult is one correctness run: a strategy under one fault.
type CrashResult struct {
	Strategy string
	Fault    fault
	// N messages with Keys distinct keys.
	N, Keys int
	// Faults counts the faults injected; Processes the processes started
	// (1 + restarts); Deliveries the handler calls; InFlight the nacks for
	// a key held by a live lease.
	Faults, Processes, Deliveries, InFlight int
	// Errors counts the nacks for errors that were not injected.
	Errors  int
	Effects effectCounts
	// Lost counts keys without any effect.
	Lost    int
	Elapsed time.Duration
}

// correctness runs stream s through strategy d with cfg.CrashWorkers
// workers, injecting fault f on the first delivery of every
// cfg.CrashEvery-th message. A crash kills the whole process: every
// delivery in flight dies with it, nothing more is acked, and the next
// process starts with fresh in-memory state; Redis and the databases keep
// theirs. Unacked and nacked messages are redelivered until all are acked.
func (e *env) correctness(ctx context.Context, d strategyDef, s *stream, f fault) (r CrashResult, err error) {
	r = CrashResult{Strategy: d.Name, Fault: f, N: len(s.Msgs), Keys: s.Keys}
	fx, err := e.newFixture(ctx, d)
	if err != nil {
		return r, err
	}
	defer func() { err = errors.Join(err, fx.close()) }()

	runCtx, cancel := context.WithTimeoutCause(ctx, e.cfg.RunTimeout, errTimeout)
	defer cancel()
	delivered := make([]atomic.Bool, len(s.Msgs))
	var faults, deliveries, inFlight, errs atomic.Int64
	faultFor := func(pos int) fault {
		if delivered[pos].CompareAndSwap(false, true) && (pos+1)%e.cfg.CrashEvery == 0 {
			faults.Add(1)
			return f
		}
		return faultNone
	}
	rec := func(_, _ int, _ *delivery, o outcome, err error, _ time.Duration) {
		deliveries.Add(1)
		switch {
		case o == nackedInFlight:
			inFlight.Add(1)
		case o == nackedError && !errors.Is(err, errTransient):
			errs.Add(1)
		}
	}
	pending := make([]int, len(s.Msgs))
	for i := range pending {
		pending[i] = i
	}
	start := time.Now()
	var joins []func()
	defer func() {
		for _, join := range joins {
			join()
		}
	}()
	for len(pending) > 0 {
		if err := runCtx.Err(); err != nil {
			return r, fmt.Errorf("%d messages still unacked after %d processes: %w", len(pending), r.Processes, context.Cause(runCtx))
		}
		p, err := fx.start(runCtx, d, procOptions{
			Lease: e.cfg.CrashLease, Crashable: true, ExpectedKeys: uint(len(s.Msgs)),
		})
		if err != nil {
			return r, err
		}
		r.Processes++
		var join func()
		pending, join = drive(runCtx, p, s, pending, e.cfg.CrashWorkers, faultFor, rec)
		joins = append(joins, join)
		p.stop()
		// The broker hands a new consumer the dead one's unacked messages
		// first, oldest first (Kafka resumes at the oldest uncommitted
		// offset; RabbitMQ requeues in place).
		slices.Sort(pending)
	}
	// The dead processes' last goroutines end before the effects are
	// counted.
	for _, join := range joins {
		join()
	}
	joins = nil
	r.Elapsed = time.Since(start)
	r.Faults, r.Deliveries, r.InFlight, r.Errors = int(faults.Load()), int(deliveries.Load()), int(inFlight.Load()), int(errs.Load())
	if r.Effects, err = fx.countEffects(ctx); err != nil {
		return r, err
	}
	r.Lost = r.Keys - r.Effects.Keys
	return r, nil
}

// errTimeout ends a run that took longer than Config.RunTimeout.
var errTimeout = errors.New("run timed out")

// quantile returns the q-quantile of sorted (nearest rank).
func quantile(sorted []time.Duration, q float64) time.Duration {
	if len(sorted) == 0 {
		return 0
	}
	i := int(float64(len(sorted))*q+0.999999) - 1
	return sorted[min(max(i, 0), len(sorted)-1)]
}

func pct(ratio float64) int { return int(ratio*100 + 0.5) }
