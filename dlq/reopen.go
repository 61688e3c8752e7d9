package dlq

import (
	"context"
	"errors"
	"fmt"

	"github.com/oncemill/oncemill/internal/sqldb"
)

// ErrNoKey is returned, wrapped, by [Store.Reopen] for an entry with no
// consumer or no key: there is no record to reopen, and a copy of the
// message runs as a new message anyway.
var ErrNoKey = errors.New("dlq: the entry has no consumer or key")

// ErrReopenElsewhere is returned, wrapped, by [Store.Reopen] on a store
// whose replays grant on another inbox store ([Store.WithGranter]): a
// reopen changes the record on the inbox table beside the dead-letter
// table, in one transaction with the entry's removal.
var ErrReopenElsewhere = errors.New("dlq: reopen works on the inbox table beside the dead-letter table only")

// Reopen gives the dead key of entry id's next copy, whichever payload it
// carries, the right to run once: the corrected-data case, where the
// producer sends the message again with the data fixed (a replay would
// run the old payload). In one transaction the key's record on the inbox
// table beside the dead-letter table goes from dead to failed with no
// attempts (as a granted replay reopens it) and the entry is deleted, so
// the next copy of the key to reach the consumer is claimed and runs; once
// it is done, the copies after it are duplicates. It returns the entry it
// deleted.
//
// Reopen refuses, and changes nothing, for an entry that is gone
// ([ErrNotFound]), that has no consumer or key ([ErrNoKey]), whose key is
// not dead in the inbox table ([ErrNoDeadKey]: the consumer's inbox is
// elsewhere, or the key was replayed, reopened or expired), or on a store
// that grants on another store ([ErrReopenElsewhere]).
func (s *Store) Reopen(ctx context.Context, id int64) (Entry, error) {
	if _, ok := s.grants.(tableGranter); !ok {
		return Entry{}, fmt.Errorf("dlq: reopen entry %d: %w; reopen it on a Store without WithGranter (oncemill dlq reopen without --inbox)", id, ErrReopenElsewhere)
	}
	var e Entry
	err := sqldb.InTx(ctx, s.t.db, readCommitted, func(tx sqldb.Tx) error {
		var err error
		e, err = scanEntry(tx.QueryRow(ctx, s.t.q.lockOne, id))
		if errors.Is(err, sqldb.ErrNoRows) {
			return fmt.Errorf("%w: %d (or another replay holds it)", ErrNotFound, id)
		}
		if err != nil {
			return s.t.wrap(fmt.Sprintf("reopen entry %d: lock", id), err)
		}
		if e.Consumer == "" || e.Key == "" {
			return fmt.Errorf("dlq: reopen entry %d (uuid %s): %w: nothing to reopen, a copy of the message runs as a new one", id, e.UUID, ErrNoKey)
		}
		consumer, key, ok := s.t.d.InboxLookup(e.Consumer, e.Key)
		var n int64
		if ok {
			n, err = tx.Exec(ctx, s.t.q.reopen, consumer, key)
		}
		if err != nil {
			return s.t.wrap(fmt.Sprintf("reopen entry %d: reopen consumer %q key %q", id, e.Consumer, e.Key), err)
		}
		if n != 1 {
			return fmt.Errorf("dlq: reopen entry %d (uuid %s): consumer %q key %q is not dead in %s: %w; "+
				"the entry stays: its key was replayed, reopened or expired, or the consumer's inbox is another store, where a corrected copy must be let through there",
				id, e.UUID, e.Consumer, e.Key, tableGranter{s.t}, ErrNoDeadKey)
		}
		if _, err := tx.Exec(ctx, s.t.q.reopenFailure, consumer, key); err != nil {
			return s.t.wrap(fmt.Sprintf("reopen entry %d: reset the failure record", id), err)
		}
		if _, err := tx.Exec(ctx, s.t.q.forgetStarts, consumer, key); err != nil {
			return s.t.wrap(fmt.Sprintf("reopen entry %d: forget the started attempts", id), err)
		}
		if _, err := tx.Exec(ctx, s.t.q.removeOne, id); err != nil {
			return s.t.wrap(fmt.Sprintf("reopen entry %d: delete it", id), err)
		}
		return nil
	})
	if err != nil {
		return Entry{}, err
	}
	return e, nil
}
