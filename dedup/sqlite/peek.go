package sqlite

import (
	"context"
	"database/sql"
	"errors"
	"time"

	"github.com/oncemill/oncemill/dedup"
)

// InboxPeek reads key's committed record in one statement, claiming
// nothing: StateDone with the stored result, else StateNew (this store has
// no leases).
func (s *Store) InboxPeek(ctx context.Context, key dedup.Key) (dedup.Claim, error) {
	var (
		status      string
		c           dedup.Claim
		firstFailed sql.NullInt64
	)
	err := s.db.QueryRowContext(ctx, s.q.peek, key.Consumer, key.Key, micros(time.Now())).
		Scan(&status, &c.Attempts, &c.Result, &firstFailed)
	if errors.Is(err, sql.ErrNoRows) {
		return dedup.Claim{State: dedup.StateNew}, nil
	}
	if err != nil {
		return dedup.Claim{}, interpret("peek", err)
	}
	if firstFailed.Valid {
		c.FirstFailedAt = time.UnixMicro(firstFailed.Int64)
	}
	switch status {
	case "done":
		c.State = dedup.StateDone
	case "dead":
		c.State, c.Result = dedup.StateDead, nil
	default:
		c.State, c.Result = dedup.StateNew, nil
	}
	return c, nil
}

// InboxHasRecord reports whether key has a row, in any state.
func (s *Store) InboxHasRecord(ctx context.Context, key dedup.Key) (bool, error) {
	var ok bool
	if err := s.db.QueryRowContext(ctx, s.q.hasRecord, key.Consumer, key.Key).Scan(&ok); err != nil {
		return false, interpret("read record", err)
	}
	return ok, nil
}

// InboxDoneKeys streams the keys consumer completed at or after since.
func (s *Store) InboxDoneKeys(ctx context.Context, consumer string, since time.Time, fn func(key string) error) error {
	rows, err := s.db.QueryContext(ctx, s.q.doneKeys, consumer, micros(since), micros(time.Now()))
	if err != nil {
		return interpret("done keys", err)
	}
	defer rows.Close()
	var key string
	for rows.Next() {
		if err := rows.Scan(&key); err != nil {
			return interpret("done keys", err)
		}
		if err := fn(key); err != nil {
			return err
		}
	}
	if err := rows.Err(); err != nil {
		return interpret("done keys", err)
	}
	return nil
}
