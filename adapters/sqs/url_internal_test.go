package sqs

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

// TestSQSURLParameters checks that visibility_timeout and connect_timeout
// reach the SQS configs.
func TestSQSURLParameters(t *testing.T) {
	pcfg, scfg, timeout, err := urlConfigs(mustParse(t, "sqs://KEY:SECRET@eu-west-1?endpoint=http://127.0.0.1:4566&create=true&visibility_timeout=2m&connect_timeout=3s"), brokerurl.Options{})
	require.NoError(t, err)
	require.Equal(t, 3*time.Second, timeout)
	require.Equal(t, 2*time.Minute, scfg.VisibilityTimeout)
	require.Equal(t, 3*time.Second, scfg.ConnectTimeout)
	require.Equal(t, 3*time.Second, pcfg.ConnectTimeout)
	require.Equal(t, "eu-west-1", pcfg.Region)
	require.Equal(t, "http://127.0.0.1:4566", pcfg.Endpoint)
	require.True(t, pcfg.CreateQueueIfMissing)

	_, scfg, _, err = urlConfigs(mustParse(t, "sqs://eu-west-1"), brokerurl.Options{})
	require.NoError(t, err)
	require.Zero(t, scfg.VisibilityTimeout, "the subscriber's default")
	require.Equal(t, brokerurl.DefaultConnectTimeout, scfg.ConnectTimeout)
}

// TestSQSURLDrainTimeout: drain_timeout reaches the subscriber's
// DrainTimeout and max_messages its MaxNumberOfMessages; absent, the
// subscriber's defaults apply.
func TestSQSURLDrainTimeout(t *testing.T) {
	_, cfg, _, err := urlConfigs(mustParse(t, "sqs://eu-west-1?drain_timeout=7s&max_messages=1"), brokerurl.Options{})
	require.NoError(t, err)
	require.Equal(t, 7*time.Second, cfg.DrainTimeout)
	require.Equal(t, 1, cfg.MaxNumberOfMessages)
	_, cfg, _, err = urlConfigs(mustParse(t, "sqs://eu-west-1"), brokerurl.Options{})
	require.NoError(t, err)
	require.Zero(t, cfg.DrainTimeout, "the subscriber's default")
	require.Zero(t, cfg.MaxNumberOfMessages, "the subscriber's default")
}

// TestSQSURLMaxInFlight: max_in_flight reaches the subscriber's
// MaxInFlight, which defaults to MaxNumberOfMessages; a negative or
// non-numeric value is refused, naming the parameter.
func TestSQSURLMaxInFlight(t *testing.T) {
	_, cfg, _, err := urlConfigs(mustParse(t, "sqs://eu-west-1?max_in_flight=64&max_messages=5"), brokerurl.Options{})
	require.NoError(t, err)
	require.Equal(t, 64, cfg.MaxInFlight)
	require.Equal(t, 5, cfg.MaxNumberOfMessages)
	_, cfg, _, err = urlConfigs(mustParse(t, "sqs://eu-west-1?max_messages=5"), brokerurl.Options{})
	require.NoError(t, err)
	cfg.setDefaults()
	require.Equal(t, 5, cfg.MaxInFlight, "MaxNumberOfMessages by default")
	for _, bad := range []string{"-1", "many"} {
		_, _, _, err = urlConfigs(mustParse(t, "sqs://eu-west-1?max_in_flight="+bad), brokerurl.Options{})
		require.ErrorIs(t, err, brokerurl.ErrBadURL, bad)
		require.ErrorContains(t, err, "max_in_flight", bad)
	}
}
