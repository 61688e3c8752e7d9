package nats

import (
	"net/url"
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

// TestNATSURLParameters checks that the parameters of a nats:// URL reach
// the publisher and subscriber configs, that every host becomes a server
// URL with the user info, and the defaults when the URL has none:
// streams are created on first use only on the embedded server, or when
// asked.
func TestNATSURLParameters(t *testing.T) {
	pcfg, scfg, err := urlConfigs(mustParse(t, "nats://app:s3cret@a,b:4223?group=billing&stream=ORDERS&ack_wait=10s&max_deliver=20"+
		"&max_ack_pending=64&max_in_flight=4&drain_timeout=3s&duplicate_window=1m&connect_timeout=2s"), brokerurl.Options{})
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

	_, scfg, err = urlConfigs(mustParse(t, "nats://a?max_deliver=-1"), brokerurl.Options{ConsumerGroup: "billing"})
	require.NoError(t, err)
	require.Equal(t, "nats://a:4222", scfg.URL)
	require.Equal(t, -1, scfg.MaxDeliver)
	require.False(t, scfg.CreateStreams, "a real server's streams are the operator's")
	require.Zero(t, scfg.AckWait, "the subscriber's default")

	_, scfg, err = urlConfigs(mustParse(t, "nats://a?group=g&create=true"), brokerurl.Options{})
	require.NoError(t, err)
	require.True(t, scfg.CreateStreams)

	_, scfg, err = urlConfigs(mustParse(t, "nats://?group=g"), brokerurl.Options{})
	require.NoError(t, err)
	require.Empty(t, scfg.URL, "the embedded server's")
	require.True(t, scfg.CreateStreams, "the embedded server is empty: streams are made on first use")
	_, scfg, err = urlConfigs(mustParse(t, "nats://?group=g&create=false"), brokerurl.Options{})
	require.NoError(t, err)
	require.False(t, scfg.CreateStreams)
}

// TestNATSURLDrainTimeout: drain_timeout reaches the subscriber's
// DrainTimeout; absent, the subscriber's default applies.
func TestNATSURLDrainTimeout(t *testing.T) {
	_, cfg, err := urlConfigs(mustParse(t, "nats://a:4222?group=g&drain_timeout=4s"), brokerurl.Options{})
	require.NoError(t, err)
	require.Equal(t, 4*time.Second, cfg.DrainTimeout)
	_, cfg, err = urlConfigs(mustParse(t, "nats://a:4222?group=g"), brokerurl.Options{})
	require.NoError(t, err)
	require.Zero(t, cfg.DrainTimeout, "the subscriber's default")
}
