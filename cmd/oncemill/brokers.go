package main

// The command opens any broker URL an operator gives it: it links every
// broker package and both embedded brokers.
import (
	"context"
	"errors"
	"fmt"
	"net/url"

	"github.com/ThreeDotsLabs/watermill"

	"github.com/oncemill/oncemill/adapters"
	_ "github.com/oncemill/oncemill/internal/allbrokers"
)

// openBroker opens broker, the URL field names, to publish to it. The
// command never subscribes: group merely satisfies brokers whose URL needs
// one (Kafka), and a group the URL names is taken as it is. A URL that
// adapters.Open cannot read is a usage error naming field; its errors end
// or start with nothing, what was not done ("nothing replayed"), as
// [checkDurableBroker]'s.
func openBroker(ctx context.Context, field, broker, group, nothing string, logger watermill.LoggerAdapter) (*adapters.PubSub, error) {
	opts := adapters.Options{Logger: logger}
	if u, err := url.Parse(broker); err != nil || u.Query().Get("group") == "" {
		opts.ConsumerGroup = group
	}
	ps, err := adapters.Open(ctx, broker, opts)
	switch {
	case errors.Is(err, adapters.ErrUnknownScheme) || errors.Is(err, adapters.ErrBadURL):
		return nil, usagef("%s: %v; %s", field, err, nothing)
	case err != nil:
		return nil, fmt.Errorf("%s: %w", nothing, err)
	}
	return ps, nil
}

// closeBroker closes ps, adding its failure to *err.
func closeBroker(ps *adapters.PubSub, err *error) {
	if closeErr := ps.Close(); closeErr != nil {
		*err = errors.Join(*err, fmt.Errorf("close broker: %w", closeErr))
	}
}
