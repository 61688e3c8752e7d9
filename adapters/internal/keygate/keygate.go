// Package keygate hands a subscription's deliveries to a Watermill output
// channel concurrently while keeping the order of each ordering key: at
// most a given number of messages in flight (handed out and not yet acked
// or nacked), deliveries of different keys in parallel, a key's deliveries
// one at a time in the order they were added, the next only once the
// previous was acked or nacked. A delivery with the empty key is its own
// key.
//
// The broker packages that receive a stream of deliveries (NATS, SQS)
// share it: each adds the deliveries it receives, in arrival order, and
// supplies through [Hooks] what an ack, a nack and a give-back mean on its
// broker. The gate never talks to a broker itself. Kafka's partition,
// which hands out offsets of its own and redelivers a nack itself, keeps
// its own loop but shares the per-key bookkeeping, [Queues].
//
// # Nacks
//
// A nacked message goes back to the broker, which delivers it again later,
// after the adapter's backoff. What that means for the key's deliveries
// the gate still holds behind it depends on the broker, so [Hooks] chooses:
//
//   - By default the key's next delivery is handed out, as every other
//     message is: the nacked one comes back after its backoff, behind the
//     key's later deliveries. That is all a broker that redelivers a
//     message out of its original order (JetStream, a standard SQS queue)
//     allows without stopping the key for an unknown time.
//   - With [Hooks.ReleaseBehindNack] the key's deliveries held behind the
//     nacked one are given back ([Hooks.Release]) instead of handed out,
//     for a broker that then delivers them again after the nacked one
//     (an SQS FIFO queue, which keeps a message group in order).
package keygate

import (
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
)

// Hooks is what an adapter does when the gate is done with a delivery.
// The gate calls each on a goroutine of its own, never on the goroutine
// that hands out, and waits for it in Close.
type Hooks[T any] struct {
	// Settled is called once the handler has acked (acked true) or
	// nacked a handed out message. The key's next delivery is handed out
	// once it returns. Nil does nothing.
	Settled func(v T, acked bool)
	// Release gives back deliveries that the gate will not hand out:
	// those held when the gate closes, and, with ReleaseBehindNack, those
	// held behind a nacked one of their key. Their messages were never
	// handed out. Nil does nothing.
	Release func(vs []T)
	// Abandoned is called for a handed out message that was neither
	// acked nor nacked when the drain of Close ended. Nil does nothing.
	Abandoned func(v T)
	// ReleaseBehindNack gives back, after a nack, the deliveries of the
	// nacked message's key that the gate holds, instead of handing them
	// out; without it the key's next delivery is handed out. Defaults to
	// false.
	ReleaseBehindNack bool
}

// Gate is a goroutine that hands out deliveries to an output channel; see
// the package doc. It is safe for concurrent use.
type Gate[T any] struct {
	out   chan *message.Message
	max   int
	hooks Hooks[T]

	add     chan *entry[T]
	results chan result[T]
	// stop is closed by Close: the gate hands out nothing more and
	// drains.
	stop      chan struct{}
	stopOnce  sync.Once
	drainFor  time.Duration
	abandoned int
	// abandon is closed when the drain ends with messages in flight:
	// their watchers stop waiting.
	abandon chan struct{}
	// done is closed when the run loop has returned.
	done chan struct{}
	// wg counts the goroutines the gate started besides run: the
	// watchers of the messages in flight and the hooks' calls.
	wg sync.WaitGroup

	// Only run's goroutine touches these: each key's deliveries not yet
	// handed out, in order, and which may go next.
	queues   Queues[key, *entry[T]]
	inFlight int
	own      uint64
}

// key is an ordering key; a delivery without one gets a number of its
// own, so that it shares its key with no other.
type key struct {
	name string
	own  uint64
}

type entry[T any] struct {
	key key
	msg *message.Message
	v   T
}

// result is what a watcher reports: the entry, and how it ended.
type result[T any] struct {
	e         *entry[T]
	acked     bool
	abandoned bool
}

// New starts a gate that hands out to out, with at most maxInFlight
// messages handed out and not yet acked or nacked (at least 1). The gate
// owns out from now on: it closes it once it hands out nothing more.
func New[T any](out chan *message.Message, maxInFlight int, hooks Hooks[T]) *Gate[T] {
	g := &Gate[T]{
		out:     out,
		max:     max(maxInFlight, 1),
		hooks:   hooks,
		add:     make(chan *entry[T]),
		results: make(chan result[T], max(maxInFlight, 1)),
		stop:    make(chan struct{}),
		abandon: make(chan struct{}),
		done:    make(chan struct{}),
	}
	go g.run()
	return g
}

// Add queues v, whose message is msg and whose ordering key is k (empty:
// a key of its own), behind the deliveries added before. The message's
// context is the adapter's to set, before Add. Once the gate is closing,
// v is given back through Hooks.Release instead.
func (g *Gate[T]) Add(k string, msg *message.Message, v T) {
	e := &entry[T]{key: key{name: k}, msg: msg, v: v}
	select {
	case g.add <- e:
	case <-g.done:
		g.release([]T{v})
	}
}

// Close stops the gate: it hands out nothing more and closes the output
// channel, gives back the deliveries it holds through Hooks.Release,
// waits up to drain for the handlers of the messages in flight to ack or
// nack, then calls Hooks.Abandoned for those still in flight, and returns
// once every goroutine it started has stopped (the hooks' calls
// included). It returns how many messages were abandoned. It is
// idempotent: a later call waits for the first and returns 0.
func (g *Gate[T]) Close(drain time.Duration) int {
	first := false
	g.stopOnce.Do(func() {
		first = true
		g.drainFor = drain
		close(g.stop)
	})
	<-g.done
	g.wg.Wait()
	if !first {
		return 0
	}
	return g.abandoned
}

func (g *Gate[T]) run() {
	defer close(g.done)
	for {
		// Asked first: a select with several ready cases picks one at
		// random, and nothing is handed out once the gate stops.
		select {
		case <-g.stop:
			g.drain()
			return
		default:
		}
		var (
			out  chan *message.Message
			next *message.Message
		)
		if e, ok := g.queues.Next(); ok && g.inFlight < g.max {
			out = g.out
			next = e.msg
		}
		select {
		case out <- next:
			g.handedOut()
		case e := <-g.add:
			g.enqueue(e)
		case r := <-g.results:
			g.finish(r)
		case <-g.stop:
			g.drain()
			return
		}
	}
}

// enqueue queues e behind its key's deliveries.
func (g *Gate[T]) enqueue(e *entry[T]) {
	if e.key.name == "" {
		g.own++
		e.key.own = g.own
	}
	g.queues.Push(e.key, e)
}

// handedOut takes the delivery just sent off its key's queue and starts
// its watcher.
func (g *Gate[T]) handedOut() {
	e := g.queues.Take()
	g.inFlight++
	g.wg.Add(1)
	go g.watch(e)
}

// finish takes a watcher's report: the key is free for its next delivery,
// or, after a nack with ReleaseBehindNack, its held deliveries are given
// back.
func (g *Gate[T]) finish(r result[T]) {
	g.inFlight--
	if !r.acked && g.hooks.ReleaseBehindNack {
		g.spawnRelease(values(g.queues.Remove(r.e.key)))
	}
	g.queues.Done(r.e.key)
}

// watch waits for the handler's ack or nack of e's message, or for the
// drain's end, and reports.
func (g *Gate[T]) watch(e *entry[T]) {
	defer g.wg.Done()
	var acked bool
	select {
	case <-e.msg.Acked():
		acked = true
	case <-e.msg.Nacked():
	case <-g.abandon:
		// An ack or nack that came with the drain's end still counts.
		select {
		case <-e.msg.Acked():
			acked = true
		case <-e.msg.Nacked():
		default:
			if g.hooks.Abandoned != nil {
				g.hooks.Abandoned(e.v)
			}
			g.results <- result[T]{e: e, abandoned: true}
			return
		}
	}
	if g.hooks.Settled != nil {
		g.hooks.Settled(e.v, acked)
	}
	g.results <- result[T]{e: e, acked: acked}
}

// drain hands out nothing more: it closes the output channel, gives back
// what it holds and waits for the messages in flight, abandoning them
// once the drain time has passed.
func (g *Gate[T]) drain() {
	close(g.out)
	g.spawnRelease(values(g.queues.Clear()))
	timer := time.NewTimer(g.drainFor)
	defer timer.Stop()
	expired := timer.C
	for g.inFlight > 0 {
		select {
		case r := <-g.results:
			g.inFlight--
			if r.abandoned {
				g.abandoned++
			}
		case e := <-g.add:
			g.spawnRelease([]T{e.v})
		case <-expired:
			expired = nil
			close(g.abandon)
		}
	}
}

// values returns the deliveries of es.
func values[T any](es []*entry[T]) []T {
	vs := make([]T, len(es))
	for i, e := range es {
		vs[i] = e.v
	}
	return vs
}

// spawnRelease gives vs back on a goroutine of the gate's.
func (g *Gate[T]) spawnRelease(vs []T) {
	if len(vs) == 0 || g.hooks.Release == nil {
		return
	}
	g.wg.Add(1)
	go func() {
		defer g.wg.Done()
		g.hooks.Release(vs)
	}()
}

// release gives vs back on the caller's goroutine, once the gate has
// stopped.
func (g *Gate[T]) release(vs []T) {
	if g.hooks.Release != nil {
		g.hooks.Release(vs)
	}
}
