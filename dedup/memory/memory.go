// Package memory is an in-process [dedup.LeaseStore].
//
// It forgets every key when the process stops, so it cannot keep the
// exactly-once promise across restarts, rebalances or several instances: a
// redelivery after a restart runs the effect again. It exists as a measured
// baseline for benchmarks and for unit tests, never as the record of a
// production consumer.
package memory

import (
	"context"
	"sync"
	"time"

	"github.com/oncemill/oncemill/dedup"
)

type status int

const (
	processing status = iota + 1
	failed
	done
)

type entry struct {
	status   status
	attempts int
	token    int64
	until    time.Time
	result   []byte
	expires  time.Time

	firstFailed time.Time
	doneAt      time.Time
}

// Store keeps leases in a map. It is safe for concurrent use and starts no
// goroutines; expired keys go with [Store.InboxDeleteExpired] (or a
// [dedup.Janitor]).
type Store struct {
	now func() time.Time

	mu   sync.Mutex
	keys map[dedup.Key]*entry
}

var (
	_ dedup.LeaseStore = (*Store)(nil)
	_ dedup.Expirer    = (*Store)(nil)
	_ dedup.Peeker     = (*Store)(nil)
	_ dedup.KeyLister  = (*Store)(nil)
)

// New returns an empty store.
func New() *Store {
	return &Store{now: time.Now, keys: map[dedup.Key]*entry{}}
}

// Len returns how many keys the store holds.
func (s *Store) Len() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.keys)
}

// LeaseClaim takes key for lease unless it is done or held by a live lease.
func (s *Store) LeaseClaim(ctx context.Context, key dedup.Key, lease, window time.Duration) (dedup.Claim, error) {
	if err := ctx.Err(); err != nil {
		return dedup.Claim{}, err
	}
	now := s.now()
	s.mu.Lock()
	defer s.mu.Unlock()
	e := s.keys[key]
	if e == nil {
		e = &entry{}
		s.keys[key] = e
	}
	switch {
	case e.status == done:
		return dedup.Claim{State: dedup.StateDone, Attempts: e.attempts, Result: e.result}, nil
	case e.status == processing && now.Before(e.until):
		return dedup.Claim{State: dedup.StateInFlight, Attempts: e.attempts, Until: e.until}, nil
	}
	e.status = processing
	e.attempts++
	e.token++
	e.until = now.Add(lease)
	e.expires = now.Add(window)
	return dedup.Claim{State: dedup.StateNew, Attempts: e.attempts, Token: e.token, Until: e.until, FirstFailedAt: e.firstFailed}, nil
}

// LeaseComplete marks key done with result if token is still current.
func (s *Store) LeaseComplete(ctx context.Context, key dedup.Key, token int64, result []byte) error {
	return s.end(ctx, key, token, func(e *entry) {
		e.status, e.result, e.doneAt = done, append([]byte(nil), result...), s.now()
	})
}

// LeaseRelease marks key failed, claimable at once, if token is still current.
func (s *Store) LeaseRelease(ctx context.Context, key dedup.Key, token int64, f dedup.Failure) error {
	return s.end(ctx, key, token, func(e *entry) {
		e.status = failed
		if e.firstFailed.IsZero() {
			e.firstFailed = f.At
		}
	})
}

func (s *Store) end(ctx context.Context, key dedup.Key, token int64, apply func(*entry)) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	e := s.keys[key]
	if e == nil || e.token != token || e.status != processing {
		return dedup.ErrLeaseLost
	}
	apply(e)
	e.until = time.Time{}
	return nil
}

// InboxDeleteExpired deletes at most limit keys whose window has passed.
func (s *Store) InboxDeleteExpired(ctx context.Context, limit int) (int, error) {
	if err := ctx.Err(); err != nil {
		return 0, err
	}
	now := s.now()
	s.mu.Lock()
	defer s.mu.Unlock()
	n := 0
	for k, e := range s.keys {
		if n == limit {
			break
		}
		if now.After(e.expires) {
			delete(s.keys, k)
			n++
		}
	}
	return n, nil
}

// InboxPeek returns key's record without claiming it.
func (s *Store) InboxPeek(ctx context.Context, key dedup.Key) (dedup.Claim, error) {
	if err := ctx.Err(); err != nil {
		return dedup.Claim{}, err
	}
	now := s.now()
	s.mu.Lock()
	defer s.mu.Unlock()
	e := s.keys[key]
	switch {
	case e == nil || now.After(e.expires):
		return dedup.Claim{State: dedup.StateNew}, nil
	case e.status == done:
		return dedup.Claim{State: dedup.StateDone, Attempts: e.attempts, Result: e.result, FirstFailedAt: e.firstFailed}, nil
	case e.status == processing && now.Before(e.until):
		return dedup.Claim{State: dedup.StateInFlight, Attempts: e.attempts, Until: e.until, FirstFailedAt: e.firstFailed}, nil
	}
	return dedup.Claim{State: dedup.StateNew, Attempts: e.attempts, FirstFailedAt: e.firstFailed}, nil
}

// InboxDoneKeys calls fn with consumer's keys completed at or after since.
// It copies them first, so fn may call the store.
func (s *Store) InboxDoneKeys(ctx context.Context, consumer string, since time.Time, fn func(key string) error) error {
	now := s.now()
	s.mu.Lock()
	var keys []string
	for k, e := range s.keys {
		if k.Consumer == consumer && e.status == done && !e.doneAt.Before(since) && !now.After(e.expires) {
			keys = append(keys, k.Key)
		}
	}
	s.mu.Unlock()
	for _, k := range keys {
		if err := ctx.Err(); err != nil {
			return err
		}
		if err := fn(k); err != nil {
			return err
		}
	}
	return nil
}
