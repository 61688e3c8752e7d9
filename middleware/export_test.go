package middleware

import "time"

// SetBloomClock replaces b's clock, for tests of generation rotation.
func SetBloomClock(b *Bloom, now func() time.Time) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.now = now
	b.rotateAt = now().Add(b.cfg.Window)
}
