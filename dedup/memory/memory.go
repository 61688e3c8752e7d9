// Package memory is an in-process [dedup.LeaseStore].
//
// It forgets every key when the process stops, so it cannot keep the
// exactly-once promise across restarts, rebalances or several instances: a
// redelivery after a restart runs the effect again. It exists as a measured
// baseline for benchmarks and for unit tests, never as the record of a
// production consumer.
//
// A key buried with [Store.LeaseBury] is dead: claims and peeks answer
// [dedup.StateDead] until [Store.InboxReopen] makes it claimable again, and
// it expires with its window like a done key. Tokens come from one counter
// of the store that never goes back, seeded with the clock in microseconds,
// so a key whose record was deleted never gets a token it had before.
package memory

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/oncemill/oncemill/dedup"
	"github.com/oncemill/oncemill/dedup/dedupdriver"
)

type status int

const (
	processing status = iota + 1
	failed
	done
	dead
)

type entry struct {
	status   status
	attempts int
	token    int64
	until    time.Time
	result   []byte
	expires  time.Time

	firstFailed time.Time
	lastFailed  time.Time
	lastErr     string
	doneAt      time.Time
	deadCopies  int
	grant       string // the replay grant; cleared when buried
}

// Store keeps leases in a map. It is safe for concurrent use and starts no
// goroutines; expired keys go with [Store.InboxDeleteExpired] (or a
// [dedup.Janitor]).
type Store struct {
	now func() time.Time

	mu        sync.Mutex
	keys      map[dedup.Key]*entry
	lastToken int64 // the highest token issued, of any key
}

var (
	_ dedup.LeaseStore         = (*Store)(nil)
	_ dedup.Expirer            = (*Store)(nil)
	_ dedupdriver.Peeker       = (*Store)(nil)
	_ dedupdriver.RecordFinder = (*Store)(nil)
	_ dedupdriver.KeyLister    = (*Store)(nil)
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

// LeaseClaim takes key for lease unless it is done, dead or held by a live
// lease. The token is higher than every token the store issued before, for
// any key, and at least the current time in microseconds.
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
	case e.status == dead:
		return dedup.Claim{State: dedup.StateDead, Attempts: e.attempts, FirstFailedAt: e.firstFailed}, nil
	case e.status == processing && now.Before(e.until):
		return dedup.Claim{State: dedup.StateInFlight, Attempts: e.attempts, Until: e.until}, nil
	}
	s.lastToken = max(s.lastToken+1, e.token+1, now.UnixMicro())
	e.status = processing
	e.attempts++
	e.token = s.lastToken
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

// LeaseRelease marks key failed, claimable at once, if token is still
// current. An abandoned attempt ([dedup.Failure.Abandoned]) records no
// failure, and its count is taken back.
func (s *Store) LeaseRelease(ctx context.Context, key dedup.Key, token int64, f dedup.Failure) error {
	return s.end(ctx, key, token, func(e *entry) {
		e.status = failed
		if f.Abandoned {
			e.attempts = max(e.attempts-1, 0)
			return
		}
		e.recordFailure(f)
	})
}

// LeaseBury marks key dead, recording f, if token is still current. The
// record keeps its expiry.
func (s *Store) LeaseBury(ctx context.Context, key dedup.Key, token int64, f dedup.Failure) error {
	return s.end(ctx, key, token, func(e *entry) {
		e.status, e.grant = dead, ""
		e.recordFailure(f)
	})
}

// recordFailure keeps the first failure's time and sets the last one's.
func (e *entry) recordFailure(f dedup.Failure) {
	if e.firstFailed.IsZero() {
		e.firstFailed = f.At
	}
	e.lastFailed, e.lastErr = f.At, f.Err
}

// LeaseExtend moves the end of token's lease to lease from now, if token
// is still current, and returns it. The record is kept at least as long as
// the lease.
func (s *Store) LeaseExtend(ctx context.Context, key dedup.Key, token int64, lease time.Duration) (time.Time, error) {
	if err := ctx.Err(); err != nil {
		return time.Time{}, err
	}
	now := s.now()
	s.mu.Lock()
	defer s.mu.Unlock()
	e := s.keys[key]
	if e == nil || e.token != token || e.status != processing {
		return time.Time{}, dedup.ErrLeaseLost
	}
	e.until = now.Add(lease)
	if e.expires.Before(e.until) {
		e.expires = e.until
	}
	return e.until, nil
}

// InboxGrantReplay writes grant on key if it is dead and reports whether
// it was.
func (s *Store) InboxGrantReplay(ctx context.Context, key dedup.Key, grant string) (bool, error) {
	if grant == "" {
		return false, fmt.Errorf("memory: grant replay of consumer %q key %q: %w", key.Consumer, key.Key, dedup.ErrNoGrant)
	}
	if err := ctx.Err(); err != nil {
		return false, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	e := s.keys[key]
	if e == nil || e.status != dead {
		return false, nil
	}
	e.grant = grant
	return true, nil
}

// InboxHasRecord reports whether key has an entry, in any state, that
// [Store.InboxDeleteExpired] has not deleted.
func (s *Store) InboxHasRecord(ctx context.Context, key dedup.Key) (bool, error) {
	if err := ctx.Err(); err != nil {
		return false, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.keys[key] != nil, nil
}

// InboxReopen makes a dead key claimable again, as a failed one with no
// attempts, if grant is the one written on it, and reports whether it
// reopened it.
func (s *Store) InboxReopen(ctx context.Context, key dedup.Key, grant string) (bool, error) {
	if err := ctx.Err(); err != nil {
		return false, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	e := s.keys[key]
	if e == nil || e.status != dead || grant == "" || e.grant != grant {
		return false, nil
	}
	e.status, e.attempts = failed, 0
	return true, nil
}

// InboxReplayGranted reports whether key holds grant.
func (s *Store) InboxReplayGranted(ctx context.Context, key dedup.Key, grant string) (bool, error) {
	if err := ctx.Err(); err != nil {
		return false, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	e := s.keys[key]
	return e != nil && grant != "" && e.grant == grant, nil
}

// InboxDeadCopy counts a copy of key that arrived while it was dead; it
// does nothing to a key that is not dead.
func (s *Store) InboxDeadCopy(ctx context.Context, key dedup.Key) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if e := s.keys[key]; e != nil && e.status == dead {
		e.deadCopies++
	}
	return nil
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
	case e.status == dead:
		return dedup.Claim{State: dedup.StateDead, Attempts: e.attempts, FirstFailedAt: e.firstFailed}, nil
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
