package amqp

import (
	"errors"
	"fmt"
	"net/url"
	"strconv"
	"strings"
	"time"

	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/oncemill/oncemill/internal/redact"
)

// Defaults applied by [Config.Validate], [Config.WatermillConfig],
// [NewPublisher] and [NewSubscriber] to zero fields.
const (
	// DefaultPrefetch is the default [Config.Prefetch].
	DefaultPrefetch = 16
	// DefaultPublishChannels is the default [Config.PublishChannels].
	DefaultPublishChannels = 8
	// DefaultConnectTimeout is the default [Config.ConnectTimeout].
	DefaultConnectTimeout = 10 * time.Second
	// DefaultDrainTimeout is the default [Config.DrainTimeout]: the
	// inbox's default drain budget (20s) and its FinishTimeout (5s), so
	// that a handler the inbox lets finish while the router closes is
	// acked on the broker, within Kubernetes' default termination grace
	// period of 30s.
	DefaultDrainTimeout = 25 * time.Second
)

// maxPrefetch is the largest prefetch count AMQP 0.9.1 can carry (a short).
const maxPrefetch = 65535

// maxPublishChannels bounds the publisher's channel pool; RabbitMQ's default
// channel_max is 2047 per connection.
const maxPublishChannels = 1024

var (
	// ErrInvalidConfig is wrapped by every error that [Config.Validate]
	// returns; the message names the field.
	ErrInvalidConfig = errors.New("amqp: invalid config")
	// ErrConnect is wrapped by the error [NewPublisher], [NewSubscriber]
	// and [Declare] return when the broker cannot be reached or refuses
	// the connection, and by Publisher.Publish and Subscriber.Backlog
	// while they reconnect.
	ErrConnect = errors.New("amqp: cannot connect to broker")
)

// Config configures a RabbitMQ publisher and subscriber.
//
// Topology: every topic is a durable fanout exchange named after the topic.
// A subscriber consumes from a durable quorum queue bound to that exchange,
// named "<topic>" or, with a ConsumerGroup, "<topic>.<group>"; the queue is
// declared (and bound) when the subscriber subscribes or its
// SubscribeInitialize is called. Instances that share a queue compete for
// its messages (a work queue); each queue, that is each consumer group,
// receives every message published to the topic.
//
// A message published while no queue is bound to the topic's exchange is
// dropped by the broker (it is unroutable, and publisher confirms still ack
// it). This package's [Publisher] publishes with mandatory and fails such a
// publish with [ErrUnroutable]; producers in other languages are not told.
// Declare each topic and group with [Declare] (or `oncemill amqp declare`)
// at deployment, before anything is published.
//
// Queue arguments (x-queue-type, x-delivery-limit, x-dead-letter-*) are fixed
// when a queue is first declared: declaring the same queue again with other
// values fails with PRECONDITION_FAILED. To change them on a live queue, use
// a RabbitMQ policy instead and leave the fields here zero.
type Config struct {
	// URL is the AMQP 0.9.1 URL of the broker,
	// amqp://user:password@host:5672/vhost (amqps:// for TLS). Required.
	// The password never appears in errors or logs.
	URL string

	// ConsumerGroup, when set, makes the subscriber's queue
	// "<topic>.<group>" instead of "<topic>", so that each group receives
	// every message of the topic while the instances of one group compete.
	// Topics are therefore best not named like another topic's queue
	// ("a.b" and topic "a" with group "b" share the queue "a.b").
	// The publisher ignores it.
	ConsumerGroup string

	// Prefetch is the consumer's prefetch count (basic.qos): how many
	// unacknowledged messages the broker sends to one subscription before it
	// waits for acks, and how many a subscription hands out at once:
	// messages of different ordering keys concurrently, a key's one at a
	// time (see Subscriber.Subscribe). Zero means
	// [DefaultPrefetch]; at most 65535.
	Prefetch int

	// DeliveryLimit sets the quorum queue argument x-delivery-limit: once a
	// message's delivery count exceeds it, the broker dead-letters the
	// message to DeadLetterExchange, or drops it when there is none.
	// oncemill's subscribers hand each message to the poison middleware
	// with its last delivery marked (delivery.MaxDeliveries), and the
	// middleware ends it there, applied, parked or in its own dead-letter
	// queue, never dropped; it holds a delivery through an outage instead
	// of nacking it, so that waiting spends no delivery.
	//
	// 0, the default, leaves the count to the poison middleware: a new
	// queue is declared with no limit (-1 on RabbitMQ 4.0 and later, whose
	// quorum queues default to 20; the argument left out before, where
	// there is no default and -1 would drop a message at its first
	// return), and a queue that exists with another limit is taken as it
	// is, its limit read from the broker's answer. -1 asks for no limit
	// in the same way. A positive limit is declared as it is, and a queue
	// that exists with another one fails Subscribe with [ErrDeclare],
	// naming both. middleware.Poison.Subscriber refuses a limit below what
	// its policy needs. A limit a policy sets cannot be read over AMQP.
	//
	// The broker counts what it considers failed deliveries. Up to RabbitMQ
	// 4.2 every return counts (nack with requeue, channel or connection
	// closed with the message unacked). Since 4.3 a basic.nack with requeue,
	// which is what the Watermill subscriber sends when a handler nacks, no
	// longer counts: only basic.reject and lost consumers do.
	DeliveryLimit int

	// SingleActiveConsumer sets the queue argument
	// x-single-active-consumer: of the subscriptions that share the queue
	// (the instances of a consumer group), RabbitMQ delivers to one at a
	// time, and to the next only once it has gone (closed, crashed, its
	// connection lost), so that a key's messages are handled in the
	// queue's order across processes as within one; the others stand by.
	// The active subscription still hands out up to Prefetch messages at
	// once, a key's one at a time. Like every queue argument it is fixed
	// when the queue is first declared: a queue that exists without it
	// fails Subscribe with [ErrDeclare] (PRECONDITION_FAILED, inequivalent
	// arg 'x-single-active-consumer'); delete the queue, or declare a new
	// group. Defaults to false: the group's subscriptions compete for the
	// queue's messages, and a key's order holds within each.
	SingleActiveConsumer bool

	// DeadLetterExchange sets the queue argument x-dead-letter-exchange: the
	// exchange that receives messages the broker dead-letters (delivery
	// limit exceeded, nack without requeue, TTL, overflow). It may be the
	// name of another topic, whose subscribers then read the dead letters;
	// that topic's subscriber must not itself use the same DeadLetterExchange.
	DeadLetterExchange string

	// DeadLetterRoutingKey sets x-dead-letter-routing-key; empty keeps the
	// message's routing key. It requires DeadLetterExchange.
	DeadLetterRoutingKey string

	// NoRequeueOnNack, when true, makes a nack drop the message, or
	// dead-letter it to DeadLetterExchange, instead of requeueing it for
	// redelivery. The default (false) requeues.
	NoRequeueOnNack bool

	// PublishChannels is the number of AMQP channels the publisher keeps
	// open and shares between concurrent Publish calls; each waits for its
	// publisher confirm. Zero means [DefaultPublishChannels].
	PublishChannels int

	// ConnectTimeout bounds each connection attempt, the first and every
	// reconnection: the TCP connect and the TLS and AMQP handshakes
	// (amqp091's connection_timeout URL parameter, which WatermillConfig
	// sets). Zero means the URL's connection_timeout (milliseconds) if it
	// has one, else [DefaultConnectTimeout]; setting both is an error.
	ConnectTimeout time.Duration

	// DrainTimeout is how long the subscriber's Close waits, handing out
	// nothing more, for the messages already handed out to be acked or
	// nacked before it closes the channels and the connection, so that
	// those acks reach the broker; what is still unacked then is returned
	// to the queue and delivered again. Keep it at least the inbox's
	// drain budget plus its FinishTimeout, and the router's CloseTimeout
	// at least this. The publisher ignores it. Defaults to
	// [DefaultDrainTimeout] (25s).
	DrainTimeout time.Duration
}

// withDefaults returns a copy of c with zero fields set to their defaults.
func (c Config) withDefaults() Config {
	if c.Prefetch == 0 {
		c.Prefetch = DefaultPrefetch
	}
	if c.PublishChannels == 0 {
		c.PublishChannels = DefaultPublishChannels
	}
	if c.DrainTimeout == 0 {
		c.DrainTimeout = DefaultDrainTimeout
	}
	return c
}

// Validate reports whether c, with its defaults applied, can be used. The
// error wraps [ErrInvalidConfig] and names the field; it never contains the
// URL's password. Validate does not modify c.
func (c Config) Validate() error {
	c = c.withDefaults()
	if c.URL == "" {
		return fmt.Errorf("%w: URL is empty", ErrInvalidConfig)
	}
	if _, err := amqp091.ParseURI(c.URL); err != nil {
		return fmt.Errorf("%w: URL %s is not an AMQP URL: %s", ErrInvalidConfig, redactURL(c.URL), uriReason(err, c.URL))
	}
	if c.Prefetch < 0 || c.Prefetch > maxPrefetch {
		return fmt.Errorf("%w: Prefetch must be between 0 and %d, got %d", ErrInvalidConfig, maxPrefetch, c.Prefetch)
	}
	if c.DeliveryLimit < -1 {
		return fmt.Errorf("%w: DeliveryLimit must be 0 (left to the poison middleware), -1 (no limit) or positive, got %d", ErrInvalidConfig, c.DeliveryLimit)
	}
	if c.DeadLetterRoutingKey != "" && c.DeadLetterExchange == "" {
		return fmt.Errorf("%w: DeadLetterRoutingKey is set but DeadLetterExchange is empty", ErrInvalidConfig)
	}
	if c.PublishChannels < 0 || c.PublishChannels > maxPublishChannels {
		return fmt.Errorf("%w: PublishChannels must be between 0 and %d, got %d", ErrInvalidConfig, maxPublishChannels, c.PublishChannels)
	}
	if c.ConnectTimeout < 0 || (c.ConnectTimeout > 0 && c.ConnectTimeout < time.Millisecond) {
		return fmt.Errorf("%w: ConnectTimeout must be at least 1ms, or 0 for the default, got %s", ErrInvalidConfig, c.ConnectTimeout)
	}
	if c.DrainTimeout < 0 {
		return fmt.Errorf("%w: DrainTimeout must be > 0, or 0 for the default, got %s", ErrInvalidConfig, c.DrainTimeout)
	}
	if c.ConnectTimeout != 0 && urlConnectionTimeout(c.URL) {
		return fmt.Errorf("%w: ConnectTimeout is set and the URL has connection_timeout; set one of them", ErrInvalidConfig)
	}
	for _, f := range []struct{ name, value string }{
		{"ConsumerGroup", c.ConsumerGroup},
		{"DeadLetterExchange", c.DeadLetterExchange},
		{"DeadLetterRoutingKey", c.DeadLetterRoutingKey},
	} {
		if len(f.value) > 255 {
			return fmt.Errorf("%w: %s is %d bytes long, AMQP allows at most 255", ErrInvalidConfig, f.name, len(f.value))
		}
	}
	return nil
}

// ExchangeName returns the name of the exchange that topic is published to:
// the topic itself.
func (c Config) ExchangeName(topic string) string {
	return topic
}

// QueueName returns the name of the queue a subscriber with this Config
// consumes topic from: "<topic>", or "<topic>.<ConsumerGroup>".
func (c Config) QueueName(topic string) string {
	if c.ConsumerGroup == "" {
		return topic
	}
	return topic + "." + c.ConsumerGroup
}

// QueueArguments returns the arguments the subscriber declares its queues
// with, whatever the server's version: x-queue-type quorum, and
// x-delivery-limit, x-single-active-consumer, x-dead-letter-exchange and
// x-dead-letter-routing-key when set. A DeliveryLimit of 0 or -1 (no limit) is left out here: the
// subscriber and [Declare] spell it for the server they reach (-1 since
// RabbitMQ 4.0, nothing before).
func (c Config) QueueArguments() amqp091.Table {
	args := amqp091.Table{"x-queue-type": "quorum"}
	if c.DeliveryLimit > 0 {
		args[deliveryLimitArg] = int64(c.DeliveryLimit)
	}
	if c.SingleActiveConsumer {
		args["x-single-active-consumer"] = true
	}
	if c.DeadLetterExchange != "" {
		args["x-dead-letter-exchange"] = c.DeadLetterExchange
	}
	if c.DeadLetterRoutingKey != "" {
		args["x-dead-letter-routing-key"] = c.DeadLetterRoutingKey
	}
	return args
}

// WatermillConfig validates c and returns the watermill-amqp configuration
// that [NewPublisher] and [NewSubscriber] use: durable fanout exchange per
// topic, durable quorum queue per topic and consumer group, manual
// acknowledgement after the handler, basic.qos with Prefetch, persistent
// messages through [Marshaler], and publisher confirms on a pool of
// PublishChannels channels. Use it to build a watermill-amqp publisher or
// subscriber on a shared connection; a watermill-amqp publisher built from
// it neither sets mandatory nor looks at returns, so an unroutable publish
// is confirmed and lost: prefer [NewPublisher].
func (c Config) WatermillConfig() (wamqp.Config, error) {
	if err := c.Validate(); err != nil {
		return wamqp.Config{}, err
	}
	c = c.withDefaults()
	emptyKey := func(string) string { return "" }
	return wamqp.Config{
		// No AmqpConfig: amqp091 writes into its Properties table on every
		// dial, and reconnecting publishers and subscribers that share one
		// wamqp.Config would race on it. The connect timeout goes in the
		// URL instead.
		Connection: wamqp.ConnectionConfig{AmqpURI: c.uriWithTimeout()},
		Marshaler:  Marshaler{},
		Exchange: wamqp.ExchangeConfig{
			GenerateName: c.ExchangeName,
			Type:         amqp091.ExchangeFanout,
			Durable:      true,
		},
		Queue: wamqp.QueueConfig{
			GenerateName: c.QueueName,
			Durable:      true,
			Arguments:    c.QueueArguments(),
		},
		QueueBind: wamqp.QueueBindConfig{GenerateRoutingKey: emptyKey},
		Publish: wamqp.PublishConfig{
			GenerateRoutingKey: emptyKey,
			ConfirmDelivery:    true,
			ChannelPoolSize:    c.PublishChannels,
		},
		Consume: wamqp.ConsumeConfig{
			NoRequeueOnNack: c.NoRequeueOnNack,
			Qos:             wamqp.QosConfig{PrefetchCount: c.Prefetch},
		},
		TopologyBuilder: &wamqp.DefaultTopologyBuilder{},
	}, nil
}

// urlConnectionTimeout reports whether rawURL sets amqp091's
// connection_timeout parameter.
func urlConnectionTimeout(rawURL string) bool {
	u, err := url.Parse(rawURL)
	return err == nil && u.Query().Has("connection_timeout")
}

// uriWithTimeout returns c.URL with connection_timeout set to
// c.ConnectTimeout, or to [DefaultConnectTimeout] when neither is set. The
// parameter is appended to the URL's text, which is otherwise kept as
// written.
func (c Config) uriWithTimeout() string {
	if c.ConnectTimeout == 0 && urlConnectionTimeout(c.URL) {
		return c.URL
	}
	timeout := c.ConnectTimeout
	if timeout == 0 {
		timeout = DefaultConnectTimeout
	}
	base, fragment, hasFragment := strings.Cut(c.URL, "#")
	sep := "?"
	if strings.Contains(base, "?") {
		sep = "&"
		if strings.HasSuffix(base, "?") || strings.HasSuffix(base, "&") {
			sep = ""
		}
	}
	uri := base + sep + "connection_timeout=" + strconv.FormatInt(timeout.Milliseconds(), 10)
	if hasFragment {
		uri += "#" + fragment
	}
	return uri
}

// redactURL returns rawURL with every credential hidden (see
// redact.URL).
func redactURL(rawURL string) string { return redact.URL(rawURL) }

// uriReason returns why amqp091.ParseURI rejected rawURL, without the URL:
// a *url.Error quotes the whole URL, password included.
func uriReason(err error, rawURL string) string {
	var uerr *url.Error
	if !errors.As(err, &uerr) {
		return scrub(err.Error(), rawURL)
	}
	reason := uerr.Err.Error()
	switch {
	case strings.Contains(reason, "invalid URL escape"):
		// net/url quotes the bad escape, which may be part of the password.
		return "invalid percent-encoding (percent-encode reserved characters in the user name and password)"
	case strings.Contains(reason, "userinfo"):
		return reason + " (percent-encode reserved characters in the user name and password)"
	}
	return scrub(reason, rawURL)
}
