package redis

import (
	"context"
	"fmt"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	goredis "github.com/redis/go-redis/v9"

	"github.com/oncemill/oncemill/dedup"
	"github.com/oncemill/oncemill/dedup/dedupdriver"
	"github.com/oncemill/oncemill/internal/breaker"
)

// Store keeps one Redis hash per (consumer, key). It implements
// [dedup.LeaseStore], [dedupdriver.Peeker] and [dedupdriver.KeyLister], is safe
// for concurrent use, and starts no goroutines. Records expire by themselves
// (PEXPIRE), so it needs no janitor.
type Store struct {
	client goredis.UniversalClient
	prefix string
	policy Policy
	logger watermill.LoggerAdapter

	claim, complete, release, bury, extend *goredis.Script
	peek, reopen, deadCopy, grant          *goredis.Script

	// breaker guards claims and peeks under FailOpen; openErr is the cause
	// logged for the answers it fails open.
	breaker *breaker.Breaker
	openErr error

	failedOpen atomic.Int64
}

var (
	_ dedup.LeaseStore         = (*Store)(nil)
	_ dedupdriver.Peeker       = (*Store)(nil)
	_ dedupdriver.RecordFinder = (*Store)(nil)
	_ dedupdriver.KeyLister    = (*Store)(nil)
)

// New returns a store on cfg.Client; cfg is copied, defaulted and
// validated. It makes no call to Redis.
func New(cfg Config) (*Store, error) {
	cfg = cfg.withDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	return &Store{
		client:   cfg.Client,
		prefix:   cfg.Prefix,
		policy:   cfg.Policy,
		logger:   cfg.Logger,
		claim:    goredis.NewScript(claimSource),
		complete: goredis.NewScript(completeSource),
		release:  goredis.NewScript(releaseSource),
		bury:     goredis.NewScript(burySource),
		extend:   goredis.NewScript(extendSource),
		peek:     goredis.NewScript(peekSource),
		reopen:   goredis.NewScript(reopenSource),
		deadCopy: goredis.NewScript(deadCopySource),
		grant:    goredis.NewScript(grantSource),
		breaker:  breaker.New(cfg.BreakerFailures, cfg.BreakerProbe),
		openErr: fmt.Errorf("redis: circuit breaker open after %d unavailable calls in a row, Redis probed every %s: %w",
			cfg.BreakerFailures, cfg.BreakerProbe, ErrUnavailable),
	}, nil
}

// Stats returns the store's counters.
func (s *Store) Stats() Stats {
	open, opens, skipped := s.breaker.State()
	return Stats{FailedOpen: s.failedOpen.Load(), Skipped: skipped, BreakerOpens: opens, BreakerOpen: open}
}

// LeaseClaim takes key for lease unless it is done, dead or held by a live
// lease. A new claim counts an attempt, issues a token higher than any
// earlier one of the key (the server's time in microseconds, or the last
// token + 1 if that is higher), and sets the record to expire window (or
// lease, if longer) from now. Every answer carries the time of the key's
// first recorded failure, if any.
func (s *Store) LeaseClaim(ctx context.Context, key dedup.Key, lease, window time.Duration) (dedup.Claim, error) {
	if lease <= 0 || window <= 0 {
		return dedup.Claim{}, fmt.Errorf("redis: lease claim: lease and window must be positive, got %s and %s", lease, window)
	}
	ttl := max(window, lease) // a record must outlive its lease, or a zombie's token could be reissued
	pass, probe := s.allow()
	if !pass {
		return s.skipped("lease claim", key), nil
	}
	reply, err := s.claim.Run(ctx, s.client, []string{s.recordKey(key)}, millis(lease), millis(ttl)).Slice()
	s.observe(ctx, probe, err)
	if err != nil {
		if s.failOpen(ctx, "lease claim", key, err) {
			return dedup.Claim{State: dedup.StateNew}, nil
		}
		return dedup.Claim{}, s.wrap(ctx, "lease claim", err)
	}
	f := fields(reply, 5)
	c := dedup.Claim{Attempts: int(f.int(1)), FirstFailedAt: f.time(4)}
	switch state := f.str(0); state {
	case "new":
		c.State, c.Token, c.Until = dedup.StateNew, f.int(2), f.time(3)
	case "in_flight":
		c.State, c.Until = dedup.StateInFlight, f.time(3)
	case "done":
		c.State, c.Result = dedup.StateDone, f.bytes(5)
	case "dead":
		c.State = dedup.StateDead
	default:
		f.fail(fmt.Errorf("unexpected state %q", state))
	}
	if f.err != nil {
		return dedup.Claim{}, fmt.Errorf("redis: lease claim: %w", f.err)
	}
	return c, nil
}

// LeaseComplete marks key done with result if token is still current. A
// nil result stores none, and a later claim answers a nil Result.
func (s *Store) LeaseComplete(ctx context.Context, key dedup.Key, token int64, result []byte) error {
	if token == 0 && s.policy == FailOpen {
		return nil // the claim failed open: there is no lease to complete
	}
	stored := "0"
	if result != nil {
		stored = "1"
	}
	return s.end(ctx, "lease complete", s.complete, key, strconv.FormatInt(token, 10), result, stored)
}

// LeaseRelease marks key failed, claimable at once, if token is still
// current, and records f; the first failure's text and time are kept. An
// abandoned attempt ([dedup.Failure.Abandoned]) records no failure, and its
// count is taken back.
func (s *Store) LeaseRelease(ctx context.Context, key dedup.Key, token int64, f dedup.Failure) error {
	if token == 0 && s.policy == FailOpen {
		return nil // the claim failed open: there is no lease to release
	}
	abandoned := "0"
	if f.Abandoned {
		abandoned = "1"
	}
	return s.end(ctx, "lease release", s.release, key, strconv.FormatInt(token, 10), f.Err, failedAt(f), abandoned)
}

// LeaseBury marks key dead if token is still current, and records f as
// LeaseRelease does. Claims and peeks answer [dedup.StateDead] until
// [Store.InboxReopen]; the record keeps its expiry, like a done one.
func (s *Store) LeaseBury(ctx context.Context, key dedup.Key, token int64, f dedup.Failure) error {
	if token == 0 && s.policy == FailOpen {
		return nil // the claim failed open: there is no lease to bury
	}
	return s.end(ctx, "lease bury", s.bury, key, strconv.FormatInt(token, 10), f.Err, failedAt(f))
}

// failedAt is f's time in milliseconds, or "" for the server's time.
func failedAt(f dedup.Failure) string {
	if f.At.IsZero() {
		return ""
	}
	return strconv.FormatInt(f.At.UnixMilli(), 10)
}

// LeaseExtend moves the end of token's lease to lease from now, on the
// server's clock, if token is still current, and returns it; the record is
// kept at least until then. Under [FailOpen], token 0 is extended without
// Redis, on the local clock.
func (s *Store) LeaseExtend(ctx context.Context, key dedup.Key, token int64, lease time.Duration) (time.Time, error) {
	if lease <= 0 {
		return time.Time{}, fmt.Errorf("redis: lease extend: lease must be positive, got %s", lease)
	}
	if token == 0 && s.policy == FailOpen {
		return time.Now().Add(lease), nil // the claim failed open: there is no lease to extend
	}
	until, err := s.extend.Run(ctx, s.client, []string{s.recordKey(key)}, strconv.FormatInt(token, 10), millis(lease)).Int64()
	if err != nil {
		return time.Time{}, s.wrap(ctx, "lease extend", err)
	}
	if until == 0 {
		return time.Time{}, fmt.Errorf("redis: lease extend: consumer %q key %q: %w", key.Consumer, key.Key, dedup.ErrLeaseLost)
	}
	return time.UnixMilli(until), nil
}

func (s *Store) end(ctx context.Context, op string, script *goredis.Script, key dedup.Key, args ...any) error {
	n, err := script.Run(ctx, s.client, []string{s.recordKey(key)}, args...).Int64()
	if err != nil {
		// Completing or releasing never fails open: the lease is still
		// held, and it expires by itself once Redis is back.
		return s.wrap(ctx, op, err)
	}
	if n == 0 {
		return fmt.Errorf("redis: %s: consumer %q key %q: %w", op, key.Consumer, key.Key, dedup.ErrLeaseLost)
	}
	return nil
}
