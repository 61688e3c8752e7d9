package middleware

import (
	"context"
	"sync"

	"github.com/oncemill/oncemill/dedup"
)

// running holds the keys whose attempts this inbox counted and runs: from
// the start that counted the attempt until the poison middleware in front
// is done with it (it succeeded, or its failure was recorded and then
// retried or dead-lettered). Such an attempt is counted in the key's starts
// while it does not always hold the key's claim (before its claim, and
// after its rollback until its dead-lettering commits), so a copy of the
// key over the limit meanwhile would count attempts that are running as
// attempts that died, and take the key for a crash loop. A copy over the
// limit waits for these attempts (see [Inbox.settle]) before it counts
// again; one over the limit is never marked, so two never wait on each
// other. Attempts in other processes are waited for through the claim.
type running struct {
	mu   sync.Mutex
	keys map[dedup.Key]*runningKey
}

type runningKey struct {
	n    int
	done chan struct{} // closed when n falls to 0
}

// mark records a running attempt of key and returns what ends it:
// called once or more, it unmarks once.
func (f *running) mark(key dedup.Key) func() {
	f.mu.Lock()
	if f.keys == nil {
		f.keys = map[dedup.Key]*runningKey{}
	}
	k := f.keys[key]
	if k == nil {
		k = &runningKey{done: make(chan struct{})}
		f.keys[key] = k
	}
	k.n++
	f.mu.Unlock()
	var once sync.Once
	return func() {
		once.Do(func() {
			f.mu.Lock()
			defer f.mu.Unlock()
			if k.n--; k.n == 0 {
				close(k.done)
				delete(f.keys, key)
			}
		})
	}
}

// wait returns when no running attempt of key is marked, or when ctx
// ends.
func (f *running) wait(ctx context.Context, key dedup.Key) error {
	for {
		f.mu.Lock()
		k := f.keys[key]
		f.mu.Unlock()
		if k == nil {
			return nil
		}
		select {
		case <-k.done:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

// turns lets one delivery of a key at a time through this inbox's
// transactional attempt, from the start that counts it to its end. The
// start numbers an attempt: without turns, copies of a key that arrive
// together are all counted first and then take the claim in any order, so
// that the copy numbered MaxAttempts may run second and be dead-lettered
// after two runs, counting the attempt of a copy that still waits and
// never runs (issue 31). A copy that waits here is not counted and holds
// no pool connection; copies in other processes still meet at the claim.
type turns struct {
	mu   sync.Mutex
	keys map[dedup.Key]*turn
}

type turn struct {
	held  chan struct{} // holds a value while a delivery has the turn
	users int           // deliveries that have or wait for the turn
}

// take returns when key's turn is this delivery's, with what gives it up,
// or ctx's error when ctx ends first.
func (t *turns) take(ctx context.Context, key dedup.Key) (func(), error) {
	t.mu.Lock()
	if t.keys == nil {
		t.keys = map[dedup.Key]*turn{}
	}
	k := t.keys[key]
	if k == nil {
		k = &turn{held: make(chan struct{}, 1)}
		t.keys[key] = k
	}
	k.users++
	t.mu.Unlock()
	leave := func() {
		t.mu.Lock()
		defer t.mu.Unlock()
		if k.users--; k.users == 0 {
			delete(t.keys, key)
		}
	}
	select {
	case k.held <- struct{}{}:
		return func() { <-k.held; leave() }, nil
	case <-ctx.Done():
		leave()
		return nil, ctx.Err()
	}
}
