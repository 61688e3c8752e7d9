package retry

import "context"

// AckLease is the subscriber's delete of a message its consumer acked,
// for the tests that ack a lease at a moment of their choosing.
func AckLease(ctx context.Context, s *Store, l Lease) error { return s.ack(ctx, l) }
