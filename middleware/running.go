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
