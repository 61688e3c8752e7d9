package amqp

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/url"
	"strings"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/oncemill/oncemill/adapters/internal/brokerurl"
)

// amqpClientParams are the URL parameters of amqp091 itself, which reach
// the client unchanged. Its connection_timeout is not one of them:
// connect_timeout sets it.
func amqpClientParams() []string {
	return []string{"heartbeat", "channel_max", "auth_mechanism", "certfile", "keyfile", "cacertfile", "server_name_indication"}
}

func init() {
	brokerurl.Register(openURL, "amqp", "amqps")
	brokerurl.RegisterChecker(func(u *url.URL, opts brokerurl.Options) error {
		_, err := urlConfig(u, opts)
		return err
	}, "amqp", "amqps")
}

// openURL opens RabbitMQ with durable quorum queues and manual acks for
// the amqp:// and amqps:// URLs of adapters.Open. Parameters: group
// (queue "<topic>.<group>"), prefetch, delivery_limit,
// single_active_consumer, dead_letter_exchange, drain_timeout (a Go duration; see
// [Config.DrainTimeout]) and connect_timeout, which are removed before
// the URL reaches the client, and amqp091's own (see amqpClientParams).
func openURL(ctx context.Context, u *url.URL, opts brokerurl.Options) (*brokerurl.Opened, error) {
	cfg, err := urlConfig(u, opts)
	if err != nil {
		return nil, err
	}
	// The client takes no context: bound its connection attempts by ctx's
	// deadline too.
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	cfg.ConnectTimeout = max(brokerurl.Within(ctx, cfg.ConnectTimeout), time.Millisecond)
	pub, err := NewPublisher(cfg, opts.Logger)
	if err != nil {
		return nil, urlConnectError(u, cfg, err)
	}
	sub, err := NewSubscriber(cfg, opts.Logger)
	if err != nil {
		return nil, errors.Join(urlConnectError(u, cfg, err), pub.Close())
	}
	return &brokerurl.Opened{Publisher: pub, Subscriber: sub}, nil
}

// urlConfig reads an amqp:// URL and opts into a checked config.
func urlConfig(u *url.URL, opts brokerurl.Options) (Config, error) {
	q, err := brokerurl.Query(u, append([]string{"prefetch", "delivery_limit", "single_active_consumer", "dead_letter_exchange", "drain_timeout"}, amqpClientParams()...)...)
	if err != nil {
		return Config{}, err
	}
	cfg := Config{DeadLetterExchange: q.Get("dead_letter_exchange")}
	if cfg.ConsumerGroup, err = brokerurl.Group(q, opts); err != nil {
		return Config{}, err
	}
	if cfg.ConnectTimeout, err = brokerurl.ConnectTimeout(q, opts); err != nil {
		return Config{}, err
	}
	if cfg.Prefetch, err = brokerurl.Int(q, "prefetch"); err != nil {
		return Config{}, err
	}
	if cfg.DeliveryLimit, err = brokerurl.Int(q, "delivery_limit"); err != nil {
		return Config{}, err
	}
	if cfg.SingleActiveConsumer, err = brokerurl.Bool(q, "single_active_consumer", false); err != nil {
		return Config{}, err
	}
	if cfg.DrainTimeout, err = brokerurl.Duration(q, "drain_timeout", false); err != nil {
		return Config{}, err
	}
	for _, p := range []string{"group", "prefetch", "delivery_limit", "single_active_consumer", "dead_letter_exchange", "drain_timeout", "connect_timeout"} {
		q.Del(p)
	}
	clean := *u
	clean.RawQuery = q.Encode()
	cfg.URL = clean.String()
	if err := cfg.Validate(); err != nil {
		return Config{}, fmt.Errorf("%w: %w", brokerurl.ErrBadURL, err)
	}
	return cfg, nil
}

// urlConnectError marks err, from connecting to the broker of u, with
// [brokerurl.ErrConnectTimeout] when the broker did not answer in time. amqp091
// reports a handshake that ran out of time as a frame error whose reason
// is the text of the network error, so the text is all there is to go by.
func urlConnectError(u *url.URL, cfg Config, err error) error {
	var aerr *amqp091.Error
	timedOut := errors.As(err, &aerr) && aerr.Code == amqp091.FrameError && strings.HasSuffix(aerr.Reason, "i/o timeout")
	var nerr net.Error
	timedOut = timedOut || (errors.As(err, &nerr) && nerr.Timeout())
	if !timedOut {
		return err
	}
	port := u.Port()
	if port == "" {
		port = map[bool]string{true: "5671", false: "5672"}[u.Scheme == "amqps"]
	}
	return brokerurl.NoAnswer(net.JoinHostPort(u.Hostname(), port), cfg.ConnectTimeout, err)
}

// ParseURL reads an amqp:// or amqps:// URL as adapters.Open reads it and
// returns the Config it describes: the group, prefetch, delivery_limit,
// single_active_consumer, dead_letter_exchange, drain_timeout and
// connect_timeout parameters set
// the Config and are removed from Config.URL, amqp091's own parameters
// stay, and any other parameter is an error that names it. Tools that
// need the Config itself (to declare queues, say) read it here, so that a
// URL means one thing everywhere.
func ParseURL(rawURL string) (Config, error) {
	u, err := url.Parse(rawURL)
	if err != nil {
		// url.Parse's error quotes the URL, password included.
		return Config{}, fmt.Errorf("%w: cannot parse the URL", brokerurl.ErrBadURL)
	}
	if u.Scheme != "amqp" && u.Scheme != "amqps" {
		return Config{}, fmt.Errorf("%w: %s: want an amqp:// or amqps:// URL", brokerurl.ErrBadURL, redactURL(rawURL))
	}
	return urlConfig(u, brokerurl.Options{})
}
