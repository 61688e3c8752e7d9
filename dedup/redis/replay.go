package redis

import (
	"context"
	"errors"
	"fmt"

	goredis "github.com/redis/go-redis/v9"

	"github.com/oncemill/oncemill/dedup"
)

// InboxGrantReplay writes grant on key's record if the key is dead, in
// the record's replay_grant field, and reports whether it was dead. It
// never fails open.
func (s *Store) InboxGrantReplay(ctx context.Context, key dedup.Key, grant string) (bool, error) {
	if grant == "" {
		return false, fmt.Errorf("redis: grant replay of consumer %q key %q: %w", key.Consumer, key.Key, dedup.ErrNoGrant)
	}
	n, err := s.grant.Run(ctx, s.client, []string{s.recordKey(key)}, grant).Int64()
	if err != nil {
		return false, s.wrap(ctx, "grant replay", err)
	}
	return n == 1, nil
}

// InboxReopen makes a dead key claimable again, as a failed key with no
// attempts, if grant is the one written on it, and reports whether it
// reopened it. Its failure history and expiry stay. It never fails open.
func (s *Store) InboxReopen(ctx context.Context, key dedup.Key, grant string) (bool, error) {
	if grant == "" {
		return false, nil
	}
	n, err := s.reopen.Run(ctx, s.client, []string{s.recordKey(key)}, grant).Int64()
	if err != nil {
		return false, s.wrap(ctx, "reopen", err)
	}
	return n == 1, nil
}

// InboxReplayGranted reports whether key's record holds grant. It never
// fails open.
func (s *Store) InboxReplayGranted(ctx context.Context, key dedup.Key, grant string) (bool, error) {
	if grant == "" {
		return false, nil
	}
	got, err := s.client.HGet(ctx, s.recordKey(key), "replay_grant").Result()
	if errors.Is(err, goredis.Nil) {
		return false, nil
	}
	if err != nil {
		return false, s.wrap(ctx, "read replay grant", err)
	}
	return got == grant, nil
}

// InboxHasRecord reports whether key has a record, in any state; Redis
// has deleted the records that expired. It never fails open.
func (s *Store) InboxHasRecord(ctx context.Context, key dedup.Key) (bool, error) {
	n, err := s.client.Exists(ctx, s.recordKey(key)).Result()
	if err != nil {
		return false, s.wrap(ctx, "read record", err)
	}
	return n == 1, nil
}

// InboxDeadCopy counts a copy of a dead key in the record's dead_copies
// field; it does nothing to a key that is not dead. It never fails open.
func (s *Store) InboxDeadCopy(ctx context.Context, key dedup.Key) error {
	if err := s.deadCopy.Run(ctx, s.client, []string{s.recordKey(key)}).Err(); err != nil {
		return s.wrap(ctx, "dead copy", err)
	}
	return nil
}
