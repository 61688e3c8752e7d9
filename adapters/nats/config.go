package nats

import (
	"errors"
	"fmt"
	"net/url"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	natsgo "github.com/nats-io/nats.go"
)

// Defaults applied by the Validate methods, [NewPublisher] and
// [NewSubscriber] to zero fields.
const (
	// DefaultConnectTimeout is the default [Config.ConnectTimeout].
	DefaultConnectTimeout = 10 * time.Second
	// DefaultDuplicateWindow is the default [Config.DuplicateWindow]:
	// JetStream's own default.
	DefaultDuplicateWindow = 2 * time.Minute
	// DefaultPublishTimeout is the default [PublisherConfig.PublishTimeout].
	DefaultPublishTimeout = 30 * time.Second
	// DefaultAckWait is the default [SubscriberConfig.AckWait]: JetStream's
	// own default.
	DefaultAckWait = 30 * time.Second
	// DefaultMaxAckPending is the default [SubscriberConfig.MaxAckPending]:
	// JetStream's own default.
	DefaultMaxAckPending = 1000
	// DefaultMaxInFlight is the default [SubscriberConfig.MaxInFlight]: one
	// message at a time, as the other adapters hand them out.
	DefaultMaxInFlight = 1
	// DefaultNackBackoffMin is the delay [DefaultNackBackoff] returns for a
	// first delivery.
	DefaultNackBackoffMin = time.Second
	// DefaultNackBackoffMax caps [DefaultNackBackoff].
	DefaultNackBackoffMax = 5 * time.Minute
	// DefaultDrainTimeout is the default [SubscriberConfig.DrainTimeout]:
	// the inbox's default drain budget (20s) and its FinishTimeout (5s), so
	// that a handler the inbox lets finish while the router closes has its
	// message acked, within Kubernetes' default termination grace period of
	// 30s.
	DefaultDrainTimeout = 25 * time.Second
)

// Limits the configuration is checked against.
const (
	// MinAckWait is the shortest [SubscriberConfig.AckWait] and
	// [SubscriberConfig.BackOff] step accepted: the subscription sends a
	// heartbeat every third of it.
	MinAckWait = time.Second
	// MaxNameLength is the longest stream or consumer name accepted.
	MaxNameLength = 255
)

var (
	// ErrInvalidConfig is wrapped by every error a Validate method
	// returns; the message names the field.
	ErrInvalidConfig = errors.New("nats: invalid config")
	// ErrClosed is returned by Publish, Subscribe, SubscribeInitialize
	// and Backlog after Close.
	ErrClosed = errors.New("nats: closed")
	// ErrNoJetStream is wrapped by the error the constructors return when
	// the server, or the account, has JetStream disabled.
	ErrNoJetStream = errors.New("nats: JetStream is not enabled")
	// ErrInvalidTopic is wrapped by the error returned for a topic that is
	// not a subject a message can be published to.
	ErrInvalidTopic = errors.New("nats: invalid topic")
	// ErrStreamNotFound is wrapped by the error Publish, Subscribe and
	// SubscribeInitialize return when a topic's stream does not exist and
	// [Config.CreateStreams] is false, and by the error of Backlog, which
	// never creates a stream; the message names the stream.
	ErrStreamNotFound = errors.New("nats: stream does not exist")
	// ErrTopicNotInStream is wrapped by the error returned when a topic's
	// stream exists but its subjects do not hold the topic.
	ErrTopicNotInStream = errors.New("nats: the stream's subjects do not hold the topic")
	// ErrConsumerMismatch is wrapped by the error Subscribe and
	// SubscribeInitialize return when the group's durable consumer exists
	// with settings other than the subscriber's; the message names each
	// field that differs.
	ErrConsumerMismatch = errors.New("nats: the durable consumer exists with other settings")
	// ErrHeartbeat is the cause (context.Cause) of a message context that
	// the subscription cancelled because it could not tell JetStream that
	// the handler is still working on the message: JetStream delivers it
	// again once its ack wait has passed.
	ErrHeartbeat = errors.New("nats: heartbeat to JetStream failed, the message will be delivered again")
)

// Config holds what publishers and subscribers share: how to reach NATS
// and how topics map to streams.
//
// A topic is a subject. By default every topic has a stream of its own,
// named by [Config.StreamName], whose only subject is the topic. With
// Stream set, every topic is a subject of that one existing stream.
type Config struct {
	// URL names the NATS servers: "nats://127.0.0.1:4222", several
	// separated by commas ("nats://a:4222,nats://b:4222"), with user and
	// password or a token in the user info if the server wants them. The
	// user info never appears in errors or logs. Required.
	URL string

	// Stream, when set, names one existing stream whose subjects hold
	// every topic (subjects "orders.>" for topics "orders.created" and
	// "orders.paid", say); each consumer then filters its topic. Empty
	// gives every topic a stream of its own, named by [Config.StreamName].
	// Defaults to "".
	Stream string

	// CreateStreams makes Publish, Subscribe and SubscribeInitialize
	// create a missing stream of a topic, with DuplicateWindow and
	// Replicas, file storage and limits retention. Otherwise they fail
	// with an error wrapping [ErrStreamNotFound] that names the stream.
	// It cannot be combined with Stream: a shared stream is the
	// operator's, created with the subjects it is meant to hold. Defaults
	// to false.
	CreateStreams bool

	// DuplicateWindow is the Duplicates window of the streams that
	// CreateStreams creates: JetStream drops a message published with the
	// same Nats-Msg-Id (its idempotency key) within it. It catches a
	// producer's quick retries only; the inbox's dedup window, hours or
	// days, catches the rest. Streams that exist keep theirs. Defaults to
	// [DefaultDuplicateWindow] (2m).
	DuplicateWindow time.Duration

	// Replicas is the replica count of the streams CreateStreams creates,
	// 1 to 5. Defaults to 1.
	Replicas int

	// ConnectTimeout bounds the connection to the server (dial, TLS and
	// protocol handshake) and the first JetStream request. Defaults to
	// [DefaultConnectTimeout] (10s).
	ConnectTimeout time.Duration

	// Options are nats.go options applied after this package's own (the
	// connection's name, ConnectTimeout, reconnecting forever, logging of
	// disconnects), for credentials files, TLS and the like. Defaults to
	// none.
	Options []natsgo.Option

	// Logger logs what the publisher and subscriber do. Defaults to
	// watermill.NopLogger.
	Logger watermill.LoggerAdapter
}

func (c *Config) setDefaults() {
	if c.DuplicateWindow == 0 {
		c.DuplicateWindow = DefaultDuplicateWindow
	}
	if c.Replicas == 0 {
		c.Replicas = 1
	}
	if c.ConnectTimeout == 0 {
		c.ConnectTimeout = DefaultConnectTimeout
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
	if c.URL == "" {
		return fmt.Errorf("%w: URL is required, such as nats://127.0.0.1:4222", ErrInvalidConfig)
	}
	for _, s := range strings.Split(c.URL, ",") {
		u, err := url.Parse(strings.TrimSpace(s))
		if err != nil || u.Hostname() == "" {
			return fmt.Errorf("%w: URL has %q, which is not a server URL such as nats://host:4222", ErrInvalidConfig, redactServer(s))
		}
	}
	if c.Stream != "" {
		if why := invalidName(c.Stream); why != "" {
			return fmt.Errorf("%w: Stream %q %s", ErrInvalidConfig, c.Stream, why)
		}
		if c.CreateStreams {
			return fmt.Errorf("%w: CreateStreams creates a stream per topic and cannot be combined with Stream %q, which must exist with the subjects it holds", ErrInvalidConfig, c.Stream)
		}
	}
	if c.DuplicateWindow < 0 {
		return fmt.Errorf("%w: DuplicateWindow must be > 0, or 0 for the default, got %s", ErrInvalidConfig, c.DuplicateWindow)
	}
	if c.Replicas < 1 || c.Replicas > 5 {
		return fmt.Errorf("%w: Replicas must be between 1 and 5, or 0 for the default, got %d", ErrInvalidConfig, c.Replicas)
	}
	if c.ConnectTimeout < 0 {
		return fmt.Errorf("%w: ConnectTimeout must be > 0, or 0 for the default, got %s", ErrInvalidConfig, c.ConnectTimeout)
	}
	return nil
}

// StreamName returns the stream that holds topic: [Config.Stream] when
// set, else the topic with every character a stream name cannot have
// ('.', '*', '>', '/', '\\', whitespace and control characters) replaced
// by '_'. Topics that differ only in those characters ("orders.eu" and
// "orders_eu") map to one stream name, whose subject is the first one's:
// the other then fails with [ErrTopicNotInStream] rather than share it.
func (c Config) StreamName(topic string) string {
	if c.Stream != "" {
		return c.Stream
	}
	return safeName(topic)
}

// shared reports whether every topic is a subject of one stream.
func (c Config) shared() bool { return c.Stream != "" }

// PublisherConfig configures a [Publisher].
type PublisherConfig struct {
	// Config holds the settings shared with the subscriber.
	Config

	// PublishTimeout bounds the publish of one message, on top of the
	// message's own context: Publish waits for JetStream to store the
	// message for at most this long. Defaults to [DefaultPublishTimeout]
	// (30s).
	PublishTimeout time.Duration
}

func (c *PublisherConfig) setDefaults() {
	c.Config.setDefaults()
	if c.PublishTimeout == 0 {
		c.PublishTimeout = DefaultPublishTimeout
	}
}

// Validate reports whether c, with its defaults applied, can be used. The
// error wraps [ErrInvalidConfig] and names the field. Validate does not
// modify c.
func (c PublisherConfig) Validate() error {
	c.setDefaults()
	if err := c.Config.Validate(); err != nil {
		return err
	}
	if c.PublishTimeout < 0 {
		return fmt.Errorf("%w: PublishTimeout must be > 0, or 0 for the default, got %s", ErrInvalidConfig, c.PublishTimeout)
	}
	return nil
}

// SubscriberConfig configures a [Subscriber]. The fields AckWait,
// MaxDeliver, BackOff and MaxAckPending are the settings of the group's
// durable consumer, which the subscriber creates, or checks when it
// exists: a consumer with other settings fails Subscribe with
// [ErrConsumerMismatch] rather than run with them.
type SubscriberConfig struct {
	// Config holds the settings shared with the publisher.
	Config

	// ConsumerGroup names the durable consumer (see
	// [SubscriberConfig.ConsumerName]): every subscriber of a group, in
	// any process, competes for the topic's messages, and every group
	// receives each message. Required.
	ConsumerGroup string

	// AckWait is how long JetStream waits for the ack of a delivered
	// message before it delivers it again: at least [MinAckWait]. While a
	// subscription holds a message it tells JetStream every AckWait/3 that
	// the handler is still working on it, so a slow handler is not raced
	// by a redelivery; AckWait is therefore what a consumer that died
	// costs, not a bound on handlers. With BackOff set it must be
	// BackOff[0] or 0. Defaults to [DefaultAckWait] (30s), or BackOff[0].
	AckWait time.Duration

	// MaxDeliver is how many times JetStream delivers a message at most;
	// -1 is no limit. A message that reaches it is neither acked nor
	// delivered again: it stays in the stream, applied by nobody and in
	// no dead-letter queue. Leave the limit to the poison middleware's
	// MaxAttempts, or keep MaxDeliver well above it. Defaults to -1 (no
	// limit).
	MaxDeliver int

	// BackOff, when set, is the consumer's redelivery schedule for
	// messages whose ack wait ran out (a consumer that died): the nth
	// redelivery waits BackOff[n-1], the last step repeating. Each step is
	// at least [MinAckWait], and the subscription's heartbeat follows the
	// step of each delivery. It does not apply to nacks, which wait
	// NackBackoff. Defaults to none: every redelivery waits AckWait.
	BackOff []time.Duration

	// MaxAckPending is how many messages the consumer has delivered and
	// not yet had acked, across all the group's subscribers, before it
	// delivers no more. Defaults to [DefaultMaxAckPending] (1000).
	MaxAckPending int

	// MaxInFlight is how many messages a subscription holds at once:
	// handed to the router and not yet acked or nacked. The subscription
	// asks JetStream for messages only when it holds fewer, so no message
	// waits in a client buffer while its ack wait runs; 1 hands them out
	// one at a time, waiting for each ack or nack, as Watermill's
	// subscribers do. At most MaxAckPending. Defaults to
	// [DefaultMaxInFlight] (1).
	MaxInFlight int

	// NackBackoff returns how long JetStream waits before it delivers a
	// nacked message again, given its delivery attempt (NumDelivered, from
	// 1); 0 delivers it again at once. Defaults to [DefaultNackBackoff].
	NackBackoff func(attempt int) time.Duration

	// DrainTimeout is how long a subscription that ends (Close, or its
	// context done) waits, handing out nothing more, for the messages its
	// handlers hold to be acked or nacked, still sending their heartbeats.
	// A message still held then has its context cancelled and is left to
	// its ack wait, after which JetStream delivers it again. Keep it at
	// least the inbox's drain budget plus its FinishTimeout, and the
	// router's CloseTimeout at least this. Defaults to
	// [DefaultDrainTimeout] (25s).
	DrainTimeout time.Duration
}

func (c *SubscriberConfig) setDefaults() {
	c.Config.setDefaults()
	if c.AckWait == 0 {
		c.AckWait = DefaultAckWait
		if len(c.BackOff) > 0 {
			c.AckWait = c.BackOff[0]
		}
	}
	if c.MaxDeliver == 0 {
		c.MaxDeliver = -1
	}
	if c.MaxAckPending == 0 {
		c.MaxAckPending = DefaultMaxAckPending
	}
	if c.MaxInFlight == 0 {
		c.MaxInFlight = DefaultMaxInFlight
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
	if c.ConsumerGroup == "" {
		return fmt.Errorf("%w: ConsumerGroup is required: it names the durable consumer, which keeps the group's place in the stream", ErrInvalidConfig)
	}
	if len(safeName(c.ConsumerGroup)) > MaxNameLength {
		return fmt.Errorf("%w: ConsumerGroup is longer than %d characters", ErrInvalidConfig, MaxNameLength)
	}
	// BackOff first: AckWait defaults to BackOff[0], whose error it would
	// otherwise report.
	for i, d := range c.BackOff {
		if d < MinAckWait {
			return fmt.Errorf("%w: BackOff[%d] must be at least %s, got %s", ErrInvalidConfig, i, MinAckWait, d)
		}
	}
	if c.AckWait < MinAckWait {
		return fmt.Errorf("%w: AckWait must be at least %s, got %s", ErrInvalidConfig, MinAckWait, c.AckWait)
	}
	if len(c.BackOff) > 0 && c.AckWait != c.BackOff[0] {
		return fmt.Errorf("%w: AckWait %s must equal BackOff[0] %s, or be 0: JetStream takes the first step as the ack wait", ErrInvalidConfig, c.AckWait, c.BackOff[0])
	}
	if c.MaxDeliver < -1 {
		return fmt.Errorf("%w: MaxDeliver must be positive, or -1 for no limit, got %d", ErrInvalidConfig, c.MaxDeliver)
	}
	if c.MaxDeliver > 0 && c.MaxDeliver < len(c.BackOff) {
		return fmt.Errorf("%w: MaxDeliver %d must be at least the %d steps of BackOff", ErrInvalidConfig, c.MaxDeliver, len(c.BackOff))
	}
	if c.MaxAckPending < 1 {
		return fmt.Errorf("%w: MaxAckPending must be at least 1, got %d", ErrInvalidConfig, c.MaxAckPending)
	}
	if c.MaxInFlight < 1 || c.MaxInFlight > c.MaxAckPending {
		return fmt.Errorf("%w: MaxInFlight must be between 1 and MaxAckPending (%d), got %d", ErrInvalidConfig, c.MaxAckPending, c.MaxInFlight)
	}
	if c.DrainTimeout < 0 {
		return fmt.Errorf("%w: DrainTimeout must be > 0, or 0 for the default, got %s", ErrInvalidConfig, c.DrainTimeout)
	}
	return nil
}

// ConsumerName returns the name of the group's durable consumer for
// topic: the consumer group, with the characters a consumer name cannot
// have replaced by '_' (as in [Config.StreamName]), in a stream of the
// topic's own; in a shared stream ([Config.Stream]), which holds a
// consumer per topic and group, the group and the topic joined by "__".
func (c SubscriberConfig) ConsumerName(topic string) string {
	if c.shared() {
		return safeName(c.ConsumerGroup + "__" + topic)
	}
	return safeName(c.ConsumerGroup)
}

// ackDeadline is how long JetStream waits for the ack of the given
// delivery attempt (from 1): the BackOff step of the attempt, else
// AckWait.
func (c SubscriberConfig) ackDeadline(attempt int) time.Duration {
	if len(c.BackOff) == 0 {
		return c.AckWait
	}
	return c.BackOff[min(max(attempt, 1), len(c.BackOff))-1]
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

// safeName returns s with every character that a stream or consumer name
// cannot have replaced by '_'.
func safeName(s string) string {
	return strings.Map(func(r rune) rune {
		if !nameRune(r) {
			return '_'
		}
		return r
	}, s)
}

// nameRune reports whether a stream or consumer name can have r.
func nameRune(r rune) bool {
	switch r {
	case '.', '*', '>', '/', '\\', ' ', '\t', '\r', '\n', 0x7f:
		return false
	}
	return r > ' '
}

// invalidName says why name is not a valid stream or consumer name, or "".
func invalidName(name string) string {
	switch {
	case name == "":
		return "is empty"
	case len(name) > MaxNameLength:
		return fmt.Sprintf("is longer than %d characters", MaxNameLength)
	case strings.IndexFunc(name, func(r rune) bool { return !nameRune(r) }) >= 0:
		return "has a character a stream name cannot have ('.', '*', '>', '/', '\\', whitespace or a control character)"
	}
	return ""
}

// invalidTopic says why topic is not a subject a message can be published
// to, or "".
func invalidTopic(topic string) string {
	switch {
	case topic == "":
		return "is empty"
	case strings.IndexFunc(topic, func(r rune) bool { return r <= ' ' || r == 0x7f }) >= 0:
		return "has whitespace or a control character, which a NATS subject cannot have"
	}
	for _, tok := range strings.Split(topic, ".") {
		switch tok {
		case "":
			return "has an empty token (a leading, trailing or double '.')"
		case "*", ">":
			return "has a wildcard token, which a published subject cannot have"
		}
	}
	return ""
}

// subjectMatches reports whether subject falls under pattern, a stream
// subject that may hold the wildcards '*' (one token) and '>' (the rest).
func subjectMatches(pattern, subject string) bool {
	pt, st := strings.Split(pattern, "."), strings.Split(subject, ".")
	for i, p := range pt {
		if p == ">" {
			return len(st) > i
		}
		if i >= len(st) || (p != "*" && p != st[i]) {
			return false
		}
	}
	return len(pt) == len(st)
}

// redactServer hides the user info of one server URL.
func redactServer(s string) string {
	s = strings.TrimSpace(s)
	if u, err := url.Parse(s); err == nil {
		if u.User != nil {
			u.User = url.User("xxxxx")
		}
		return u.String()
	}
	if scheme, rest, ok := strings.Cut(s, "://"); ok {
		if _, host, ok := strings.Cut(rest, "@"); ok {
			return scheme + "://xxxxx@" + host
		}
	}
	return s
}

// redactURL hides the user info of every server in a URL list.
func redactURL(list string) string {
	parts := strings.Split(list, ",")
	for i, p := range parts {
		parts[i] = redactServer(p)
	}
	return strings.Join(parts, ",")
}
