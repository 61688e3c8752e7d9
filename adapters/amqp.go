package adapters

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"strconv"

	"github.com/oncemill/oncemill/adapters/amqp"
)

// openAMQP opens RabbitMQ with durable quorum queues and manual acks.
// Parameters: group (queue "<topic>.<group>"), prefetch, delivery_limit,
// dead_letter_exchange; they are removed before the URL reaches the client.
func openAMQP(_ context.Context, u *url.URL, opts Options) (*PubSub, error) {
	q := u.Query()
	cfg := amqp.Config{
		ConsumerGroup:      group(u, opts),
		DeadLetterExchange: q.Get("dead_letter_exchange"),
	}
	var err error
	if cfg.Prefetch, err = intParam(q, "prefetch"); err != nil {
		return nil, err
	}
	if cfg.DeliveryLimit, err = intParam(q, "delivery_limit"); err != nil {
		return nil, err
	}
	for _, p := range []string{"group", "prefetch", "delivery_limit", "dead_letter_exchange"} {
		q.Del(p)
	}
	clean := *u
	clean.RawQuery = q.Encode()
	cfg.URL = clean.String()
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrBadURL, err)
	}

	pub, err := amqp.NewPublisher(cfg, opts.Logger)
	if err != nil {
		return nil, err
	}
	sub, err := amqp.NewSubscriber(cfg, opts.Logger)
	if err != nil {
		return nil, errors.Join(err, pub.Close())
	}
	return &PubSub{Publisher: pub, Subscriber: sub}, nil
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
