package middleware

import (
	"context"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
)

// When the handler succeeds again after an outage, the messages parked
// meanwhile are brought forward (retry.Store.BringForward): forwardBatch
// at a time, at most once every forwardEvery per topic, the next batch
// only after a success, so that messages parked through an outage come
// back within seconds of its end, while a dependency that fails again at
// once costs at most one batch an attempt.
//
// An outage is told from a message that fails on its own by what came
// between two successes of the topic: counted failures of at least two
// different messages. One failing message on a busy topic (a poison
// message, one account's rejected payment) fails between successes of
// others, alone: its delayed attempts keep the policy's Delays, instead
// of being brought forward by every success of its neighbours and
// dead-lettered within a second. Once an outage's end is seen, the
// bringing forward goes on, batch after batch, until none is left.
const (
	forwardBatch = 32
	forwardEvery = 250 * time.Millisecond
)

// forwarding is the state of one topic's bringing forward.
type forwarding struct {
	last atomic.Int64 // unix nanoseconds of the last BringForward
	// idle is set when the last BringForward found nothing to bring
	// forward, and cleared by the next park: no statement runs meanwhile.
	idle atomic.Bool
	// failing counts the different messages whose attempts failed since
	// the topic's last success; lastFailed is the latest of them.
	failing    atomic.Int64
	lastFailed atomic.Pointer[string]
	// recovering is set by a success that follows failures of
	// several messages, and cleared when nothing is left to bring
	// forward.
	recovering atomic.Bool
}

type forwards struct{ topics sync.Map } // topic → *forwarding

func (f *forwards) of(topic string) *forwarding {
	if v, ok := f.topics.Load(topic); ok {
		return v.(*forwarding)
	}
	v, _ := f.topics.LoadOrStore(topic, &forwarding{})
	return v.(*forwarding)
}

// parked tells that a message of topic was parked.
func (f *forwards) parked(topic string) { f.of(topic).idle.Store(false) }

// failed tells that a counted attempt of the message uuid of topic
// failed.
func (f *forwards) failed(topic, uuid string) {
	t := f.of(topic)
	if prev := t.lastFailed.Swap(&uuid); prev == nil || *prev != uuid {
		t.failing.Add(1)
	}
}

// bringForward is called after a successful attempt of msg: while
// messages of its topic may be parked, it brings the next batch of them
// forward, at the bounded rate.
func (p *Poison) bringForward(msg *message.Message) {
	if p.cfg.Retries == nil {
		return
	}
	topic := topicOf(msg)
	f := p.forwards.of(topic)
	var failing int64
	if f.failing.Load() != 0 { // a load, not a write, on the common path
		failing = f.failing.Swap(0)
		f.lastFailed.Store(nil)
	}
	if f.idle.Load() {
		return
	}
	if !f.recovering.Load() {
		if failing < 2 {
			return
		}
		f.recovering.Store(true)
	}
	now := time.Now().UnixNano()
	last := f.last.Load()
	if now-last < int64(forwardEvery) || !f.last.CompareAndSwap(last, now) {
		return
	}
	consumer := p.consumerOf(msg)
	ctx, cancel := context.WithTimeout(context.WithoutCancel(msg.Context()), p.cfg.PublishTimeout)
	defer cancel()
	n, err := p.cfg.Retries.BringForward(ctx, consumer, topic, forwardBatch)
	fields := watermill.LogFields{"consumer": consumer, "topic": topic}
	if err != nil {
		p.cfg.Logger.Debug("Bringing parked messages forward failed; they come back at their due times", fields.Add(watermill.LogFields{"error": err.Error()}))
		return
	}
	if n == 0 {
		f.idle.Store(true)
		f.recovering.Store(false)
		return
	}
	p.broughtForward.Add(int64(n))
	p.cfg.Logger.Info("Handler succeeds again: parked messages brought forward", fields.Add(watermill.LogFields{"brought_forward": n}))
}
