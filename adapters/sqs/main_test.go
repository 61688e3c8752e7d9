package sqs_test

import (
	"testing"

	"go.uber.org/goleak"
)

// TestMain fails the package when a test leaves a goroutine running: every
// publisher, subscriber and admin client must be closed.
func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }
