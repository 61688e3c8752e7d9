package adapters_test

import (
	"os"
	"testing"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	if cfg := os.Getenv(childEnv); cfg != "" {
		// A child consumer process started by a test of this package.
		os.Exit(runChild(cfg))
	}
	// Sarama starts a process-wide metrics ticker that nothing stops.
	goleak.VerifyTestMain(m, goleak.IgnoreTopFunction("github.com/rcrowley/go-metrics.(*meterArbiter).tick"))
}
