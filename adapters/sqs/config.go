package sqs

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"net/url"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/aws/aws-sdk-go-v2/aws"
	awshttp "github.com/aws/aws-sdk-go-v2/aws/transport/http"
	"github.com/aws/aws-sdk-go-v2/service/sqs"
)

// Defaults applied by [PublisherConfig.Validate], [SubscriberConfig.Validate],
// [NewPublisher] and [NewSubscriber] to zero fields.
const (
	// DefaultWaitTime is the default [SubscriberConfig.WaitTime]: the
	// longest long poll SQS allows.
	DefaultWaitTime = 20 * time.Second
	// DefaultMaxNumberOfMessages is the default
	// [SubscriberConfig.MaxNumberOfMessages]: the most SQS returns at once.
	DefaultMaxNumberOfMessages = 10
	// DefaultVisibilityTimeout is the default
	// [SubscriberConfig.VisibilityTimeout].
	DefaultVisibilityTimeout = 30 * time.Second
	// DefaultNackBackoffMin is the delay [DefaultNackBackoff] returns for a
	// first delivery.
	DefaultNackBackoffMin = time.Second
	// DefaultNackBackoffMax caps [DefaultNackBackoff].
	DefaultNackBackoffMax = 5 * time.Minute
	// DefaultConnectTimeout is the default [Config.ConnectTimeout].
	DefaultConnectTimeout = 10 * time.Second
	// DefaultDrainTimeout is the default [SubscriberConfig.DrainTimeout]:
	// the inbox's default drain budget (20s) and its FinishTimeout (5s),
	// so that a handler the inbox lets finish while the router closes has
	// its message deleted, within Kubernetes' default termination grace
	// period of 30s.
	DefaultDrainTimeout = 25 * time.Second
)

// Limits of SQS that the configuration is checked against.
const (
	// MaxWaitTime is the longest long poll SQS allows.
	MaxWaitTime = 20 * time.Second
	// MaxVisibilityTimeout is the longest visibility timeout SQS allows.
	MaxVisibilityTimeout = 12 * time.Hour
	// MaxQueueNameLength is the longest queue name SQS allows, ".fifo"
	// suffix included.
	MaxQueueNameLength = 80
	// FIFOSuffix ends the name of every FIFO queue.
	FIFOSuffix = ".fifo"
)

var (
	// ErrInvalidConfig is wrapped by every error that a Validate method or
	// [RedrivePolicy] returns; the message names the field.
	ErrInvalidConfig = errors.New("sqs: invalid config")
	// ErrClosed is returned by Publish, Subscribe, SubscribeInitialize
	// and Backlog after Close.
	ErrClosed = errors.New("sqs: closed")
	// ErrQueueNotFound is wrapped by the error Publish and Subscribe return
	// when a topic's queue does not exist and CreateQueueIfMissing is
	// false, and by the error of Backlog, which never creates a queue.
	ErrQueueNotFound = errors.New("sqs: queue does not exist")
	// ErrInvalidTopic is wrapped by the error returned for a topic that
	// maps to no valid queue name.
	ErrInvalidTopic = errors.New("sqs: invalid topic")
	// ErrInvalidMessage is wrapped by the error Publish returns for a
	// message that SQS cannot carry, before anything is sent.
	ErrInvalidMessage = errors.New("sqs: invalid message")
	// ErrPublish is wrapped by the error Publish returns when SQS rejects
	// one or more messages of a batch; the message names them.
	ErrPublish = errors.New("sqs: publish failed")
)

// Config holds what publishers and subscribers share: how to reach SQS and
// how topics map to queues.
//
// Every topic is one SQS queue, named by QueueNameFromTopic. A name ending
// in ".fifo" is a FIFO queue; see the package documentation for how
// messages map to message groups and deduplication IDs.
type Config struct {
	// AWSConfig, when set, is the AWS SDK configuration to build the SQS
	// client from, as returned by config.LoadDefaultConfig. It is copied,
	// never modified. Region and Credentials below override its fields
	// when set. When nil, the configuration is loaded with
	// config.LoadDefaultConfig (environment, shared files, instance roles).
	AWSConfig *aws.Config

	// Region is the AWS region, such as "us-east-1". Empty means the
	// region of AWSConfig or of the environment (AWS_REGION); one of them
	// must be set.
	Region string

	// Endpoint, when set, replaces the SQS endpoint (the client's
	// BaseEndpoint), for an emulator such as fauxqs or LocalStack:
	// "http://127.0.0.1:4566". It must be an absolute http or https URL.
	Endpoint string

	// Credentials, when set, replaces the credentials of AWSConfig or of
	// the environment. Emulators accept any static credentials:
	// credentials.NewStaticCredentialsProvider("test", "test", "").
	Credentials aws.CredentialsProvider

	// ConnectTimeout bounds each connection the client opens to SQS: the
	// TCP connect and the TLS handshake. Zero means
	// [DefaultConnectTimeout] for the HTTP client the SDK would build, and
	// leaves an HTTP client of AWSConfig unchanged. A non-zero value
	// applies to an AWSConfig HTTP client only if it is the SDK's
	// (*awshttp.BuildableClient); for another, set its timeouts there.
	ConnectTimeout time.Duration

	// ClientOptions are applied to the SQS client's options after
	// everything else, for settings this Config does not name (retryer,
	// API options).
	ClientOptions []func(*sqs.Options)

	// CreateQueueIfMissing makes Publish and Subscribe create a topic's
	// queue, with QueueAttributes, when it does not exist. Otherwise they
	// fail with [ErrQueueNotFound]. SubscribeInitialize always creates it.
	CreateQueueIfMissing bool

	// QueueAttributes are the attributes queues are created with
	// (CreateQueue's Attributes: "VisibilityTimeout",
	// "MessageRetentionPeriod", "RedrivePolicy", ...; see [RedrivePolicy]).
	// "FifoQueue" is set to "true" for queue names ending in ".fifo". They
	// are not applied to queues that already exist. The map is copied.
	QueueAttributes map[string]string

	// QueueNameFromTopic maps a topic to its queue name. Defaults to
	// [DefaultQueueName].
	QueueNameFromTopic func(topic string) string

	// Logger logs what the publisher and subscriber do. Defaults to
	// watermill.NopLogger.
	Logger watermill.LoggerAdapter
}

// setDefaults sets the zero fields of c to their defaults.
func (c *Config) setDefaults() {
	if c.QueueNameFromTopic == nil {
		c.QueueNameFromTopic = DefaultQueueName
	}
	if c.Logger == nil {
		c.Logger = watermill.NopLogger{}
	}
}

// Validate reports whether c, with its defaults applied, can be used. The
// error wraps [ErrInvalidConfig] and names the field. Validate does not
// modify c.
func (c Config) Validate() error {
	c.setDefaults()
	if c.Endpoint != "" {
		u, err := url.Parse(c.Endpoint)
		if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
			return fmt.Errorf("%w: Endpoint must be an absolute http or https URL, got %q", ErrInvalidConfig, c.Endpoint)
		}
	}
	// An empty Region may still be named by AWSConfig or the environment;
	// the constructors check once the AWS configuration is loaded.
	if strings.ContainsAny(c.Region, " /:") {
		return fmt.Errorf("%w: Region %q is not a region name", ErrInvalidConfig, c.Region)
	}
	for k := range c.QueueAttributes {
		if k == "" {
			return fmt.Errorf("%w: QueueAttributes has an empty attribute name", ErrInvalidConfig)
		}
	}
	if c.ConnectTimeout < 0 {
		return fmt.Errorf("%w: ConnectTimeout must be > 0, or 0 for the default, got %s", ErrInvalidConfig, c.ConnectTimeout)
	}
	if c.ConnectTimeout != 0 && c.AWSConfig != nil && c.AWSConfig.HTTPClient != nil {
		if _, ok := c.AWSConfig.HTTPClient.(*awshttp.BuildableClient); !ok {
			return fmt.Errorf("%w: ConnectTimeout cannot be applied to AWSConfig.HTTPClient of type %T; set the timeout on that client", ErrInvalidConfig, c.AWSConfig.HTTPClient)
		}
	}
	return nil
}

// PublisherConfig configures a [Publisher].
type PublisherConfig struct {
	// Config holds the settings shared with the subscriber.
	Config
}

// setDefaults sets the zero fields of c to their defaults.
func (c *PublisherConfig) setDefaults() {
	c.Config.setDefaults()
}

// Validate reports whether c, with its defaults applied, can be used. The
// error wraps [ErrInvalidConfig] and names the field. Validate does not
// modify c.
func (c PublisherConfig) Validate() error {
	c.setDefaults()
	return c.Config.Validate()
}

// SubscriberConfig configures a [Subscriber].
type SubscriberConfig struct {
	// Config holds the settings shared with the publisher.
	Config

	// WaitTime is how long one ReceiveMessage call waits for messages
	// (long polling, WaitTimeSeconds): a whole number of seconds from 1s
	// to 20s. Zero means [DefaultWaitTime]. Close does not wait for a poll
	// to end: it cancels it once the drain of the messages handlers hold
	// ends (at once when they hold none); a poll that ends during the
	// drain has what it received made visible again at once.
	WaitTime time.Duration

	// MaxNumberOfMessages is the most one ReceiveMessage call asks for:
	// 1 to 10, SQS's own limit. Defaults to [DefaultMaxNumberOfMessages]
	// (10).
	MaxNumberOfMessages int

	// MaxInFlight is how many messages a subscription holds at once,
	// received and not yet acked or nacked: it receives again, up to
	// MaxNumberOfMessages a call, only while it holds fewer. The
	// subscription hands them to the router concurrently, a key's
	// messages one at a time (see Subscriber.Subscribe), so that group
	// commit and middleware.BatchHandler fill batches larger than one
	// receive; 1 hands out one message at a time. While a message waits
	// behind another of its key, the heartbeat keeps it invisible to other
	// consumers. Size the database pool for it (docs/brokers.md). Defaults
	// to MaxNumberOfMessages.
	MaxInFlight int

	// VisibilityTimeout is how long SQS hides a received message from
	// other consumers: a whole number of seconds from 1s to 12h. Zero
	// means [DefaultVisibilityTimeout]. It is passed to every
	// ReceiveMessage call, overriding the queue's attribute, and a
	// heartbeat extends it every VisibilityTimeout/3 for as long as the
	// subscription holds the message, so a slow handler is not raced by a
	// redelivery. It is also how long a message stays hidden after its
	// subscriber dies or closes while a handler holds it.
	VisibilityTimeout time.Duration

	// NackBackoff returns how long a nacked message stays hidden before
	// SQS delivers it again, given its delivery attempt (the message's
	// ApproximateReceiveCount, from 1). The result is rounded up to whole
	// seconds and clamped to 0..12h; 0 makes the message visible at once.
	// Defaults to [DefaultNackBackoff].
	NackBackoff func(attempt int) time.Duration

	// DrainTimeout is how long a subscription that ends (Close, or its
	// context done) waits, handing out nothing more, for the message its
	// handler holds to be acked, which deletes it, or nacked; the
	// heartbeat keeps the message invisible meanwhile. A message still
	// held then is left to its visibility timeout. Keep it at least the
	// inbox's drain budget plus its FinishTimeout, and the router's
	// CloseTimeout at least this. Defaults to [DefaultDrainTimeout] (25s).
	DrainTimeout time.Duration
}

// setDefaults sets the zero fields of c to their defaults.
func (c *SubscriberConfig) setDefaults() {
	c.Config.setDefaults()
	if c.WaitTime == 0 {
		c.WaitTime = DefaultWaitTime
	}
	if c.MaxNumberOfMessages == 0 {
		c.MaxNumberOfMessages = DefaultMaxNumberOfMessages
	}
	if c.MaxInFlight == 0 {
		c.MaxInFlight = c.MaxNumberOfMessages
	}
	if c.VisibilityTimeout == 0 {
		c.VisibilityTimeout = DefaultVisibilityTimeout
	}
	if c.NackBackoff == nil {
		c.NackBackoff = DefaultNackBackoff
	}
	if c.DrainTimeout == 0 {
		c.DrainTimeout = DefaultDrainTimeout
	}
}

// Validate reports whether c, with its defaults applied, can be used. The
// error wraps [ErrInvalidConfig] and names the field. Validate does not
// modify c.
func (c SubscriberConfig) Validate() error {
	c.setDefaults()
	if err := c.Config.Validate(); err != nil {
		return err
	}
	if c.WaitTime < time.Second || c.WaitTime > MaxWaitTime || c.WaitTime%time.Second != 0 {
		return fmt.Errorf("%w: WaitTime must be a whole number of seconds from 1s to %s, got %s", ErrInvalidConfig, MaxWaitTime, c.WaitTime)
	}
	if c.MaxNumberOfMessages < 1 || c.MaxNumberOfMessages > 10 {
		return fmt.Errorf("%w: MaxNumberOfMessages must be between 1 and 10, got %d", ErrInvalidConfig, c.MaxNumberOfMessages)
	}
	if c.MaxInFlight < 1 {
		return fmt.Errorf("%w: MaxInFlight must be at least 1, or 0 for MaxNumberOfMessages, got %d", ErrInvalidConfig, c.MaxInFlight)
	}
	if c.VisibilityTimeout < time.Second || c.VisibilityTimeout > MaxVisibilityTimeout || c.VisibilityTimeout%time.Second != 0 {
		return fmt.Errorf("%w: VisibilityTimeout must be a whole number of seconds from 1s to %s, got %s", ErrInvalidConfig, MaxVisibilityTimeout, c.VisibilityTimeout)
	}
	if c.DrainTimeout < 0 {
		return fmt.Errorf("%w: DrainTimeout must be > 0, or 0 for the default, got %s", ErrInvalidConfig, c.DrainTimeout)
	}
	return nil
}

// DefaultNackBackoff is the default [SubscriberConfig.NackBackoff]:
// [DefaultNackBackoffMin] for the first attempt, doubling with each
// further attempt, capped at [DefaultNackBackoffMax].
func DefaultNackBackoff(attempt int) time.Duration {
	if attempt < 1 {
		attempt = 1
	}
	if attempt > 32 {
		return DefaultNackBackoffMax
	}
	d := DefaultNackBackoffMin << (attempt - 1)
	if d <= 0 || d > DefaultNackBackoffMax {
		return DefaultNackBackoffMax
	}
	return d
}

// visibilitySeconds converts d to the whole seconds SQS expects, rounding
// up and clamping to 0..12h.
func visibilitySeconds(d time.Duration) int32 {
	if d <= 0 {
		return 0
	}
	if d >= MaxVisibilityTimeout {
		return int32(MaxVisibilityTimeout / time.Second)
	}
	return int32(math.Ceil(d.Seconds()))
}

// DefaultQueueName is the default [Config.QueueNameFromTopic]: the topic
// with every character SQS does not accept in a queue name (anything but
// ASCII letters, digits, '-' and '_') replaced by '-', keeping a ".fifo"
// suffix. A name longer than 80 characters is shortened and ends with 8 hex
// digits of the topic's SHA-256, so that long topics stay distinct.
// Topics that differ only in replaced characters ("a.b" and "a-b") share a
// queue; name topics accordingly or set [Config.QueueNameFromTopic].
func DefaultQueueName(topic string) string {
	base, suffix := topic, ""
	if strings.HasSuffix(topic, FIFOSuffix) {
		base, suffix = strings.TrimSuffix(topic, FIFOSuffix), FIFOSuffix
	}
	var b strings.Builder
	b.Grow(len(base))
	for _, r := range base {
		if isQueueNameChar(r) {
			b.WriteRune(r)
		} else {
			b.WriteByte('-')
		}
	}
	name := b.String()
	if len(name)+len(suffix) > MaxQueueNameLength {
		sum := sha256.Sum256([]byte(topic))
		keep := MaxQueueNameLength - len(suffix) - 9
		name = name[:keep] + "-" + hex.EncodeToString(sum[:4])
	}
	return name + suffix
}

func isQueueNameChar(r rune) bool {
	return r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '-' || r == '_'
}

// validQueueName reports why name is not a valid SQS queue name, or "".
func validQueueName(name string) string {
	if name == "" {
		return "queue name is empty"
	}
	if len(name) > MaxQueueNameLength {
		return fmt.Sprintf("queue name %q is longer than %d characters", name, MaxQueueNameLength)
	}
	base := strings.TrimSuffix(name, FIFOSuffix)
	if base == "" {
		return fmt.Sprintf("queue name %q has nothing before %s", name, FIFOSuffix)
	}
	for _, r := range base {
		if !isQueueNameChar(r) {
			return fmt.Sprintf("queue name %q has a character other than letters, digits, '-' and '_' (before an optional %s)", name, FIFOSuffix)
		}
	}
	return ""
}

// isFIFO reports whether queue names a FIFO queue.
func isFIFO(queue string) bool {
	return strings.HasSuffix(queue, FIFOSuffix)
}

// RedrivePolicy returns the JSON value of the "RedrivePolicy" queue
// attribute, for [Config.QueueAttributes]: SQS moves a message to the queue
// deadLetterQueueARN once it has been received more than maxReceiveCount
// times (1 to 1000) without being deleted. The dead-letter queue must be of
// the same type (standard or FIFO) and in the same account and region.
//
// A nack counts as a receive, as does every redelivery after a visibility
// timeout; set maxReceiveCount above the poison middleware's attempt limit
// so that the broker's redrive is only a backstop.
func RedrivePolicy(deadLetterQueueARN string, maxReceiveCount int) (string, error) {
	if !strings.HasPrefix(deadLetterQueueARN, "arn:") {
		return "", fmt.Errorf("%w: deadLetterQueueARN must be a queue ARN (arn:aws:sqs:region:account:name), got %q", ErrInvalidConfig, deadLetterQueueARN)
	}
	if maxReceiveCount < 1 || maxReceiveCount > 1000 {
		return "", fmt.Errorf("%w: maxReceiveCount must be between 1 and 1000, got %d", ErrInvalidConfig, maxReceiveCount)
	}
	b, err := json.Marshal(struct {
		DeadLetterTargetArn string `json:"deadLetterTargetArn"`
		MaxReceiveCount     int    `json:"maxReceiveCount"`
	}{deadLetterQueueARN, maxReceiveCount})
	if err != nil {
		return "", fmt.Errorf("sqs: encode redrive policy: %w", err)
	}
	return string(b), nil
}
