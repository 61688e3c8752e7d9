package adapters_test

import (
	"testing"

	"go.uber.org/goleak"

	"github.com/oncemill/oncemill/internal/testing/proctest"
)

func TestMain(m *testing.M) {
	// A child process started by a test of this package runs its role and
	// exits here.
	proctest.Main(failureRole, inflightRole, batchRole, burstRole, restartRole, ledgerRole)
	// Sarama starts a process-wide metrics ticker that nothing stops.
	goleak.VerifyTestMain(m, goleak.IgnoreTopFunction("github.com/rcrowley/go-metrics.(*meterArbiter).tick"))
}
