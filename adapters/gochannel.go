package adapters

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"net/url"
	"slices"
	"sync"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/oncemill/oncemill/adapters/internal/brokerurl"
	"github.com/oncemill/oncemill/delivery"
)

// ErrNoSubscribers is wrapped by the error a non-persistent [GoChannel]
// returns from Publish when nothing subscribes to the topic: Watermill's
// GoChannel would drop the messages and report success.
var ErrNoSubscribers = errors.New("adapters: no subscriber on the GoChannel topic, the messages would be dropped")

// GoChannel is Watermill's in-process GoChannel, publisher and subscriber
// in one value, whose Publish fails rather than drops: unless the
// GoChannel is persistent, publishing to a topic that nothing subscribes
// to returns an error wrapping [ErrNoSubscribers] and delivers nothing, as
// a broker that cannot route a message does. An outbox relay then keeps
// its rows and a dead-lettering keeps the delivery unacked. A persistent
// GoChannel keeps every message for later subscribers and publishes as
// Watermill's does. A subscriber that goes away while a Publish runs can
// still miss the messages: GoChannel keeps nothing for it.
//
// [Open] returns one for gochannel:// URLs.
type GoChannel struct {
	gc         *gochannel.GoChannel
	persistent bool

	mu   sync.Mutex
	subs map[string][]context.Context
}

var (
	_ message.Publisher  = (*GoChannel)(nil)
	_ message.Subscriber = (*GoChannel)(nil)
)

// NewGoChannel returns a GoChannel with Watermill's config and logger
// (nil: watermill.NopLogger).
func NewGoChannel(cfg gochannel.Config, logger watermill.LoggerAdapter) *GoChannel {
	return &GoChannel{
		gc:         gochannel.NewGoChannel(cfg, logger),
		persistent: cfg.Persistent,
		subs:       map[string][]context.Context{},
	}
}

// Persistent reports whether the GoChannel keeps messages for subscribers
// that come later.
func (g *GoChannel) Persistent() bool { return g.persistent }

// Publish publishes msgs to topic, or, on a non-persistent GoChannel that
// nothing subscribes to on topic, returns an error wrapping
// [ErrNoSubscribers] and publishes nothing. A message carrying delivery
// facts ([delivery.IsAdapterFact]: a consumed message published again, or
// a producer's own oncemill_decode_error) is published as a copy without
// them, as every broker adapter publishes: they are facts of another
// delivery. The caller's messages are left as they are.
func (g *GoChannel) Publish(topic string, msgs ...*message.Message) error {
	if !g.persistent && !g.subscribed(topic) {
		return fmt.Errorf("%w: topic %q", ErrNoSubscribers, topic)
	}
	out := msgs
	cloned := false
	for i, m := range msgs {
		if !hasAdapterFact(m) {
			continue
		}
		if !cloned {
			out, cloned = slices.Clone(msgs), true
		}
		c := m.Copy()
		c.SetContext(m.Context())
		maps.DeleteFunc(c.Metadata, func(k, _ string) bool { return delivery.IsAdapterFact(k) })
		out[i] = c
	}
	return g.gc.Publish(topic, out...)
}

// hasAdapterFact reports whether m carries a [delivery.IsAdapterFact] key.
func hasAdapterFact(m *message.Message) bool {
	for k := range m.Metadata {
		if delivery.IsAdapterFact(k) {
			return true
		}
	}
	return false
}

// subscribed reports whether a subscription to topic is live, forgetting
// those whose context is done (GoChannel drops them then).
func (g *GoChannel) subscribed(topic string) bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	live := g.subs[topic][:0]
	for _, ctx := range g.subs[topic] {
		if ctx.Err() == nil {
			live = append(live, ctx)
		}
	}
	if len(live) == 0 {
		delete(g.subs, topic)
		return false
	}
	g.subs[topic] = live
	return true
}

// Subscribe subscribes to topic until ctx is done or the GoChannel closes.
func (g *GoChannel) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	ch, err := g.gc.Subscribe(ctx, topic)
	if err != nil {
		return nil, err
	}
	g.mu.Lock()
	g.subs[topic] = append(g.subs[topic], ctx)
	g.mu.Unlock()
	return ch, nil
}

// Close closes the GoChannel and its subscriptions; publishing then fails.
// It is safe to call more than once.
func (g *GoChannel) Close() error { return g.gc.Close() }

// openGoChannel opens an in-process [GoChannel]: publisher and subscriber
// are one value. persistent=true keeps every message for later
// subscribers, the closest it comes to a broker's redelivery after a
// restart; without it, publishing to a topic that nothing subscribes to
// fails with [ErrNoSubscribers]. group and connect_timeout are accepted,
// so that a URL switches between brokers by its scheme alone, and checked,
// but GoChannel has neither groups nor connections.
func openGoChannel(_ context.Context, u *url.URL, opts brokerurl.Options) (*brokerurl.Opened, error) {
	persistent, err := goChannelConfig(u, opts)
	if err != nil {
		return nil, err
	}
	gc := NewGoChannel(gochannel.Config{Persistent: persistent, OutputChannelBuffer: 1024}, opts.Logger)
	// GoChannel's Close is idempotent: PubSub.Close calls it twice.
	return &brokerurl.Opened{Publisher: gc, Subscriber: gc}, nil
}

// goChannelConfig reads a gochannel:// URL and opts: whether the channel
// is persistent. A host, port, user or path is an error: the channel is
// in this process, and a URL that names somewhere else was meant for
// another scheme.
func goChannelConfig(u *url.URL, opts brokerurl.Options) (bool, error) {
	switch {
	case u.Opaque != "":
		return false, fmt.Errorf("%w: gochannel: %q after the scheme: write gochannel:// with only parameters, e.g. gochannel://?persistent=true", brokerurl.ErrBadURL, u.Opaque)
	case u.Host != "":
		return false, fmt.Errorf("%w: gochannel:// names host %q, but the channel lives in this process: write gochannel://?persistent=true, or the scheme of the broker at that host", brokerurl.ErrBadURL, u.Host)
	case u.User != nil:
		return false, fmt.Errorf("%w: gochannel:// has user info, which it does not use: remove it", brokerurl.ErrBadURL)
	case u.Path != "" && u.Path != "/":
		return false, fmt.Errorf("%w: gochannel:// has a path %q, which it does not use: remove it", brokerurl.ErrBadURL, u.Path)
	}
	q, err := brokerurl.Query(u, "persistent")
	if err != nil {
		return false, err
	}
	if _, err := brokerurl.Group(q, opts); err != nil {
		return false, err
	}
	if _, err := brokerurl.ConnectTimeout(q, opts); err != nil {
		return false, err
	}
	return brokerurl.Bool(q, "persistent", false)
}
