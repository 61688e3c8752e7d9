package dlq

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/oncemill/oncemill/internal/sqldb"
)

// DefaultBeatEvery is how often a [ReplaySubscriber] announces itself
// when [ReplaySubscriberConfig.BeatEvery] is zero.
const DefaultBeatEvery = 10 * time.Second

// missedBeats is how many announcements a replay subscriber may miss
// before its consumer counts as having none running: one late beat (a
// slow database, a pause) does not raise an alarm.
const missedBeats = 3

// Replayer is what the table knows of a consumer's replay subscribers:
// when one last announced itself, and how often it does.
type Replayer struct {
	// Consumer is the consumer the subscriber delivers replays to.
	Consumer string `json:"consumer"`
	// SeenAt is when a subscriber of the consumer last announced itself.
	SeenAt time.Time `json:"seen_at"`
	// BeatEvery is how often it announces itself.
	BeatEvery time.Duration `json:"beat_every"`
	// Alive is true when it announced itself within three beats, by the
	// database's clock: a replay requested for the consumer is picked up.
	Alive bool `json:"alive"`
}

// PendingReplay counts the entries of a consumer and topic whose replay
// to the consumer was requested and is not delivered yet.
type PendingReplay struct {
	Consumer string `json:"consumer"`
	Topic    string `json:"topic"`
	Entries  int    `json:"entries"`
	// Since is when the oldest of them was requested.
	Since time.Time `json:"since"`
}

// replayerQueries are the statements on the replayers table, in the
// dialect's placeholders.
func (t *table) replayerQueries(d *sqldb.Dialect) {
	rt := d.Quote(t.names.DLQName + "_replayers")
	if t.names.Schema != "" {
		rt = t.names.Schema + "." + rt
	}
	q := &t.q
	q.beatUpdate = `UPDATE ` + rt + ` SET seen_at = ` + d.Now() + `, beat_every_ms = ? WHERE consumer = ?`
	q.beatInsert = `INSERT INTO ` + rt + ` (consumer, seen_at, beat_every_ms) VALUES (?, ` + d.Now() + `, ?)` +
		d.InsertOnce("(consumer)", "consumer")
	cols := `consumer, ` + d.Micros("seen_at") + `, beat_every_ms, ` + d.Micros(d.Now())
	q.replayer = `SELECT ` + cols + ` FROM ` + rt + ` WHERE consumer = ?`
	q.replayers = `SELECT ` + cols + ` FROM ` + rt + ` ORDER BY consumer`
	q.pending = `SELECT consumer, topic, COUNT(*), ` + d.Micros("MIN(replay_requested_at)") + ` FROM ` + t.names.DLQ + `
WHERE replay_requested_at IS NOT NULL GROUP BY consumer, topic ORDER BY consumer, topic`
}

// beat announces that a replay subscriber of consumer runs, and beats
// every every.
func (t *table) beat(ctx context.Context, consumer string, every time.Duration) error {
	c := t.d.Text(sqldb.Ident(consumer))
	n, err := t.db.Exec(ctx, t.q.beatUpdate, every.Milliseconds(), c)
	if err == nil && n == 0 {
		_, err = t.db.Exec(ctx, t.q.beatInsert, c, every.Milliseconds())
	}
	if err != nil {
		return t.wrapReplayers("announce the replay subscriber of consumer "+fmt.Sprintf("%q", consumer), err)
	}
	return nil
}

// wrapReplayers is wrap, for the replayers table of a later migration.
func (t *table) wrapReplayers(op string, err error) error {
	if t.d.UndefinedTable(err) {
		return fmt.Errorf("dlq: %s: %w (the replayers table, migration dlq_replayers): %w", op, ErrNotMigrated, err)
	}
	return fmt.Errorf("dlq: %s: %w", op, err)
}

func scanReplayer(r sqldb.Row) (Replayer, error) {
	var (
		p          Replayer
		now        time.Time
		everyMilli int64
	)
	if err := r.Scan(&p.Consumer, sqldb.Time(&p.SeenAt), &everyMilli, sqldb.Time(&now)); err != nil {
		return Replayer{}, err
	}
	p.BeatEvery = time.Duration(everyMilli) * time.Millisecond
	p.Alive = now.Sub(p.SeenAt) <= missedBeats*p.BeatEvery
	return p, nil
}

// Replayer returns what the table knows of consumer's replay subscribers;
// ok is false when none ever announced itself. A table migrated before
// replay subscribers announced themselves is an error wrapping
// [ErrNotMigrated].
func (s *Store) Replayer(ctx context.Context, consumer string) (p Replayer, ok bool, err error) {
	p, err = scanReplayer(s.t.db.QueryRow(ctx, s.t.q.replayer, s.t.d.Text(sqldb.Ident(consumer))))
	switch {
	case errors.Is(err, sqldb.ErrNoRows):
		return Replayer{}, false, nil
	case err != nil:
		return Replayer{}, false, s.t.wrapReplayers(fmt.Sprintf("replay subscriber of consumer %q", consumer), err)
	}
	return p, true, nil
}

// Replayers returns every consumer whose replay subscriber ever announced
// itself, ordered by consumer.
func (s *Store) Replayers(ctx context.Context) ([]Replayer, error) {
	rows, err := s.t.db.Query(ctx, s.t.q.replayers)
	out, err := sqldb.Collect(rows, err, func(r sqldb.Rows) (Replayer, error) { return scanReplayer(r) })
	if err != nil {
		return nil, s.t.wrapReplayers("replay subscribers", err)
	}
	return out, nil
}

// PendingReplays counts, by consumer and topic, the entries whose replay
// to their consumer was requested and not delivered yet.
func (s *Store) PendingReplays(ctx context.Context) ([]PendingReplay, error) {
	rows, err := s.t.db.Query(ctx, s.t.q.pending)
	out, err := sqldb.Collect(rows, err, func(r sqldb.Rows) (PendingReplay, error) {
		var p PendingReplay
		err := r.Scan(&p.Consumer, &p.Topic, &p.Entries, sqldb.Time(&p.Since))
		return p, err
	})
	if err != nil {
		return nil, s.t.wrap("pending replays", err)
	}
	return out, nil
}

// NoReplayerError says that a replay to consumer would not be picked up:
// no replay subscriber of it announced itself lately (p.SeenAt is the
// last time one did; ok is false when none ever did). It wraps
// [ErrNoReplayer].
func NoReplayerError(consumer string, p Replayer, ok bool) error {
	since := "ever"
	if ok {
		since = "since " + p.SeenAt.Format(time.RFC3339)
	}
	return fmt.Errorf("%w for consumer %q %s", ErrNoReplayer, consumer, since)
}

// ErrNoReplayer is wrapped by the error of a replay to a consumer whose
// replay subscriber has not announced itself lately ([Store.Replayer]):
// the request would wait in the table until one runs. Replay the entry to
// its topic instead ([Store.Replay]; oncemill dlq replay --broker URL).
var ErrNoReplayer = errors.New("dlq: no replay subscriber seen")
