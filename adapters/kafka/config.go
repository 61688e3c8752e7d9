package kafka

import (
	"errors"
	"fmt"
	"net"
	"slices"
	"time"

	"github.com/IBM/sarama"
	wkafka "github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"

	"github.com/oncemill/oncemill/delivery"
)

var (
	// ErrInvalidConfig is wrapped by every error that a config's Validate
	// returns; the message names the field.
	ErrInvalidConfig = errors.New("kafka: invalid config")
	// ErrInvalidMessage is wrapped by the error that [Marshaler.Marshal],
	// and so Publish, returns for a message that a subscriber could not
	// decode.
	ErrInvalidMessage = errors.New("kafka: invalid message")
	// ErrPublisherClosed is returned by [Publisher.Publish] after Close.
	ErrPublisherClosed = errors.New("kafka: publisher closed")
)

// NoSleep, as NackResendSleep or ReconnectRetrySleep, means no sleep.
const NoSleep = wkafka.NoSleep

// Defaults of the timeouts of [SubscriberConfig] and [PublisherConfig].
const (
	// DefaultDialTimeout is the default DialTimeout.
	DefaultDialTimeout = 10 * time.Second
	// DefaultReadTimeout is the default [PublisherConfig.ReadTimeout], and
	// the least default [SubscriberConfig.ReadTimeout].
	DefaultReadTimeout = 30 * time.Second
	// DefaultSessionTimeout is the default
	// [SubscriberConfig.SessionTimeout]: the least that brokers accept
	// by default (group.min.session.timeout.ms), so that a member that
	// dies without leaving holds the group up as briefly as the broker
	// allows. Sarama's own default is 10s. See SessionTimeout for the
	// trade-off.
	DefaultSessionTimeout = 6 * time.Second
	// DefaultRebalanceTimeout is the default
	// [SubscriberConfig.RebalanceTimeout], Sarama's.
	DefaultRebalanceTimeout = 60 * time.Second
	// JoinGroupMargin is how much longer than the rebalance timeout the
	// default [SubscriberConfig.ReadTimeout] is, as the Java client waits
	// for a JoinGroup response.
	JoinGroupMargin = 5 * time.Second
	// DefaultDrainTimeout is the default [SubscriberConfig.DrainTimeout]:
	// the inbox's default drain budget (20s) and its FinishTimeout (5s),
	// so that a handler the inbox lets finish while the router closes is
	// acked and its offset committed, within Kubernetes' default
	// termination grace period of 30s.
	DefaultDrainTimeout = 25 * time.Second
	// DefaultRevokeTimeout is the longest default
	// [SubscriberConfig.RevokeTimeout]; the default is at most half the
	// rebalance timeout.
	DefaultRevokeTimeout = 5 * time.Second
)

// DefaultMaxInFlightPerPartition is the default
// [SubscriberConfig.MaxInFlightPerPartition]: up to 64 messages of one
// partition, of different keys, in flight at once.
const DefaultMaxInFlightPerPartition = 64

// maxHeartbeatInterval is Sarama's default heartbeat interval, kept while
// it is at most a third of the session timeout.
const maxHeartbeatInterval = 3 * time.Second

// InitialOffset is where a consumer group starts reading a partition for
// which it has no committed offset.
type InitialOffset int8

const (
	// Oldest starts at the oldest record still in the partition, so a
	// new group sees everything published before it subscribed. The
	// default.
	Oldest InitialOffset = iota
	// Newest starts after the last record, so a new group sees only what
	// is published after it subscribed.
	Newest
)

// String returns "Oldest", "Newest", or the number of an invalid value.
func (o InitialOffset) String() string {
	switch o {
	case Oldest:
		return "Oldest"
	case Newest:
		return "Newest"
	default:
		return fmt.Sprintf("InitialOffset(%d)", int8(o))
	}
}

func (o InitialOffset) sarama() int64 {
	if o == Newest {
		return sarama.OffsetNewest
	}
	return sarama.OffsetOldest
}

// SubscriberConfig configures [NewSubscriber]. The zero value of every
// field but Brokers is valid and means the documented default.
type SubscriberConfig struct {
	// Brokers are the seed brokers, as host:port. Required.
	Brokers []string

	// ConsumerGroup is the consumer group the subscriber joins, resumes
	// from and commits to. Empty subscribes without a group: every
	// Subscribe reads all partitions from InitialOffset and commits
	// nothing, so it suits only tools and tests.
	ConsumerGroup string

	// InitialOffset is where the group starts in a partition it has no
	// committed offset for (Kafka's auto.offset.reset). Defaults to
	// Oldest, so that nothing published before the group first
	// subscribed is skipped.
	InitialOffset InitialOffset

	// CommitInterval is how often the offsets of acked messages are
	// committed to the group. Defaults to 1s. Whatever was acked is also
	// committed when the subscriber closes and before the group
	// rebalances. Only acked offsets are ever committed; after a crash,
	// the messages acked in the last interval are delivered again.
	CommitInterval time.Duration

	// SyncCommit commits after every ack, before the partition's next
	// message is delivered, instead of every CommitInterval: a crash then
	// redelivers at most the last acked message of each partition, whose
	// commit may not have completed, at the cost of one round trip to the
	// group coordinator per message.
	SyncCommit bool

	// NackResendSleep is how long the subscriber waits before it delivers
	// a nacked message again. Defaults to 500ms. NoSleep disables the
	// wait. In the key-parallel mode (MaxInFlightPerPartition above 1)
	// only the message's key waits meanwhile: the partition's other keys
	// go on, while the waiting message still counts as in flight towards
	// MaxInFlightPerPartition and MaxInFlight, and the committed offset
	// does not pass it. With MaxInFlightPerPartition 1, or without a
	// ConsumerGroup, its whole partition waits.
	NackResendSleep time.Duration

	// ReconnectRetrySleep is how long the subscriber waits before it
	// tries again when it cannot connect to the brokers. Defaults to 1s.
	// NoSleep disables the wait.
	ReconnectRetrySleep time.Duration

	// TopicPartitions and TopicReplicationFactor are the partition count
	// and replication factor with which SubscribeInitialize creates a
	// missing topic. Both default to 1, which suits development; create
	// production topics with your own tooling or set these.
	TopicPartitions        int32
	TopicReplicationFactor int16

	// DialTimeout bounds each connection to a broker, TCP connect and TLS
	// handshake (Sarama's Net.DialTimeout). Defaults to
	// [DefaultDialTimeout].
	DialTimeout time.Duration

	// ReadTimeout is how long the client waits for a broker's response
	// (Sarama's Net.ReadTimeout). With a ConsumerGroup it must be longer
	// than RebalanceTimeout: the group coordinator holds a JoinGroup
	// request open until every member has rejoined, for up to the
	// rebalance timeout, and a client that gives up sooner fails the join
	// and starts over, so a rebalance that waits for a slow member never
	// completes. Defaults to RebalanceTimeout plus [JoinGroupMargin], and
	// at least [DefaultReadTimeout]: 65s with the default rebalance
	// timeout.
	ReadTimeout time.Duration

	// SessionTimeout is how long the group coordinator waits for a
	// member's heartbeat before it drops the member and rebalances
	// (Sarama's Consumer.Group.Session.Timeout). Brokers accept 6s to 30m
	// unless configured otherwise (group.min.session.timeout.ms and
	// group.max.session.timeout.ms); outside that range every join fails
	// with "The provided session timeout is outside the allowed range",
	// which the subscriber logs. Defaults to [DefaultSessionTimeout]
	// (6s). The heartbeat interval is a third of it, at most 3s.
	//
	// It is how long the partitions of a member that dies without
	// leaving the group (SIGKILL, an OOM kill, a lost host) wait before
	// they move. A dynamic member restarted at once does not shorten the
	// wait but spreads it: its join starts a rebalance, which stops every
	// member, and the coordinator completes it only once the dead
	// member's session has expired, so each crash of a crash loop stalls
	// the whole group for most of the session timeout (InstanceID avoids
	// that). A member that closes (SIGTERM) leaves the group at once,
	// whatever this says, unless InstanceID is set.
	//
	// Shorter moves a dead member's partitions sooner. Too short makes a
	// live member whose heartbeats are late (a stalled or CPU-starved
	// process, a network blip, a slow coordinator) look dead; each such
	// spurious expiry costs a rebalance of a few seconds, which is less
	// than a crash costs, as the member rejoins at once. Heartbeats run
	// on their own goroutine, however long handlers take, so the session
	// expires only when no heartbeat got through for the whole timeout:
	// three missed heartbeats at the default. Kafka's Java client, whose
	// rebalances are costlier, defaults to 45s since Kafka 3.0; raise
	// this where heartbeats may be held up for seconds (a broker whose
	// minimum is higher, a link that drops out).
	SessionTimeout time.Duration

	// RebalanceTimeout is how long the group coordinator waits, in a
	// rebalance, for every member to rejoin (Sarama's
	// Consumer.Group.Rebalance.Timeout): long enough for the handlers of
	// revoked partitions to finish and their offsets to be committed.
	// Defaults to [DefaultRebalanceTimeout].
	RebalanceTimeout time.Duration

	// InstanceID, when set, makes the subscriber a static member of
	// ConsumerGroup (KIP-345, Kafka's group.instance.id, Sarama's
	// Consumer.Group.InstanceId; Kafka 2.3 or later): an identity that
	// outlives the process, such as a StatefulSet pod's name. It must be
	// unique within the group, at most 249 characters of a-z, A-Z, 0-9,
	// '.', '_' and '-', and neither "." nor "..". Empty, the default,
	// joins as a dynamic member.
	//
	// A static member that restarts within SessionTimeout takes its
	// partitions back, from the committed offsets, without a rebalance:
	// the rest of the group goes on undisturbed, and only the restarted
	// member's partitions wait, for as long as the restart takes. In
	// exchange it does not leave the group when it closes (Sarama sends
	// no LeaveGroup for a static member, as Kafka's clients do not): its
	// partitions stay assigned to it, unconsumed, until it comes back or
	// its session times out, so a SIGTERM that is not followed by a
	// restart stalls them for SessionTimeout, as a SIGKILL would. The
	// session must outlast the restart: raise SessionTimeout where a
	// restart takes longer than that (a pod rescheduled, an image
	// pulled), at the cost of a longer stall when a member does not come
	// back. Two processes with one InstanceID fence each other: each join
	// of one makes the other's heartbeats fail with FENCED_INSTANCE_ID,
	// which the subscriber logs, and the two take the partitions from
	// each other in turn.
	InstanceID string

	// MaxInFlightPerPartition is how many messages of one partition the
	// subscriber hands to the router at once. Messages with different
	// record keys are handled concurrently; messages with the same key
	// stay strictly in order: a key's next message is handed out only
	// once the previous one is acked, and a nacked one is delivered again
	// (after NackResendSleep) before any later message of its key,
	// without holding up other keys. Offsets are committed up to the
	// lowest offset not yet acked. Defaults to
	// [DefaultMaxInFlightPerPartition] (64). Each message in flight may
	// hold resources of its handler (a database transaction of the inbox,
	// say) while it waits for more: a handler that takes a second pooled
	// connection while the inbox holds one deadlocks once every
	// connection is held by a waiting handler, so either size the pool
	// for MaxInFlightPerPartition times the partitions a member may own,
	// or keep handlers to the inbox's transaction (postgres.Tx). 1 hands
	// out one message per partition at a time, in offset order, through
	// watermill-kafka's subscriber, which is also used, whatever this
	// field says, without a ConsumerGroup.
	MaxInFlightPerPartition int

	// MaxInFlight, when above 0, bounds the messages in flight across all
	// the partitions of one Subscribe, on top of MaxInFlightPerPartition:
	// a partition with work waits for a slot. Set it to what the
	// handlers' resources allow, the database pool's size, say, so that
	// a member that owns many partitions does not queue hundreds of
	// handlers on a pool of a few dozen connections (or deadlock handlers
	// that take a second connection). Applies when MaxInFlightPerPartition
	// is above 1. Defaults to 0: no limit but MaxInFlightPerPartition times
	// the partitions owned.
	MaxInFlight int

	// DrainTimeout is how long Close waits for the handlers of the
	// messages in flight to ack or nack. From the start of Close nothing
	// more is handed out (a message the router has not taken yet is taken
	// back), each acked offset is marked as it comes, and the message
	// contexts are left alone (a router that closes cancels them itself,
	// and the inbox keeps its handler's context alive for its own drain
	// budget); once DrainTimeout has passed, the contexts of the messages
	// still in flight are cancelled and those messages are delivered
	// again later. Then the member commits what was acked and leaves the
	// group. Keep it at least the inbox's drain budget plus its
	// FinishTimeout, and the router's CloseTimeout at least this. Applies
	// when MaxInFlightPerPartition is above 1. Defaults to
	// [DefaultDrainTimeout] (25s).
	DrainTimeout time.Duration

	// RevokeTimeout is DrainTimeout for a partition revoked in a
	// rebalance: how long it waits, handing out nothing more, for the
	// handlers of its messages in flight to ack or nack, before it
	// cancels their contexts and lets the partition go; nothing more of
	// it is marked once its session has ended, so the messages not
	// committed are delivered again to its next owner. The whole group
	// waits for the revoked partitions, so it is short. Applies when
	// MaxInFlightPerPartition is above 1. Defaults to
	// [DefaultRevokeTimeout] or half the rebalance timeout, whichever is
	// shorter; when set, it must be shorter than the rebalance timeout.
	RevokeTimeout time.Duration

	// HandOutMarks, when set, keeps a durable mark per partition of the
	// offsets the subscriber hands out (delivery.HandOutMarks; the inbox
	// stores dedup/postgres, dedup/sqlstore and dedup/sqlite implement it,
	// on a table beside the inbox's): before it hands out an offset above
	// the mark it raises the mark to the highest offset received, one
	// durable write for a batch of offsets, and when it is given a
	// partition it reads the mark. An offset at or below the mark it read
	// may have been handed out before, to a process that died in it: its
	// message goes out marked delivery.Redelivered, and the inbox counts
	// its attempts one by one. Any other goes out with delivery.Attempts
	// 1, a first delivery, which the inbox runs in one transaction with
	// no attempt record before it, as on brokers that count deliveries:
	// a message that kills its process is still stopped at the poison
	// middleware's MaxAttempts. A nacked message handed out again is
	// marked delivery.Redelivered. When a mark cannot be read or written,
	// the messages it would cover go out unmarked, and the inbox records
	// each attempt, as without it. Applies when MaxInFlightPerPartition
	// is above 1 and ConsumerGroup is set. Defaults to nil: every
	// delivery goes out unmarked.
	HandOutMarks delivery.HandOutMarks

	// Sarama, when set, adjusts the Sarama config after this package's
	// defaults (Version 2.3.0.0, ClientID "oncemill", the timeouts above,
	// Sarama's own defaults otherwise), for TLS, SASL, Version, ClientID
	// or other timeouts. Version must be at least 0.11.0.0, for record
	// headers; against the embedded broker it must stay below 2.4.0.0
	// (see package embedded). When ReadTimeout is zero and the hook leaves
	// Net.ReadTimeout alone, the default read timeout follows the hook's
	// Consumer.Group.Rebalance.Timeout. The settings that carry the
	// guarantees are applied after it: Consumer.Offsets.Initial and
	// AutoCommit come from the fields above, and Consumer.Return.Errors is
	// true.
	Sarama func(*sarama.Config)
}

// Validate reports the first invalid field of c, in an error that wraps
// [ErrInvalidConfig]. It checks the fields, not the Sarama config that the
// Sarama hook produces; [SubscriberConfig.WatermillConfig] checks that.
func (c SubscriberConfig) Validate() error {
	c = c.withDefaults()
	if err := validateBrokers("SubscriberConfig", c.Brokers); err != nil {
		return err
	}
	switch {
	case c.InitialOffset != Oldest && c.InitialOffset != Newest:
		return fmt.Errorf("%w: SubscriberConfig.InitialOffset is %s, want Oldest or Newest", ErrInvalidConfig, c.InitialOffset)
	case c.CommitInterval < 0:
		return fmt.Errorf("%w: SubscriberConfig.CommitInterval is %s, want >= 0", ErrInvalidConfig, c.CommitInterval)
	case c.NackResendSleep < 0 && c.NackResendSleep != NoSleep:
		return fmt.Errorf("%w: SubscriberConfig.NackResendSleep is %s, want >= 0 or NoSleep", ErrInvalidConfig, c.NackResendSleep)
	case c.ReconnectRetrySleep < 0 && c.ReconnectRetrySleep != NoSleep:
		return fmt.Errorf("%w: SubscriberConfig.ReconnectRetrySleep is %s, want >= 0 or NoSleep", ErrInvalidConfig, c.ReconnectRetrySleep)
	case c.MaxInFlight < 0:
		return fmt.Errorf("%w: SubscriberConfig.MaxInFlight is %d, want >= 0 (0: no limit across partitions)", ErrInvalidConfig, c.MaxInFlight)
	case c.MaxInFlightPerPartition < 0:
		return fmt.Errorf("%w: SubscriberConfig.MaxInFlightPerPartition is %d, want >= 1, or 0 for the default (%d)", ErrInvalidConfig, c.MaxInFlightPerPartition, DefaultMaxInFlightPerPartition)
	case c.TopicPartitions < 0:
		return fmt.Errorf("%w: SubscriberConfig.TopicPartitions is %d, want >= 0", ErrInvalidConfig, c.TopicPartitions)
	case c.TopicReplicationFactor < 0:
		return fmt.Errorf("%w: SubscriberConfig.TopicReplicationFactor is %d, want >= 0", ErrInvalidConfig, c.TopicReplicationFactor)
	}
	if c.InstanceID != "" {
		if problem := instanceIDProblem(c.InstanceID); problem != "" {
			return fmt.Errorf("%w: SubscriberConfig.InstanceID %s", ErrInvalidConfig, problem)
		}
		if c.ConsumerGroup == "" {
			return fmt.Errorf("%w: SubscriberConfig.InstanceID is set without a ConsumerGroup: static membership is membership of a group", ErrInvalidConfig)
		}
	}
	if err := validateTimeouts("SubscriberConfig", []timeout{
		{"DialTimeout", c.DialTimeout},
		{"ReadTimeout", c.ReadTimeout},
		{"SessionTimeout", c.SessionTimeout},
		{"RebalanceTimeout", c.RebalanceTimeout},
		{"DrainTimeout", c.DrainTimeout},
		{"RevokeTimeout", c.RevokeTimeout},
	}); err != nil {
		return err
	}
	if rebalance := c.withDefaults().RebalanceTimeout; c.ConsumerGroup != "" && c.ReadTimeout != 0 && c.ReadTimeout <= rebalance {
		return fmt.Errorf("%w: SubscriberConfig.ReadTimeout is %s, want longer than RebalanceTimeout (%s): the broker holds a JoinGroup request for up to the rebalance timeout",
			ErrInvalidConfig, c.ReadTimeout, rebalance)
	}
	if rebalance := c.withDefaults().RebalanceTimeout; c.RevokeTimeout != 0 && c.RevokeTimeout >= rebalance {
		return fmt.Errorf("%w: SubscriberConfig.RevokeTimeout is %s, want shorter than RebalanceTimeout (%s): a member still draining when the rebalance times out is dropped from the group, and its commits are refused",
			ErrInvalidConfig, c.RevokeTimeout, rebalance)
	}
	return nil
}

// MaxInstanceIDLength is the longest [SubscriberConfig.InstanceID] Kafka
// accepts.
const MaxInstanceIDLength = 249

// ValidateInstanceID reports, in an error that wraps [ErrInvalidConfig],
// why id is not a valid [SubscriberConfig.InstanceID] (Kafka's rules for
// group.instance.id): it must have 1 to [MaxInstanceIDLength] characters
// of a-z, A-Z, 0-9, '.', '_' and '-', and be neither "." nor "..". It
// returns nil for a valid id.
func ValidateInstanceID(id string) error {
	if problem := instanceIDProblem(id); problem != "" {
		return fmt.Errorf("%w: instance id %s", ErrInvalidConfig, problem)
	}
	return nil
}

// instanceIDProblem says what is wrong with the instance id id, after the
// id itself, or returns "" if nothing is.
func instanceIDProblem(id string) string {
	switch {
	case id == "":
		return `is empty, want 1 to 249 characters of a-z, A-Z, 0-9, '.', '_' and '-'`
	case id == "." || id == "..":
		return fmt.Sprintf(`is %q, which Kafka reserves`, id)
	case len(id) > MaxInstanceIDLength:
		return fmt.Sprintf("has %d characters, want at most %d", len(id), MaxInstanceIDLength)
	}
	for i := 0; i < len(id); i++ {
		switch b := id[i]; {
		case 'a' <= b && b <= 'z', 'A' <= b && b <= 'Z', '0' <= b && b <= '9', b == '.', b == '_', b == '-':
		default:
			return fmt.Sprintf("%q has %q at byte %d, want only a-z, A-Z, 0-9, '.', '_' and '-'", id, id[i:i+1], i)
		}
	}
	return ""
}

// timeout is a timeout field of a config, for validateTimeouts.
type timeout struct {
	field string
	value time.Duration
}

// validateTimeouts reports the first negative timeout of config.
func validateTimeouts(config string, timeouts []timeout) error {
	for _, t := range timeouts {
		if t.value < 0 {
			return fmt.Errorf("%w: %s.%s is %s, want > 0, or 0 for the default", ErrInvalidConfig, config, t.field, t.value)
		}
	}
	return nil
}

// readTimeoutFor returns the default read timeout of a subscriber whose
// rebalance timeout is rebalance.
func readTimeoutFor(rebalance time.Duration) time.Duration {
	return max(DefaultReadTimeout, rebalance+JoinGroupMargin)
}

// withDefaults returns a copy of c with defaults applied; c is unchanged.
func (c SubscriberConfig) withDefaults() SubscriberConfig {
	c.Brokers = slices.Clone(c.Brokers)
	if c.CommitInterval == 0 {
		c.CommitInterval = time.Second
	}
	if c.NackResendSleep == 0 {
		c.NackResendSleep = 500 * time.Millisecond
	}
	if c.ReconnectRetrySleep == 0 {
		c.ReconnectRetrySleep = time.Second
	}
	if c.MaxInFlightPerPartition == 0 {
		c.MaxInFlightPerPartition = DefaultMaxInFlightPerPartition
	}
	if c.TopicPartitions == 0 {
		c.TopicPartitions = 1
	}
	if c.TopicReplicationFactor == 0 {
		c.TopicReplicationFactor = 1
	}
	if c.DialTimeout == 0 {
		c.DialTimeout = DefaultDialTimeout
	}
	if c.SessionTimeout == 0 {
		c.SessionTimeout = DefaultSessionTimeout
	}
	if c.RebalanceTimeout == 0 {
		c.RebalanceTimeout = DefaultRebalanceTimeout
	}
	if c.DrainTimeout == 0 {
		c.DrainTimeout = DefaultDrainTimeout
	}
	if c.RevokeTimeout == 0 {
		c.RevokeTimeout = min(DefaultRevokeTimeout, c.RebalanceTimeout/2)
	}
	if c.ReadTimeout == 0 {
		c.ReadTimeout = readTimeoutFor(c.RebalanceTimeout)
	}
	return c
}

// WatermillConfig validates c and returns the watermill-kafka subscriber
// config that [NewSubscriber] uses, with a fresh Sarama config and the
// [Marshaler] as unmarshaler. c is not modified.
//
// The Sarama config commits only what the handler acked: watermill-kafka
// marks a record's offset when its message is acked, never before, and
// Sarama commits only marked offsets, every CommitInterval with
// Consumer.Offsets.AutoCommit (which, unlike the Java client's
// enable.auto.commit, does not commit what was merely fetched), or after
// each mark with SyncCommit, where AutoCommit is off and watermill-kafka
// calls Commit itself.
func (c SubscriberConfig) WatermillConfig() (wkafka.SubscriberConfig, error) {
	if err := c.Validate(); err != nil {
		return wkafka.SubscriberConfig{}, err
	}
	readDefault := c.ReadTimeout == 0
	c = c.withDefaults()

	sc := sarama.NewConfig()
	// 2.3, not later: from 2.4 on Sarama fetches committed offsets with
	// OffsetFetch v6+, the first flexible version, and reads each
	// partition's metadata as a non-nullable compact string. kfake (the
	// embedded broker) answers null for a partition the group never
	// committed, where Kafka answers "", and Sarama then fails the whole
	// join with "error decoding packet: invalid byteslice length". 2.3
	// uses OffsetFetch v5, whose decoder accepts null; nothing the
	// subscriber uses needs a later version.
	sc.Version = sarama.V2_3_0_0
	sc.ClientID = "oncemill"
	sc.Net.DialTimeout = c.DialTimeout
	sc.Net.ReadTimeout = c.ReadTimeout
	sc.Consumer.Group.Session.Timeout = c.SessionTimeout
	sc.Consumer.Group.Heartbeat.Interval = min(maxHeartbeatInterval, c.SessionTimeout/3)
	sc.Consumer.Group.Rebalance.Timeout = c.RebalanceTimeout
	sc.Consumer.Group.InstanceId = c.InstanceID
	if c.Sarama != nil {
		c.Sarama(sc)
		if readDefault && sc.Net.ReadTimeout == c.ReadTimeout {
			sc.Net.ReadTimeout = readTimeoutFor(sc.Consumer.Group.Rebalance.Timeout)
		}
	}
	sc.Consumer.Return.Errors = true
	sc.Consumer.Offsets.Initial = c.InitialOffset.sarama()
	sc.Consumer.Offsets.AutoCommit.Enable = !c.SyncCommit
	sc.Consumer.Offsets.AutoCommit.Interval = c.CommitInterval
	if sc.Consumer.Group.InstanceId != "" && !sc.Version.IsAtLeast(sarama.V2_3_0_0) {
		// Sarama refuses it too, without naming the field.
		return wkafka.SubscriberConfig{}, fmt.Errorf("%w: SubscriberConfig.InstanceID needs Version 2.3.0.0 or later (JoinGroup v5), but SubscriberConfig.Sarama set Version %s",
			ErrInvalidConfig, sc.Version)
	}
	if err := checkSarama("SubscriberConfig", "record headers", sc); err != nil {
		return wkafka.SubscriberConfig{}, err
	}
	if c.ConsumerGroup != "" && sc.Net.ReadTimeout <= sc.Consumer.Group.Rebalance.Timeout {
		return wkafka.SubscriberConfig{}, fmt.Errorf("%w: SubscriberConfig.Sarama left Net.ReadTimeout %s, want longer than Consumer.Group.Rebalance.Timeout (%s): the broker holds a JoinGroup request for up to the rebalance timeout",
			ErrInvalidConfig, sc.Net.ReadTimeout, sc.Consumer.Group.Rebalance.Timeout)
	}

	return wkafka.SubscriberConfig{
		Brokers:               c.Brokers,
		Unmarshaler:           Marshaler{},
		OverwriteSaramaConfig: sc,
		ConsumerGroup:         c.ConsumerGroup,
		NackResendSleep:       c.NackResendSleep,
		ReconnectRetrySleep:   c.ReconnectRetrySleep,
		InitializeTopicDetails: &sarama.TopicDetail{
			NumPartitions:     c.TopicPartitions,
			ReplicationFactor: c.TopicReplicationFactor,
		},
	}, nil
}

// PublisherConfig configures [NewPublisher]. The zero value of every field
// but Brokers is valid and means the documented default.
type PublisherConfig struct {
	// Brokers are the seed brokers, as host:port. Required.
	Brokers []string

	// MaxRetries is how many times the producer retries a failed send
	// before Publish fails. Defaults to 10. The producer is idempotent, so
	// a retry never writes a record twice.
	MaxRetries int

	// DialTimeout bounds each connection to a broker, TCP connect and TLS
	// handshake (Sarama's Net.DialTimeout). Defaults to
	// [DefaultDialTimeout].
	DialTimeout time.Duration

	// ReadTimeout is how long the producer waits for a broker's response
	// (Sarama's Net.ReadTimeout). Defaults to [DefaultReadTimeout].
	ReadTimeout time.Duration

	// Sarama, when set, adjusts the Sarama config after this package's
	// defaults (Version 2.3.0.0, ClientID "oncemill", the timeouts above,
	// the [NewKeyPartitioner] partitioner, Sarama's own defaults
	// otherwise), for TLS, SASL, Version, ClientID, other timeouts or the
	// partitioner.
	// Version must be at least 0.11.0.0, for record headers and the
	// idempotent producer. The settings that carry the guarantees are
	// applied after it: Producer.Idempotent, RequiredAcks = WaitForAll,
	// Net.MaxOpenRequests = 1, Producer.Retry.Max = MaxRetries, and
	// Return.Successes and Return.Errors, which Publish needs.
	Sarama func(*sarama.Config)
}

// Validate reports the first invalid field of c, in an error that wraps
// [ErrInvalidConfig]. It checks the fields, not the Sarama config that the
// Sarama hook produces; [PublisherConfig.WatermillConfig] checks that.
func (c PublisherConfig) Validate() error {
	c = c.withDefaults()
	if err := validateBrokers("PublisherConfig", c.Brokers); err != nil {
		return err
	}
	if c.MaxRetries < 0 {
		return fmt.Errorf("%w: PublisherConfig.MaxRetries is %d, want >= 0", ErrInvalidConfig, c.MaxRetries)
	}
	return validateTimeouts("PublisherConfig", []timeout{
		{"DialTimeout", c.DialTimeout},
		{"ReadTimeout", c.ReadTimeout},
	})
}

// withDefaults returns a copy of c with defaults applied; c is unchanged.
func (c PublisherConfig) withDefaults() PublisherConfig {
	c.Brokers = slices.Clone(c.Brokers)
	if c.MaxRetries == 0 {
		c.MaxRetries = 10
	}
	if c.DialTimeout == 0 {
		c.DialTimeout = DefaultDialTimeout
	}
	if c.ReadTimeout == 0 {
		c.ReadTimeout = DefaultReadTimeout
	}
	return c
}

// WatermillConfig validates c and returns the watermill-kafka publisher
// config that [NewPublisher] uses: a fresh Sarama config for the
// idempotent producer, the [NewKeyPartitioner] partitioner, and the
// [Marshaler]. c is not modified.
func (c PublisherConfig) WatermillConfig() (wkafka.PublisherConfig, error) {
	if err := c.Validate(); err != nil {
		return wkafka.PublisherConfig{}, err
	}
	c = c.withDefaults()

	sc := sarama.NewConfig()
	// The subscriber's version, for one minimum broker version; the
	// idempotent producer needs 0.11.
	sc.Version = sarama.V2_3_0_0
	sc.ClientID = "oncemill"
	sc.Net.DialTimeout = c.DialTimeout
	sc.Net.ReadTimeout = c.ReadTimeout
	sc.Producer.Partitioner = NewKeyPartitioner
	if c.Sarama != nil {
		c.Sarama(sc)
	}
	sc.Producer.Idempotent = true
	sc.Producer.RequiredAcks = sarama.WaitForAll
	sc.Net.MaxOpenRequests = 1
	sc.Producer.Retry.Max = c.MaxRetries
	sc.Producer.Return.Successes = true
	sc.Producer.Return.Errors = true
	if err := checkSarama("PublisherConfig", "record headers and the idempotent producer", sc); err != nil {
		return wkafka.PublisherConfig{}, err
	}

	return wkafka.PublisherConfig{
		Brokers:               c.Brokers,
		Marshaler:             Marshaler{},
		OverwriteSaramaConfig: sc,
	}, nil
}

func validateBrokers(config string, brokers []string) error {
	if len(brokers) == 0 {
		return fmt.Errorf("%w: %s.Brokers is empty", ErrInvalidConfig, config)
	}
	for i, b := range brokers {
		if _, _, err := net.SplitHostPort(b); err != nil {
			return fmt.Errorf("%w: %s.Brokers[%d] %q is not host:port", ErrInvalidConfig, config, i, b)
		}
	}
	return nil
}

// checkSarama validates the Sarama config that the hook left; needs says
// what needs Version 0.11.
func checkSarama(config, needs string, sc *sarama.Config) error {
	if !sc.Version.IsAtLeast(sarama.V0_11_0_0) {
		return fmt.Errorf("%w: %s.Sarama set Version %s; %s need at least 0.11.0.0", ErrInvalidConfig, config, sc.Version, needs)
	}
	if err := sc.Validate(); err != nil {
		return fmt.Errorf("%w: %s.Sarama: %w", ErrInvalidConfig, config, err)
	}
	return nil
}
