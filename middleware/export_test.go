package middleware

import (
	"math"
	"time"
)

// SetBloomClock replaces b's clock, for tests of generation rotation.
func SetBloomClock(b *Bloom, now func() time.Time) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.now = now
	b.rotateAt = now().Add(b.cfg.Window)
}

// BitsPerKey is each generation's size in bits divided by ExpectedKeys.
func BitsPerKey(b *Bloom) float64 { return float64(b.m) / float64(b.cfg.ExpectedKeys) }

// OptimalBitsPerKey is the smallest size per key that reaches rate p:
// -ln(p)/ln(2)².
func OptimalBitsPerKey(p float64) float64 { return -math.Log(p) / (math.Ln2 * math.Ln2) }

// StoredAttempts is storedAttempts, for the tests that check the count the
// inbox hands the poison middleware.
var StoredAttempts = storedAttempts

// BatchSlots is how many batch slots in is holding (0 when not batching).
func BatchSlots(in *Inbox) int {
	if in.batcher == nil {
		return 0
	}
	return in.batcher.slots()
}

// BatchQueued is how many deliveries wait in in's batch queues.
func BatchQueued(in *Inbox) int {
	if in.batcher == nil {
		return 0
	}
	in.batcher.mu.Lock()
	defer in.batcher.mu.Unlock()
	n := 0
	for _, q := range in.batcher.queues {
		n += len(q)
	}
	return n
}
