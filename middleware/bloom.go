package middleware

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/bits-and-blooms/bloom/v3"

	"github.com/oncemill/oncemill/dedup"
	"github.com/oncemill/oncemill/dedup/dedupdriver"
	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/observe"
)

// BloomConfig configures a [Bloom] prefilter.
type BloomConfig struct {
	// Inbox is the inbox the prefilter goes in front of: its store (which must
	// implement dedupdriver.Peeker), key function, consumer name and window are
	// the prefilter's, so that each is given once. Setting Store, Key, Consumer
	// or Window as well is an error. Without it, set them to the inbox's by
	// hand.
	Inbox *Inbox
	// Store is read for keys the filter may have seen: the inbox's store.
	// Required unless Inbox is set. The dedup/postgres, dedup/sqlite,
	// dedup/memory and dedup/redis stores implement it.
	Store dedupdriver.Peeker
	// Key must be the inbox's key function. Defaults to the Inbox's, else
	// to [DefaultKey].
	Key KeyFunc
	// Consumer must be the inbox's consumer name. Defaults to the Inbox's,
	// else to the router handler's name; [Bloom.Warm] needs it set.
	Consumer string
	// ExpectedKeys is how many distinct keys one consumer completes in one
	// Window; each of the two generations is sized for it. Defaults to
	// 1,000,000 (about 1.2 MB per generation at 1%).
	ExpectedKeys uint
	// FalsePositiveRate is the target rate of "maybe seen" answers for keys
	// never seen, per generation. Defaults to 0.01.
	FalsePositiveRate float64
	// Window must be the inbox's window: keys are remembered at least this
	// long and at most twice as long. Defaults to the Inbox's, else to 72
	// hours.
	Window time.Duration
	// Hooks are told of every check (observe.BloomHook: surely new,
	// false positive), and of each duplicate the prefilter answers itself
	// (observe.InboxHook, outcome duplicate), so that with the same hooks
	// on the inbox a duplicate is counted once whichever answered it.
	Hooks []observe.Hook
	// Logger receives store errors (the message then goes on to the inbox,
	// which decides). Defaults to watermill.NopLogger.
	Logger watermill.LoggerAdapter
}

// fromInbox takes the settings the prefilter shares with its inbox from
// c.Inbox, refusing any of them given twice.
func (c *BloomConfig) fromInbox() error {
	in := c.Inbox
	if in == nil {
		return nil
	}
	for _, f := range []struct {
		name, inbox string
		set         bool
	}{
		{"Store", "TxStore or LeaseStore", c.Store != nil},
		{"Key", "Key", c.Key != nil},
		{"Consumer", "Consumer", c.Consumer != ""},
		{"Window", "Window", c.Window != 0},
	} {
		if f.set {
			return fmt.Errorf("middleware: BloomConfig.%s is taken from BloomConfig.Inbox (its InboxConfig.%s): set one of them", f.name, f.inbox)
		}
	}
	p, ok := in.store().(dedupdriver.Peeker)
	if !ok {
		return fmt.Errorf("middleware: BloomConfig.Inbox: its store (%T) cannot be read without a claim (dedupdriver.Peeker)", in.store())
	}
	c.Store, c.Key, c.Consumer, c.Window = p, in.cfg.Key, in.cfg.Consumer, in.cfg.Window
	return nil
}

func (c *BloomConfig) setDefaults() {
	if c.Key == nil {
		c.Key = DefaultKey
	}
	if c.ExpectedKeys == 0 {
		c.ExpectedKeys = 1_000_000
	}
	if c.FalsePositiveRate == 0 {
		c.FalsePositiveRate = 0.01
	}
	if c.Window == 0 {
		c.Window = dedup.DefaultWindow
	}
	if c.Logger == nil {
		c.Logger = watermill.NopLogger{}
	}
}

// Validate reports the first field that is missing or out of range.
func (c BloomConfig) Validate() error {
	c.setDefaults()
	switch {
	case c.Store == nil:
		return errors.New("middleware: BloomConfig.Store is required: it answers for keys the filter may have seen")
	case c.ExpectedKeys > 1<<32:
		return fmt.Errorf("middleware: BloomConfig.ExpectedKeys must be at most %d, got %d", uint64(1)<<32, c.ExpectedKeys)
	case !(c.FalsePositiveRate > 0 && c.FalsePositiveRate < 0.5):
		return fmt.Errorf("middleware: BloomConfig.FalsePositiveRate must be between 0 and 0.5, got %g", c.FalsePositiveRate)
	case c.Window < time.Minute:
		return fmt.Errorf("middleware: BloomConfig.Window must be at least 1m, got %s", c.Window)
	}
	return nil
}

// BloomStats counts what a [Bloom] prefilter did since it was made.
type BloomStats struct {
	// Checks counts messages looked up in the filter.
	Checks int64
	// SurelyNew counts keys the filter had never seen: they went straight
	// to the inbox, with no extra read.
	SurelyNew int64
	// MaybeSeen counts keys the filter may have seen: the store was read.
	MaybeSeen int64
	// Duplicates counts maybe-seen keys the store confirmed done: acked
	// with their stored result, without a write transaction or the
	// handler.
	Duplicates int64
	// FalsePositives counts maybe-seen keys the store did not hold as
	// done.
	FalsePositives int64
	// Rotations counts generation changes.
	Rotations int64
}

// Bloom is a router middleware that goes in front of the inbox and spares
// it the cost of duplicates: a key the filter has surely never seen goes
// straight to the inbox (no extra round trip); a key it may have seen is
// first read from the store, and a confirmed duplicate is answered with its
// stored result without opening a write transaction or running the handler.
//
// Correctness never rests on the filter: a false positive costs one read,
// and a key the filter never saw (another instance applied it, or this one
// restarted) is still caught by the inbox's claim. Two generations rotate
// every Window, so a key is remembered for between one and two windows;
// each is sized for ExpectedKeys at FalsePositiveRate, the optimal
// -ln(p)/ln(2)² bits per key (9.59 at 1%). A lookup tests both, so just
// before a rotation the rate of false positives approaches twice the
// target. It starts no goroutines; rotation happens on the message path.
type Bloom struct {
	cfg   BloomConfig
	hooks observe.Hooks
	m     uint // bits per generation
	k     uint // hash functions
	now   func() time.Time

	mu        sync.RWMutex
	cur, prev *bloom.BloomFilter
	rotateAt  time.Time

	checks, surelyNew, maybeSeen, duplicates, falsePositives, rotations atomic.Int64
}

// NewBloom returns a prefilter for cfg; cfg is copied, defaulted and
// validated. It is empty: call [Bloom.Warm] before the router starts to
// load the keys the store already holds.
func NewBloom(cfg BloomConfig) (*Bloom, error) {
	if err := cfg.fromInbox(); err != nil {
		return nil, err
	}
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	m, k := bloom.EstimateParameters(cfg.ExpectedKeys, cfg.FalsePositiveRate)
	b := &Bloom{cfg: cfg, hooks: observe.New(cfg.Hooks...), m: m, k: k, now: time.Now}
	b.cur, b.prev = bloom.New(m, k), bloom.New(m, k)
	b.rotateAt = b.now().Add(cfg.Window)
	return b, nil
}

// Stats returns the prefilter's counters.
func (b *Bloom) Stats() BloomStats {
	return BloomStats{
		Checks:         b.checks.Load(),
		SurelyNew:      b.surelyNew.Load(),
		MaybeSeen:      b.maybeSeen.Load(),
		Duplicates:     b.duplicates.Load(),
		FalsePositives: b.falsePositives.Load(),
		Rotations:      b.rotations.Load(),
	}
}

// Warm loads the keys the consumer completed in the last Window from the
// store, streamed: memory stays the filter's fixed size however many keys
// there are. The store must implement dedupdriver.KeyLister, and
// BloomConfig.Consumer must be set. It returns how many keys it added.
func (b *Bloom) Warm(ctx context.Context) (int, error) {
	lister, ok := b.cfg.Store.(dedupdriver.KeyLister)
	if !ok {
		return 0, fmt.Errorf("middleware: Bloom.Warm: the store (%T) cannot list its keys (dedupdriver.KeyLister)", b.cfg.Store)
	}
	if b.cfg.Consumer == "" {
		return 0, errors.New("middleware: Bloom.Warm: set BloomConfig.Consumer: the keys to load are the consumer's")
	}
	n := 0
	err := lister.InboxDoneKeys(ctx, b.cfg.Consumer, b.now().Add(-b.cfg.Window), func(key string) error {
		b.add(entry(b.cfg.Consumer, key))
		n++
		return nil
	})
	if err != nil {
		return n, fmt.Errorf("middleware: Bloom.Warm after %d keys: %w", n, err)
	}
	return n, nil
}

// Middleware wraps h, which must be the inbox (or reach it): add it with
// router.AddMiddleware between the poison middleware and the inbox.
func (b *Bloom) Middleware(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		consumer := b.cfg.Consumer
		if consumer == "" {
			consumer = message.HandlerNameFromCtx(msg.Context())
		}
		key, err := keyOf(b.cfg.Key, msg)
		if err != nil || consumer == "" {
			return h(msg) // the inbox reports it
		}
		b.checks.Add(1)
		e := entry(consumer, key)
		if !b.test(e) {
			b.surelyNew.Add(1)
			b.report(msg, consumer, true, false)
			return b.run(h, msg, e)
		}
		b.maybeSeen.Add(1)
		began := time.Now()
		claim, err := b.cfg.Store.InboxPeek(msg.Context(), dedup.Key{Consumer: consumer, Key: key})
		if err != nil {
			b.report(msg, consumer, false, false)
			b.cfg.Logger.Error("Bloom prefilter: store read failed, passing to the inbox", err,
				watermill.LogFields{"message_uuid": msg.UUID, "consumer": consumer, "key": key})
			return b.run(h, msg, e)
		}
		if claim.State != dedup.StateDone {
			falsePositive := claim.State == dedup.StateNew
			if falsePositive {
				b.falsePositives.Add(1)
			}
			b.report(msg, consumer, false, falsePositive)
			return b.run(h, msg, e) // the inbox answers a dead or in-flight key
		}
		b.report(msg, consumer, false, false)
		produced, err := decodeResult(claim.Result)
		if err != nil {
			return nil, Permanent(fmt.Errorf("consumer %q key %q: %w", consumer, key, err))
		}
		b.duplicates.Add(1)
		if b.hooks.ObservesInbox() {
			b.hooks.InboxAttempt(msg.Context(), observe.InboxAttempt{
				Consumer: consumer, Topic: topicOf(msg), Outcome: observe.Duplicate, Store: time.Since(began),
			})
		}
		return produced, nil
	}
}

// report tells the hooks of one check.
func (b *Bloom) report(msg *message.Message, consumer string, surelyNew, falsePositive bool) {
	b.hooks.BloomCheck(msg.Context(), observe.BloomCheck{
		Consumer: consumer, Topic: topicOf(msg), SurelyNew: surelyNew, FalsePositive: falsePositive,
	})
}

// topicOf is the topic a message came from: the one the router subscribed
// to, which is what the hooks label with and where a dead letter is
// replayed to. The message's metadata is read only outside a router: a
// producer can write it as it likes, and a label per forged topic would
// grow the metrics without bound.
func topicOf(msg *message.Message) string {
	if t := message.SubscribeTopicFromCtx(msg.Context()); t != "" {
		return t
	}
	return msg.Metadata.Get(delivery.Topic)
}

// run calls h and remembers the key once its effect is done.
func (b *Bloom) run(h message.HandlerFunc, msg *message.Message, e []byte) ([]*message.Message, error) {
	produced, err := h(msg)
	if err == nil {
		b.add(e)
	}
	return produced, err
}

// entry is what the filter holds for a key: consumer, NUL, key.
func entry(consumer, key string) []byte {
	e := make([]byte, 0, len(consumer)+1+len(key))
	e = append(e, consumer...)
	e = append(e, 0) // keys and consumer names hold no NUL
	return append(e, key...)
}

func (b *Bloom) test(e []byte) bool {
	b.maybeRotate()
	b.mu.RLock()
	defer b.mu.RUnlock()
	return b.cur.Test(e) || b.prev.Test(e)
}

func (b *Bloom) add(e []byte) {
	b.maybeRotate()
	b.mu.Lock()
	b.cur.Add(e)
	b.mu.Unlock()
}

// maybeRotate starts a new generation once the current one is Window old:
// the previous generation, whose keys are all older than the window, goes.
func (b *Bloom) maybeRotate() {
	now := b.now()
	b.mu.RLock()
	due := !now.Before(b.rotateAt)
	b.mu.RUnlock()
	if !due {
		return
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if now.Before(b.rotateAt) {
		return
	}
	b.prev, b.cur = b.cur, bloom.New(b.m, b.k)
	if now.Sub(b.rotateAt) >= b.cfg.Window {
		// Idle for more than a window: both generations are stale.
		b.prev = bloom.New(b.m, b.k)
	}
	b.rotateAt = now.Add(b.cfg.Window)
	b.rotations.Add(1)
}
