package adapters

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

	"github.com/oncemill/oncemill/adapters/nats"
	"github.com/oncemill/oncemill/adapters/nats/embedded"
)

// natsDefaultPort is the port of a nats:// host that names none.
const natsDefaultPort = "4222"

// openNATS opens NATS JetStream: nats://host:4222?group=billing, several
// servers as nats://h1:4222,h2:4222, user and password or a token in the
// user info. A topic is a subject; by default each topic has a stream of
// its own, named after it, and each group a durable pull consumer of it
// (see package nats). Parameters: group (required, here or in Options),
// stream, one existing stream whose subjects hold every topic (see
// [nats.Config.Stream]); create=true, which creates a topic's missing
// stream (see [nats.Config.CreateStreams]); duplicate_window, the
// Nats-Msg-Id deduplication window of the streams it creates (a Go
// duration, default 2m); the consumer's ack_wait (a Go duration of at
// least 1s, default 30s; see [nats.SubscriberConfig.AckWait]),
// max_deliver (a positive integer, or -1 for no limit, the default; see
// [nats.SubscriberConfig.MaxDeliver]) and max_ack_pending (a positive
// integer, default 1000); max_in_flight, the messages a subscription
// holds at once (a positive integer, default 1; see
// [nats.SubscriberConfig.MaxInFlight]); drain_timeout, how long Close
// waits for the messages in flight (a Go duration; see
// [nats.SubscriberConfig.DrainTimeout]); and connect_timeout.
//
// nats:// with no host starts an embedded NATS server with JetStream that
// lives as long as the PubSub: for development only, since its store is a
// temporary directory (start one with the embedded package to keep or
// share it). Its streams are created on first use unless create=false.
func openNATS(ctx context.Context, u *url.URL, opts Options) (*PubSub, error) {
	pcfg, scfg, err := natsConfigs(u, opts)
	if err != nil {
		return nil, err
	}
	ps := &PubSub{}
	if u.Host == "" {
		srv, err := embedded.Start(embedded.Config{Logger: opts.Logger})
		if err != nil {
			return nil, fmt.Errorf("start embedded nats: %w", err)
		}
		ps.closers = append(ps.closers, srv.Close)
		pcfg.URL, scfg.URL = srv.URL(), srv.URL()
	}
	fail := func(err error) (*PubSub, error) { return nil, errors.Join(err, ps.Close()) }

	// What is left of ctx bounds the connection attempts too, and is the
	// timeout an error names.
	pcfg.ConnectTimeout = max(within(ctx, pcfg.ConnectTimeout), time.Millisecond)
	scfg.ConnectTimeout = pcfg.ConnectTimeout
	pub, err := nats.NewPublisher(ctx, pcfg)
	if err != nil {
		return fail(natsConnectError(u, pcfg.ConnectTimeout, err))
	}
	ps.Publisher = pub
	sub, err := nats.NewSubscriber(ctx, scfg)
	if err != nil {
		return fail(natsConnectError(u, scfg.ConnectTimeout, err))
	}
	ps.Subscriber = sub
	return ps, nil
}

// natsConfigs reads a nats:// URL and opts into the publisher and
// subscriber configs, both checked. The server URL is left empty for the
// embedded server.
func natsConfigs(u *url.URL, opts Options) (nats.PublisherConfig, nats.SubscriberConfig, error) {
	fail := func(err error) (nats.PublisherConfig, nats.SubscriberConfig, error) {
		return nats.PublisherConfig{}, nats.SubscriberConfig{}, err
	}
	q, err := query(u, "stream", "create", "duplicate_window", "ack_wait", "max_deliver", "max_ack_pending", "max_in_flight", "drain_timeout")
	if err != nil {
		return fail(err)
	}
	group, err := group(q, opts)
	if err != nil {
		return fail(err)
	}
	if group == "" {
		// Without a group there is no durable consumer to keep the
		// place in the stream: a restarted subscriber would start over.
		return fail(fmt.Errorf("%w: nats needs a consumer group: add ?group=<name> or set Options.ConsumerGroup", ErrBadURL))
	}
	cfg := nats.Config{Stream: q.Get("stream"), Logger: opts.Logger}
	if cfg.ConnectTimeout, err = connectTimeout(q, opts); err != nil {
		return fail(err)
	}
	// The embedded server is the process's own and empty: nothing there
	// for create=false to protect, unless asked for.
	if cfg.CreateStreams, err = boolParam(q, "create", u.Host == "" && cfg.Stream == ""); err != nil {
		return fail(err)
	}
	if cfg.Stream != "" && cfg.CreateStreams {
		return fail(fmt.Errorf("%w: parameters stream=%s and create=true: create makes a stream per topic; a stream named by stream= must exist with the subjects it holds", ErrBadURL, cfg.Stream))
	}
	scfg := nats.SubscriberConfig{ConsumerGroup: group}
	for _, p := range []struct {
		name string
		to   *time.Duration
	}{
		{"duplicate_window", &cfg.DuplicateWindow},
		{"ack_wait", &scfg.AckWait},
		{"drain_timeout", &scfg.DrainTimeout},
	} {
		if *p.to, err = durationParam(q, p.name, false); err != nil {
			return fail(err)
		}
	}
	if scfg.AckWait != 0 && scfg.AckWait < nats.MinAckWait {
		return fail(fmt.Errorf("%w: parameter ack_wait=%s: want at least %s, as the subscription sends a heartbeat every third of it", ErrBadURL, q.Get("ack_wait"), nats.MinAckWait))
	}
	if v := q.Get("max_deliver"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n == 0 || n < -1 {
			return fail(fmt.Errorf("%w: parameter max_deliver=%q: want a positive integer, or -1 for no limit", ErrBadURL, v))
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
				return fail(fmt.Errorf("%w: parameter %s=%q: want a positive integer, %s", ErrBadURL, p.name, v, p.what))
			}
			*p.to = n
		}
	}
	if u.Host != "" {
		if cfg.URL, err = natsServers(u); err != nil {
			return fail(err)
		}
	} else {
		cfg.URL = "nats://127.0.0.1:" + natsDefaultPort // replaced by the embedded server's
	}
	pcfg := nats.PublisherConfig{Config: cfg}
	scfg.Config = cfg
	if err := pcfg.Validate(); err != nil {
		return fail(fmt.Errorf("%w: %w", ErrBadURL, err))
	}
	if err := scfg.Validate(); err != nil {
		return fail(fmt.Errorf("%w: %w", ErrBadURL, err))
	}
	if u.Host == "" {
		pcfg.URL, scfg.URL = "", ""
	}
	return pcfg, scfg, nil
}

// natsServers returns the server list of u for nats.go: each host of
// u.Host, comma-separated, as a nats:// URL with u's user info.
func natsServers(u *url.URL) (string, error) {
	var servers []string
	for _, h := range strings.Split(u.Host, ",") {
		host, port, err := net.SplitHostPort(h)
		if err != nil {
			host, port = h, natsDefaultPort
		}
		if host == "" || strings.ContainsAny(host, "/@") {
			return "", fmt.Errorf("%w: server %q is not host[:port]", ErrBadURL, h)
		}
		if _, err := strconv.ParseUint(port, 10, 16); err != nil {
			return "", fmt.Errorf("%w: server %q has no valid port", ErrBadURL, h)
		}
		s := url.URL{Scheme: "nats", User: u.User, Host: net.JoinHostPort(host, port)}
		servers = append(servers, s.String())
	}
	return strings.Join(servers, ","), nil
}

// natsConnectError marks err, from connecting to the servers of u, with
// [ErrConnectTimeout] when a server did not answer in time.
func natsConnectError(u *url.URL, timeout time.Duration, err error) error {
	var nerr net.Error
	timedOut := errors.Is(err, natsgo.ErrTimeout) || errors.Is(err, os.ErrDeadlineExceeded) ||
		errors.Is(err, context.DeadlineExceeded) || (errors.As(err, &nerr) && nerr.Timeout())
	if !timedOut || u.Host == "" {
		return err
	}
	return noAnswer(u.Host, timeout, err)
}
