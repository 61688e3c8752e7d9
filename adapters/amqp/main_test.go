package amqp_test

import (
	"testing"

	"go.uber.org/goleak"
)

// TestMain fails the package when a test leaves a goroutine running: every
// publisher, subscriber and admin connection must be closed.
func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }
