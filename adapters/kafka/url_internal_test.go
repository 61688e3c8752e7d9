package kafka

import (
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/adapters/internal/brokerurl"
)

func mustParse(t *testing.T, raw string) *url.URL {
	u, err := url.Parse(raw)
	require.NoError(t, err, raw)
	return u
}

// TestKafkaURLTimeouts checks that the Kafka timeouts of the URL reach the
// Sarama configs, and the defaults when it has none: a read timeout
// longer than the rebalance timeout, so that a JoinGroup the broker holds
// open does not time out in the client.
func TestKafkaURLTimeouts(t *testing.T) {
	pcfg, scfg, timeout, err := urlConfigs(mustParse(t, "kafka://a:9092,b:9092?group=g&offset=newest&connect_timeout=2s&read_timeout=90s&session_timeout=6s&rebalance_timeout=20s"), brokerurl.Options{})
	require.NoError(t, err)
	require.Equal(t, 2*time.Second, timeout)
	require.Equal(t, []string{"a:9092", "b:9092"}, scfg.Brokers)
	require.Equal(t, Newest, scfg.InitialOffset)
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

	pcfg, scfg, timeout, err = urlConfigs(mustParse(t, "kafka://a:9092"), brokerurl.Options{ConsumerGroup: "g", ConnectTimeout: 3 * time.Second})
	require.NoError(t, err)
	require.Equal(t, 3*time.Second, timeout)
	require.Equal(t, "g", scfg.ConsumerGroup)
	sw, err = scfg.WatermillConfig()
	require.NoError(t, err)
	sc = sw.OverwriteSaramaConfig
	require.Equal(t, 3*time.Second, sc.Net.DialTimeout)
	require.Equal(t, DefaultRebalanceTimeout, sc.Consumer.Group.Rebalance.Timeout)
	require.Greater(t, sc.Net.ReadTimeout, sc.Consumer.Group.Rebalance.Timeout)
	pw, err = pcfg.WatermillConfig()
	require.NoError(t, err)
	require.Equal(t, DefaultReadTimeout, pw.OverwriteSaramaConfig.Net.ReadTimeout)

	// A longer rebalance timeout takes the default read timeout along.
	_, scfg, _, err = urlConfigs(mustParse(t, "kafka://a:9092?group=g&rebalance_timeout=5m"), brokerurl.Options{})
	require.NoError(t, err)
	sw, err = scfg.WatermillConfig()
	require.NoError(t, err)
	require.Equal(t, 5*time.Minute+JoinGroupMargin, sw.OverwriteSaramaConfig.Net.ReadTimeout)

	_, _, timeout, err = urlConfigs(mustParse(t, "kafka://?group=g"), brokerurl.Options{})
	require.NoError(t, err)
	require.Equal(t, brokerurl.DefaultConnectTimeout, timeout)
}

// TestKafkaURLMaxInFlight: max_in_flight reaches
// SubscriberConfig.MaxInFlightPerPartition; without it the config keeps
// the default (0, meaning 1).
func TestKafkaURLMaxInFlight(t *testing.T) {
	_, scfg, _, err := urlConfigs(mustParse(t, "kafka://a:9092?group=g&max_in_flight=8"), brokerurl.Options{})
	require.NoError(t, err)
	require.Equal(t, 8, scfg.MaxInFlightPerPartition)
	_, scfg, _, err = urlConfigs(mustParse(t, "kafka://a:9092?group=g&max_in_flight=1"), brokerurl.Options{})
	require.NoError(t, err)
	require.Equal(t, 1, scfg.MaxInFlightPerPartition)
	_, scfg, _, err = urlConfigs(mustParse(t, "kafka://a:9092?group=g"), brokerurl.Options{})
	require.NoError(t, err)
	require.Zero(t, scfg.MaxInFlightPerPartition)
	for _, bad := range []string{"0", "-1", "2.5", "x"} {
		_, _, _, err = urlConfigs(mustParse(t, "kafka://a:9092?group=g&max_in_flight="+bad), brokerurl.Options{})
		require.ErrorIs(t, err, brokerurl.ErrBadURL, bad)
		require.ErrorContains(t, err, "max_in_flight", bad)
	}
}

// TestKafkaURLMaxInFlightTotal: max_in_flight_total reaches
// SubscriberConfig.MaxInFlight; without it there is no limit across
// partitions.
func TestKafkaURLMaxInFlightTotal(t *testing.T) {
	_, scfg, _, err := urlConfigs(mustParse(t, "kafka://a:9092?group=g&max_in_flight_total=16"), brokerurl.Options{})
	require.NoError(t, err)
	require.Equal(t, 16, scfg.MaxInFlight)
	_, scfg, _, err = urlConfigs(mustParse(t, "kafka://a:9092?group=g"), brokerurl.Options{})
	require.NoError(t, err)
	require.Zero(t, scfg.MaxInFlight)
}

// TestKafkaURLInstanceID: instance_id reaches SubscriberConfig.InstanceID
// and so Sarama's Consumer.Group.InstanceId; without it the subscriber is
// a dynamic member; a present but empty or invalid value is refused,
// naming the parameter, with the embedded broker as with a cluster.
func TestKafkaURLInstanceID(t *testing.T) {
	_, scfg, _, err := urlConfigs(mustParse(t, "kafka://a:9092?group=g&instance_id=ledger-0"), brokerurl.Options{})
	require.NoError(t, err)
	require.Equal(t, "ledger-0", scfg.InstanceID)
	sw, err := scfg.WatermillConfig()
	require.NoError(t, err)
	require.Equal(t, "ledger-0", sw.OverwriteSaramaConfig.Consumer.Group.InstanceId)

	_, scfg, _, err = urlConfigs(mustParse(t, "kafka://a:9092?group=g"), brokerurl.Options{})
	require.NoError(t, err)
	require.Empty(t, scfg.InstanceID)

	_, scfg, _, err = urlConfigs(mustParse(t, "kafka://?group=g&instance_id=pod.7_a-b"), brokerurl.Options{})
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
			_, _, _, err = urlConfigs(mustParse(t, "kafka://"+host+"?group=g&instance_id="+bad), brokerurl.Options{})
			require.ErrorIs(t, err, brokerurl.ErrBadURL, bad)
			require.ErrorIs(t, err, ErrInvalidConfig, bad)
			require.ErrorContains(t, err, "parameter instance_id=", bad)
			require.ErrorContains(t, err, want, bad)
		}
	}
}

// TestKafkaURLDrainTimeout: drain_timeout reaches the subscriber's
// DrainTimeout; absent, the subscriber's default applies.
func TestKafkaURLDrainTimeout(t *testing.T) {
	_, cfg, _, err := urlConfigs(mustParse(t, "kafka://a:9092?group=g&drain_timeout=12s"), brokerurl.Options{})
	require.NoError(t, err)
	require.Equal(t, 12*time.Second, cfg.DrainTimeout)
	_, cfg, _, err = urlConfigs(mustParse(t, "kafka://a:9092?group=g"), brokerurl.Options{})
	require.NoError(t, err)
	require.Zero(t, cfg.DrainTimeout, "the subscriber's default")
}
