package adapters

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/url"
	"strconv"
	"strings"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/oncemill/oncemill/adapters/amqp"
)

// amqpClientParams are the URL parameters of amqp091 itself, which reach
// the client unchanged. Its connection_timeout is not one of them:
// connect_timeout sets it.
func amqpClientParams() []string {
	return []string{"heartbeat", "channel_max", "auth_mechanism", "certfile", "keyfile", "cacertfile", "server_name_indication"}
}

// openAMQP opens RabbitMQ with durable quorum queues and manual acks.
// Parameters: group (queue "<topic>.<group>"), prefetch, delivery_limit,
// dead_letter_exchange, drain_timeout (a Go duration; see
// [amqp.Config.DrainTimeout]) and connect_timeout, which are removed before
// the URL reaches the client, and amqp091's own (see amqpClientParams).
func openAMQP(ctx context.Context, u *url.URL, opts Options) (*PubSub, error) {
	cfg, err := amqpConfig(u, opts)
	if err != nil {
		return nil, err
	}
	// The client takes no context: bound its connection attempts by ctx's
	// deadline too.
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	cfg.ConnectTimeout = max(within(ctx, cfg.ConnectTimeout), time.Millisecond)
	pub, err := amqp.NewPublisher(cfg, opts.Logger)
	if err != nil {
		return nil, amqpConnectError(u, cfg, err)
	}
	sub, err := amqp.NewSubscriber(cfg, opts.Logger)
	if err != nil {
		return nil, errors.Join(amqpConnectError(u, cfg, err), pub.Close())
	}
	return &PubSub{Publisher: pub, Subscriber: sub}, nil
}

// amqpConfig reads an amqp:// URL and opts into a checked config.
func amqpConfig(u *url.URL, opts Options) (amqp.Config, error) {
	q, err := query(u, append([]string{"prefetch", "delivery_limit", "dead_letter_exchange", "drain_timeout"}, amqpClientParams()...)...)
	if err != nil {
		return amqp.Config{}, err
	}
	cfg := amqp.Config{DeadLetterExchange: q.Get("dead_letter_exchange")}
	if cfg.ConsumerGroup, err = group(q, opts); err != nil {
		return amqp.Config{}, err
	}
	if cfg.ConnectTimeout, err = connectTimeout(q, opts); err != nil {
		return amqp.Config{}, err
	}
	if cfg.Prefetch, err = intParam(q, "prefetch"); err != nil {
		return amqp.Config{}, err
	}
	if cfg.DeliveryLimit, err = intParam(q, "delivery_limit"); err != nil {
		return amqp.Config{}, err
	}
	if cfg.DrainTimeout, err = durationParam(q, "drain_timeout", false); err != nil {
		return amqp.Config{}, err
	}
	for _, p := range []string{"group", "prefetch", "delivery_limit", "dead_letter_exchange", "drain_timeout", "connect_timeout"} {
		q.Del(p)
	}
	clean := *u
	clean.RawQuery = q.Encode()
	cfg.URL = clean.String()
	if err := cfg.Validate(); err != nil {
		return amqp.Config{}, fmt.Errorf("%w: %w", ErrBadURL, err)
	}
	return cfg, nil
}

// amqpConnectError marks err, from connecting to the broker of u, with
// [ErrConnectTimeout] when the broker did not answer in time. amqp091
// reports a handshake that ran out of time as a frame error whose reason
// is the text of the network error, so the text is all there is to go by.
func amqpConnectError(u *url.URL, cfg amqp.Config, err error) error {
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
	return noAnswer(net.JoinHostPort(u.Hostname(), port), cfg.ConnectTimeout, err)
}

// intParam reads an optional integer query parameter; absent is 0.
func intParam(q url.Values, name string) (int, error) {
	v := q.Get(name)
	if v == "" {
		return 0, nil
	}
	n, err := strconv.Atoi(v)
	if err != nil {
		return 0, fmt.Errorf("%w: parameter %s=%q is not an integer", ErrBadURL, name, v)
	}
	return n, nil
}
