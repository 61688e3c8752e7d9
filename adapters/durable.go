package adapters

import (
	"errors"
	"fmt"
	"net/url"
	"reflect"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/oncemill/oncemill/adapters/internal/brokerurl"
)

// ErrInProcess is wrapped by the errors of [CheckDurable] and
// [CheckDurableURL] for a destination that lives inside this process: an
// embedded broker that kafka:// or nats:// with no host started, or a
// GoChannel. What is published there is gone when the process exits, so
// whoever deletes or acknowledges the source once the publish returned
// (the outbox relay, a dead-letter replay, the Poison middleware) would
// lose it. The message names what to give instead.
var ErrInProcess = errors.New("adapters: not a durable destination")

// CheckDurable returns nil for a publisher that, as far as can be seen,
// hands its messages to something outside this process, and an error
// wrapping [ErrInProcess] for one that does not:
//
//   - the publisher that [Open] returns for kafka:// or nats:// with no
//     host, which publishes into an embedded broker;
//   - a GoChannel that is not persistent, Watermill's
//     (*gochannel.GoChannel), which also reports success for messages
//     that nothing subscribes to, or this package's [GoChannel].
//
// A persistent GoChannel is accepted: it keeps every message for the
// subscribers of this process, and configuring it so is how a test or a
// demo says that its destination is meant to live in process. A decorator
// around one of the above cannot be seen through.
//
// forwarder.NewRelay, middleware.NewPoison and dlq's replays call it on
// the publisher they are given.
func CheckDurable(p message.Publisher) error {
	switch p := p.(type) {
	case *inProcessPublisher:
		return fmt.Errorf("%w: %s", ErrInProcess, p.reason)
	case *GoChannel:
		if p != nil && !p.Persistent() {
			return fmt.Errorf("%w: a non-persistent GoChannel (gochannel://) keeps nothing once this process exits; "+
				"name the broker the consumers read from, or, in a test or a demo, make it persistent (gochannel://?persistent=true)", ErrInProcess)
		}
	case *gochannel.GoChannel:
		if p != nil && !persistentGoChannel(p) {
			return fmt.Errorf("%w: a non-persistent *gochannel.GoChannel returns nil for a topic nobody subscribes to and keeps nothing once this process exits; "+
				"name the broker the consumers read from, or, in a test or a demo, set gochannel.Config.Persistent", ErrInProcess)
		}
	}
	return nil
}

// CheckDurableURL returns an error wrapping [ErrInProcess] for a broker
// URL that names no broker outside this process: gochannel://, persistent
// or not, and kafka:// or nats:// with no host, which start an embedded
// broker (a template whose ${HOST} was empty). A command that publishes
// and then deletes what it published (a relay, a replay) has no
// subscriber of its own, so it refuses these before it opens anything. A
// URL that does not parse is left to [Open] to report.
func CheckDurableURL(rawURL string) error {
	u, err := url.Parse(rawURL)
	if err != nil {
		return nil
	}
	switch {
	case u.Scheme == "gochannel":
		return fmt.Errorf("%w: gochannel:// lives inside this process, which nothing else subscribes to; "+
			"name the broker the consumers read from, e.g. kafka://broker:9092", ErrInProcess)
	case (u.Scheme == "kafka" || u.Scheme == "nats") && u.Host == "":
		return fmt.Errorf("%w: %s", ErrInProcess, brokerurl.NoHost(u.Scheme))
	}
	return nil
}

// inProcessPublisher is the publisher of a broker that [Open] started in
// this process, marked so for [CheckDurable].
type inProcessPublisher struct {
	message.Publisher
	reason string
}

// persistentGoChannel reports whether a Watermill GoChannel keeps messages
// for later subscribers. GoChannel does not export its config; its
// Persistent flag is read by reflection, and a GoChannel whose flag cannot
// be found counts as not persistent.
func persistentGoChannel(gc *gochannel.GoChannel) bool {
	cfg := reflect.ValueOf(gc).Elem().FieldByName("config")
	if cfg.Kind() != reflect.Struct {
		return false
	}
	persistent := cfg.FieldByName("Persistent")
	return persistent.Kind() == reflect.Bool && persistent.Bool()
}
