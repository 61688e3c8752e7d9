// Package adapters opens a Watermill publisher and subscriber for a broker
// named by a URL, so that one handler runs unchanged on each broker and the
// choice is configuration:
//
//	kafka://host:9092,host2:9092?group=billing   Kafka (kafka:// with no host: an embedded broker)
//	amqp://user:pass@host:5672/vhost?group=billing   RabbitMQ, quorum queues, manual ack
//	sqs://us-east-1?endpoint=http://127.0.0.1:4566&create=true   Amazon SQS
//	postgres://user@host:5432/db?group=billing   watermill-sql v4 on PostgreSQL
//	gochannel://?persistent=true   in-process Watermill GoChannel
//
// Every adapter acknowledges to the broker only when the handler acks, and
// sets the [delivery] metadata. Credentials in a URL never appear in errors
// or logs.
package adapters

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"strconv"
	"strings"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
)

var (
	// ErrUnknownScheme is returned for a URL whose scheme names no adapter.
	ErrUnknownScheme = errors.New("adapters: unknown broker scheme")
	// ErrBadURL is returned for a URL that is malformed or misses a
	// required part; the message says which.
	ErrBadURL = errors.New("adapters: bad broker URL")
)

// Options are the settings that a URL does not carry.
type Options struct {
	// Logger is passed to the publisher and subscriber. Defaults to
	// watermill.NopLogger.
	Logger watermill.LoggerAdapter
	// ConsumerGroup, when set, overrides the URL's group parameter.
	ConsumerGroup string
}

// PubSub is an opened broker: its publisher, its subscriber, and whatever
// else Open started for them (an embedded broker, a connection pool), which
// Close stops.
type PubSub struct {
	// Publisher publishes to the broker.
	Publisher message.Publisher
	// Subscriber subscribes to the broker with manual acknowledgement.
	Subscriber message.Subscriber
	// Scheme is the URL scheme that chose the adapter.
	Scheme string

	closers []func() error
}

// Close closes the subscriber, the publisher and everything Open started,
// in that order, and returns every error.
func (p *PubSub) Close() error {
	var errs []error
	if p.Subscriber != nil {
		errs = append(errs, p.Subscriber.Close())
	}
	if p.Publisher != nil {
		errs = append(errs, p.Publisher.Close())
	}
	for i := len(p.closers) - 1; i >= 0; i-- {
		errs = append(errs, p.closers[i]())
	}
	return errors.Join(errs...)
}

// Open returns a publisher and subscriber for rawURL. It checks that the
// broker is reachable before returning, so that a wrong address fails here
// with a clear error instead of in the first handler.
func Open(ctx context.Context, rawURL string, opts Options) (*PubSub, error) {
	if opts.Logger == nil {
		opts.Logger = watermill.NopLogger{}
	}
	u, err := url.Parse(rawURL)
	if err != nil {
		// url.Parse's error repeats the URL, password included.
		return nil, fmt.Errorf("%w: cannot parse %q", ErrBadURL, redactRaw(rawURL))
	}
	safe := u.Redacted()
	var ps *PubSub
	switch u.Scheme {
	case "gochannel":
		ps, err = openGoChannel(u, opts)
	case "postgres", "postgresql":
		ps, err = openPostgres(ctx, u, opts)
	case "kafka":
		ps, err = openKafka(ctx, u, opts)
	case "amqp", "amqps":
		ps, err = openAMQP(ctx, u, opts)
	case "sqs":
		ps, err = openSQS(ctx, u, opts)
	case "":
		return nil, fmt.Errorf("%w: %q has no scheme; use kafka://, amqp://, sqs://, postgres:// or gochannel://", ErrUnknownScheme, safe)
	default:
		return nil, fmt.Errorf("%w %q in %q; use kafka://, amqp://, sqs://, postgres:// or gochannel://", ErrUnknownScheme, u.Scheme, safe)
	}
	if err != nil {
		return nil, fmt.Errorf("adapters: open %s: %w", safe, scrub(err, u))
	}
	ps.Scheme = u.Scheme
	return ps, nil
}

// group returns the consumer group: the option, else the URL's group
// parameter.
func group(u *url.URL, opts Options) string {
	if opts.ConsumerGroup != "" {
		return opts.ConsumerGroup
	}
	return u.Query().Get("group")
}

// boolParam reads an optional boolean query parameter.
func boolParam(u *url.URL, name string, def bool) (bool, error) {
	v := u.Query().Get(name)
	if v == "" {
		return def, nil
	}
	b, err := strconv.ParseBool(v)
	if err != nil {
		return false, fmt.Errorf("%w: parameter %s=%q is not a boolean", ErrBadURL, name, v)
	}
	return b, nil
}

// scrub removes the URL's password from an error a driver returned, in case
// the driver quoted the URL.
func scrub(err error, u *url.URL) error {
	pass, ok := u.User.Password()
	if !ok || pass == "" || !strings.Contains(err.Error(), pass) {
		return err
	}
	return redactedError{msg: strings.ReplaceAll(err.Error(), pass, "xxxxx"), err: err}
}

// redactedError shows a scrubbed message but still unwraps to the
// driver's error for errors.Is and errors.As.
type redactedError struct {
	msg string
	err error
}

func (e redactedError) Error() string { return e.msg }
func (e redactedError) Unwrap() error { return e.err }

// redactRaw hides what looks like a password in a URL that did not parse.
func redactRaw(raw string) string {
	scheme, rest, ok := strings.Cut(raw, "://")
	if !ok {
		return raw
	}
	userinfo, host, ok := strings.Cut(rest, "@")
	if !ok {
		return raw
	}
	user, _, hasPass := strings.Cut(userinfo, ":")
	if !hasPass {
		return raw
	}
	return scheme + "://" + user + ":xxxxx@" + host
}
