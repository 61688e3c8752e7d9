package main

import (
	"context"
	"errors"
	"flag"
	"fmt"

	"github.com/oncemill/oncemill/adapters/amqp"
)

// URL parameters that adapters.Open reads from an amqp:// URL and removes
// before the URL reaches the client.
const (
	paramGroup              = "group"
	paramDeliveryLimit      = "delivery_limit"
	paramDeadLetterExchange = "dead_letter_exchange"
)

// amqpDeclare declares the exchange, queue and binding of each --topic.
func (c *cmd) amqpDeclare(ctx context.Context, args []string) error {
	var (
		rawURL, group, dlx string
		topics             []string
		limit              int
	)
	fs := newFlags(c.name)
	fs.StringVar(&rawURL, "url", "", "amqp:// or amqps:// `URL` of the broker (default $BROKER_URL); its group, delivery_limit, dead_letter_exchange and connect_timeout parameters are read as adapters.Open reads them")
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
	cfg, err := amqpConfig(rawURL)
	if err != nil {
		return err
	}
	set := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
	for _, o := range []struct {
		flag, param string
		value       string  // the flag's
		field       *string // the URL's, and the result
	}{
		{"group", paramGroup, group, &cfg.ConsumerGroup},
		{"dead-letter-exchange", paramDeadLetterExchange, dlx, &cfg.DeadLetterExchange},
	} {
		if !set[o.flag] {
			continue
		}
		if *o.field != "" && *o.field != o.value {
			return usagef("--%s %q and the URL's %s=%q differ; give one of them", o.flag, o.value, o.param, *o.field)
		}
		*o.field = o.value
	}
	if set["delivery-limit"] {
		if cfg.DeliveryLimit != 0 && cfg.DeliveryLimit != limit {
			return usagef("--delivery-limit %d and the URL's %s=%d differ; give one of them", limit, paramDeliveryLimit, cfg.DeliveryLimit)
		}
		cfg.DeliveryLimit = limit
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

// amqpConfig reads an amqp:// or amqps:// URL as adapters.Open does.
func amqpConfig(rawURL string) (amqp.Config, error) {
	cfg, err := amqp.ParseURL(rawURL)
	if err != nil {
		return amqp.Config{}, usagef("--url: %v", err)
	}
	return cfg, nil
}
