package sqs

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"time"

	"github.com/aws/aws-sdk-go-v2/credentials"

	"github.com/oncemill/oncemill/adapters/internal/brokerurl"
)

func init() {
	brokerurl.Register(openURL, "sqs")
	brokerurl.RegisterChecker(func(u *url.URL, opts brokerurl.Options) error {
		_, _, _, err := urlConfigs(u, opts)
		return err
	}, "sqs")
}

// openURL opens Amazon SQS for the sqs:// URLs of adapters.Open: sqs://region?endpoint=…&create=true. Access
// keys come from the URL's user info (sqs://KEY:SECRET@region, handy for
// emulators) or else the AWS default chain. A topic is a queue; create=true
// creates missing queues. Parameters: endpoint, create,
// visibility_timeout (whole seconds, 1s to 12h; see
// [SubscriberConfig]), max_messages (1 to 10, the messages one
// receive asks for; see [SubscriberConfig.MaxNumberOfMessages]),
// max_in_flight (the messages a subscription holds at once; see
// [SubscriberConfig.MaxInFlight]), drain_timeout (a Go duration; see [SubscriberConfig.DrainTimeout]),
// connect_timeout, and group, which is accepted
// and ignored: every subscriber of a queue competes for its messages.
func openURL(ctx context.Context, u *url.URL, opts brokerurl.Options) (*brokerurl.Opened, error) {
	pcfg, scfg, timeout, err := urlConfigs(u, opts)
	if err != nil {
		return nil, err
	}
	if pcfg.Endpoint != "" {
		if err := probeEndpoint(ctx, pcfg.Endpoint, timeout); err != nil {
			return nil, err
		}
	}
	pub, err := NewPublisher(pcfg)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", brokerurl.ErrBadURL, err)
	}
	sub, err := NewSubscriber(scfg)
	if err != nil {
		return nil, errors.Join(fmt.Errorf("%w: %w", brokerurl.ErrBadURL, err), pub.Close())
	}
	return &brokerurl.Opened{Publisher: pub, Subscriber: sub}, nil
}

// urlConfigs reads an sqs:// URL and opts into the publisher and
// subscriber configs and the connect timeout, all checked.
func urlConfigs(u *url.URL, opts brokerurl.Options) (PublisherConfig, SubscriberConfig, time.Duration, error) {
	fail := func(err error) (PublisherConfig, SubscriberConfig, time.Duration, error) {
		return PublisherConfig{}, SubscriberConfig{}, 0, err
	}
	q, err := brokerurl.Query(u, "endpoint", "create", "visibility_timeout", "max_messages", "max_in_flight", "drain_timeout")
	if err != nil {
		return fail(err)
	}
	if u.Host == "" {
		return fail(fmt.Errorf("%w: sqs needs a region: sqs://us-east-1", brokerurl.ErrBadURL))
	}
	if _, err := brokerurl.Group(q, opts); err != nil {
		return fail(err)
	}
	timeout, err := brokerurl.ConnectTimeout(q, opts)
	if err != nil {
		return fail(err)
	}
	create, err := brokerurl.Bool(q, "create", false)
	if err != nil {
		return fail(err)
	}
	visibility, err := brokerurl.Duration(q, "visibility_timeout", false)
	if err != nil {
		return fail(err)
	}
	drain, err := brokerurl.Duration(q, "drain_timeout", false)
	if err != nil {
		return fail(err)
	}
	maxMessages := 0
	if v := q.Get("max_messages"); v != "" {
		if maxMessages, err = strconv.Atoi(v); err != nil || maxMessages < 1 || maxMessages > 10 {
			return fail(fmt.Errorf("%w: parameter max_messages=%q: want an integer from 1 to 10, the messages one receive asks for", brokerurl.ErrBadURL, v))
		}
	}
	maxInFlight, err := brokerurl.Int(q, "max_in_flight")
	if err != nil {
		return fail(err)
	}
	if maxInFlight < 0 {
		return fail(fmt.Errorf("%w: parameter max_in_flight=%q: want a positive integer, the messages a subscription holds at once", brokerurl.ErrBadURL, q.Get("max_in_flight")))
	}
	if visibility != 0 && (visibility < time.Second || visibility > MaxVisibilityTimeout || visibility%time.Second != 0) {
		return fail(fmt.Errorf("%w: parameter visibility_timeout=%s: want whole seconds from 1s to %s", brokerurl.ErrBadURL, q.Get("visibility_timeout"), MaxVisibilityTimeout))
	}
	cfg := Config{
		Region:               u.Hostname(),
		Endpoint:             q.Get("endpoint"),
		CreateQueueIfMissing: create,
		ConnectTimeout:       timeout,
		Logger:               opts.Logger,
	}
	if cfg.Endpoint != "" {
		if ep, err := url.Parse(cfg.Endpoint); err != nil || ep.Host == "" || (ep.Scheme != "http" && ep.Scheme != "https") {
			return fail(fmt.Errorf("%w: parameter endpoint=%q is not an http(s) URL", brokerurl.ErrBadURL, cfg.Endpoint))
		}
	}
	if u.User != nil {
		secret, _ := u.User.Password()
		cfg.Credentials = credentials.NewStaticCredentialsProvider(u.User.Username(), secret, "")
	}
	pcfg := PublisherConfig{Config: cfg}
	scfg := SubscriberConfig{Config: cfg, VisibilityTimeout: visibility, MaxNumberOfMessages: maxMessages, MaxInFlight: maxInFlight, DrainTimeout: drain}
	if err := scfg.Validate(); err != nil {
		return fail(fmt.Errorf("%w: %w", brokerurl.ErrBadURL, err))
	}
	return pcfg, scfg, timeout, nil
}

// probeEndpoint sends one HTTP request to an SQS endpoint and returns once
// anything answers, whatever the status, so that an emulator that is down
// or hung fails at Open within the connect timeout, naming its address,
// rather than in the first receive.
func probeEndpoint(ctx context.Context, endpoint string, timeout time.Duration) error {
	ep, err := url.Parse(endpoint)
	if err != nil {
		return fmt.Errorf("%w: parameter endpoint=%q: %w", brokerurl.ErrBadURL, endpoint, err)
	}
	addr := ep.Host
	if ep.Port() == "" {
		addr = net.JoinHostPort(ep.Hostname(), map[bool]string{true: "443", false: "80"}[ep.Scheme == "https"])
	}
	timeout = brokerurl.Within(ctx, timeout)
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, endpoint, nil)
	if err != nil {
		return fmt.Errorf("%w: parameter endpoint=%q: %w", brokerurl.ErrBadURL, endpoint, err)
	}
	// A client of its own, keeping no connection: nothing outlives Open.
	client := &http.Client{
		Transport:     &http.Transport{Proxy: http.ProxyFromEnvironment, DisableKeepAlives: true},
		CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse },
	}
	resp, err := client.Do(req)
	switch {
	case err != nil && (errors.Is(ctx.Err(), context.DeadlineExceeded) || errors.Is(err, context.DeadlineExceeded)):
		return fmt.Errorf("sqs endpoint: %w", brokerurl.NoAnswer(addr, timeout, err))
	case err != nil:
		return fmt.Errorf("sqs endpoint %s unreachable: %w", addr, err)
	}
	_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 1<<16))
	return resp.Body.Close()
}
