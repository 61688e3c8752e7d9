package main

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/internal/testing/pgtest"
)

// TestRelayStartupLineHidesCredentials runs "oncemill relay" with broker
// URLs that carry a credential in each form the services here accept (a
// NATS token, a password in a postgres:// query, an AMQP password): the
// startup line names the broker, and no credential is printed anywhere.
func TestRelayStartupLineHidesCredentials(t *testing.T) {
	t.Parallel()
	bin := buildOncemill(t)
	for _, tc := range []struct{ broker, secret, want string }{
		{"nats://TOKEN123@127.0.0.1:4222", "TOKEN123", "nats://xxxxx@127.0.0.1:4222"},
		{pgtest.URL() + "&password=hunter2", "hunter2", "&password=xxxxx"},
		{"amqp://guest:guest@127.0.0.1:5672/", ":guest@", "amqp://guest:xxxxx@127.0.0.1:5672/"},
	} {
		pool := pgtest.Pool(t, 1)
		schema := pgtest.Schema(t, pool)
		relay := startRelay(t, bin, nil, "--broker", tc.broker, "--database", pgtest.URL(), "--schema", schema,
			"--migrate", "--listen", "")
		running, _ := logLine(relay.out.String(), "oncemill relay running")
		relay.terminate(t)
		out := relay.out.String()
		require.NotContains(t, out, tc.secret, "%s: %s", tc.broker, out)
		require.True(t, strings.HasSuffix(running["broker"], tc.want), "the broker, to its end: %q; output:\n%s", running["broker"], out)
		require.True(t, strings.HasPrefix(running["broker"], strings.SplitN(tc.broker, ":", 2)[0]+"://"), "the broker, from its scheme: %q", running["broker"])
	}
}
