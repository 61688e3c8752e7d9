package adapters

import (
	"errors"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/adapters/kafka"
)

func mustParse(t *testing.T, rawURL string) *url.URL {
	t.Helper()
	u, err := url.Parse(rawURL)
	require.NoError(t, err)
	return u
}

// TestKafkaURLTimeouts checks that the Kafka timeouts of the URL reach the
// Sarama configs, and the defaults when it has none: a read timeout
// longer than the rebalance timeout, so that a JoinGroup the broker holds
// open does not time out in the client.
func TestKafkaURLTimeouts(t *testing.T) {
	pcfg, scfg, timeout, err := kafkaConfigs(mustParse(t, "kafka://a:9092,b:9092?group=g&offset=newest&connect_timeout=2s&read_timeout=90s&session_timeout=6s&rebalance_timeout=20s"), Options{})
	require.NoError(t, err)
	require.Equal(t, 2*time.Second, timeout)
	require.Equal(t, []string{"a:9092", "b:9092"}, scfg.Brokers)
	require.Equal(t, kafka.Newest, scfg.InitialOffset)
	sw, err := scfg.WatermillConfig()
	require.NoError(t, err)
	sc := sw.OverwriteSaramaConfig
	require.Equal(t, 2*time.Second, sc.Net.DialTimeout)
	require.Equal(t, 90*time.Second, sc.Net.ReadTimeout)
	require.Equal(t, 6*time.Second, sc.Consumer.Group.Session.Timeout)
	require.Equal(t, 2*time.Second, sc.Consumer.Group.Heartbeat.Interval, "a third of the session timeout")
	require.Equal(t, 20*time.Second, sc.Consumer.Group.Rebalance.Timeout)
	pw, err := pcfg.WatermillConfig()
	require.NoError(t, err)
	require.Equal(t, 2*time.Second, pw.OverwriteSaramaConfig.Net.DialTimeout)
	require.Equal(t, 90*time.Second, pw.OverwriteSaramaConfig.Net.ReadTimeout)

	pcfg, scfg, timeout, err = kafkaConfigs(mustParse(t, "kafka://a:9092"), Options{ConsumerGroup: "g", ConnectTimeout: 3 * time.Second})
	require.NoError(t, err)
	require.Equal(t, 3*time.Second, timeout)
	require.Equal(t, "g", scfg.ConsumerGroup)
	sw, err = scfg.WatermillConfig()
	require.NoError(t, err)
	sc = sw.OverwriteSaramaConfig
	require.Equal(t, 3*time.Second, sc.Net.DialTimeout)
	require.Equal(t, kafka.DefaultRebalanceTimeout, sc.Consumer.Group.Rebalance.Timeout)
	require.Greater(t, sc.Net.ReadTimeout, sc.Consumer.Group.Rebalance.Timeout)
	pw, err = pcfg.WatermillConfig()
	require.NoError(t, err)
	require.Equal(t, kafka.DefaultReadTimeout, pw.OverwriteSaramaConfig.Net.ReadTimeout)

	// A longer rebalance timeout takes the default read timeout along.
	_, scfg, _, err = kafkaConfigs(mustParse(t, "kafka://a:9092?group=g&rebalance_timeout=5m"), Options{})
	require.NoError(t, err)
	sw, err = scfg.WatermillConfig()
	require.NoError(t, err)
	require.Equal(t, 5*time.Minute+kafka.JoinGroupMargin, sw.OverwriteSaramaConfig.Net.ReadTimeout)

	_, _, timeout, err = kafkaConfigs(mustParse(t, "kafka://?group=g"), Options{})
	require.NoError(t, err)
	require.Equal(t, DefaultConnectTimeout, timeout)
}

// TestSQSURLParameters checks that visibility_timeout and connect_timeout
// reach the SQS configs.
func TestSQSURLParameters(t *testing.T) {
	pcfg, scfg, timeout, err := sqsConfigs(mustParse(t, "sqs://KEY:SECRET@eu-west-1?endpoint=http://127.0.0.1:4566&create=true&visibility_timeout=2m&connect_timeout=3s"), Options{})
	require.NoError(t, err)
	require.Equal(t, 3*time.Second, timeout)
	require.Equal(t, 2*time.Minute, scfg.VisibilityTimeout)
	require.Equal(t, 3*time.Second, scfg.ConnectTimeout)
	require.Equal(t, 3*time.Second, pcfg.ConnectTimeout)
	require.Equal(t, "eu-west-1", pcfg.Region)
	require.Equal(t, "http://127.0.0.1:4566", pcfg.Endpoint)
	require.True(t, pcfg.CreateQueueIfMissing)

	_, scfg, _, err = sqsConfigs(mustParse(t, "sqs://eu-west-1"), Options{})
	require.NoError(t, err)
	require.Zero(t, scfg.VisibilityTimeout, "the subscriber's default")
	require.Equal(t, DefaultConnectTimeout, scfg.ConnectTimeout)
}

// TestAMQPURLParameters checks that this package's parameters leave the
// URL, amqp091's stay in it, and connect_timeout becomes its
// connection_timeout.
func TestAMQPURLParameters(t *testing.T) {
	cfg, err := amqpConfig(mustParse(t, "amqp://guest:guest@127.0.0.1:5672/vh?group=billing&prefetch=4&delivery_limit=5&dead_letter_exchange=dlx&connect_timeout=2s&heartbeat=5"), Options{})
	require.NoError(t, err)
	require.Equal(t, "billing", cfg.ConsumerGroup)
	require.Equal(t, 4, cfg.Prefetch)
	require.Equal(t, 5, cfg.DeliveryLimit)
	require.Equal(t, "dlx", cfg.DeadLetterExchange)
	require.Equal(t, 2*time.Second, cfg.ConnectTimeout)
	require.Equal(t, "amqp://guest:guest@127.0.0.1:5672/vh?heartbeat=5", cfg.URL)
	w, err := cfg.WatermillConfig()
	require.NoError(t, err)
	require.Equal(t, "amqp://guest:guest@127.0.0.1:5672/vh?heartbeat=5&connection_timeout=2000", w.Connection.AmqpURI)

	cfg, err = amqpConfig(mustParse(t, "amqp://guest:guest@127.0.0.1:5672/"), Options{})
	require.NoError(t, err)
	require.Equal(t, DefaultConnectTimeout, cfg.ConnectTimeout)
}

// TestScrubKeepsPasswordText checks that scrubbing replaces the user info,
// in each spelling a driver may quote it, and leaves alone the password's
// text elsewhere: with the password "e", the rest of the message is kept
// letter for letter.
func TestScrubKeepsPasswordText(t *testing.T) {
	for _, tc := range []struct{ raw, quoted, want string }{
		{
			raw:    "postgres://oncemill:e@db.example:5432/test",
			quoted: "server error: password authentication failed for user oncemill (postgres://oncemill:e@db.example:5432/test)",
			want:   "server error: password authentication failed for user oncemill (postgres://oncemill:xxxxx@db.example:5432/test)",
		},
		{
			// As written, re-escaped, and decoded.
			raw:    "amqp://guest:p%40ss%2Fe@rabbit:5672/",
			quoted: "dial amqp://guest:p%40ss%2Fe@rabbit:5672/, then guest:p%40ss%2Fe@rabbit, then guest:p@ss/e@rabbit: the end",
			want:   "dial amqp://guest:xxxxx@rabbit:5672/, then guest:xxxxx@rabbit, then guest:xxxxx@rabbit: the end",
		},
		{
			raw:    "sqs://KEY:e@us-east-1",
			quoted: "the request was refused",
			want:   "the request was refused",
		},
	} {
		u := mustParse(t, tc.raw)
		cause := errors.New(tc.quoted)
		err := scrub(cause, tc.raw, u)
		require.Equal(t, tc.want, err.Error())
		require.ErrorIs(t, err, cause, "the driver's error is still wrapped")
	}

	// The same through Open's own message: the redacted URL and the
	// parameter error keep every "e".
	_, err := openGoChannel(mustParse(t, "gochannel://?persistent=yes"), Options{})
	require.Error(t, err)
	msg := scrub(err, "gochannel://u:e@?persistent=yes", mustParse(t, "gochannel://u:e@?persistent=yes")).Error()
	require.Equal(t, err.Error(), msg)
	require.Contains(t, msg, `bad broker URL: parameter persistent="yes" is not a boolean`)
}

// TestKafkaURLMaxInFlight: max_in_flight reaches
// SubscriberConfig.MaxInFlightPerPartition; without it the config keeps
// the default (0, meaning 1).
func TestKafkaURLMaxInFlight(t *testing.T) {
	_, scfg, _, err := kafkaConfigs(mustParse(t, "kafka://a:9092?group=g&max_in_flight=8"), Options{})
	require.NoError(t, err)
	require.Equal(t, 8, scfg.MaxInFlightPerPartition)
	_, scfg, _, err = kafkaConfigs(mustParse(t, "kafka://a:9092?group=g&max_in_flight=1"), Options{})
	require.NoError(t, err)
	require.Equal(t, 1, scfg.MaxInFlightPerPartition)
	_, scfg, _, err = kafkaConfigs(mustParse(t, "kafka://a:9092?group=g"), Options{})
	require.NoError(t, err)
	require.Zero(t, scfg.MaxInFlightPerPartition)
	for _, bad := range []string{"0", "-1", "2.5", "x"} {
		_, _, _, err = kafkaConfigs(mustParse(t, "kafka://a:9092?group=g&max_in_flight="+bad), Options{})
		require.ErrorIs(t, err, ErrBadURL, bad)
		require.ErrorContains(t, err, "max_in_flight", bad)
	}
}

// TestKafkaURLMaxInFlightTotal: max_in_flight_total reaches
// SubscriberConfig.MaxInFlight; without it there is no limit across
// partitions.
func TestKafkaURLMaxInFlightTotal(t *testing.T) {
	_, scfg, _, err := kafkaConfigs(mustParse(t, "kafka://a:9092?group=g&max_in_flight_total=16"), Options{})
	require.NoError(t, err)
	require.Equal(t, 16, scfg.MaxInFlight)
	_, scfg, _, err = kafkaConfigs(mustParse(t, "kafka://a:9092?group=g"), Options{})
	require.NoError(t, err)
	require.Zero(t, scfg.MaxInFlight)
}

// TestKafkaURLInstanceID: instance_id reaches SubscriberConfig.InstanceID
// and so Sarama's Consumer.Group.InstanceId; without it the subscriber is
// a dynamic member; a present but empty or invalid value is refused,
// naming the parameter, with the embedded broker as with a cluster.
func TestKafkaURLInstanceID(t *testing.T) {
	_, scfg, _, err := kafkaConfigs(mustParse(t, "kafka://a:9092?group=g&instance_id=ledger-0"), Options{})
	require.NoError(t, err)
	require.Equal(t, "ledger-0", scfg.InstanceID)
	sw, err := scfg.WatermillConfig()
	require.NoError(t, err)
	require.Equal(t, "ledger-0", sw.OverwriteSaramaConfig.Consumer.Group.InstanceId)

	_, scfg, _, err = kafkaConfigs(mustParse(t, "kafka://a:9092?group=g"), Options{})
	require.NoError(t, err)
	require.Empty(t, scfg.InstanceID)

	_, scfg, _, err = kafkaConfigs(mustParse(t, "kafka://?group=g&instance_id=pod.7_a-b"), Options{})
	require.NoError(t, err)
	require.Equal(t, "pod.7_a-b", scfg.InstanceID)

	for bad, want := range map[string]string{
		"":                       "instance id is empty",
		"..":                     `instance id is ".."`,
		"pod%201":                `"pod 1" has " " at byte 3`,
		"pod%2F1":                `"pod/1" has "/" at byte 3`,
		strings.Repeat("p", 250): "instance id has 250 characters, want at most 249",
	} {
		for _, host := range []string{"a:9092", ""} {
			_, _, _, err = kafkaConfigs(mustParse(t, "kafka://"+host+"?group=g&instance_id="+bad), Options{})
			require.ErrorIs(t, err, ErrBadURL, bad)
			require.ErrorIs(t, err, kafka.ErrInvalidConfig, bad)
			require.ErrorContains(t, err, "parameter instance_id=", bad)
			require.ErrorContains(t, err, want, bad)
		}
	}
}

// TestURLDrainTimeout: drain_timeout reaches each broker's drain budget
// (the subscriber's DrainTimeout, which its Close waits for the messages
// in flight); absent, the adapter's default applies; a value that is not
// a positive duration is refused, naming the parameter. SQS's
// max_messages reaches MaxNumberOfMessages and is checked the same way.
func TestURLDrainTimeout(t *testing.T) {
	_, kcfg, _, err := kafkaConfigs(mustParse(t, "kafka://a:9092?group=g&drain_timeout=12s"), Options{})
	require.NoError(t, err)
	require.Equal(t, 12*time.Second, kcfg.DrainTimeout)
	acfg, err := amqpConfig(mustParse(t, "amqp://guest:guest@127.0.0.1:5672/?drain_timeout=1500ms&heartbeat=5"), Options{})
	require.NoError(t, err)
	require.Equal(t, 1500*time.Millisecond, acfg.DrainTimeout)
	require.Equal(t, "amqp://guest:guest@127.0.0.1:5672/?heartbeat=5", acfg.URL, "drain_timeout does not reach amqp091")
	_, scfg, _, err := sqsConfigs(mustParse(t, "sqs://eu-west-1?drain_timeout=7s&max_messages=1"), Options{})
	require.NoError(t, err)
	require.Equal(t, 7*time.Second, scfg.DrainTimeout)
	require.Equal(t, 1, scfg.MaxNumberOfMessages)

	_, kcfg, _, err = kafkaConfigs(mustParse(t, "kafka://a:9092?group=g"), Options{})
	require.NoError(t, err)
	require.Zero(t, kcfg.DrainTimeout, "the subscriber's default")
	acfg, err = amqpConfig(mustParse(t, "amqp://guest:guest@127.0.0.1:5672/"), Options{})
	require.NoError(t, err)
	require.Zero(t, acfg.DrainTimeout, "the subscriber's default")
	_, scfg, _, err = sqsConfigs(mustParse(t, "sqs://eu-west-1"), Options{})
	require.NoError(t, err)
	require.Zero(t, scfg.DrainTimeout, "the subscriber's default")

	_, ncfg, err := natsConfigs(mustParse(t, "nats://a:4222?group=g&drain_timeout=4s"), Options{})
	require.NoError(t, err)
	require.Equal(t, 4*time.Second, ncfg.DrainTimeout)
	_, ncfg, err = natsConfigs(mustParse(t, "nats://a:4222?group=g"), Options{})
	require.NoError(t, err)
	require.Zero(t, ncfg.DrainTimeout, "the subscriber's default")

	open := map[string]func(u *url.URL) error{
		"kafka://a:9092?group=g&": func(u *url.URL) error { _, _, _, err := kafkaConfigs(u, Options{}); return err },
		"amqp://127.0.0.1/?":      func(u *url.URL) error { _, err := amqpConfig(u, Options{}); return err },
		"sqs://eu-west-1?":        func(u *url.URL) error { _, _, _, err := sqsConfigs(u, Options{}); return err },
		"nats://a:4222?group=g&":  func(u *url.URL) error { _, _, err := natsConfigs(u, Options{}); return err },
	}
	for prefix, parse := range open {
		for _, bad := range []string{"0s", "-1s", "ten", "10"} {
			err := parse(mustParse(t, prefix+"drain_timeout="+bad))
			require.ErrorIs(t, err, ErrBadURL, prefix+bad)
			require.ErrorContains(t, err, "parameter drain_timeout=", prefix+bad)
		}
	}
	for _, bad := range []string{"0", "11", "x"} {
		_, _, _, err := sqsConfigs(mustParse(t, "sqs://eu-west-1?max_messages="+bad), Options{})
		require.ErrorIs(t, err, ErrBadURL, bad)
		require.ErrorContains(t, err, "parameter max_messages=", bad)
	}
}

// TestNATSURLParameters checks that the parameters of a nats:// URL reach
// the publisher and subscriber configs, that every host becomes a server
// URL with the user info, and the defaults when the URL has none:
// streams are created on first use only on the embedded server, or when
// asked.
func TestNATSURLParameters(t *testing.T) {
	pcfg, scfg, err := natsConfigs(mustParse(t, "nats://app:s3cret@a,b:4223?group=billing&stream=ORDERS&ack_wait=10s&max_deliver=20"+
		"&max_ack_pending=64&max_in_flight=4&drain_timeout=3s&duplicate_window=1m&connect_timeout=2s"), Options{})
	require.NoError(t, err)
	require.Equal(t, "nats://app:s3cret@a:4222,nats://app:s3cret@b:4223", pcfg.URL)
	require.Equal(t, pcfg.Config, scfg.Config, "one Config for both")
	require.Equal(t, "ORDERS", scfg.Stream)
	require.False(t, scfg.CreateStreams)
	require.Equal(t, time.Minute, scfg.DuplicateWindow)
	require.Equal(t, 2*time.Second, scfg.ConnectTimeout)
	require.Equal(t, "billing", scfg.ConsumerGroup)
	require.Equal(t, 10*time.Second, scfg.AckWait)
	require.Equal(t, 20, scfg.MaxDeliver)
	require.Equal(t, 64, scfg.MaxAckPending)
	require.Equal(t, 4, scfg.MaxInFlight)
	require.Equal(t, 3*time.Second, scfg.DrainTimeout)

	_, scfg, err = natsConfigs(mustParse(t, "nats://a?max_deliver=-1"), Options{ConsumerGroup: "billing"})
	require.NoError(t, err)
	require.Equal(t, "nats://a:4222", scfg.URL)
	require.Equal(t, -1, scfg.MaxDeliver)
	require.False(t, scfg.CreateStreams, "a real server's streams are the operator's")
	require.Zero(t, scfg.AckWait, "the subscriber's default")

	_, scfg, err = natsConfigs(mustParse(t, "nats://a?group=g&create=true"), Options{})
	require.NoError(t, err)
	require.True(t, scfg.CreateStreams)

	_, scfg, err = natsConfigs(mustParse(t, "nats://?group=g"), Options{})
	require.NoError(t, err)
	require.Empty(t, scfg.URL, "the embedded server's")
	require.True(t, scfg.CreateStreams, "the embedded server is empty: streams are made on first use")
	_, scfg, err = natsConfigs(mustParse(t, "nats://?group=g&create=false"), Options{})
	require.NoError(t, err)
	require.False(t, scfg.CreateStreams)
}
