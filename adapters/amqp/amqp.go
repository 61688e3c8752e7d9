package amqp

import (
	"fmt"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
)

// NewSubscriber connects to the broker at cfg.URL and returns a
// watermill-amqp subscriber configured by [Config.WatermillConfig], wrapped
// in a [Subscriber] whose Close drains (see [Config.DrainTimeout]). Subscribe
// (or SubscribeInitialize) declares the topic's durable fanout exchange and
// the durable quorum queue [Config.QueueName], binds them and consumes with
// manual acknowledgement and a prefetch of cfg.Prefetch. Each subscription
// hands out up to cfg.Prefetch messages at once, in the order of each
// ordering key ([Subscriber.Subscribe]), and acknowledges a message to the
// broker only when the handler acks; a nack requeues it (or dead-letters
// it when cfg.NoRequeueOnNack is set). Messages not acked when the
// subscriber's drain ends are returned to the queue.
//
// It starts a goroutine that watches the connection and reconnects with
// backoff when it drops, and each Subscribe starts one that consumes, on a
// connection of its own that it makes again when it drops, until its
// context is done or the subscriber closes; the subscriber's Close stops
// them all and closes the connections. A nil logger logs nothing.
//
// The error wraps [ErrInvalidConfig] for a bad cfg and [ErrConnect] when the
// broker cannot be reached; it never contains the URL's password.
func NewSubscriber(cfg Config, logger watermill.LoggerAdapter) (*Subscriber, error) {
	wcfg, err := cfg.WatermillConfig()
	if err != nil {
		return nil, err
	}
	if logger == nil {
		logger = watermill.NopLogger{}
	}
	q := &queues{}
	wcfg.TopologyBuilder = &topology{queues: q}
	sub, err := wamqp.NewSubscriber(wcfg, logger)
	if err != nil {
		return nil, connectError("subscriber", cfg.URL, err)
	}
	logger.Debug("AMQP subscriber connected", watermill.LogFields{
		"url":            redactURL(cfg.URL),
		"consumer_group": cfg.ConsumerGroup,
	})
	return newSubscriber(sub, cfg, q, logger), nil
}

// connectError wraps err, from creating a publisher or subscriber (what),
// in [ErrConnect] with the redacted URL, and scrubs the password from it.
func connectError(what, rawURL string, err error) error {
	return redactErr(fmt.Errorf("%w at %s (%s): %w", ErrConnect, redactURL(rawURL), what, err), rawURL)
}
