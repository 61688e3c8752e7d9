package retry

import (
	"context"
	"errors"

	"github.com/oncemill/oncemill/internal/sqldb"
)

// BringForward makes due now the n parked messages of consumer and topic
// that are due soonest and not yet due, leaving alone those out to the
// consumer: the poison middleware calls it once its handler succeeds
// again after failures, so that messages parked through an outage come
// back within seconds of its end instead of at their delayed slots. Their
// order per ordering key is kept: only the first message of a key waits
// for a due time (those behind it are due already and wait for it). It
// returns how many it changed; the due time is the database's clock.
func (s *Store) BringForward(ctx context.Context, consumer, topic string, n int) (int, error) {
	if s == nil {
		return 0, errors.New("retry: BringForward on a nil *Store")
	}
	if n < 1 {
		return 0, nil
	}
	now := s.d.Now()
	set := "due_at = " + now + ", version = version + 1"
	cond := "due_at > " + now + " AND (leased_until IS NULL OR leased_until < " + now + ")"
	sel := "SELECT p.id FROM " + s.names.Retries + " AS p WHERE p.consumer = ? AND p.topic = ? AND p." + cond +
		" ORDER BY p.due_at, p.id LIMIT ?"
	args := []any{s.d.Text(consumer), s.d.Text(topic), n}
	var (
		changed int64
		err     error
	)
	if s.d.WriteFromSelf {
		changed, err = s.exec(ctx, s.d.Rebind("UPDATE "+s.names.Retries+" SET "+set+" WHERE id IN ("+sel+")"), args...)
	} else {
		var ids []int64
		rows, qerr := s.db.Query(ctx, s.d.Rebind(sel), args...)
		if ids, err = sqldb.Collect(rows, qerr, sqldb.Value[int64]); err == nil && len(ids) > 0 {
			changed, err = s.exec(ctx, s.d.Rebind(s.d.ByIDs(s.names.Retries, set, cond)), idsJSON(ids))
		}
	}
	if err != nil {
		return 0, s.wrap("bring parked messages forward", err)
	}
	return int(changed), nil
}
