package nats

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"strconv"
	"strings"
	"time"

	natsgo "github.com/nats-io/nats.go"

	"github.com/oncemill/oncemill/adapters/internal/brokerurl"
)

// natsDefaultPort is the port of a nats:// host that names none.
const natsDefaultPort = "4222"

func init() {
	brokerurl.Register(openURL, "nats")
	brokerurl.RegisterChecker(func(u *url.URL, opts brokerurl.Options) error {
		_, _, err := urlConfigs(u, opts)
		return err
	}, "nats")
}

// openURL opens NATS JetStream for the nats:// URLs of adapters.Open: nats://host:4222?group=billing, several
// servers as nats://h1:4222,h2:4222, user and password or a token in the
// user info. A topic is a subject; by default each topic has a stream of
// its own, named after it, and each group a durable pull consumer of it
// (see package nats). Parameters: group (required, here or in Options),
// stream, one existing stream whose subjects hold every topic (see
// [Config.Stream]); create=true, which creates a topic's missing
// stream (see [Config.CreateStreams]); duplicate_window, the
// Nats-Msg-Id deduplication window of the streams it creates (a Go
// duration, default 2m); the consumer's ack_wait (a Go duration of at
// least 1s, default 30s; see [SubscriberConfig.AckWait]),
// max_deliver (a positive integer, or -1 for no limit, the default; see
// [SubscriberConfig.MaxDeliver]) and max_ack_pending (a positive
// integer, default 1000); max_in_flight, the messages a subscription
// holds at once (a positive integer, default 1; see
// [SubscriberConfig.MaxInFlight]); drain_timeout, how long Close
// waits for the messages in flight (a Go duration; see
// [SubscriberConfig.DrainTimeout]); and connect_timeout.
//
// nats:// with no host starts the embedded NATS server with JetStream of
// package embedded, which the program links by importing it, and which
// lives as long as the PubSub: for development only, since its store is a
// temporary directory. Its streams are created on first use unless create=false.
func openURL(ctx context.Context, u *url.URL, opts brokerurl.Options) (*brokerurl.Opened, error) {
	pcfg, scfg, err := urlConfigs(u, opts)
	if err != nil {
		return nil, err
	}
	ps := &brokerurl.Opened{}
	if u.Host == "" {
		addrs, err := brokerurl.StartEmbedded(ps, "nats", opts.Logger)
		if err != nil {
			return nil, err
		}
		pcfg.URL, scfg.URL = addrs[0], addrs[0]
	}
	fail := func(err error) (*brokerurl.Opened, error) { return nil, errors.Join(err, ps.Close()) }

	// What is left of ctx bounds the connection attempts too, and is the
	// timeout an error names.
	pcfg.ConnectTimeout = max(brokerurl.Within(ctx, pcfg.ConnectTimeout), time.Millisecond)
	scfg.ConnectTimeout = pcfg.ConnectTimeout
	pub, err := NewPublisher(ctx, pcfg)
	if err != nil {
		return fail(urlConnectError(u, pcfg.ConnectTimeout, err))
	}
	ps.Publisher = pub
	sub, err := NewSubscriber(ctx, scfg)
	if err != nil {
		return fail(urlConnectError(u, scfg.ConnectTimeout, err))
	}
	ps.Subscriber = sub
	return ps, nil
}

// urlConfigs reads a nats:// URL and opts into the publisher and
// subscriber configs, both checked. The server URL is left empty for the
// embedded server.
func urlConfigs(u *url.URL, opts brokerurl.Options) (PublisherConfig, SubscriberConfig, error) {
	fail := func(err error) (PublisherConfig, SubscriberConfig, error) {
		return PublisherConfig{}, SubscriberConfig{}, err
	}
	q, err := brokerurl.Query(u, "stream", "create", "duplicate_window", "ack_wait", "max_deliver", "max_ack_pending", "max_in_flight", "drain_timeout")
	if err != nil {
		return fail(err)
	}
	group, err := brokerurl.Group(q, opts)
	if err != nil {
		return fail(err)
	}
	if group == "" {
		// Without a group there is no durable consumer to keep the
		// place in the stream: a restarted subscriber would start over.
		return fail(fmt.Errorf("%w: nats needs a consumer group: add ?group=<name> or set Options.ConsumerGroup", brokerurl.ErrBadURL))
	}
	cfg := Config{Stream: q.Get("stream"), Logger: opts.Logger}
	if cfg.ConnectTimeout, err = brokerurl.ConnectTimeout(q, opts); err != nil {
		return fail(err)
	}
	// The embedded server is the process's own and empty: nothing there
	// for create=false to protect, unless asked for.
	if cfg.CreateStreams, err = brokerurl.Bool(q, "create", u.Host == "" && cfg.Stream == ""); err != nil {
		return fail(err)
	}
	if cfg.Stream != "" && cfg.CreateStreams {
		return fail(fmt.Errorf("%w: parameters stream=%s and create=true: create makes a stream per topic; a stream named by stream= must exist with the subjects it holds", brokerurl.ErrBadURL, cfg.Stream))
	}
	scfg := SubscriberConfig{ConsumerGroup: group}
	for _, p := range []struct {
		name string
		to   *time.Duration
	}{
		{"duplicate_window", &cfg.DuplicateWindow},
		{"ack_wait", &scfg.AckWait},
		{"drain_timeout", &scfg.DrainTimeout},
	} {
		if *p.to, err = brokerurl.Duration(q, p.name, false); err != nil {
			return fail(err)
		}
	}
	if scfg.AckWait != 0 && scfg.AckWait < MinAckWait {
		return fail(fmt.Errorf("%w: parameter ack_wait=%s: want at least %s, as the subscription sends a heartbeat every third of it", brokerurl.ErrBadURL, q.Get("ack_wait"), MinAckWait))
	}
	if v := q.Get("max_deliver"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n == 0 || n < -1 {
			return fail(fmt.Errorf("%w: parameter max_deliver=%q: want a positive integer, or -1 for no limit", brokerurl.ErrBadURL, v))
		}
		scfg.MaxDeliver = n
	}
	for _, p := range []struct {
		name, what string
		to         *int
	}{
		{"max_ack_pending", "the messages the group's consumer delivers and waits for acks of", &scfg.MaxAckPending},
		{"max_in_flight", "the messages a subscription holds at once (1 for one at a time)", &scfg.MaxInFlight},
	} {
		if v := q.Get(p.name); v != "" {
			n, err := strconv.Atoi(v)
			if err != nil || n < 1 {
				return fail(fmt.Errorf("%w: parameter %s=%q: want a positive integer, %s", brokerurl.ErrBadURL, p.name, v, p.what))
			}
			*p.to = n
		}
	}
	if u.Host != "" {
		if cfg.URL, err = urlServers(u); err != nil {
			return fail(err)
		}
	} else {
		cfg.URL = "nats://127.0.0.1:" + natsDefaultPort // replaced by the embedded server's
	}
	pcfg := PublisherConfig{Config: cfg}
	scfg.Config = cfg
	if err := pcfg.Validate(); err != nil {
		return fail(fmt.Errorf("%w: %w", brokerurl.ErrBadURL, err))
	}
	if err := scfg.Validate(); err != nil {
		return fail(fmt.Errorf("%w: %w", brokerurl.ErrBadURL, err))
	}
	if u.Host == "" {
		pcfg.URL, scfg.URL = "", ""
	}
	return pcfg, scfg, nil
}

// urlServers returns the server list of u for nats.go: each host of
// u.Host, comma-separated, as a nats:// URL with u's user info.
func urlServers(u *url.URL) (string, error) {
	var servers []string
	for _, h := range strings.Split(u.Host, ",") {
		host, port, err := net.SplitHostPort(h)
		if err != nil {
			host, port = h, natsDefaultPort
		}
		if host == "" || strings.ContainsAny(host, "/@") {
			return "", fmt.Errorf("%w: server %q is not host[:port]", brokerurl.ErrBadURL, h)
		}
		if _, err := strconv.ParseUint(port, 10, 16); err != nil {
			return "", fmt.Errorf("%w: server %q has no valid port", brokerurl.ErrBadURL, h)
		}
		s := url.URL{Scheme: "nats", User: u.User, Host: net.JoinHostPort(host, port)}
		servers = append(servers, s.String())
	}
	return strings.Join(servers, ","), nil
}

// urlConnectError marks err, from connecting to the servers of u, with
// [brokerurl.ErrConnectTimeout] when a server did not answer in time.
func urlConnectError(u *url.URL, timeout time.Duration, err error) error {
	var nerr net.Error
	timedOut := errors.Is(err, natsgo.ErrTimeout) || errors.Is(err, os.ErrDeadlineExceeded) ||
		errors.Is(err, context.DeadlineExceeded) || (errors.As(err, &nerr) && nerr.Timeout())
	if !timedOut || u.Host == "" {
		return err
	}
	return brokerurl.NoAnswer(u.Host, timeout, err)
}
