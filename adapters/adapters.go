// Package adapters opens a Watermill publisher and subscriber for a broker
// named by a URL, so that one handler runs unchanged on each broker and the
// choice is configuration:
//
//	kafka://host:9092,host2:9092?group=billing   Kafka (kafka:// with no host: an embedded broker)
//	amqp://user:pass@host:5672/vhost?group=billing   RabbitMQ, quorum queues, manual ack
//	sqs://us-east-1?endpoint=http://127.0.0.1:4566&create=true   Amazon SQS
//	nats://host:4222?group=billing   NATS JetStream, durable pull consumers (nats:// with no host: an embedded server)
//	postgres://user@host:5432/db?group=billing   watermill-sql v4 on PostgreSQL
//	gochannel://?persistent=true   in-process Watermill GoChannel
//
// Every scheme accepts group (the consumer group; SQS and GoChannel have
// none and ignore it) and connect_timeout (see [DefaultConnectTimeout]);
// each adapter's documentation lists its other parameters. A parameter a
// scheme does not know is an error, so that a misspelt one does not
// silently leave its default in place.
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
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
)

// DefaultConnectTimeout bounds each connection attempt of Open (the TCP
// connect and the broker's first answer) when neither the URL's
// connect_timeout nor [Options.ConnectTimeout] sets a bound.
const DefaultConnectTimeout = 10 * time.Second

var (
	// ErrUnknownScheme is returned for a URL whose scheme names no adapter.
	ErrUnknownScheme = errors.New("adapters: unknown broker scheme")
	// ErrBadURL is returned for a URL that is malformed, misses a required
	// part, has a parameter its scheme does not know or a value that is not
	// valid, or contradicts [Options]; the message says which.
	ErrBadURL = errors.New("adapters: bad broker URL")
	// ErrConnectTimeout is wrapped by the error Open returns when a broker
	// did not accept a connection, or did not answer on it, within the
	// connect timeout; the message names the host and port.
	ErrConnectTimeout = errors.New("adapters: no answer within the connect timeout")
)

// Options are the settings that a URL does not carry.
type Options struct {
	// Logger is passed to the publisher and subscriber. Defaults to
	// watermill.NopLogger.
	Logger watermill.LoggerAdapter
	// ConsumerGroup is the consumer group, which the URL's group parameter
	// can also name. Giving both with different values is an error.
	ConsumerGroup string
	// ConnectTimeout bounds each connection attempt of Open, which the
	// URL's connect_timeout parameter can also set. Giving both with
	// different values is an error. Zero means [DefaultConnectTimeout].
	ConnectTimeout time.Duration
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
// with a clear error instead of in the first handler. Each connection
// attempt is bounded by the connect timeout (see [Options.ConnectTimeout])
// and by ctx.
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
	case "nats":
		ps, err = openNATS(ctx, u, opts)
	case "":
		return nil, fmt.Errorf("%w: %q has no scheme; use kafka://, amqp://, sqs://, nats://, postgres:// or gochannel://", ErrUnknownScheme, safe)
	default:
		return nil, fmt.Errorf("%w %q in %q; use kafka://, amqp://, sqs://, nats://, postgres:// or gochannel://", ErrUnknownScheme, u.Scheme, safe)
	}
	if err != nil {
		return nil, fmt.Errorf("adapters: open %s: %w", safe, scrub(err, rawURL, u))
	}
	ps.Scheme = u.Scheme
	return ps, nil
}

// query parses u's query and checks it against known, the parameters of
// u's scheme besides group and connect_timeout, which every scheme takes.
// A parameter not known, or given twice, is an error that names it and
// lists the known ones.
func query(u *url.URL, known ...string) (url.Values, error) {
	q, err := url.ParseQuery(u.RawQuery)
	if err != nil {
		return nil, fmt.Errorf("%w: query: %w", ErrBadURL, err)
	}
	known = append([]string{"group", "connect_timeout"}, known...)
	slices.Sort(known)
	var unknown []string
	for name, values := range q {
		switch {
		case !slices.Contains(known, name):
			unknown = append(unknown, strconv.Quote(name))
		case len(values) > 1:
			return nil, fmt.Errorf("%w: parameter %s is given %d times", ErrBadURL, name, len(values))
		}
	}
	if len(unknown) > 0 {
		slices.Sort(unknown)
		what := "parameter"
		if len(unknown) > 1 {
			what = "parameters"
		}
		return nil, fmt.Errorf("%w: unknown %s %s for %s://; known parameters: %s",
			ErrBadURL, what, strings.Join(unknown, ", "), u.Scheme, strings.Join(known, ", "))
	}
	return q, nil
}

// group returns the consumer group: the URL's group parameter or the
// option, which must agree when both are set.
func group(q url.Values, opts Options) (string, error) {
	fromURL := q.Get("group")
	switch {
	case fromURL == "":
		return opts.ConsumerGroup, nil
	case opts.ConsumerGroup != "" && opts.ConsumerGroup != fromURL:
		return "", fmt.Errorf("%w: parameter group=%q and Options.ConsumerGroup %q differ; set one of them", ErrBadURL, fromURL, opts.ConsumerGroup)
	}
	return fromURL, nil
}

// connectTimeout returns the connect timeout: the URL's connect_timeout
// parameter or the option, which must agree when both are set, else
// [DefaultConnectTimeout].
func connectTimeout(q url.Values, opts Options) (time.Duration, error) {
	fromURL, err := durationParam(q, "connect_timeout", true)
	if err != nil {
		return 0, err
	}
	switch {
	case opts.ConnectTimeout < 0:
		return 0, fmt.Errorf("%w: Options.ConnectTimeout is %s, want > 0, or 0 for the default", ErrBadURL, opts.ConnectTimeout)
	case fromURL == 0 && opts.ConnectTimeout == 0:
		return DefaultConnectTimeout, nil
	case fromURL == 0:
		return opts.ConnectTimeout, nil
	case opts.ConnectTimeout != 0 && opts.ConnectTimeout != fromURL:
		return 0, fmt.Errorf("%w: parameter connect_timeout=%s and Options.ConnectTimeout %s differ; set one of them", ErrBadURL, q.Get("connect_timeout"), opts.ConnectTimeout)
	}
	return fromURL, nil
}

// durationParam reads an optional duration parameter, which must be
// positive: a Go duration such as "1500ms" or "2s", or, when seconds is
// true, a whole number of seconds as libpq's connect_timeout. Absent is 0.
func durationParam(q url.Values, name string, seconds bool) (time.Duration, error) {
	v := q.Get(name)
	if v == "" {
		return 0, nil
	}
	d, err := time.ParseDuration(v)
	if err != nil && seconds {
		if n, nerr := strconv.ParseInt(v, 10, 32); nerr == nil {
			d, err = time.Duration(n)*time.Second, nil
		}
	}
	if err != nil || d <= 0 {
		want := "a positive Go duration such as 5s"
		if seconds {
			want += ", or whole seconds"
		}
		return 0, fmt.Errorf("%w: parameter %s=%q: want %s", ErrBadURL, name, v, want)
	}
	return d, nil
}

// boolParam reads an optional boolean query parameter.
func boolParam(q url.Values, name string, def bool) (bool, error) {
	v := q.Get(name)
	if v == "" {
		return def, nil
	}
	b, err := strconv.ParseBool(v)
	if err != nil {
		return false, fmt.Errorf("%w: parameter %s=%q is not a boolean", ErrBadURL, name, v)
	}
	return b, nil
}

// within returns the bound of one connection attempt: timeout, or less
// when ctx ends sooner.
func within(ctx context.Context, timeout time.Duration) time.Duration {
	if dl, ok := ctx.Deadline(); ok {
		if left := time.Until(dl); left < timeout {
			return max(left, 0)
		}
	}
	return timeout
}

// noAnswer is the error of a connection attempt to addr that did not
// complete within timeout.
func noAnswer(addr string, timeout time.Duration, err error) error {
	return fmt.Errorf("%w (%s) from %s: %w", ErrConnectTimeout, timeout.Round(time.Millisecond), addr, err)
}

// scrub removes the URL's user info from an error a driver returned, in
// case the driver quoted the URL. Only the user info is replaced, in the
// spellings a driver may quote it (as written in rawURL, re-escaped, and
// decoded), not every occurrence of the password's text, which may be a
// common word or a single letter.
func scrub(err error, rawURL string, u *url.URL) error {
	msg := redactUserinfo(err.Error(), rawURL, u)
	if msg == err.Error() {
		return err
	}
	return redactedError{msg: msg, err: err}
}

// redactUserinfo replaces the user info of u, parsed from rawURL, with
// "user:xxxxx" wherever s quotes it followed by its '@'.
func redactUserinfo(s, rawURL string, u *url.URL) string {
	if u.User == nil {
		return s
	}
	pass, ok := u.User.Password()
	if !ok {
		return s
	}
	safe := url.UserPassword(u.User.Username(), "xxxxx").String() + "@"
	forms := []string{u.User.String() + "@", u.User.Username() + ":" + pass + "@"}
	if raw := rawUserinfo(rawURL); raw != "" {
		forms = append(forms, raw+"@")
	}
	for _, f := range forms {
		s = strings.ReplaceAll(s, f, safe)
	}
	return s
}

// rawUserinfo returns the user info of rawURL as written, or "".
func rawUserinfo(rawURL string) string {
	_, rest, ok := strings.Cut(rawURL, "://")
	if !ok {
		return ""
	}
	if end := strings.IndexAny(rest, "/?#"); end >= 0 {
		rest = rest[:end]
	}
	if at := strings.LastIndex(rest, "@"); at >= 0 {
		return rest[:at]
	}
	return ""
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
