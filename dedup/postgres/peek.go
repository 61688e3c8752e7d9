package postgres

import (
	"context"
	"errors"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/oncemill/oncemill/dedup"
)

// InboxPeek reads key's committed record in one statement, claiming
// nothing: StateDone with the stored result, StateInFlight while a live
// lease holds it, else StateNew.
func (s *Store) InboxPeek(ctx context.Context, key dedup.Key) (dedup.Claim, error) {
	var (
		status      string
		c           dedup.Claim
		until       *time.Time
		firstFailed *time.Time
		leased      bool
	)
	err := s.db.QueryRow(ctx, s.q.Peek, key.Consumer, key.Key).
		Scan(&status, &c.Attempts, &until, &c.Result, &firstFailed, &leased)
	if errors.Is(err, pgx.ErrNoRows) {
		return dedup.Claim{State: dedup.StateNew}, nil
	}
	if err != nil {
		return dedup.Claim{}, interpret(ctx, "peek", err)
	}
	if firstFailed != nil {
		c.FirstFailedAt = *firstFailed
	}
	switch {
	case status == "done":
		c.State = dedup.StateDone
	case status == "dead":
		c.State, c.Result = dedup.StateDead, nil
	case leased:
		c.State, c.Until, c.Result = dedup.StateInFlight, *until, nil
	default:
		c.State, c.Result = dedup.StateNew, nil
	}
	return c, nil
}

// InboxHasRecord reports whether key has a row, in any state.
func (s *Store) InboxHasRecord(ctx context.Context, key dedup.Key) (bool, error) {
	var ok bool
	if err := s.db.QueryRow(ctx, s.q.HasRecord, key.Consumer, key.Key).Scan(&ok); err != nil {
		return false, interpret(ctx, "read record", err)
	}
	return ok, nil
}

// InboxDoneKeys streams the keys consumer completed at or after since, one
// row at a time from the server.
func (s *Store) InboxDoneKeys(ctx context.Context, consumer string, since time.Time, fn func(key string) error) error {
	rows, err := s.db.Query(ctx, s.q.DoneKeys, consumer, since)
	if err != nil {
		return interpret(ctx, "done keys", err)
	}
	defer rows.Close()
	var key string
	for rows.Next() {
		if err := rows.Scan(&key); err != nil {
			return interpret(ctx, "done keys", err)
		}
		if err := fn(key); err != nil {
			return err
		}
	}
	if err := rows.Err(); err != nil {
		return interpret(ctx, "done keys", err)
	}
	return nil
}
