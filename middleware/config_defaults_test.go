package middleware_test

import (
	"testing"

	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/adapters"
	"github.com/oncemill/oncemill/dedup/memory"
	"github.com/oncemill/oncemill/middleware"
)

// TestConfigDefaultsValidate: a config whose fields are left at their
// documented zero defaults passes Validate (InboxConfig.Window,
// PoisonConfig.MaxAttempts, …), and a field set out of range is named.
func TestConfigDefaultsValidate(t *testing.T) {
	t.Parallel()
	pub := adapters.NewGoChannel(gochannel.Config{Persistent: true}, nil)
	t.Cleanup(func() { require.NoError(t, pub.Close()) })
	store := memory.New()
	require.NoError(t, middleware.InboxConfig{LeaseStore: store}.Validate(), "Window, Lease and the rest default")
	require.NoError(t, middleware.PoisonConfig{Publisher: pub, Topic: "dlq"}.Validate(), "MaxAttempts and the backoffs default")
	require.NoError(t, middleware.BloomConfig{Store: store}.Validate(), "every field but Store defaults")
	for name, tc := range map[string]struct {
		err  error
		want string
	}{
		"negative Window":      {middleware.InboxConfig{LeaseStore: store, Window: -1}.Validate(), "middleware: InboxConfig.Window must be at least 1m, got -1ns"},
		"negative MaxAttempts": {middleware.PoisonConfig{Publisher: pub, Topic: "dlq", MaxAttempts: -1}.Validate(), "middleware: PoisonConfig.MaxAttempts must be at least 1, got -1"},
		"poison without topic": {middleware.PoisonConfig{Publisher: pub}.Validate(), "middleware: PoisonConfig.Topic is required: the dead-letter topic"},
	} {
		require.EqualError(t, tc.err, tc.want, name)
	}
}
