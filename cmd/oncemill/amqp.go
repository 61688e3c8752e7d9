package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"strings"

	"github.com/oncemill/oncemill/adapters/amqp"
)

// amqpDeclare declares the exchange, queue and binding of each --topic.
func (c *cmd) amqpDeclare(ctx context.Context, args []string) error {
	var (
		rawURL, group, dlx string
		topics             []string
		limit              int
	)
	fs := newFlags(c.name)
	fs.StringVar(&rawURL, "url", "", "amqp:// or amqps:// `URL` of the broker (default $BROKER_URL); its group, delivery_limit, single_active_consumer, dead_letter_exchange and connect_timeout parameters are read as adapters.Open reads them")
	fs.Func("topic", "`TOPIC` to declare: its exchange, queue and binding (repeat for more)", func(s string) error {
		if s == "" {
			return errors.New("empty topic")
		}
		topics = append(topics, s)
		return nil
	})
	fs.StringVar(&group, "group", "", "consumer `GROUP` whose queue to declare (or the URL's group)")
	fs.IntVar(&limit, "delivery-limit", 0, "queue argument x-delivery-limit, `N` deliveries (or the URL's delivery_limit)")
	fs.StringVar(&dlx, "dead-letter-exchange", "", "`EXCHANGE` for the queue argument x-dead-letter-exchange (or the URL's dead_letter_exchange)")
	if err := onlyFlags(fs, args, "give topics with --topic"); err != nil {
		return err
	}
	if len(topics) == 0 {
		return usagef("--topic is required")
	}
	rawURL, err := c.required("--url", rawURL, "BROKER_URL")
	if err != nil {
		return err
	}
	// The URL's parameters, read as adapters.Open reads them.
	cfg, err := amqp.ParseURL(rawURL)
	if err != nil {
		return usagef("--url: %v", err)
	}
	given := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { given[f.Name] = true })
	if err := errors.Join(fromFlag(given, "group", group, &cfg.ConsumerGroup),
		fromFlag(given, "dead-letter-exchange", dlx, &cfg.DeadLetterExchange),
		fromFlag(given, "delivery-limit", limit, &cfg.DeliveryLimit)); err != nil {
		return err
	}
	if err := cfg.Validate(); err != nil {
		return usageError{msg: err.Error()}
	}

	err = amqp.Declare(ctx, cfg, topics...)
	if errors.Is(err, amqp.ErrInvalidTopic) {
		return usagef("--topic: %v; nothing declared", err)
	}
	if err != nil {
		return err
	}
	for _, t := range topics {
		fmt.Fprintf(c.stdout, "declared exchange %q, quorum queue %q and their binding\n", cfg.ExchangeName(t), cfg.QueueName(t))
	}
	return nil
}

// fromFlag sets *field, read from the URL's parameter named as flag with
// '_' for '-', to value when flag was given, refusing a URL that gives
// another value.
func fromFlag[T comparable](given map[string]bool, flag string, value T, field *T) error {
	var zero T
	if !given[flag] {
		return nil
	}
	if *field != zero && *field != value {
		param := strings.ReplaceAll(flag, "-", "_")
		return usagef("--%s %#v and the URL's %s=%#v differ; give one of them", flag, value, param, *field)
	}
	*field = value
	return nil
}
