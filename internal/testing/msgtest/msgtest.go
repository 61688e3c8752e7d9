// Package msgtest holds small assertions on Watermill message channels for
// the adapters' tests.
package msgtest

import (
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/oncemill/oncemill/delivery"
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

// Closers closes, when the test ends, everything added to it, in the order
// added. Watermill's universal suite leaves some subscribers open (its
// TestPublishSubscribeInOrder closes one before subscribing it); a harness
// adds every publisher and subscriber it builds, and Close being idempotent
// makes the second close harmless.
type Closers struct {
	mu  sync.Mutex
	fns []func() error
}

// NewClosers returns a set whose closers run in t's cleanup.
func NewClosers(t testing.TB) *Closers {
	c := &Closers{}
	t.Cleanup(func() {
		c.mu.Lock()
		defer c.mu.Unlock()
		for _, fn := range c.fns {
			if err := fn(); err != nil {
				t.Errorf("close at test end: %v", err)
			}
		}
	})
	return c
}

// Add registers closers; it is safe for concurrent use.
func (c *Closers) Add(fns ...func() error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.fns = append(c.fns, fns...)
}

// RoundTrip fails t unless back, a broker's decoding of what its adapter
// encoded from sent, carries sent's UUID (when sent had one), its payload
// and every metadata entry for which skip, when given, returns false;
// adapter facts (delivery.IsAdapterFact) are always skipped.
func RoundTrip(t testing.TB, sent, back *message.Message, skip func(k, v string) bool) {
	t.Helper()
	if sent.UUID != "" && back.UUID != sent.UUID {
		t.Fatalf("UUID %q came back as %q", sent.UUID, back.UUID)
	}
	if string(back.Payload) != string(sent.Payload) {
		t.Fatalf("payload %q came back as %q", sent.Payload, back.Payload)
	}
	for k, v := range sent.Metadata {
		if delivery.IsAdapterFact(k) || skip != nil && skip(k, v) {
			continue
		}
		if got, ok := back.Metadata[k]; !ok || got != v {
			t.Fatalf("metadata %q=%q came back as %q (present %v)", k, v, got, ok)
		}
	}
}
