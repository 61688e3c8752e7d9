package adapters

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/url"

	"github.com/aws/aws-sdk-go-v2/credentials"

	"github.com/oncemill/oncemill/adapters/sqs"
)

// openSQS opens Amazon SQS: sqs://region?endpoint=…&create=true. Access
// keys come from the URL's user info (sqs://KEY:SECRET@region, handy for
// emulators) or else the AWS default chain. A topic is a queue; create=true
// creates missing queues.
func openSQS(ctx context.Context, u *url.URL, opts Options) (*PubSub, error) {
	if u.Host == "" {
		return nil, fmt.Errorf("%w: sqs needs a region: sqs://us-east-1", ErrBadURL)
	}
	create, err := boolParam(u, "create", false)
	if err != nil {
		return nil, err
	}
	cfg := sqs.Config{
		Region:               u.Hostname(),
		Endpoint:             u.Query().Get("endpoint"),
		CreateQueueIfMissing: create,
		Logger:               opts.Logger,
	}
	if cfg.Endpoint != "" {
		ep, err := url.Parse(cfg.Endpoint)
		if err != nil || ep.Host == "" {
			return nil, fmt.Errorf("%w: parameter endpoint=%q is not an http(s) URL", ErrBadURL, cfg.Endpoint)
		}
		host := ep.Host
		if ep.Port() == "" {
			host = net.JoinHostPort(ep.Hostname(), map[bool]string{true: "443", false: "80"}[ep.Scheme == "https"])
		}
		if err := reachable(ctx, []string{host}); err != nil {
			return nil, fmt.Errorf("sqs endpoint: %w", err)
		}
	}
	if u.User != nil {
		secret, _ := u.User.Password()
		cfg.Credentials = credentials.NewStaticCredentialsProvider(u.User.Username(), secret, "")
	}
	pub, err := sqs.NewPublisher(sqs.PublisherConfig{Config: cfg})
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrBadURL, err)
	}
	sub, err := sqs.NewSubscriber(sqs.SubscriberConfig{Config: cfg})
	if err != nil {
		return nil, errors.Join(fmt.Errorf("%w: %w", ErrBadURL, err), pub.Close())
	}
	return &PubSub{Publisher: pub, Subscriber: sub}, nil
}
