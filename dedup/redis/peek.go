package redis

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"time"

	goredis "github.com/redis/go-redis/v9"

	"github.com/oncemill/oncemill/dedup"
)

// InboxPeek reads key's record without claiming it, in one round trip that
// writes nothing. Under [FailOpen] an unavailable Redis answers
// [dedup.StateNew].
func (s *Store) InboxPeek(ctx context.Context, key dedup.Key) (dedup.Claim, error) {
	pass, probe := s.allow()
	if !pass {
		return s.skipped("peek", key), nil
	}
	reply, err := s.peek.Run(ctx, s.client, []string{s.recordKey(key)}).Slice()
	s.observe(ctx, probe, err)
	if err != nil {
		if s.failOpen(ctx, "peek", key, err) {
			return dedup.Claim{State: dedup.StateNew}, nil
		}
		return dedup.Claim{}, s.wrap(ctx, "peek", err)
	}
	f := fields(reply, 4)
	c := dedup.Claim{Attempts: int(f.int(1)), FirstFailedAt: f.time(3)}
	switch state := f.str(0); state {
	case "new":
		c.State = dedup.StateNew
	case "in_flight":
		c.State, c.Until = dedup.StateInFlight, f.time(2)
	case "done":
		c.State, c.Result = dedup.StateDone, f.bytes(4)
	case "dead":
		c.State = dedup.StateDead
	default:
		f.fail(fmt.Errorf("unexpected state %q", state))
	}
	if f.err != nil {
		return dedup.Claim{}, fmt.Errorf("redis: peek: %w", f.err)
	}
	return c, nil
}

// scanCount is the COUNT hint of each SCAN: how many keys Redis looks at per
// round trip.
const scanCount = 500

// InboxDoneKeys calls fn with every key of consumer completed at or after
// since (to the millisecond) that has not expired. It walks the consumer's
// keys with SCAN, scanCount at a time, and reads their status in one
// pipeline per batch, so memory does not grow with the number of keys.
// SCAN may return a key twice while Redis rehashes, so fn may see a key
// twice. It never fails open: an unavailable Redis returns an error
// wrapping [ErrUnavailable] under either policy.
func (s *Store) InboxDoneKeys(ctx context.Context, consumer string, since time.Time, fn func(key string) error) error {
	prefix := s.consumerPrefix(consumer)
	// The hash tag in the pattern holds no metacharacter, so go-redis
	// routes the SCAN to the node that owns the consumer's slot.
	match := globEscape(prefix) + "*"
	sinceMs := since.UnixMilli()
	var cursor uint64
	for {
		if err := ctx.Err(); err != nil {
			return err
		}
		keys, next, err := s.client.Scan(ctx, cursor, match, scanCount).Result()
		if err != nil {
			return s.wrap(ctx, "done keys: scan", err)
		}
		if err := s.emitDone(ctx, prefix, keys, sinceMs, fn); err != nil {
			return err
		}
		if next == 0 {
			return nil
		}
		cursor = next
	}
}

func (s *Store) emitDone(ctx context.Context, prefix string, keys []string, sinceMs int64, fn func(string) error) error {
	if len(keys) == 0 {
		return nil
	}
	cmds := make([]*goredis.SliceCmd, len(keys))
	// The pipeline's own error is that of its first failed command; each
	// command reports its own below, so that a stray key of another type
	// under the prefix is skipped rather than fatal.
	_, pipeErr := s.client.Pipelined(ctx, func(p goredis.Pipeliner) error {
		for i, k := range keys {
			cmds[i] = p.HMGet(ctx, k, "status", "done_at")
		}
		return nil
	})
	for i, k := range keys {
		vals, err := cmds[i].Result()
		if isWrongType(err) {
			continue // not one of the store's hashes
		}
		if err == nil && len(vals) < 2 {
			err = pipeErr
			if err == nil {
				err = fmt.Errorf("short HMGET reply %v", vals)
			}
		}
		if err != nil {
			return s.wrap(ctx, "done keys: read", err)
		}
		status, _ := vals[0].(string)
		doneAt, _ := vals[1].(string)
		if status != "done" {
			continue
		}
		if ms, err := strconv.ParseInt(doneAt, 10, 64); err != nil || ms < sinceMs {
			continue
		}
		if err := fn(strings.TrimPrefix(k, prefix)); err != nil {
			return err
		}
	}
	return nil
}

func isWrongType(err error) bool {
	return goredis.HasErrorPrefix(err, "WRONGTYPE")
}
