// Package brokerurl is what package adapters and the broker packages share:
// the registry of URL schemes that each broker package fills in its init,
// as database/sql drivers do, the embedded brokers that kafka:// and
// nats:// without a host start, and the URL parameter readers and errors
// every scheme uses. A program links a broker only by importing its
// package.
package brokerurl

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/oncemill/oncemill/delivery"
)

// DefaultConnectTimeout bounds each connection attempt when neither the
// URL's connect_timeout nor the options set a bound.
const DefaultConnectTimeout = 10 * time.Second

var (
	// ErrUnknownScheme is returned for a URL whose scheme names no adapter.
	ErrUnknownScheme = errors.New("adapters: unknown broker scheme")
	// ErrNotLinked is returned for a URL whose broker package the program
	// does not import.
	ErrNotLinked = errors.New("adapters: broker package not linked")
	// ErrBadURL is returned for a URL that is malformed or not valid.
	ErrBadURL = errors.New("adapters: bad broker URL")
	// ErrConnectTimeout is wrapped when a broker did not answer in time.
	ErrConnectTimeout = errors.New("adapters: no answer within the connect timeout")
)

// Options are the settings that a URL does not carry; see adapters.Options.
type Options struct {
	Logger         watermill.LoggerAdapter
	ConsumerGroup  string
	ConnectTimeout time.Duration
	HandOutMarks   delivery.HandOutMarks
}

// Opened is what an [Opener] returns: the publisher, the subscriber, and
// what else it started for them, which Close stops after both.
type Opened struct {
	Publisher  message.Publisher
	Subscriber message.Subscriber
	// Closers are called in reverse order after the subscriber and the
	// publisher are closed.
	Closers []func() error
	// InProcess, when not empty, says why the broker lives inside this
	// process (an embedded broker that a URL with no host started), for
	// the error of a caller that needs a durable destination.
	InProcess string
}

// Close closes the subscriber, the publisher and the closers, in that
// order, and returns every error.
func (o *Opened) Close() error {
	var errs []error
	if o.Subscriber != nil {
		errs = append(errs, o.Subscriber.Close())
	}
	if o.Publisher != nil {
		errs = append(errs, o.Publisher.Close())
	}
	for i := len(o.Closers) - 1; i >= 0; i-- {
		errs = append(errs, o.Closers[i]())
	}
	return errors.Join(errs...)
}

// An Opener opens the broker of a parsed URL of its scheme.
type Opener func(ctx context.Context, u *url.URL, opts Options) (*Opened, error)

// An EmbeddedStarter starts an in-process broker and returns the
// addresses to reach it and the function that stops it.
type EmbeddedStarter func(logger watermill.LoggerAdapter) (addrs []string, stop func() error, err error)

// A Checker reads a parsed URL of its scheme and the options as its
// [Opener] does, and returns the error the Opener would give for them,
// without connecting or starting anything.
type Checker func(u *url.URL, opts Options) error

var (
	mu       sync.RWMutex
	openers  = map[string]Opener{}
	checkers = map[string]Checker{}
	embedded = map[string]EmbeddedStarter{}
)

// RegisterChecker makes check the checker of schemes, whose opener reads
// the URL the same way before it connects. It panics if a scheme has one
// already.
func RegisterChecker(check Checker, schemes ...string) {
	mu.Lock()
	defer mu.Unlock()
	for _, s := range schemes {
		if _, dup := checkers[s]; dup {
			panic("adapters: checker for scheme " + s + " registered twice")
		}
		checkers[s] = check
	}
}

// LookupChecker returns the checker of scheme, if a linked package
// registered one.
func LookupChecker(scheme string) (Checker, bool) {
	mu.RLock()
	defer mu.RUnlock()
	check, ok := checkers[scheme]
	return check, ok
}

// Register makes open the opener of schemes. It panics if a scheme has
// one already: two packages claiming one scheme is a programming error.
func Register(open Opener, schemes ...string) {
	mu.Lock()
	defer mu.Unlock()
	for _, s := range schemes {
		if _, dup := openers[s]; dup {
			panic("adapters: scheme " + s + " registered twice")
		}
		openers[s] = open
	}
}

// Lookup returns the opener of scheme, if a linked package registered one.
func Lookup(scheme string) (Opener, bool) {
	mu.RLock()
	defer mu.RUnlock()
	open, ok := openers[scheme]
	return open, ok
}

// RegisterEmbedded makes start the embedded broker of scheme's URLs
// without a host. It panics if scheme has one already.
func RegisterEmbedded(scheme string, start EmbeddedStarter) {
	mu.Lock()
	defer mu.Unlock()
	if _, dup := embedded[scheme]; dup {
		panic("adapters: embedded broker for " + scheme + " registered twice")
	}
	embedded[scheme] = start
}

// StartEmbedded starts the embedded broker of scheme, adds its stop to
// o's closers and returns its addresses; without a linked embedded broker
// the error wraps [ErrNotLinked] and names the package to import.
func StartEmbedded(o *Opened, scheme string, logger watermill.LoggerAdapter) ([]string, error) {
	mu.RLock()
	start, ok := embedded[scheme]
	mu.RUnlock()
	if !ok {
		return nil, fmt.Errorf("%w: %s:// with no host starts an embedded broker, which this program does not link; add import _ %q, or give a host",
			ErrNotLinked, scheme, "github.com/oncemill/oncemill/adapters/"+scheme+"/embedded")
	}
	addrs, stop, err := start(logger)
	if err != nil {
		return nil, fmt.Errorf("start embedded %s: %w", scheme, err)
	}
	o.Closers = append(o.Closers, stop)
	o.InProcess = NoHost(scheme)
	return addrs, nil
}

// exampleHosts are the example addresses NoHost names, per scheme.
var exampleHosts = map[string]string{"kafka": "broker:9092", "nats": "nats:4222"}

// NoHost says that a scheme:// URL with no host names a broker inside
// this process, and how to name one outside it.
func NoHost(scheme string) string {
	host := exampleHosts[scheme]
	if host == "" {
		host = "host:port"
	}
	return fmt.Sprintf("%s:// has no host, which starts an embedded broker that lives and dies with this process: "+
		"name the brokers, e.g. %s://%s", scheme, scheme, host)
}

// Query parses u's query and checks it against known, the parameters of
// u's scheme besides group and connect_timeout, which every scheme takes.
// A parameter not known, or given twice, is an error that names it and
// lists the known ones.
func Query(u *url.URL, known ...string) (url.Values, error) {
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

// Group returns the consumer group: the URL's group parameter or the
// option, which must agree when both are set.
func Group(q url.Values, opts Options) (string, error) {
	fromURL := q.Get("group")
	switch {
	case fromURL == "":
		return opts.ConsumerGroup, nil
	case opts.ConsumerGroup != "" && opts.ConsumerGroup != fromURL:
		return "", fmt.Errorf("%w: parameter group=%q and Options.ConsumerGroup %q differ; set one of them", ErrBadURL, fromURL, opts.ConsumerGroup)
	}
	return fromURL, nil
}

// ConnectTimeout returns the connect timeout: the URL's connect_timeout
// parameter or the option, which must agree when both are set, else
// [DefaultConnectTimeout].
func ConnectTimeout(q url.Values, opts Options) (time.Duration, error) {
	fromURL, err := Duration(q, "connect_timeout", true)
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

// Duration reads an optional duration parameter, which must be positive:
// a Go duration such as "1500ms" or "2s", or, when seconds is true, a
// whole number of seconds as libpq's connect_timeout. Absent is 0.
func Duration(q url.Values, name string, seconds bool) (time.Duration, error) {
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

// Bool reads an optional boolean parameter; absent is def.
func Bool(q url.Values, name string, def bool) (bool, error) {
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

// Int reads an optional integer parameter; absent is 0.
func Int(q url.Values, name string) (int, error) {
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

// Within returns the bound of one connection attempt: timeout, or less
// when ctx ends sooner.
func Within(ctx context.Context, timeout time.Duration) time.Duration {
	if dl, ok := ctx.Deadline(); ok {
		if left := time.Until(dl); left < timeout {
			return max(left, 0)
		}
	}
	return timeout
}

// NoAnswer is the error of a connection attempt to addr that did not
// complete within timeout.
func NoAnswer(addr string, timeout time.Duration, err error) error {
	return fmt.Errorf("%w (%s) from %s: %w", ErrConnectTimeout, timeout.Round(time.Millisecond), addr, err)
}
