// Package msgtest holds small assertions on Watermill message channels for
// the adapters' tests.
package msgtest

import (
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
)

// Receive returns the next message from ch, failing the test after timeout
// or when ch is closed.
func Receive(t testing.TB, ch <-chan *message.Message, timeout time.Duration) *message.Message {
	t.Helper()
	select {
	case msg, ok := <-ch:
		if !ok {
			t.Fatal("messages channel closed")
		}
		return msg
	case <-time.After(timeout):
		t.Fatalf("no message within %s", timeout)
		return nil
	}
}

// Nothing asserts that ch yields no message for d.
func Nothing(t testing.TB, ch <-chan *message.Message, d time.Duration) {
	t.Helper()
	select {
	case msg, ok := <-ch:
		if ok {
			t.Fatalf("unexpected message %s: %q %v", msg.UUID, msg.Payload, msg.Metadata)
		}
	case <-time.After(d):
	}
}
