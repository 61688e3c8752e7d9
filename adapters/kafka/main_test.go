package kafka_test

import (
	"os"
	"regexp"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/oncemill/oncemill/adapters/kafka"
	"github.com/oncemill/oncemill/adapters/kafka/embedded"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m,
		// Sarama's metrics start go-metrics's process-wide meter
		// goroutine, which never stops.
		goleak.IgnoreTopFunction("github.com/rcrowley/go-metrics.(*meterArbiter).tick"),
		// The universal tests' subscriber multiplier forwards messages
		// to a channel that the test stops reading once it has what it
		// wants, and never closes; a forwarder holding a surplus message
		// (a duplicate, or another subscriber's copy when there is no
		// group) blocks forever, and so does the goroutine waiting for
		// the forwarders. Both belong to the test suite, not to this
		// package.
		goleak.IgnoreAnyFunction("github.com/ThreeDotsLabs/watermill/internal/subscriber.(*multiplier).Subscribe.func2"),
		goleak.IgnoreAnyFunction("github.com/ThreeDotsLabs/watermill/internal/subscriber.(*multiplier).Subscribe.func3"),
	)
}

// Brokers returns the seed brokers for t: those of ONCEMILL_KAFKA_BROKERS
// if set, else those of an embedded cluster that t's cleanup closes.
// Every test names its topics and groups uniquely, so that tests share a
// real cluster safely.
func Brokers(t testing.TB) []string {
	t.Helper()
	if b := kafka.BrokersFromEnv(); len(b) > 0 {
		return b
	}
	c, err := embedded.Start(embedded.Config{Logger: testLogger()})
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, c.Close()) })
	return c.Addrs()
}

// testLogger logs only when ONCEMILL_TEST_LOG is set (to "trace" for
// everything).
func testLogger() watermill.LoggerAdapter {
	switch os.Getenv("ONCEMILL_TEST_LOG") {
	case "":
		return watermill.NopLogger{}
	case "trace":
		return watermill.NewStdLogger(true, true)
	default:
		return watermill.NewStdLogger(true, false)
	}
}

var unsafeName = regexp.MustCompile(`[^a-zA-Z0-9._-]+`)

// uniqueName returns a topic or group name unique to this run.
func uniqueName(prefix string) string {
	return prefix + "_" + watermill.NewShortUUID()
}

// fastGroups shortens Sarama's group timings so that rebalances in tests
// take a fraction of a second instead of seconds.
func fastGroups(sc *sarama.Config) {
	sc.Consumer.Group.Session.Timeout = 6 * time.Second
	sc.Consumer.Group.Heartbeat.Interval = 200 * time.Millisecond
	sc.Consumer.Group.Rebalance.Timeout = 3 * time.Second
	sc.Consumer.MaxWaitTime = 100 * time.Millisecond
}

// createTopic creates topic with the given number of partitions through
// Sarama's admin client, as on any cluster.
func createTopic(t testing.TB, brokers []string, topic string, partitions int32) {
	t.Helper()
	sc := sarama.NewConfig()
	sc.Version = sarama.V2_3_0_0
	admin, err := sarama.NewClusterAdmin(brokers, sc)
	require.NoError(t, err)
	defer func() { require.NoError(t, admin.Close()) }()
	require.NoError(t, admin.CreateTopic(topic, &sarama.TopicDetail{NumPartitions: partitions, ReplicationFactor: 1}, false))
}

func newSubscriber(t testing.TB, brokers []string, group string, tune ...func(*kafka.SubscriberConfig)) message.Subscriber {
	t.Helper()
	cfg := kafka.SubscriberConfig{
		Brokers:         brokers,
		ConsumerGroup:   group,
		NackResendSleep: 50 * time.Millisecond,
		Sarama:          fastGroups,
	}
	for _, f := range tune {
		f(&cfg)
	}
	sub, err := kafka.NewSubscriber(cfg, testLogger())
	require.NoError(t, err)
	return sub
}

func newPublisher(t testing.TB, brokers []string) message.Publisher {
	t.Helper()
	pub, err := kafka.NewPublisher(kafka.PublisherConfig{Brokers: brokers}, testLogger())
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, pub.Close()) })
	return pub
}
