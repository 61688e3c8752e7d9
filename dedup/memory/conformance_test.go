package memory

import (
	"context"
	"testing"

	"github.com/oncemill/oncemill/dedup"
	"github.com/oncemill/oncemill/dedup/deduptest"
)

// TestConformance runs the lease store's conformance suite on the real
// clock.
func TestConformance(t *testing.T) {
	t.Parallel()
	deduptest.RunLeaseStore(t, deduptest.LeaseHarness{
		New: func(t *testing.T) deduptest.LeaseBundle {
			s := New()
			return deduptest.LeaseBundle{
				Store: s,
				DeadCopies: func(_ context.Context, key dedup.Key) (int, error) {
					s.mu.Lock()
					defer s.mu.Unlock()
					if e := s.keys[key]; e != nil {
						return e.deadCopies, nil
					}
					return 0, nil
				},
			}
		},
	})
}
