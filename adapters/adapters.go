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
// A program links the brokers it names, and no others, by importing their
// packages, as database/sql drivers are linked:
//
//	import (
//		"github.com/oncemill/oncemill/adapters"
//		_ "github.com/oncemill/oncemill/adapters/amqp" // amqp://, amqps://
//	)
//
// The packages are adapters/kafka, adapters/amqp, adapters/sqs,
// adapters/nats and adapters/postgres; kafka:// and nats:// with no host
// also need adapters/kafka/embedded or adapters/nats/embedded, which link
// an in-process broker; gochannel:// needs nothing. Open names the import
// a URL is missing.
//
// Every scheme accepts group (the consumer group; SQS and GoChannel have
// none and ignore it) and connect_timeout (see [DefaultConnectTimeout]);
// each adapter's documentation lists its other parameters. A parameter a
// scheme does not know is an error, so that a misspelt one does not
// silently leave its default in place.
//
// Every adapter acknowledges to the broker only when the handler acks, and
// sets the [delivery] metadata. Every broker's subscriber but GoChannel's
// and postgres:// can tell what the broker still holds for its consumer
// (see [Backlogger] and [PubSub.Backlog]), which observe/prom exports. Credentials in a URL never appear in errors
// or logs: not the password nor a user-only token (nats://TOKEN@host), nor
// the value of a query parameter not known to be harmless (password=…,
// an unknown one), nor those of a URL in a parameter (endpoint=…).
package adapters

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/oncemill/oncemill/adapters/internal/brokerurl"
	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/internal/redact"
)

// DefaultConnectTimeout bounds each connection attempt of Open (the TCP
// connect and the broker's first answer) when neither the URL's
// connect_timeout nor [Options.ConnectTimeout] sets a bound.
const DefaultConnectTimeout = brokerurl.DefaultConnectTimeout

var (
	// ErrUnknownScheme is returned for a URL whose scheme names no adapter.
	ErrUnknownScheme = brokerurl.ErrUnknownScheme
	// ErrNotLinked is returned for a URL whose broker package the program
	// does not import (amqp:// without adapters/amqp), or for kafka:// or
	// nats:// with no host without the package of the embedded broker;
	// the message names the import to add.
	ErrNotLinked = brokerurl.ErrNotLinked
	// ErrBadURL is returned for a URL that is malformed, misses a required
	// part, has a parameter its scheme does not know or a value that is not
	// valid, or contradicts [Options]; the message says which.
	ErrBadURL = brokerurl.ErrBadURL
	// ErrConnectTimeout is wrapped by the error Open returns when a broker
	// did not accept a connection, or did not answer on it, within the
	// connect timeout; the message names the host and port.
	ErrConnectTimeout = brokerurl.ErrConnectTimeout
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
	// HandOutMarks is the Kafka subscriber's store of hand-out marks
	// (kafka.SubscriberConfig.HandOutMarks): the inbox's store, so that a
	// first delivery runs without an attempt record, as on the brokers
	// that count deliveries. The other brokers count their deliveries and
	// ignore it. Defaults to nil.
	HandOutMarks delivery.HandOutMarks
}

// PubSub is an opened broker: its publisher, its subscriber, and whatever
// else Open started for them (an embedded broker, a connection pool), which
// Close stops.
type PubSub struct {
	// Publisher publishes to the broker. For kafka:// or nats:// with no
	// host, [CheckDurable] refuses it: the broker lives in this process.
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
	o := brokerurl.Opened{Publisher: p.Publisher, Subscriber: p.Subscriber, Closers: p.closers}
	return o.Close()
}

// brokerPackages are the packages that register each scheme, for the
// error of a URL whose package the program does not import.
var brokerPackages = map[string]string{
	"kafka":      "kafka",
	"amqp":       "amqp",
	"amqps":      "amqp",
	"sqs":        "sqs",
	"nats":       "nats",
	"postgres":   "postgres",
	"postgresql": "postgres",
}

func init() {
	brokerurl.Register(openGoChannel, "gochannel")
	brokerurl.RegisterChecker(func(u *url.URL, opts brokerurl.Options) error {
		_, err := goChannelConfig(u, opts)
		return err
	}, "gochannel")
}

// Open returns a publisher and subscriber for rawURL. It checks that the
// broker is reachable before returning, so that a wrong address fails here
// with a clear error instead of in the first handler. Each connection
// attempt is bounded by the connect timeout (see [Options.ConnectTimeout])
// and by ctx.
//
// A scheme is there when its broker package is linked: gochannel://
// always; kafka://, amqp://, sqs://, nats:// and postgres:// by importing
// the package of the same name under adapters/, for its side effect if
// nothing else:
//
//	import _ "github.com/oncemill/oncemill/adapters/amqp"
//
// Without it Open returns an error wrapping [ErrNotLinked] that names the
// import. kafka:// and nats:// with no host also need the package of
// their embedded broker (adapters/kafka/embedded, adapters/nats/embedded).
func Open(ctx context.Context, rawURL string, opts Options) (*PubSub, error) {
	if opts.Logger == nil {
		opts.Logger = watermill.NopLogger{}
	}
	u, open, err := checkURL(rawURL, opts)
	if err != nil {
		return nil, err
	}
	o, err := open(ctx, u, brokerurl.Options{Logger: opts.Logger, ConsumerGroup: opts.ConsumerGroup, ConnectTimeout: opts.ConnectTimeout,
		HandOutMarks: opts.HandOutMarks})
	if err != nil {
		return nil, fmt.Errorf("adapters: open %s: %w", redact.URL(rawURL), redact.Error(err, rawURL))
	}
	pub := o.Publisher
	if o.InProcess != "" {
		pub = &inProcessPublisher{Publisher: pub, reason: o.InProcess}
	}
	return &PubSub{Publisher: pub, Subscriber: o.Subscriber, Scheme: u.Scheme, closers: o.Closers}, nil
}

// schemes lists the schemes, for the errors of a URL without a known one.
const schemes = "kafka://, amqp://, sqs://, nats://, postgres:// or gochannel://"

// defaultSchemes guess the scheme of an address written without one from
// its port, for the error that says to add it.
var defaultSchemes = map[string]string{"9092": "kafka", "5672": "amqp", "5671": "amqps", "4222": "nats", "5432": "postgres"}

// defaultScheme returns the scheme of the broker that usually listens on
// port, else amqp.
func defaultScheme(port string) string {
	if s, ok := defaultSchemes[port]; ok {
		return s
	}
	return "amqp"
}

// checkURL reads rawURL and opts as Open does, without connecting: it
// returns the parsed URL and the opener of its scheme, or the error Open
// returns for them, which names the part at fault and the fix and never
// holds a credential of rawURL.
func checkURL(rawURL string, opts Options) (*url.URL, brokerurl.Opener, error) {
	safe := redact.URL(rawURL)
	u, err := url.Parse(rawURL)
	if err != nil {
		return nil, nil, parseError(rawURL, safe, err)
	}
	if u.Scheme == "" {
		return nil, nil, fmt.Errorf("%w: %q has no scheme; use %s", ErrUnknownScheme, safe, schemes)
	}
	open, ok := brokerurl.Lookup(u.Scheme)
	if !ok {
		if pkg, known := brokerPackages[u.Scheme]; known {
			return nil, nil, fmt.Errorf("%w: %s:// in %q needs its broker package; add import _ %q",
				ErrNotLinked, u.Scheme, safe, "github.com/oncemill/oncemill/adapters/"+pkg)
		}
		if port := strings.TrimRight(u.Opaque, "/"); port != "" && strings.Trim(port, "0123456789") == "" {
			// localhost:5672 parses as scheme "localhost".
			return nil, nil, fmt.Errorf("%w %q in %q: it looks like host:port without a scheme; write it as %s://%s/",
				ErrUnknownScheme, u.Scheme, safe, defaultScheme(port), strings.TrimRight(safe, "/"))
		}
		return nil, nil, fmt.Errorf("%w %q in %q; use %s", ErrUnknownScheme, u.Scheme, safe, schemes)
	}
	if u.Host != "" && u.Hostname() == "" {
		return nil, nil, fmt.Errorf("%w: %q has a port but no host: write the host before it, e.g. %s://127.0.0.1:%s/",
			ErrBadURL, safe, u.Scheme, u.Port())
	}
	if check, ok := brokerurl.LookupChecker(u.Scheme); ok {
		bopts := brokerurl.Options{Logger: opts.Logger, ConsumerGroup: opts.ConsumerGroup, ConnectTimeout: opts.ConnectTimeout}
		if err := check(u, bopts); err != nil {
			return nil, nil, fmt.Errorf("adapters: open %s: %w", safe, redact.Error(err, rawURL))
		}
	}
	return u, open, nil
}

// parseError says why url.Parse refused rawURL, whose redacted form is
// safe, and how to write it; url.Parse's own error repeats the URL,
// password included, so none of its text is used but what names the
// fault.
func parseError(rawURL, safe string, err error) error {
	var esc url.EscapeError
	var badHost url.InvalidHostError
	switch {
	case !strings.Contains(rawURL, "://"):
		scheme := defaultScheme("")
		if i := strings.LastIndexByte(rawURL, ':'); i >= 0 {
			scheme = defaultScheme(strings.TrimRight(rawURL[i+1:], "/"))
		}
		return fmt.Errorf("%w: %q has no scheme: write it as %s://%s/ (the scheme names the broker: %s)",
			ErrBadURL, safe, scheme, strings.TrimRight(safe, "/"), schemes)
	case errors.As(err, &esc):
		return fmt.Errorf("%w: %q has the invalid escape %q: write a literal %% as %%25, and other reserved characters as %%XX",
			ErrBadURL, safe, string(esc))
	case errors.As(err, &badHost):
		return fmt.Errorf("%w: %q has a character %q that a host cannot hold: percent-escape it, or check the host",
			ErrBadURL, safe, string(badHost))
	}
	host := authority(rawURL)
	if strings.Contains(host, ",,") || strings.HasSuffix(host, ",") || strings.HasPrefix(host, ",") {
		return fmt.Errorf("%w: %q has an empty address in its host list: separate hosts by single commas, e.g. host1:9092,host2:9092",
			ErrBadURL, safe)
	}
	if strings.Contains(err.Error(), "missing ']'") {
		return fmt.Errorf("%w: %q has an IPv6 host without its closing ]: write it as [::1]:5672", ErrBadURL, safe)
	}
	if strings.Contains(err.Error(), "invalid port") {
		return fmt.Errorf("%w: %q has a port that is not a number: write host:port, e.g. 127.0.0.1:5672", ErrBadURL, safe)
	}
	return fmt.Errorf("%w: cannot parse %q: check it against scheme://user:password@host:port/path?parameter=value", ErrBadURL, safe)
}

// authority returns the host part of rawURL: after "//" and any user
// info, up to the path, query or fragment.
func authority(rawURL string) string {
	_, rest, _ := strings.Cut(rawURL, "//")
	if i := strings.IndexAny(rest, "/?#"); i >= 0 {
		rest = rest[:i]
	}
	if i := strings.LastIndexByte(rest, '@'); i >= 0 {
		rest = rest[i+1:]
	}
	return rest
}
