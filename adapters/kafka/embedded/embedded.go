// Package embedded runs an in-process Kafka-compatible broker for
// development and tests, on franz-go's kfake.
//
// The broker speaks the Kafka protocol on loopback ports, so Sarama,
// watermill-kafka and franz-go connect to [Cluster.Addrs] exactly as they
// connect to a real cluster. It supports what oncemill's Kafka adapter
// needs: classic consumer groups (join, sync, heartbeat, leave), offset
// commits and fetches, the idempotent producer (InitProducerID and
// sequence checks), and topic creation, automatic or explicit.
//
// It is not a production broker: it keeps the log in memory unless
// [Config.DataDir] is set, and it has no replication.
//
// A client that goes away (a consumer process killed) is noticed as Kafka
// notices it: only once the broker has answered the requests it holds for
// it, such as a JoinGroup waiting for a rebalance. A consumer killed in a
// JoinGroup therefore leaves its group one session timeout after the
// rebalance completes, as in Kafka, however many consumers were killed
// before it; kfake alone would keep such a member, without a session,
// until a later rebalance timed out.
//
// Sarama consumer groups must speak a protocol version below 2.4.0.0, as
// package kafka's subscriber does by default: from 2.4 on Sarama fetches
// committed offsets with OffsetFetch v6+, and kfake answers a partition
// the group never committed with a null metadata string, where Kafka
// answers "", which Sarama's v6+ decoder rejects ("error decoding packet:
// invalid byteslice length"), failing every join of a new group. The
// same holds for Sarama's ClusterAdmin.ListConsumerGroupOffsets.
// franz-go clients are not affected.
package embedded

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
)

var (
	// ErrInvalidConfig is wrapped by every error of [Config.Validate].
	ErrInvalidConfig = errors.New("embedded: invalid config")
	// ErrTopicExists is returned by [Cluster.CreateTopic] for a topic that
	// exists already.
	ErrTopicExists = errors.New("embedded: topic already exists")
	// ErrClosed is returned by [Cluster.CreateTopic] after [Cluster.Close].
	ErrClosed = errors.New("embedded: cluster closed")
)

// Config configures [Start]. The zero value is a one-broker cluster on a
// random loopback port that creates topics on first use with one
// partition.
type Config struct {
	// Brokers is the number of brokers. Defaults to len(Ports), else 1.
	Brokers int
	// Ports are the loopback ports the brokers listen on, one per broker.
	// Empty picks free ports; Addrs reports them.
	Ports []int
	// DefaultPartitions is the partition count of topics created on first
	// use and by CreateTopic with partitions < 1. Defaults to 1, like
	// Kafka's num.partitions.
	DefaultPartitions int32
	// DisableAutoCreateTopics makes a produce or subscribe to a missing
	// topic fail with UNKNOWN_TOPIC_OR_PARTITION, as on a cluster with
	// auto.create.topics.enable=false; use CreateTopic first.
	DisableAutoCreateTopics bool
	// GroupMinSessionTimeout is the smallest consumer session timeout the
	// broker accepts (group.min.session.timeout.ms). Defaults to 6s, as
	// in Kafka; Sarama's default session timeout is 10s.
	GroupMinSessionTimeout time.Duration
	// DataDir, when set, persists topics, records and committed offsets
	// in this directory, and a later Start with the same directory loads
	// them.
	DataDir string
	// Logger receives the broker's errors (Error), warnings (Info) and
	// per-request logs (Trace). Defaults to watermill.NopLogger.
	Logger watermill.LoggerAdapter
}

// Validate reports the first invalid field of c. Zero values, which take
// defaults, are valid.
func (c Config) Validate() error {
	c = c.withDefaults()
	if c.Brokers < 0 {
		return fmt.Errorf("%w: Config.Brokers is %d, want >= 0", ErrInvalidConfig, c.Brokers)
	}
	if len(c.Ports) > 0 && c.Brokers > 0 && len(c.Ports) != c.Brokers {
		return fmt.Errorf("%w: Config.Ports has %d ports for Config.Brokers %d", ErrInvalidConfig, len(c.Ports), c.Brokers)
	}
	for i, p := range c.Ports {
		if p < 0 || p > 65535 {
			return fmt.Errorf("%w: Config.Ports[%d] is %d, want 0..65535", ErrInvalidConfig, i, p)
		}
	}
	if c.DefaultPartitions < 0 {
		return fmt.Errorf("%w: Config.DefaultPartitions is %d, want >= 0", ErrInvalidConfig, c.DefaultPartitions)
	}
	if c.GroupMinSessionTimeout < 0 {
		return fmt.Errorf("%w: Config.GroupMinSessionTimeout is %s, want >= 0", ErrInvalidConfig, c.GroupMinSessionTimeout)
	}
	return nil
}

func (c Config) withDefaults() Config {
	c.Ports = slices.Clone(c.Ports)
	if c.Brokers == 0 {
		c.Brokers = max(len(c.Ports), 1)
	}
	if c.DefaultPartitions == 0 {
		c.DefaultPartitions = 1
	}
	if c.GroupMinSessionTimeout == 0 {
		c.GroupMinSessionTimeout = 6 * time.Second
	}
	if c.Logger == nil {
		c.Logger = watermill.NopLogger{}
	}
	return c
}

// Cluster is a running embedded broker. Its methods are safe for
// concurrent use.
type Cluster struct {
	kc     *kfake.Cluster
	addrs  []string
	logger watermill.LoggerAdapter

	mu     sync.Mutex
	closed bool
}

// Start starts a cluster configured by cfg and returns once it accepts
// connections. It starts goroutines, the broker's loop and one listener
// per broker, which [Cluster.Close] stops.
func Start(cfg Config) (*Cluster, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg = cfg.withDefaults()

	opts := []kfake.Opt{
		kfake.NumBrokers(cfg.Brokers),
		kfake.DefaultNumPartitions(int(cfg.DefaultPartitions)),
		kfake.GroupMinSessionTimeout(cfg.GroupMinSessionTimeout),
		// A client's end reaches the broker once its held requests are
		// answered, as in Kafka; see heldConn.
		kfake.ListenFn(listen),
	}
	if _, nop := cfg.Logger.(watermill.NopLogger); !nop {
		// kfake formats a line per request; skip that for no logger.
		opts = append(opts, kfake.WithLogger(kfakeLogger{cfg.Logger}))
	}
	if len(cfg.Ports) > 0 {
		opts = append(opts, kfake.Ports(cfg.Ports...))
	}
	if !cfg.DisableAutoCreateTopics {
		opts = append(opts, kfake.AllowAutoTopicCreation())
	}
	if cfg.DataDir != "" {
		opts = append(opts, kfake.DataDir(cfg.DataDir))
	}
	kc, err := kfake.NewCluster(opts...)
	if err != nil {
		return nil, fmt.Errorf("embedded: start: %w", err)
	}
	c := &Cluster{kc: kc, addrs: kc.ListenAddrs(), logger: cfg.Logger}
	c.logger.Info("Embedded Kafka started", watermill.LogFields{"addrs": c.addrs})
	return c, nil
}

// Addrs returns the brokers' host:port addresses, to use as seed brokers.
func (c *Cluster) Addrs() []string {
	return slices.Clone(c.addrs)
}

// CreateTopic creates topic name with the given number of partitions, or
// with [Config.DefaultPartitions] if partitions < 1, and returns once the
// topic exists. It returns an error wrapping [ErrTopicExists] if the topic
// exists, and [ErrClosed] after Close. ctx is checked before the call;
// the creation itself, in memory, does not wait on the network.
func (c *Cluster) CreateTopic(ctx context.Context, name string, partitions int32) error {
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("embedded: create topic %q: %w", name, err)
	}
	// Held across the call: kfake's admin calls block forever once the
	// cluster is closed, so Close waits for us.
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return ErrClosed
	}
	if err := c.kc.CreateTopic(name, partitions, nil); err != nil {
		if errors.Is(err, kerr.TopicAlreadyExists) {
			return fmt.Errorf("%w: %q", ErrTopicExists, name)
		}
		return fmt.Errorf("embedded: create topic %q: %w", name, err)
	}
	c.logger.Debug("Embedded Kafka created topic", watermill.LogFields{"topic": name, "partitions": partitions})
	return nil
}

// Close stops the cluster: it closes the listeners and the broker's loop,
// and with [Config.DataDir] it saves the state first. Clients still
// connected see their connections fail. Close is idempotent and returns
// nil.
func (c *Cluster) Close() error {
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return nil
	}
	c.closed = true
	c.mu.Unlock()
	c.kc.Close()
	c.logger.Info("Embedded Kafka closed", watermill.LogFields{"addrs": c.addrs})
	return nil
}

// kfakeLogger forwards kfake's logs to a Watermill logger, each at the
// level below kfake's, since kfake logs every request at info.
type kfakeLogger struct{ l watermill.LoggerAdapter }

func (k kfakeLogger) Logf(level kfake.LogLevel, format string, args ...any) {
	switch level {
	case kfake.LogLevelError:
		k.l.Error("kfake error", errors.New(fmt.Sprintf(format, args...)), nil)
	case kfake.LogLevelWarn:
		k.l.Info("kfake: "+fmt.Sprintf(format, args...), nil)
	case kfake.LogLevelInfo:
		k.l.Trace("kfake: "+fmt.Sprintf(format, args...), nil)
	}
}
