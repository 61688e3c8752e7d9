package forwarder

import (
	"context"
	"fmt"

	"github.com/ThreeDotsLabs/watermill/message"
)

// Plugin runs the relay with a Watermill router: add it with
// router.AddPlugin(relay.Plugin). The relay starts when the router runs,
// as a handler of its own with no messages to handle, named after its
// outbox table: oncemill_outbox_relay_<schema>.<table>, the same on every
// start, so that the router's metrics and logs keep one series per relay.
// A second relay of the same table in one router is named with a suffix,
// _2, _3 and so on in the order the router loads them (handler names must
// be unique in a router). The router's Close stops the relay, lets the
// batch in flight finish and waits for it, within the router's
// CloseTimeout. Do not also call Run.
func (r *Relay) Plugin(router *message.Router) error {
	router.AddNoPublisherHandler(handlerName(router, r.outbox), r.outbox, relaySubscriber{r},
		func(*message.Message) error { return nil })
	return nil
}

// handlerName is the name of the relay of outbox in router: the first one
// free of oncemill_outbox_relay_<outbox>, then with _2, _3, ….
func handlerName(router *message.Router, outbox string) string {
	base := "oncemill_outbox_relay_" + outbox
	taken := router.Handlers()
	name := base
	for i := 2; ; i++ {
		if _, ok := taken[name]; !ok {
			return name
		}
		name = fmt.Sprintf("%s_%d", base, i)
	}
}

// relaySubscriber is how [Relay.Plugin] ties the relay to the router: the
// router's Subscribe starts Run on the router's context, and the channel
// closes once Run has returned, which is what the router's Close waits for.
type relaySubscriber struct{ r *Relay }

func (s relaySubscriber) Subscribe(ctx context.Context, _ string) (<-chan *message.Message, error) {
	out := make(chan *message.Message)
	go func() {
		defer close(out)
		if err := s.r.Run(ctx); err != nil {
			s.r.cfg.Logger.Error("Outbox relay did not start with the router", err, nil)
		}
	}()
	return out, nil
}

func (s relaySubscriber) Close() error { return s.r.Close() }
