package dlq

import (
	"context"
	"errors"
	"fmt"

	"github.com/oncemill/oncemill/dedup"
	"github.com/oncemill/oncemill/dedup/dedupdriver"
)

// ErrNoDeadKey is returned, wrapped, by [Store.Replay] for an entry whose
// key has no record in the store its replay grants on: the consumer's
// inbox is another store (Redis, another database or schema), where the key
// stays dead and the copy would be acked without running, or its record
// expired after the dedup window. The entry stays in the table, and
// nothing is published for it. Pass the consumer's inbox store
// ([Store.WithGranter]; oncemill dlq replay --inbox URL); for a record
// that expired, [Store.WithNewKeys] (--force) replays the entry as a new
// key.
var ErrNoDeadKey = errors.New("dlq: the key has no record in the inbox store the replay grants on")

// Granter writes replay grants on the dead keys of a consumer's inbox
// store: the inbox reopens a dead key only for the replayed copy that
// carries the grant written on the key's record, never for a copy that
// merely says it is a replay. Every oncemill store implements it
// ([dedup.Graveyard]). By default a [Store] and a
// [ReplaySubscriber] write grants on the inbox table beside the
// dead-letter table (the same sqlschema.Config); a consumer whose inbox
// lives elsewhere (Redis, another database or schema) passes its store instead
// ([Store.WithGranter], [ReplaySubscriberConfig.Granter]). A replay whose
// key is not dead in the granter's store goes on only when the granter
// is a [dedupdriver.RecordFinder], as every oncemill store is, that holds a
// record of the key (done, failed or in flight: the copy is a duplicate
// or a normal retry); otherwise it is refused with [ErrNoDeadKey], since
// the key's dead mark may be in another store.
type Granter interface {
	// InboxGrantReplay writes grant on key's record if the key is dead,
	// and reports whether it was.
	InboxGrantReplay(ctx context.Context, key dedup.Key, grant string) (bool, error)
}

var _ dedupdriver.RecordFinder = tableGranter{}

// tableGranter writes grants on the inbox table beside the dead-letter
// table (the same sqlschema.Config), whose keys are as the family's inbox
// store holds them (Dialect.InboxKey).
type tableGranter struct{ t *table }

// InboxGrantReplay writes grant on key's row if the key is dead. A missing
// inbox table is no error: the consumer's records are elsewhere, and it
// reports false.
func (g tableGranter) InboxGrantReplay(ctx context.Context, key dedup.Key, grant string) (bool, error) {
	consumer, k, ok := g.t.d.InboxLookup(key.Consumer, key.Key)
	if !ok {
		return false, nil // not text: no inbox holds it
	}
	n, err := g.t.db.Exec(ctx, g.t.q.grant, grant, consumer, k)
	switch {
	case g.t.d.UndefinedTable(err):
		return false, nil
	case g.t.d.UndefinedColumn(err):
		return false, fmt.Errorf("%w (the inbox table has no replay_grant column): %w", ErrNotMigrated, err)
	case err != nil:
		return false, err
	}
	return n == 1, nil
}

// InboxHasRecord reports whether key has a row in the inbox table; a
// missing table holds none.
func (g tableGranter) InboxHasRecord(ctx context.Context, key dedup.Key) (bool, error) {
	consumer, k, ok := g.t.d.InboxLookup(key.Consumer, key.Key)
	if !ok {
		return false, nil // not text: no inbox holds it
	}
	var n int
	err := g.t.db.QueryRow(ctx, g.t.q.hasRecord, consumer, k).Scan(&n)
	if g.t.d.UndefinedTable(err) {
		return false, nil
	}
	return n > 0, err
}

// String names the table, for errors.
func (g tableGranter) String() string {
	return "the inbox table " + g.t.names.Inbox + " beside the dead-letter table (" + g.t.d.String() + ")"
}

// grantReplay writes a new replay grant for e's key through g, before e's
// replay is published, and returns it for the replayed copy to carry
// (delivery.Replay). The write commits on its own: the copy may reach the
// consumer before anything else the replay does commits. An entry with no
// consumer or key has no record to grant on: its copy runs as a plain
// message, and it still gets a fresh marker. When the key is not dead in
// g, the replay goes on only if g holds a record of the key (the copy is
// then a duplicate or a retry there), or if newKeys says to run it as a
// new key; otherwise the error wraps [ErrNoDeadKey].
func grantReplay(ctx context.Context, g Granter, e Entry, newKeys bool) (string, error) {
	grant, err := dedup.NewReplayGrant()
	if err != nil {
		return "", fmt.Errorf("dlq: replay entry %d: %w", e.ID, err)
	}
	if e.Consumer == "" || e.Key == "" {
		return grant, nil
	}
	key := dedup.Key{Consumer: e.Consumer, Key: e.Key}
	dead, err := g.InboxGrantReplay(ctx, key, grant)
	if err != nil {
		return "", fmt.Errorf("dlq: replay entry %d: grant the replay to consumer %q key %q: %w", e.ID, e.Consumer, e.Key, err)
	}
	if dead || newKeys {
		return grant, nil
	}
	if f, ok := g.(dedupdriver.RecordFinder); ok {
		found, err := f.InboxHasRecord(ctx, key)
		if err != nil {
			return "", fmt.Errorf("dlq: replay entry %d: read the record of consumer %q key %q: %w", e.ID, e.Consumer, e.Key, err)
		}
		if found {
			return grant, nil
		}
	}
	where := "the inbox store the replay grants on"
	if s, ok := g.(fmt.Stringer); ok {
		where = s.String()
	}
	return "", fmt.Errorf("dlq: replay entry %d (uuid %s): consumer %q key %q has no record in %s: %w; "+
		"the entry stays: if the consumer's inbox is another store (Redis, another database or schema), "+
		"pass it (Store.WithGranter or ReplaySubscriberConfig.Granter in Go, --inbox URL on the command line), or the copy is acked there without running; "+
		"if its record expired, replay it as a new key (Store.WithNewKeys, or --force)",
		e.ID, e.UUID, e.Consumer, e.Key, where, ErrNoDeadKey)
}
