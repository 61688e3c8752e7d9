package dlq

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/oncemill/oncemill/dedup"
)

// Granter writes replay grants on the dead keys of a consumer's inbox
// store: the inbox reopens a dead key only for the replayed copy that
// carries the grant written on the key's record, never for a copy that
// merely says it is a replay. Every oncemill store implements it
// ([dedup.Graveyard]). By default a [Store] and a [ReplaySubscriber] write
// grants on the PostgreSQL inbox table beside the dead-letter table (the
// same sqlschema.Config); a consumer whose inbox lives elsewhere (Redis,
// SQLite, another schema) passes its store instead ([Store.WithGranter],
// [ReplaySubscriberConfig.Granter]), or its replays are acked without
// running while its key stays dead.
type Granter interface {
	// InboxGrantReplay writes grant on key's record if the key is dead,
	// and reports whether it was.
	InboxGrantReplay(ctx context.Context, key dedup.Key, grant string) (bool, error)
}

// tableGranter writes grants on a PostgreSQL inbox table.
type tableGranter struct {
	pool  *pgxpool.Pool
	inbox string
}

// InboxGrantReplay writes grant on key's row if the key is dead. A missing
// inbox table is no error: the consumer's records are elsewhere, and it
// reports false.
func (g tableGranter) InboxGrantReplay(ctx context.Context, key dedup.Key, grant string) (bool, error) {
	tag, err := g.pool.Exec(ctx, `UPDATE `+g.inbox+` SET replay_grant = $3, updated_at = now()
WHERE consumer = $1 AND key = $2 AND status = 'dead'`, key.Consumer, key.Key, grant)
	var pgErr *pgconn.PgError
	switch {
	case errors.As(err, &pgErr) && pgErr.Code == "42P01": // undefined_table
		return false, nil
	case errors.As(err, &pgErr) && pgErr.Code == "42703": // undefined_column
		return false, fmt.Errorf("%w (the inbox table has no replay_grant column): %w", ErrNotMigrated, err)
	case err != nil:
		return false, err
	}
	return tag.RowsAffected() == 1, nil
}

// grantReplay writes a new replay grant for e's key through g, before e's
// replay is published, and returns it for the replayed copy to carry
// (delivery.Replay). The write commits on its own: the copy may reach the
// consumer before anything else the replay does commits. An entry with no
// consumer or key has no record to grant on; it still gets a fresh
// marker.
func grantReplay(ctx context.Context, g Granter, e Entry) (string, error) {
	grant, err := dedup.NewReplayGrant()
	if err != nil {
		return "", fmt.Errorf("dlq: replay entry %d: %w", e.ID, err)
	}
	if e.Consumer == "" || e.Key == "" {
		return grant, nil
	}
	if _, err := g.InboxGrantReplay(ctx, dedup.Key{Consumer: e.Consumer, Key: e.Key}, grant); err != nil {
		return "", fmt.Errorf("dlq: replay entry %d: grant the replay to consumer %q key %q: %w", e.ID, e.Consumer, e.Key, err)
	}
	return grant, nil
}
