package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/oncemill/oncemill/adapters/amqp"
	"github.com/oncemill/oncemill/internal/redact"
)

// URL parameters that adapters.Open reads from an amqp:// URL and removes
// before the URL reaches the client.
const (
	paramGroup              = "group"
	paramPrefetch           = "prefetch"
	paramDeliveryLimit      = "delivery_limit"
	paramDeadLetterExchange = "dead_letter_exchange"
	paramConnectTimeout     = "connect_timeout"
)

// amqpDeclare declares the exchange, queue and binding of each --topic.
func amqpDeclare(ctx context.Context, name string, args []string, env func(string) string, stdout io.Writer) error {
	var (
		rawURL, group, dlx string
		topics             []string
		limit              int
	)
	fs := newFlags(name)
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
	pos, err := parse(fs, args)
	if err != nil {
		return err
	}
	if len(pos) > 0 {
		return usagef("unexpected argument %q: give topics with --topic", pos[0])
	}
	if len(topics) == 0 {
		return usagef("--topic is required")
	}
	if rawURL == "" {
		rawURL = env("BROKER_URL")
	}
	if rawURL == "" {
		return usagef("--url is required (or set BROKER_URL)")
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
		fmt.Fprintf(stdout, "declared exchange %q, quorum queue %q and their binding\n", cfg.ExchangeName(t), cfg.QueueName(t))
	}
	return nil
}

// amqpClientParams are amqp091's own URL parameters, which reach the client
// unchanged.
var amqpClientParams = [...]string{"heartbeat", "channel_max", "auth_mechanism", "certfile", "keyfile", "cacertfile", "server_name_indication"}

// amqpConfig reads an amqp:// or amqps:// URL as adapters.Open does: the
// group, delivery_limit, dead_letter_exchange and connect_timeout (a Go
// duration or whole seconds) parameters set the Config and are removed,
// with prefetch, which only consumers use, from the URL the client dials;
// amqp091's own parameters stay. Any other parameter is a usage error.
func amqpConfig(rawURL string) (amqp.Config, error) {
	u, err := url.Parse(rawURL)
	if err != nil {
		// url.Parse's error quotes the URL, password included.
		return amqp.Config{}, usagef("--url: cannot parse the URL")
	}
	if u.Scheme != "amqp" && u.Scheme != "amqps" {
		return amqp.Config{}, usagef("--url %s: want an amqp:// or amqps:// URL", redact.URL(rawURL))
	}
	q, err := url.ParseQuery(u.RawQuery)
	if err != nil {
		return amqp.Config{}, usagef("--url: query: %v", err)
	}
	ours := []string{paramGroup, paramPrefetch, paramDeliveryLimit, paramDeadLetterExchange, paramConnectTimeout}
	for name, values := range q {
		switch {
		case !slices.Contains(ours, name) && !slices.Contains(amqpClientParams[:], name):
			known := append(slices.Clone(ours), amqpClientParams[:]...)
			slices.Sort(known)
			return amqp.Config{}, usagef("--url: unknown parameter %q; known parameters: %s", name, strings.Join(known, ", "))
		case len(values) > 1:
			return amqp.Config{}, usagef("--url: parameter %s is given %d times", name, len(values))
		}
	}
	cfg := amqp.Config{
		ConsumerGroup:      q.Get(paramGroup),
		DeadLetterExchange: q.Get(paramDeadLetterExchange),
	}
	if v := q.Get(paramDeliveryLimit); v != "" {
		if cfg.DeliveryLimit, err = strconv.Atoi(v); err != nil {
			return amqp.Config{}, usagef("--url: parameter %s=%q is not an integer", paramDeliveryLimit, v)
		}
	}
	if v := q.Get(paramConnectTimeout); v != "" {
		d, err := time.ParseDuration(v)
		if err != nil {
			if n, nerr := strconv.ParseInt(v, 10, 32); nerr == nil {
				d, err = time.Duration(n)*time.Second, nil
			}
		}
		if err != nil || d <= 0 {
			return amqp.Config{}, usagef("--url: parameter %s=%q: want a positive Go duration such as 5s, or whole seconds", paramConnectTimeout, v)
		}
		cfg.ConnectTimeout = d
	}
	for _, p := range ours {
		q.Del(p)
	}
	u.RawQuery = q.Encode()
	cfg.URL = u.String()
	return cfg, nil
}
