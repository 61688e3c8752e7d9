package sqs

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"net"
	"net/http"
	"slices"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/aws/aws-sdk-go-v2/aws"
	awshttp "github.com/aws/aws-sdk-go-v2/aws/transport/http"
	awsconfig "github.com/aws/aws-sdk-go-v2/config"
	"github.com/aws/aws-sdk-go-v2/service/sqs"
	"github.com/aws/aws-sdk-go-v2/service/sqs/types"
)

// client is the SQS client of one publisher or subscriber, with its cache
// of queue URLs.
type client struct {
	api    *sqs.Client
	cfg    Config
	logger watermill.LoggerAdapter

	// transport is the HTTP transport the client owns, closed with it; nil
	// when the caller supplied the HTTP client.
	transport *http.Transport

	mu   sync.Mutex
	urls map[string]string // queue name → queue URL
}

// newClient builds the SQS client for cfg, which has its defaults set.
func newClient(cfg Config) (*client, error) {
	// The caller keeps its map and slice; later changes must not reach us.
	cfg.QueueAttributes = maps.Clone(cfg.QueueAttributes)
	cfg.ClientOptions = slices.Clone(cfg.ClientOptions)
	var awsCfg aws.Config
	if cfg.AWSConfig != nil {
		awsCfg = cfg.AWSConfig.Copy()
		if cfg.Credentials != nil {
			awsCfg.Credentials = cacheCredentials(cfg.Credentials)
		}
	} else {
		var opts []func(*awsconfig.LoadOptions) error
		if cfg.Region != "" {
			opts = append(opts, awsconfig.WithRegion(cfg.Region))
		}
		if cfg.Credentials != nil {
			opts = append(opts, awsconfig.WithCredentialsProvider(cfg.Credentials))
		}
		// Loading reads the environment and shared files; it makes no
		// request, so no context of the caller's is needed.
		loaded, err := awsconfig.LoadDefaultConfig(context.Background(), opts...)
		if err != nil {
			return nil, fmt.Errorf("sqs: load AWS configuration: %w", err)
		}
		awsCfg = loaded
	}
	if cfg.Region != "" {
		awsCfg.Region = cfg.Region
	}
	if awsCfg.Region == "" {
		return nil, fmt.Errorf("%w: Region is empty, and neither AWSConfig nor the environment (AWS_REGION) names one", ErrInvalidConfig)
	}

	c := &client{cfg: cfg, logger: cfg.Logger, urls: map[string]string{}}
	// The SDK's own client (none in AWSConfig, or the one
	// LoadDefaultConfig built) gets the default connect timeout; one the
	// caller configured only an explicit ConnectTimeout.
	connectTimeout := cfg.ConnectTimeout
	if connectTimeout == 0 && (cfg.AWSConfig == nil || cfg.AWSConfig.HTTPClient == nil) {
		connectTimeout = DefaultConnectTimeout
	}
	withTimeout := func(b *awshttp.BuildableClient) *awshttp.BuildableClient {
		if connectTimeout == 0 {
			return b
		}
		return b.WithDialerOptions(func(d *net.Dialer) { d.Timeout = connectTimeout }).
			WithTransportOptions(func(t *http.Transport) { t.TLSHandshakeTimeout = connectTimeout })
	}
	// The SDK's default HTTP client keeps idle connections (and their
	// goroutines) until the process ends. Use a client with the same
	// transport settings whose connections Close can release.
	switch hc := awsCfg.HTTPClient.(type) {
	case nil:
		c.transport = withTimeout(awshttp.NewBuildableClient()).GetTransport()
		awsCfg.HTTPClient = ownHTTPClient(c.transport, 0)
	case *awshttp.BuildableClient:
		c.transport = withTimeout(hc).GetTransport()
		awsCfg.HTTPClient = ownHTTPClient(c.transport, hc.GetTimeout())
	}

	optFns := make([]func(*sqs.Options), 0, len(cfg.ClientOptions)+1)
	if cfg.Endpoint != "" {
		endpoint := cfg.Endpoint
		optFns = append(optFns, func(o *sqs.Options) { o.BaseEndpoint = aws.String(endpoint) })
	}
	optFns = append(optFns, cfg.ClientOptions...)
	c.api = sqs.NewFromConfig(awsCfg, optFns...)
	return c, nil
}

// cacheCredentials wraps p in a credentials cache unless it is one.
func cacheCredentials(p aws.CredentialsProvider) aws.CredentialsProvider {
	if _, ok := p.(*aws.CredentialsCache); ok {
		return p
	}
	return aws.NewCredentialsCache(p)
}

// ownHTTPClient returns an HTTP client on transport that, like the SDK's,
// does not follow redirects.
func ownHTTPClient(transport *http.Transport, timeout time.Duration) *http.Client {
	return &http.Client{
		Transport: transport,
		Timeout:   timeout,
		CheckRedirect: func(*http.Request, []*http.Request) error {
			return http.ErrUseLastResponse
		},
	}
}

// close releases the idle connections of the client's own transport.
func (c *client) close() {
	if c.transport != nil {
		c.transport.CloseIdleConnections()
	}
}

// queueName returns the queue name of topic, checked.
func (c *client) queueName(topic string) (string, error) {
	if topic == "" {
		return "", fmt.Errorf("%w: topic is empty", ErrInvalidTopic)
	}
	name := c.cfg.QueueNameFromTopic(topic)
	if why := validQueueName(name); why != "" {
		return "", fmt.Errorf("%w: topic %q: %s", ErrInvalidTopic, topic, why)
	}
	return name, nil
}

// queueURL returns the URL of topic's queue, from the cache or SQS,
// creating the queue when it does not exist and create is true.
func (c *client) queueURL(ctx context.Context, topic string, create bool) (name, url string, err error) {
	name, err = c.queueName(topic)
	if err != nil {
		return "", "", err
	}
	c.mu.Lock()
	url, ok := c.urls[name]
	c.mu.Unlock()
	if ok {
		return name, url, nil
	}

	out, err := c.api.GetQueueUrl(ctx, &sqs.GetQueueUrlInput{QueueName: aws.String(name)})
	switch {
	case err == nil:
		url = aws.ToString(out.QueueUrl)
	case !isQueueNotFound(err):
		return "", "", fmt.Errorf("sqs: get URL of queue %q: %w", name, err)
	case !create:
		return "", "", fmt.Errorf("%w: %q (topic %q); create it or set CreateQueueIfMissing: %w", ErrQueueNotFound, name, topic, err)
	default:
		if url, err = c.createQueue(ctx, name); err != nil {
			return "", "", err
		}
	}
	c.mu.Lock()
	c.urls[name] = url
	c.mu.Unlock()
	return name, url, nil
}

// createQueue creates the queue name with the configured attributes and
// returns its URL. Creating a queue that exists with the same attributes
// succeeds.
func (c *client) createQueue(ctx context.Context, name string) (string, error) {
	attrs := maps.Clone(c.cfg.QueueAttributes)
	if isFIFO(name) {
		if attrs == nil {
			attrs = map[string]string{}
		}
		if _, ok := attrs[string(types.QueueAttributeNameFifoQueue)]; !ok {
			attrs[string(types.QueueAttributeNameFifoQueue)] = "true"
		}
	}
	out, err := c.api.CreateQueue(ctx, &sqs.CreateQueueInput{QueueName: aws.String(name), Attributes: attrs})
	if err != nil {
		return "", fmt.Errorf("sqs: create queue %q: %w", name, err)
	}
	url := aws.ToString(out.QueueUrl)
	c.logger.Info("Created SQS queue", watermill.LogFields{"queue": name, "queue_url": url})
	return url, nil
}

// forget drops name from the URL cache, after SQS said the queue does not
// exist, so that the next call looks it up (and creates it) again.
func (c *client) forget(name string) {
	c.mu.Lock()
	delete(c.urls, name)
	c.mu.Unlock()
}

// isQueueNotFound reports whether err says that a queue does not exist.
func isQueueNotFound(err error) bool {
	var nf *types.QueueDoesNotExist
	return errors.As(err, &nf)
}
