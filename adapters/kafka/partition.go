package kafka

import (
	"context"
	"sync"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/oncemill/oncemill/adapters/internal/keygate"
	"github.com/oncemill/oncemill/delivery"
)

// newPartition returns the state of a claim of sub, ready to run; the
// caller cancels its context once run has returned.
func newPartition(sub *subscription, sess sarama.ConsumerGroupSession, claim sarama.ConsumerGroupClaim) *partition {
	cfg := sub.s.cfg
	ctx, cancel := context.WithCancel(sub.ctx)
	var marks delivery.HandOutMarks
	if cfg.ConsumerGroup != "" {
		marks = cfg.HandOutMarks
	}
	return &partition{
		sub:       sub,
		sess:      sess,
		claim:     claim,
		ctx:       ctx,
		cancel:    cancel,
		max:       cfg.MaxInFlightPerPartition,
		buffer:    bufferFor(cfg.MaxInFlightPerPartition),
		results:   make(chan result, cfg.MaxInFlightPerPartition),
		withdraw:  make(chan struct{}),
		abandon:   make(chan struct{}),
		done:      map[int64]bool{},
		marks:     marks,
		suspectTo: -1,
		marked:    -1,
		plainTo:   -1,
		highest:   -1,
		markDone:  make(chan markResult, 1),
		logFields: sub.fields.Add(watermill.LogFields{"kafka_partition": claim.Partition(), "kafka_initial_offset": claim.InitialOffset()}),
	}
}

// result is what a delivery reports: the record, and whether its message
// was acked.
type result struct {
	rec   *sarama.ConsumerMessage
	acked bool
}

// partition is the state of one claim. Only run's goroutine touches the
// maps and slices; the deliveries report through results.
type partition struct {
	sub    *subscription
	sess   sarama.ConsumerGroupSession
	claim  sarama.ConsumerGroupClaim
	ctx    context.Context // parent of the message contexts
	cancel context.CancelFunc
	max    int // messages in flight at most
	buffer int // records held, received and not acked, at most

	results chan result
	// withdraw is closed when the drain starts: a message not yet taken
	// by the router is taken back, a nacked one is not handed out again.
	withdraw chan struct{}
	// abandon is closed when the drain timeout passes, after the message
	// contexts are cancelled: the deliveries stop waiting for acks.
	abandon  chan struct{}
	wg       sync.WaitGroup
	inFlight int
	stopping bool

	// keys holds each key's records not yet handed out, in offset
	// order, and says which goes next.
	keys keygate.Queues[string, *sarama.ConsumerMessage]

	// outstanding are the offsets received and not yet committable, in
	// offset order, from head on; done marks those acked.
	outstanding []int64
	head        int
	done        map[int64]bool

	// The hand-out mark (SubscriberConfig.HandOutMarks), nil without one:
	// the offsets up to suspectTo (the mark when the claim began) may
	// have been handed out before; those above, up to marked, this
	// claim's durable mark covers; those above marked, up to plainTo,
	// whose mark could not be written, go out unmarked. A record above
	// all three waits for the write of a mark up to highest, the highest
	// offset received; marking says one is under way.
	marks                               delivery.HandOutMarks
	suspectTo, marked, plainTo, highest int64
	marking                             bool
	markDone                            chan markResult

	logFields watermill.LogFields
}

// markResult is the outcome of a mark's write up to offset.
type markResult struct {
	offset int64
	err    error
}

// markTimeout bounds a read or a write of the hand-out mark; past it the
// records it would cover go out unmarked.
const markTimeout = 5 * time.Second

// stamp is what a hand-out says of its record's earlier hand-outs.
type stamp int

const (
	unmarked stamp = iota // no mark kept: the inbox records the attempt
	firstOut              // delivery.Attempts 1: no hand-out before
	suspect               // delivery.Redelivered: maybe handed out before
)

// readMark reads the partition's mark, the offsets that earlier owners
// or lives of this group may have handed out; without it the claim hands
// out unmarked.
func (p *partition) readMark() {
	if p.marks == nil {
		return
	}
	ctx, cancel := context.WithTimeout(p.ctx, markTimeout)
	defer cancel()
	mark, err := p.marks.InboxHandOutMark(ctx, p.sub.s.cfg.ConsumerGroup, p.claim.Topic(), p.claim.Partition())
	if err != nil {
		p.sub.s.logger.Error("Cannot read the partition's hand-out mark: its messages go out unmarked, each attempt recorded", err, p.logFields)
		p.marks = nil
		return
	}
	p.suspectTo, p.marked = mark, mark
}

// stampOf says how offset may go out now; ok is false when it waits for
// a mark.
func (p *partition) stampOf(offset int64) (stamp, bool) {
	switch {
	case p.marks == nil:
		return unmarked, true
	case offset <= p.suspectTo:
		return suspect, true
	case offset <= p.marked:
		return firstOut, true
	case offset <= p.plainTo:
		return unmarked, true
	}
	return unmarked, false
}

// mark starts the write of a mark up to the highest offset received,
// unless one is under way.
func (p *partition) mark() {
	if p.marking {
		return
	}
	p.marking = true
	offset := p.highest
	go func() {
		ctx, cancel := context.WithTimeout(p.ctx, markTimeout)
		defer cancel()
		err := p.marks.InboxMarkHandOut(ctx, p.sub.s.cfg.ConsumerGroup, p.claim.Topic(), p.claim.Partition(), offset)
		p.markDone <- markResult{offset: offset, err: err}
	}()
}

// markWritten takes a mark's outcome and hands out what it covers.
func (p *partition) markWritten(res markResult) {
	p.marking = false
	if res.err != nil {
		if p.ctx.Err() == nil {
			p.sub.s.logger.Error("Cannot write the partition's hand-out mark: the messages it would cover go out unmarked, each attempt recorded", res.err,
				p.logFields.Add(watermill.LogFields{"kafka_partition_offset": res.offset}))
		}
		p.plainTo = max(p.plainTo, res.offset)
	} else {
		p.marked = max(p.marked, res.offset)
	}
	p.dispatch()
}

func (p *partition) run() {
	p.readMark()
	records := p.claim.Messages()
	for {
		in := records
		if len(p.outstanding)-p.head >= p.buffer {
			in = nil
		}
		// With every slot of the subscription taken, a partition with
		// work waits for one here, among its other cases.
		var slot chan struct{}
		if p.sub.slots != nil && p.canDispatch() {
			slot = p.sub.slots
		}
		select {
		case slot <- struct{}{}:
			if commit, over := p.over(); over {
				// The slot freed as the session ended or the
				// subscription began to stop: give it back, hand out
				// nothing more.
				<-p.sub.slots
				p.drain(commit)
				return
			}
			p.dispatchOne()
			p.dispatch()
		case rec, ok := <-in:
			if !ok {
				// The claim ended: the partition is being revoked.
				p.drain(p.sub.isStopped())
				return
			}
			if commit, over := p.over(); over {
				// Not handed out: whoever consumes the partition next
				// starts at or before it.
				p.drain(commit)
				return
			}
			p.add(rec)
		case res := <-p.markDone:
			p.markWritten(res)
		case res := <-p.results:
			if commit, over := p.over(); over {
				p.stopping = true // nothing more handed out by finish
				p.finish(res, commit)
				p.drain(commit)
				return
			}
			p.finish(res, true)
		case <-p.sess.Context().Done():
			// A rebalance, unless the subscription is stopping (a
			// sibling claim that has drained ends the session).
			p.drain(p.sub.isStopped())
			return
		case <-p.sub.stop:
			p.drain(true)
			return
		}
	}
}

// over reports whether the partition is to stop, because its session
// ended or the subscription is stopping, and whether it still commits
// what was acked (only when stopping: a revoked partition marks nothing
// more). select picks at random among the cases that are ready, so run
// asks this before it acts on a record, a result or a freed slot that
// came with the end, and dispatch before each hand-out: otherwise a
// revoked partition could hand out a record it has buffered, or mark an
// offset, after its session ended.
func (p *partition) over() (commit, over bool) {
	if p.sub.isStopped() {
		return true, true
	}
	if p.sess.Context().Err() != nil {
		return false, true
	}
	return false, false
}

// add queues a record just received and hands out what it can.
func (p *partition) add(rec *sarama.ConsumerMessage) {
	p.outstanding = append(p.outstanding, rec.Offset)
	p.highest = max(p.highest, rec.Offset)
	p.keys.Push(string(rec.Key), rec)
	p.dispatch()
}

// dispatch hands out the heads of ready keys while there is room, until
// the partition is over: run's select then takes the end. (The session
// can end while the partition marks or commits an offset, after run asked
// over.)
func (p *partition) dispatch() {
	for p.canDispatch() {
		if _, over := p.over(); over {
			return
		}
		if p.sub.slots != nil {
			select {
			case p.sub.slots <- struct{}{}:
			default:
				return // run waits for a slot
			}
		}
		p.dispatchOne()
	}
}

// canDispatch reports whether the partition has a ready key, room for
// one more message in flight, and a mark for the ready key's record; it
// starts the mark's write when the record waits for one.
func (p *partition) canDispatch() bool {
	if p.stopping || p.inFlight >= p.max {
		return false
	}
	rec, ok := p.keys.Next()
	if !ok {
		return false
	}
	if _, ok := p.stampOf(rec.Offset); !ok {
		p.mark()
		return false
	}
	return true
}

// dispatchOne hands out the head of the first ready key; the caller has
// checked canDispatch and taken a slot, when there are slots.
func (p *partition) dispatchOne() {
	rec := p.keys.Take()
	p.inFlight++
	p.wg.Add(1)
	st, _ := p.stampOf(rec.Offset)
	go p.deliver(rec, st)
}

// newSlots returns the slots of a subscription with at most n messages in
// flight, or nil for n == 0 (no limit).
func newSlots(n int) chan struct{} {
	if n <= 0 {
		return nil
	}
	return make(chan struct{}, n)
}

// finish takes a delivery's result. An acked record frees its key and may
// move the committed offset; with mark, the new offset is marked (and,
// with SyncCommit, committed). A record that was not acked (its context
// ended) keeps its key busy, so that no later message of the key is
// handed out before it.
func (p *partition) finish(res result, mark bool) {
	p.inFlight--
	if p.sub.slots != nil {
		<-p.sub.slots
	}
	if !res.acked {
		return
	}
	p.done[res.rec.Offset] = true
	next := int64(-1)
	for p.head < len(p.outstanding) && p.done[p.outstanding[p.head]] {
		delete(p.done, p.outstanding[p.head])
		next = p.outstanding[p.head] + 1
		p.head++
	}
	if p.head > len(p.outstanding)/2 && p.head > 64 {
		p.outstanding = append(p.outstanding[:0], p.outstanding[p.head:]...)
		p.head = 0
	}
	if next >= 0 && mark {
		p.sess.MarkOffset(p.claim.Topic(), p.claim.Partition(), next, "")
		if p.sub.s.cfg.SyncCommit {
			p.sess.Commit()
		}
	}
	p.keys.Done(string(res.rec.Key))
	p.dispatch()
}

// drain stops the partition: it hands out nothing more (a message the
// router has not taken yet is taken back), waits for the handlers of the
// messages in flight to ack or nack, with live contexts, and once the
// drain budget has passed cancels their contexts and abandons them. With
// commit (the subscription stops), acked offsets are still marked, and
// committed at the end, and the budget is DrainTimeout; without (a
// revocation), nothing more is marked, and the budget is RevokeTimeout,
// for the whole group waits for the revoked partitions.
func (p *partition) drain(commit bool) {
	p.stopping = true
	close(p.withdraw)
	budget := p.sub.s.cfg.RevokeTimeout
	if commit {
		budget = p.sub.s.cfg.DrainTimeout
	}
	timer := time.NewTimer(budget)
	defer timer.Stop()
	abandoned := false
	for p.inFlight > 0 {
		select {
		case res := <-p.results:
			p.finish(res, commit)
		case <-timer.C:
			if !abandoned {
				abandoned = true
				p.cancel()
				close(p.abandon)
				p.sub.s.logger.Info("Drain timeout: handlers still running, their messages will be delivered again", p.logFields.Add(watermill.LogFields{"in_flight": p.inFlight, "drain_timeout": budget.String()}))
			}
		}
	}
	p.wg.Wait()
	if commit {
		p.sess.Commit()
	}
}

// deliver hands one record's message to the router until it is acked,
// and reports the result.
func (p *partition) deliver(rec *sarama.ConsumerMessage, st stamp) {
	defer p.wg.Done()
	acked := p.handOut(rec, st)
	p.results <- result{rec: rec, acked: acked}
}

func (p *partition) handOut(rec *sarama.ConsumerMessage, st stamp) bool {
	ctx, cancel := context.WithCancel(p.ctx)
	defer cancel()
	// Marshaler.Unmarshal never fails: an undecodable record becomes a
	// message with delivery.DecodeError set. It takes no adapter fact
	// from the record's headers: the stamp is this subscriber's alone.
	msg, _ := Marshaler{}.Unmarshal(rec)
	stampMessage(msg, st)
	fields := p.logFields.Add(watermill.LogFields{"kafka_partition_offset": rec.Offset, "message_uuid": msg.UUID})
	sleep := p.sub.s.cfg.NackResendSleep
	for {
		// The drain may have started while this delivery waited: a
		// select with several ready cases picks one at random, so ask
		// first, and hand out nothing once it has.
		select {
		case <-p.withdraw:
			return false
		case <-ctx.Done():
			return false
		default:
		}
		msg.SetContext(ctx)
		select {
		case p.sub.output <- msg:
			p.sub.s.logger.Trace("Message sent to consumer", fields)
		case <-p.withdraw:
			return false
		case <-ctx.Done():
			return false
		}
		select {
		case <-msg.Acked():
			p.sub.s.logger.Trace("Message acked", fields)
			return true
		case <-msg.Nacked():
			p.sub.s.logger.Trace("Message nacked", fields)
			if ctx.Err() != nil {
				return false
			}
			if sleep != NoSleep && sleep > 0 {
				t := time.NewTimer(sleep)
				select {
				case <-t.C:
				case <-p.withdraw:
					t.Stop()
					return false
				case <-ctx.Done():
					t.Stop()
					return false
				}
			}
			msg = msg.Copy()
			if st != unmarked {
				// Handed out before: its attempts are counted one by one.
				st = suspect
				stampMessage(msg, st)
			}
		case <-p.abandon:
			return false
		}
	}
}

// stampMessage sets what st says of msg's earlier hand-outs.
func stampMessage(msg *message.Message, st stamp) {
	switch st {
	case firstOut:
		msg.Metadata.Set(delivery.Attempts, "1")
	case suspect:
		delete(msg.Metadata, delivery.Attempts)
		msg.Metadata.Set(delivery.Redelivered, "true")
	}
}
