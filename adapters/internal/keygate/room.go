package keygate

import (
	"context"
	"sync"
	"time"
)

// Room bounds the deliveries a subscription holds: received (fetched,
// polled) and not yet acked, nacked or given back. A broker package that
// asks its broker for messages (NATS, SQS) asks only for as many as there
// is room for, so that it never holds more than the bound, and frees a
// place when it is done with a delivery.
//
// Places freed together are taken together: Free(n) makes all n free at
// once, so the next ask is for all of them, not for the first of them.
type Room struct {
	mu   sync.Mutex
	free int
	wake chan struct{} // a token once places were freed
}

// NewRoom returns room for n deliveries (at least 1).
func NewRoom(n int) *Room {
	return &Room{free: max(n, 1), wake: make(chan struct{}, 1)}
}

// take waits for room for one delivery, then takes whatever else is free,
// and returns how many places it took; 0 once ctx has ended.
func (r *Room) take(ctx context.Context) int {
	for {
		if ctx.Err() != nil {
			return 0
		}
		r.mu.Lock()
		n := r.free
		r.free = 0
		r.mu.Unlock()
		if n > 0 {
			return n
		}
		select {
		case <-ctx.Done():
			return 0
		case <-r.wake:
		}
	}
}

// Free gives back n places.
func (r *Room) Free(n int) {
	if n <= 0 {
		return
	}
	r.mu.Lock()
	r.free += n
	r.mu.Unlock()
	select {
	case r.wake <- struct{}{}:
	default:
	}
}

// Backoff is how long a poll loop waits after a failed ask: Min after the
// first failure, doubling up to Max; a success starts again from Min.
type Backoff struct {
	Min, Max time.Duration
}

// Poll asks for deliveries while there is room until ctx ends: each round
// it takes the room there is (at least one place, waiting for it) and
// calls ask with how many, which returns how many it received and holds
// (their places stay taken until freed) and an error. The places of what
// did not arrive are freed. After an error, unless ctx has ended, Poll
// calls failed with the error and the wait before the next ask, and
// waits. It returns once ctx has ended.
func Poll(ctx context.Context, room *Room, ask func(n int) (int, error), failed func(err error, retryIn time.Duration), backoff Backoff) {
	retry := backoff.Min
	for {
		n := room.take(ctx)
		if n == 0 {
			return
		}
		got, err := ask(n)
		room.Free(n - got)
		if ctx.Err() != nil {
			return
		}
		if err != nil {
			failed(err, retry)
			select {
			case <-ctx.Done():
				return
			case <-time.After(retry):
			}
			retry = min(2*retry, backoff.Max)
			continue
		}
		retry = backoff.Min
	}
}
