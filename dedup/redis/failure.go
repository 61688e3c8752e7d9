package redis

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	goredis "github.com/redis/go-redis/v9"

	"github.com/oncemill/oncemill/dedup"
	"github.com/oncemill/oncemill/internal/breaker"
)

// ErrUnavailable is wrapped by the errors returned while Redis cannot be
// reached or cannot serve the command (connection refused or lost, timeout,
// pool exhausted, LOADING, READONLY, OOM…), under [FailClosed], or by
// [Store.InboxDoneKeys] under either policy. The message should be nacked
// and retried later. Errors that are not wrapped with it (a script error, a
// key of the wrong type, a refused password) will not go away by retrying.
var ErrUnavailable error = unavailableError{}

// unavailableError is [ErrUnavailable]: it also matches
// dedup.ErrUnavailable, so that the middlewares see an outage whatever the
// store.
type unavailableError struct{}

func (unavailableError) Error() string { return "redis: server unavailable" }

func (unavailableError) Is(target error) bool { return target == dedup.ErrUnavailable }

// allow asks the breaker whether a claim or peek may call Redis, under
// FailOpen; under FailClosed every call does.
func (s *Store) allow() (pass, probe bool) {
	if s.policy != FailOpen {
		return true, false
	}
	return s.breaker.Allow(time.Now())
}

// observe gives the breaker, under FailOpen, the outcome of a claim or
// peek that called Redis and ended with err, and logs its change, if any.
func (s *Store) observe(ctx context.Context, probe bool, err error) {
	if s.policy != FailOpen {
		return
	}
	s.breaker.Observe(ctx, probe, err, unavailable, s.logger, breaker.Lines{
		Opened: "Redis unavailable: circuit breaker open, claims and peeks fail open without calling Redis",
		Closed: "Redis answers again: circuit breaker closed",
	})
}

// skipped answers a claim or peek that the open breaker kept from Redis,
// as failOpen does.
func (s *Store) skipped(op string, key dedup.Key) dedup.Claim {
	s.failedOpen.Add(1)
	s.logger.Error("Redis unavailable: failing open, the message is processed without dedup", s.openErr, watermill.LogFields{
		"op": op, "consumer": key.Consumer, "key": key.Key, "breaker": "open",
	})
	return dedup.Claim{State: dedup.StateNew}
}

// failOpen reports whether err is to be answered as a new key: the policy
// is FailOpen and err means Redis is unavailable. It counts and logs it.
func (s *Store) failOpen(ctx context.Context, op string, key dedup.Key, err error) bool {
	if s.policy != FailOpen || ctx.Err() != nil || !unavailable(err) {
		return false
	}
	s.failedOpen.Add(1)
	s.logger.Error("Redis unavailable: failing open, the message is processed without dedup", err, watermill.LogFields{
		"op": op, "consumer": key.Consumer, "key": key.Key,
	})
	return true
}

// wrap prefixes err with the operation and, when it means Redis is
// unavailable, wraps ErrUnavailable. The caller's own cancellation is not
// unavailability.
func (s *Store) wrap(ctx context.Context, op string, err error) error {
	if ctx.Err() == nil && unavailable(err) {
		return fmt.Errorf("redis: %s: %w: %w", op, ErrUnavailable, err)
	}
	return fmt.Errorf("redis: %s: %w", op, err)
}

// unavailable reports whether err means that Redis could not serve the
// command rather than that the command is wrong. Anything that is not an
// error reply from the server (network errors, timeouts, io.EOF, a pool
// timeout, a closed client) is unavailability; of the error replies, only
// those a healthy server would not give are.
func unavailable(err error) bool {
	var reply goredis.Error
	if !errors.As(err, &reply) {
		return true
	}
	// The codes of a server that cannot serve now: loading its data set,
	// a replica, a master without its replicas, a cluster without quorum,
	// out of memory under noeviction, busy running a long script, refusing
	// writes because it cannot persist, or full of clients.
	codes := [...]string{
		"LOADING ", "READONLY ", "MASTERDOWN ", "CLUSTERDOWN ", "TRYAGAIN ", "NOREPLICAS ",
		"OOM ", "BUSY ", "MISCONF ", "ERR max number of clients reached",
	}
	msg := reply.Error()
	for _, code := range codes {
		// Redis 7 passes a script's failed call on with its own code;
		// Redis 6 wraps it: "ERR Error running script …: -READONLY …".
		if strings.HasPrefix(msg, code) || strings.Contains(msg, "-"+code) {
			return true
		}
	}
	return false
}
