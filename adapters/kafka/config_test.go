package kafka_test

import (
	"strings"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/adapters/kafka"
)

func TestSubscriberConfigValidate(t *testing.T) {
	ok := kafka.SubscriberConfig{Brokers: []string{"localhost:9092"}}
	require.NoError(t, ok.Validate())

	for field, tc := range map[string]func(*kafka.SubscriberConfig){
		"SubscriberConfig.Brokers is empty":             func(c *kafka.SubscriberConfig) { c.Brokers = nil },
		"SubscriberConfig.Brokers[1]":                   func(c *kafka.SubscriberConfig) { c.Brokers = []string{"a:1", "no-port"} },
		"SubscriberConfig.InitialOffset":                func(c *kafka.SubscriberConfig) { c.InitialOffset = 7 },
		"SubscriberConfig.CommitInterval":               func(c *kafka.SubscriberConfig) { c.CommitInterval = -time.Second },
		"SubscriberConfig.NackResendSleep":              func(c *kafka.SubscriberConfig) { c.NackResendSleep = -2 },
		"SubscriberConfig.ReconnectRetrySleep":          func(c *kafka.SubscriberConfig) { c.ReconnectRetrySleep = -2 },
		"SubscriberConfig.TopicPartitions":              func(c *kafka.SubscriberConfig) { c.TopicPartitions = -1 },
		"SubscriberConfig.TopicReplicationFactor":       func(c *kafka.SubscriberConfig) { c.TopicReplicationFactor = -1 },
		"SubscriberConfig.DialTimeout":                  func(c *kafka.SubscriberConfig) { c.DialTimeout = -time.Second },
		"SubscriberConfig.ReadTimeout is -1s":           func(c *kafka.SubscriberConfig) { c.ReadTimeout = -time.Second },
		"SubscriberConfig.SessionTimeout":               func(c *kafka.SubscriberConfig) { c.SessionTimeout = -time.Second },
		"SubscriberConfig.RebalanceTimeout":             func(c *kafka.SubscriberConfig) { c.RebalanceTimeout = -time.Second },
		"SubscriberConfig.DrainTimeout":                 func(c *kafka.SubscriberConfig) { c.DrainTimeout = -time.Second },
		"SubscriberConfig.RevokeTimeout":                func(c *kafka.SubscriberConfig) { c.RevokeTimeout = -time.Second },
		"SubscriberConfig.MaxInFlight is -1, want >= 0": func(c *kafka.SubscriberConfig) { c.MaxInFlight = -1 },
		"SubscriberConfig.MaxInFlightPerPartition is -1, want >= 1, or 0 for the default (64)": func(c *kafka.SubscriberConfig) {
			c.MaxInFlightPerPartition = -1
		},
		"SubscriberConfig.ReadTimeout is 30s, want longer than RebalanceTimeout (1m0s)": func(c *kafka.SubscriberConfig) {
			c.ConsumerGroup, c.ReadTimeout = "g", 30*time.Second
		},
		"SubscriberConfig.ReadTimeout is 20s, want longer than RebalanceTimeout (20s)": func(c *kafka.SubscriberConfig) {
			c.ConsumerGroup, c.ReadTimeout, c.RebalanceTimeout = "g", 20*time.Second, 20*time.Second
		},
		"SubscriberConfig.RevokeTimeout is 1m0s, want shorter than RebalanceTimeout (1m0s)": func(c *kafka.SubscriberConfig) {
			c.ConsumerGroup, c.RevokeTimeout = "g", time.Minute
		},
		"SubscriberConfig.RevokeTimeout is 30s, want shorter than RebalanceTimeout (20s)": func(c *kafka.SubscriberConfig) {
			c.ConsumerGroup, c.RevokeTimeout, c.RebalanceTimeout, c.ReadTimeout = "g", 30*time.Second, 20*time.Second, 25*time.Second
		},
		`SubscriberConfig.InstanceID "pod 1" has " " at byte 3`: func(c *kafka.SubscriberConfig) {
			c.ConsumerGroup, c.InstanceID = "g", "pod 1"
		},
		`SubscriberConfig.InstanceID is "..", which Kafka reserves`: func(c *kafka.SubscriberConfig) {
			c.ConsumerGroup, c.InstanceID = "g", ".."
		},
		"SubscriberConfig.InstanceID has 250 characters, want at most 249": func(c *kafka.SubscriberConfig) {
			c.ConsumerGroup, c.InstanceID = "g", strings.Repeat("x", 250)
		},
		"SubscriberConfig.InstanceID is set without a ConsumerGroup": func(c *kafka.SubscriberConfig) {
			c.InstanceID = "pod-1"
		},
	} {
		t.Run(field, func(t *testing.T) {
			c := ok
			tc(&c)
			err := c.Validate()
			require.ErrorIs(t, err, kafka.ErrInvalidConfig)
			require.ErrorContains(t, err, field)
			_, err = c.WatermillConfig()
			require.ErrorIs(t, err, kafka.ErrInvalidConfig)
			_, err = kafka.NewSubscriber(c, nil)
			require.ErrorContains(t, err, field)
		})
	}

	t.Run("NoSleep", func(t *testing.T) {
		c := ok
		c.NackResendSleep, c.ReconnectRetrySleep = kafka.NoSleep, kafka.NoSleep
		require.NoError(t, c.Validate())
	})
	t.Run("Sarama hook", func(t *testing.T) {
		c := ok
		c.Sarama = func(sc *sarama.Config) { sc.Version = sarama.V0_10_2_0 }
		_, err := c.WatermillConfig()
		require.ErrorIs(t, err, kafka.ErrInvalidConfig)
		require.ErrorContains(t, err, "SubscriberConfig.Sarama")

		c.Sarama = func(sc *sarama.Config) { sc.Consumer.Group.Session.Timeout = 0 }
		_, err = c.WatermillConfig()
		require.ErrorIs(t, err, kafka.ErrInvalidConfig)
		require.ErrorContains(t, err, "SubscriberConfig.Sarama: kafka: invalid configuration (Consumer.Group.Session.Timeout")
	})
}

func TestSubscriberConfigDefaults(t *testing.T) {
	brokers := []string{"localhost:9092"}
	c := kafka.SubscriberConfig{Brokers: brokers, ConsumerGroup: "g"}
	orig := c
	w, err := c.WatermillConfig()
	require.NoError(t, err)
	require.Equal(t, orig, c, "the caller's config is not modified")

	sc := w.OverwriteSaramaConfig
	require.Equal(t, sarama.OffsetOldest, sc.Consumer.Offsets.Initial)
	require.True(t, sc.Consumer.Offsets.AutoCommit.Enable, "Sarama's auto-commit commits only marked, that is acked, offsets")
	require.Equal(t, time.Second, sc.Consumer.Offsets.AutoCommit.Interval)
	require.True(t, sc.Consumer.Return.Errors)
	require.Equal(t, sarama.V2_3_0_0, sc.Version)
	require.Equal(t, "oncemill", sc.ClientID)
	require.Equal(t, 500*time.Millisecond, w.NackResendSleep)
	require.Equal(t, time.Second, w.ReconnectRetrySleep)
	require.Equal(t, "g", w.ConsumerGroup)
	require.Equal(t, kafka.Marshaler{}, w.Unmarshaler)
	require.Equal(t, &sarama.TopicDetail{NumPartitions: 1, ReplicationFactor: 1}, w.InitializeTopicDetails)

	w.Brokers[0] = "changed:1"
	require.Equal(t, "localhost:9092", brokers[0], "the brokers slice is copied")

	// The hook cannot undo the guarantees.
	c.InitialOffset = kafka.Newest
	c.SyncCommit = true
	c.Sarama = func(sc *sarama.Config) {
		sc.Consumer.Offsets.Initial = sarama.OffsetOldest
		sc.Consumer.Offsets.AutoCommit.Enable = true
		sc.Consumer.Return.Errors = false
		sc.ClientID = "mine"
	}
	w, err = c.WatermillConfig()
	require.NoError(t, err)
	sc = w.OverwriteSaramaConfig
	require.Equal(t, sarama.OffsetNewest, sc.Consumer.Offsets.Initial)
	require.False(t, sc.Consumer.Offsets.AutoCommit.Enable, "SyncCommit: watermill-kafka commits after each ack")
	require.True(t, sc.Consumer.Return.Errors)
	require.Equal(t, "mine", sc.ClientID)
}

func TestPublisherConfigValidate(t *testing.T) {
	ok := kafka.PublisherConfig{Brokers: []string{"localhost:9092"}}
	require.NoError(t, ok.Validate())

	for field, tc := range map[string]func(*kafka.PublisherConfig){
		"PublisherConfig.Brokers is empty": func(c *kafka.PublisherConfig) { c.Brokers = []string{} },
		"PublisherConfig.Brokers[0]":       func(c *kafka.PublisherConfig) { c.Brokers = []string{""} },
		"PublisherConfig.MaxRetries":       func(c *kafka.PublisherConfig) { c.MaxRetries = -1 },
		"PublisherConfig.DialTimeout":      func(c *kafka.PublisherConfig) { c.DialTimeout = -1 },
		"PublisherConfig.ReadTimeout":      func(c *kafka.PublisherConfig) { c.ReadTimeout = -1 },
		"PublisherConfig.Sarama":           func(c *kafka.PublisherConfig) { c.Sarama = func(sc *sarama.Config) { sc.Version = sarama.V0_10_0_0 } },
	} {
		t.Run(field, func(t *testing.T) {
			c := ok
			tc(&c)
			_, err := c.WatermillConfig()
			require.ErrorIs(t, err, kafka.ErrInvalidConfig)
			require.ErrorContains(t, err, field)
			_, err = kafka.NewPublisher(c, nil)
			require.ErrorContains(t, err, field)
		})
	}
}

func TestPublisherConfigDefaults(t *testing.T) {
	c := kafka.PublisherConfig{
		Brokers: []string{"localhost:9092"},
		// The hook cannot undo the guarantees.
		Sarama: func(sc *sarama.Config) {
			sc.Producer.Idempotent = false
			sc.Producer.RequiredAcks = sarama.WaitForLocal
			sc.Net.MaxOpenRequests = 5
			sc.Producer.Retry.Max = 0
			sc.Producer.Return.Successes = false
		},
	}
	orig := c
	w, err := c.WatermillConfig()
	require.NoError(t, err)
	require.Equal(t, orig.Brokers, c.Brokers)
	require.Equal(t, 0, c.MaxRetries, "the caller's config is not modified")

	sc := w.OverwriteSaramaConfig
	require.True(t, sc.Producer.Idempotent)
	require.Equal(t, sarama.WaitForAll, sc.Producer.RequiredAcks)
	require.Equal(t, 1, sc.Net.MaxOpenRequests)
	require.Equal(t, 10, sc.Producer.Retry.Max)
	require.True(t, sc.Producer.Return.Successes)
	require.True(t, sc.Producer.Return.Errors)
	require.Equal(t, sarama.V2_3_0_0, sc.Version)
	require.Equal(t, kafka.Marshaler{}, w.Marshaler)
	key := &sarama.ProducerMessage{Key: sarama.StringEncoder("order-42")}
	got, err := sc.Producer.Partitioner("t").Partition(key, 1000)
	require.NoError(t, err)
	want, err := kafka.NewKeyPartitioner("t").Partition(key, 1000)
	require.NoError(t, err)
	require.Equal(t, want, got, "the key partitioner")
}

// TestSubscriberConfigTimeouts checks the Sarama timeouts the fields and
// their defaults give: the read timeout outlasts the rebalance timeout, as
// a JoinGroup request may wait that long for its response.
func TestSubscriberConfigTimeouts(t *testing.T) {
	brokers := []string{"localhost:9092"}
	sarama0 := sarama.NewConfig()
	require.LessOrEqual(t, sarama0.Net.ReadTimeout, sarama0.Consumer.Group.Rebalance.Timeout,
		"Sarama's own defaults would time out a JoinGroup the broker holds open; this package's must not")

	w, err := kafka.SubscriberConfig{Brokers: brokers, ConsumerGroup: "g"}.WatermillConfig()
	require.NoError(t, err)
	sc := w.OverwriteSaramaConfig
	require.Equal(t, kafka.DefaultDialTimeout, sc.Net.DialTimeout)
	require.Equal(t, kafka.DefaultSessionTimeout, sc.Consumer.Group.Session.Timeout)
	require.Equal(t, 6*time.Second, sc.Consumer.Group.Session.Timeout, "the least brokers accept by default (group.min.session.timeout.ms)")
	require.Equal(t, 2*time.Second, sc.Consumer.Group.Heartbeat.Interval, "a third of the session timeout")
	require.Equal(t, kafka.DefaultRebalanceTimeout, sc.Consumer.Group.Rebalance.Timeout)
	require.Equal(t, kafka.DefaultRebalanceTimeout+kafka.JoinGroupMargin, sc.Net.ReadTimeout)
	require.Greater(t, sc.Net.ReadTimeout, sc.Consumer.Group.Rebalance.Timeout)

	c := kafka.SubscriberConfig{
		Brokers:          brokers,
		ConsumerGroup:    "g",
		DialTimeout:      2 * time.Second,
		ReadTimeout:      45 * time.Second,
		SessionTimeout:   7500 * time.Millisecond,
		RebalanceTimeout: 40 * time.Second,
	}
	orig := c
	w, err = c.WatermillConfig()
	require.NoError(t, err)
	require.Equal(t, orig, c, "the caller's config is not modified")
	sc = w.OverwriteSaramaConfig
	require.Equal(t, 2*time.Second, sc.Net.DialTimeout)
	require.Equal(t, 45*time.Second, sc.Net.ReadTimeout)
	require.Equal(t, 7500*time.Millisecond, sc.Consumer.Group.Session.Timeout)
	require.Equal(t, 2500*time.Millisecond, sc.Consumer.Group.Heartbeat.Interval, "a third of the session timeout")
	require.Equal(t, 40*time.Second, sc.Consumer.Group.Rebalance.Timeout)

	// A short rebalance timeout keeps the read timeout at its floor.
	w, err = kafka.SubscriberConfig{Brokers: brokers, ConsumerGroup: "g", RebalanceTimeout: 3 * time.Second}.WatermillConfig()
	require.NoError(t, err)
	require.Equal(t, kafka.DefaultReadTimeout, w.OverwriteSaramaConfig.Net.ReadTimeout)

	// Without a group there is no JoinGroup: any read timeout will do.
	_, err = kafka.SubscriberConfig{Brokers: brokers, ReadTimeout: time.Second}.WatermillConfig()
	require.NoError(t, err)

	// The default read timeout follows a rebalance timeout the hook sets.
	w, err = kafka.SubscriberConfig{Brokers: brokers, ConsumerGroup: "g", Sarama: func(sc *sarama.Config) {
		sc.Consumer.Group.Rebalance.Timeout = 5 * time.Minute
	}}.WatermillConfig()
	require.NoError(t, err)
	require.Equal(t, 5*time.Minute+kafka.JoinGroupMargin, w.OverwriteSaramaConfig.Net.ReadTimeout)

	// A hook that sets both, the wrong way round, is refused.
	_, err = kafka.SubscriberConfig{Brokers: brokers, ConsumerGroup: "g", Sarama: func(sc *sarama.Config) {
		sc.Net.ReadTimeout = 30 * time.Second
		sc.Consumer.Group.Rebalance.Timeout = time.Minute
	}}.WatermillConfig()
	require.ErrorIs(t, err, kafka.ErrInvalidConfig)
	require.ErrorContains(t, err, "SubscriberConfig.Sarama left Net.ReadTimeout 30s, want longer than Consumer.Group.Rebalance.Timeout (1m0s)")
}

func TestPublisherConfigTimeouts(t *testing.T) {
	brokers := []string{"localhost:9092"}
	w, err := kafka.PublisherConfig{Brokers: brokers}.WatermillConfig()
	require.NoError(t, err)
	require.Equal(t, kafka.DefaultDialTimeout, w.OverwriteSaramaConfig.Net.DialTimeout)
	require.Equal(t, kafka.DefaultReadTimeout, w.OverwriteSaramaConfig.Net.ReadTimeout)

	w, err = kafka.PublisherConfig{Brokers: brokers, DialTimeout: time.Second, ReadTimeout: 90 * time.Second}.WatermillConfig()
	require.NoError(t, err)
	require.Equal(t, time.Second, w.OverwriteSaramaConfig.Net.DialTimeout)
	require.Equal(t, 90*time.Second, w.OverwriteSaramaConfig.Net.ReadTimeout)
}

// TestSubscriberConfigInstanceID checks that InstanceID reaches Sarama's
// Consumer.Group.InstanceId, which both subscribers take from
// WatermillConfig's Sarama config, that it is empty (dynamic membership)
// by default, and that a Sarama hook cannot lower Version below what
// static membership needs without an error naming the field.
func TestSubscriberConfigInstanceID(t *testing.T) {
	brokers := []string{"localhost:9092"}
	w, err := kafka.SubscriberConfig{Brokers: brokers, ConsumerGroup: "g"}.WatermillConfig()
	require.NoError(t, err)
	require.Empty(t, w.OverwriteSaramaConfig.Consumer.Group.InstanceId, "dynamic membership by default")

	for _, inFlight := range []int{1, 0} { // watermill-kafka's subscriber, and the key-parallel one
		c := kafka.SubscriberConfig{Brokers: brokers, ConsumerGroup: "g", InstanceID: "ledger-0", MaxInFlightPerPartition: inFlight}
		w, err = c.WatermillConfig()
		require.NoError(t, err)
		require.Equal(t, "ledger-0", w.OverwriteSaramaConfig.Consumer.Group.InstanceId)
		require.True(t, w.OverwriteSaramaConfig.Version.IsAtLeast(sarama.V2_3_0_0), "JoinGroup v5 carries the instance id")
		sub, err := kafka.NewSubscriber(c, nil)
		require.NoError(t, err)
		require.NoError(t, sub.Close())
	}

	longest := strings.Repeat("a", kafka.MaxInstanceIDLength)
	w, err = kafka.SubscriberConfig{Brokers: brokers, ConsumerGroup: "g", InstanceID: longest}.WatermillConfig()
	require.NoError(t, err)
	require.Equal(t, longest, w.OverwriteSaramaConfig.Consumer.Group.InstanceId)

	_, err = kafka.SubscriberConfig{Brokers: brokers, ConsumerGroup: "g", InstanceID: "ledger-0", Sarama: func(sc *sarama.Config) {
		sc.Version = sarama.V2_1_0_0
	}}.WatermillConfig()
	require.ErrorIs(t, err, kafka.ErrInvalidConfig)
	require.ErrorContains(t, err, "SubscriberConfig.InstanceID needs Version 2.3.0.0 or later (JoinGroup v5), but SubscriberConfig.Sarama set Version 2.1.0")
}

// TestValidateInstanceID checks Kafka's rules for group.instance.id.
func TestValidateInstanceID(t *testing.T) {
	for _, id := range []string{"a", "ledger-0", "pod_7.eu-west-1", "A.B-c_9", strings.Repeat("z", 249), "..."} {
		require.NoError(t, kafka.ValidateInstanceID(id), id)
	}
	for id, want := range map[string]string{
		"":                       "instance id is empty",
		".":                      `instance id is ".", which Kafka reserves`,
		"..":                     `instance id is "..", which Kafka reserves`,
		strings.Repeat("z", 250): "instance id has 250 characters, want at most 249",
		"pod/1":                  `instance id "pod/1" has "/" at byte 3`,
		"pöd":                    `instance id "pöd" has "\xc3" at byte 1`,
		"a:b":                    `"a:b" has ":" at byte 1, want only a-z, A-Z, 0-9, '.', '_' and '-'`,
	} {
		err := kafka.ValidateInstanceID(id)
		require.ErrorIs(t, err, kafka.ErrInvalidConfig, id)
		require.ErrorContains(t, err, want, id)
	}
}

func TestBrokersFromEnv(t *testing.T) {
	t.Setenv(kafka.BrokersEnv, " a:1, b:2 ,,")
	require.Equal(t, []string{"a:1", "b:2"}, kafka.BrokersFromEnv())
	t.Setenv(kafka.BrokersEnv, "")
	require.Nil(t, kafka.BrokersFromEnv())
}
