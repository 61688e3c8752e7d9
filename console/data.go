package console

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/dlq"
	"github.com/oncemill/oncemill/forwarder"
	"github.com/oncemill/oncemill/internal/sqldb"
)

// The console reads the tables with queries of its own, which select only
// what a page shows: a list row takes the start of the error and no
// payload, an entry's page the first MaxPayload bytes of its payload and
// its length. Every value from a request is a parameter; the only names
// in the SQL are sqlschema's, validated. Each query is written once, with
// '?' and the dialect's builders: times leave the database as
// microseconds since the epoch and enter the same way, so that neither a
// session's time zone nor a driver's parsing matters.

// criteria select dead letters, as the filter form and a group give them;
// they mean what dlq.Filter's fields mean, plus the group.
type criteria struct {
	IDs                    []int64
	Topic, Consumer, Error string
	// Group selects the entries whose NormalizeError is this; "" does
	// not filter.
	Group        string
	Since, Until time.Time
}

// stmt is q, written with '?' and {DLQ}, {INBOX}, {key} and {error}, in
// the database's dialect ([sqldb.Dialect.Named]).
func (c *Console) stmt(q string) string { return c.db.Dialect().Named(q, c.names) }

// where renders cr as a WHERE clause (empty when cr selects everything)
// and its arguments.
func (c *Console) where(cr criteria) (string, []any) {
	d := c.db.Dialect()
	var (
		conds []string
		args  []any
	)
	add := func(cond string, vs ...any) { conds, args = append(conds, cond), append(args, vs...) }
	if len(cr.IDs) > 0 {
		ids := make([]any, len(cr.IDs))
		for i, id := range cr.IDs {
			ids[i] = id
		}
		add("id IN "+sqldb.List(len(ids)), ids...)
	}
	// Strings are cleaned as dlq's publisher cleans what it stores.
	if cr.Topic != "" {
		add("topic = ?", d.Text(clean(cr.Topic)))
	}
	if cr.Consumer != "" {
		add("consumer = ?", d.Text(clean(cr.Consumer)))
	}
	if cr.Error != "" {
		add(d.Position("lower(?)", "lower({error})")+" > 0", clean(cr.Error))
	}
	if cr.Group != "" {
		add(normalizeSQL(d, "{error}")+" = ?", clean(cr.Group))
	}
	if !cr.Since.IsZero() {
		add("dead_at >= "+d.FromMicros("?"), cr.Since.UnixMicro())
	}
	if !cr.Until.IsZero() {
		add("dead_at <= "+d.FromMicros("?"), cr.Until.UnixMicro())
	}
	if len(conds) == 0 {
		return "", nil
	}
	return " WHERE " + strings.Join(conds, " AND "), args
}

// clean makes s comparable with stored text: invalid UTF-8 and NUL become
// U+FFFD, as the dead-letter publisher stores them.
func clean(s string) string {
	s = strings.ToValidUTF8(s, "\uFFFD")
	return strings.ReplaceAll(s, "\x00", "\uFFFD")
}

// listRow is a dead letter as the list shows it.
type listRow struct {
	ID                   int64
	UUID                 string
	Topic, Consumer, Key string
	Attempts             int
	Error                string
	Permanent            bool
	DeadAt               time.Time
	ReplayRequested      bool
	PayloadSize          int
	ErrorTruncated       bool
	// Counted says what Attempts counts and who counted it.
	Counted dlq.Counted
}

// counted says what a listed entry's attempts count, from the source and
// the JetStream stream its metadata records.
func counted(attempts int, source, stream *string) dlq.Counted {
	md := map[string]string{}
	if source != nil && *source != "" {
		md[delivery.DeadAttemptsSource] = *source
	}
	if stream != nil && *stream != "" {
		md[delivery.DeadStream] = *stream
	}
	return dlq.Entry{Attempts: attempts, Metadata: md}.AttemptsCounted()
}

// countDead counts the entries cr selects.
func (c *Console) countDead(ctx context.Context, cr criteria) (int, error) {
	where, args := c.where(cr)
	var n int
	if err := c.db.QueryRow(ctx, c.stmt(`SELECT count(*) FROM {DLQ}`+where), args...).Scan(&n); err != nil {
		return 0, fmt.Errorf("console: count dead letters: %w", err)
	}
	return n, nil
}

// listDead returns one page of the entries cr selects, newest (highest id)
// first.
func (c *Console) listDead(ctx context.Context, cr criteria, limit, offset int) ([]listRow, error) {
	d := c.db.Dialect()
	where, args := c.where(cr)
	q := `SELECT id, uuid, topic, consumer, {key}, attempts, substr({error}, 1, ` + strconv.Itoa(maxErrorListed) + `),
	` + d.CharLength("{error}") + ` > ` + strconv.Itoa(maxErrorListed) + `, permanent, ` + d.Micros("dead_at") + `, replay_requested_at IS NOT NULL, length(payload),
	` + d.JSONText("metadata", delivery.DeadAttemptsSource) + `, ` + d.JSONText("metadata", delivery.DeadStream) + `
FROM {DLQ}` + where + ` ORDER BY id DESC LIMIT ? OFFSET ?`
	rows, err := c.db.Query(ctx, c.stmt(q), append(args, limit, offset)...)
	list, err := sqldb.Collect(rows, err, func(row sqldb.Rows) (listRow, error) {
		var (
			l              listRow
			source, stream *string
		)
		err := row.Scan(&l.ID, &l.UUID, &l.Topic, &l.Consumer, &l.Key, &l.Attempts, &l.Error, &l.ErrorTruncated, &l.Permanent,
			sqldb.Time(&l.DeadAt), &l.ReplayRequested, &l.PayloadSize, &source, &stream)
		l.Counted = counted(l.Attempts, source, stream)
		return l, err
	})
	if err != nil {
		return nil, fmt.Errorf("console: list dead letters: %w", err)
	}
	return list, nil
}

// group is a set of dead letters with one normalised error.
type group struct {
	Text          string
	Entries       int
	First, Last   time.Time
	Consumers     int
	Consumer      string // the first, by name
	Topics        int
	Topic         string // the first, by name
	GroupsInTotal int    // how many groups cr has
}

// groups counts the entries cr selects by normalised error, in SQL: only
// the groups come out of the database, largest first.
func (c *Console) groups(ctx context.Context, cr criteria, limit int) ([]group, error) {
	d := c.db.Dialect()
	where, args := c.where(cr)
	q := `SELECT g, count(*), ` + d.Micros("min(dead_at)") + `, ` + d.Micros("max(dead_at)") + `, count(DISTINCT consumer), min(consumer),
	count(DISTINCT topic), min(topic), count(*) OVER ()
FROM (SELECT ` + normalizeSQL(d, "{error}") + ` AS g, dead_at, consumer, topic FROM {DLQ}` + where + `) s
GROUP BY g ORDER BY count(*) DESC, g LIMIT ?`
	rows, err := c.db.Query(ctx, c.stmt(q), append(args, limit)...)
	groups, err := sqldb.Collect(rows, err, func(row sqldb.Rows) (group, error) {
		var g group
		err := row.Scan(&g.Text, &g.Entries, sqldb.Time(&g.First), sqldb.Time(&g.Last), &g.Consumers, &g.Consumer, &g.Topics, &g.Topic, &g.GroupsInTotal)
		return g, err
	})
	if err != nil {
		return nil, fmt.Errorf("console: group dead letters: %w", err)
	}
	return groups, nil
}

// entryRow is one dead letter as its page shows it: the payload cut at
// MaxPayload, and its full size.
type entryRow struct {
	ID                            int64
	UUID, Topic, DLQTopic         string
	Consumer, Key                 string
	Attempts                      int
	Error                         string
	Permanent                     bool
	FirstFailedAt, LastFailedAt   *time.Time
	Partition                     *int32
	Offset                        *int64
	Payload                       []byte
	PayloadSize                   int
	Metadata                      map[string]string
	DeadAt                        time.Time
	ReplayRequestedAt             *time.Time
	CopiesSince                   int
	CopiesKnown, ErrorIsTruncated bool
}

// errNoEntry is returned by getEntry for an id with no entry.
var errNoEntry = errors.New("console: no such dead letter")

// getEntry reads the entry id, and the copies of its key the inbox
// refused since.
func (c *Console) getEntry(ctx context.Context, id int64) (entryRow, error) {
	d := c.db.Dialect()
	var (
		e  entryRow
		md []byte
	)
	err := c.db.QueryRow(ctx, c.stmt(`SELECT id, uuid, topic, dlq_topic, consumer, {key}, attempts, substr({error}, 1, `+strconv.Itoa(maxErrorShown)+`),
	`+d.CharLength("{error}")+` > `+strconv.Itoa(maxErrorShown)+`, permanent, `+d.MicrosEach("first_failed_at", "last_failed_at")+`,
	kafka_partition, kafka_offset, substr(payload, 1, ?), length(payload), metadata, `+d.MicrosEach("dead_at", "replay_requested_at")+`
FROM {DLQ} WHERE id = ?`), c.cfg.MaxPayload, id).Scan(
		&e.ID, &e.UUID, &e.Topic, &e.DLQTopic, &e.Consumer, &e.Key, &e.Attempts, &e.Error, &e.ErrorIsTruncated, &e.Permanent,
		sqldb.TimeOrNil(&e.FirstFailedAt), sqldb.TimeOrNil(&e.LastFailedAt), &e.Partition, &e.Offset, &e.Payload, &e.PayloadSize, &md,
		sqldb.Time(&e.DeadAt), sqldb.TimeOrNil(&e.ReplayRequestedAt))
	if errors.Is(err, sqldb.ErrNoRows) {
		return entryRow{}, errNoEntry
	}
	if err != nil {
		return entryRow{}, fmt.Errorf("console: read dead letter %d: %w", id, err)
	}
	if err := json.Unmarshal(md, &e.Metadata); err != nil {
		return entryRow{}, fmt.Errorf("console: dead letter %d: metadata: %w", id, err)
	}
	// The copies of the dead key the inbox refused since: unknown
	// without the key's dead row.
	e.CopiesSince, e.CopiesKnown, err = c.dlq.CopiesSince(ctx, dlq.Entry{ID: e.ID, Consumer: e.Consumer, Key: e.Key})
	if err != nil {
		return entryRow{}, fmt.Errorf("console: dead letter %d: copies since: %w", id, err)
	}
	return e, nil
}

// target is one entry an action would touch.
type target struct {
	ID              int64
	Consumer, Topic string
	ReplayRequested bool
	// Key and Permanent say whether a replay can succeed
	// (dlq.Entry.Hopeless).
	Key       string
	Permanent bool
}

// targets returns, in id order, at most limit of the entries cr selects.
func (c *Console) targets(ctx context.Context, cr criteria, limit int) ([]target, error) {
	where, args := c.where(cr)
	rows, err := c.db.Query(ctx, c.stmt(`SELECT id, consumer, topic, replay_requested_at IS NOT NULL, {key}, permanent FROM {DLQ}`+where+
		` ORDER BY id LIMIT ?`), append(args, limit)...)
	ts, err := sqldb.Collect(rows, err, func(row sqldb.Rows) (target, error) {
		var t target
		err := row.Scan(&t.ID, &t.Consumer, &t.Topic, &t.ReplayRequested, &t.Key, &t.Permanent)
		return t, err
	})
	if err != nil {
		return nil, fmt.Errorf("console: select dead letters: %w", err)
	}
	return ts, nil
}

// inboxStat is one consumer's line of the overview.
type inboxStat struct {
	Consumer                  string
	LastHour, LastDay         int
	Processing, Failing, Dead int
	DeadCopies                int64
}

// inboxStats aggregates the inbox table per consumer, in one scan.
func (c *Console) inboxStats(ctx context.Context, now time.Time) ([]inboxStat, error) {
	from := c.db.Dialect().FromMicros("?")
	rows, err := c.db.Query(ctx, c.stmt(`SELECT i.consumer,
	count(CASE WHEN i.status = 'done' AND i.done_at >= `+from+` THEN 1 END),
	count(CASE WHEN i.status = 'done' AND i.done_at >= `+from+` THEN 1 END),
	count(CASE WHEN i.status = 'processing' THEN 1 END),
	count(CASE WHEN i.status = 'failed' THEN 1 END),
	count(CASE WHEN i.status = 'dead' THEN 1 END),
	COALESCE(sum(f.dead_copies), 0)
FROM {INBOX} i LEFT JOIN {INBOX_FAILURES} f ON f.consumer = i.consumer AND f.{key} = i.{key}
GROUP BY i.consumer ORDER BY i.consumer`), now.Add(-time.Hour).UnixMicro(), now.Add(-24*time.Hour).UnixMicro())
	stats, err := sqldb.Collect(rows, err, func(row sqldb.Rows) (inboxStat, error) {
		var s inboxStat
		err := row.Scan(&s.Consumer, &s.LastHour, &s.LastDay, &s.Processing, &s.Failing, &s.Dead, &s.DeadCopies)
		return s, err
	})
	if err != nil {
		return nil, fmt.Errorf("console: inbox by consumer: %w", err)
	}
	return stats, nil
}

// consumers returns the inbox's consumers, in order, at most
// maxConsumers; it walks the primary key (a loose index scan), one lookup
// per consumer, rather than the table.
func (c *Console) consumers(ctx context.Context) ([]string, error) {
	rows, err := c.db.Query(ctx, c.stmt(`WITH RECURSIVE c(consumer) AS (
	SELECT min(consumer) FROM {INBOX}
	UNION ALL
	SELECT (SELECT i.consumer FROM {INBOX} i WHERE i.consumer > c.consumer ORDER BY i.consumer LIMIT 1)
	FROM c WHERE c.consumer IS NOT NULL)
SELECT consumer FROM c WHERE consumer IS NOT NULL LIMIT ?`), maxConsumers)
	names, err := sqldb.Collect(rows, err, sqldb.Value[string])
	if err != nil {
		return nil, fmt.Errorf("console: inbox consumers: %w", err)
	}
	return names, nil
}

// inboxRow is one inbox record, its result cut at MaxPayload.
type inboxRow struct {
	Status                      string
	Attempts                    int
	FirstError, LastError       string
	FirstFailedAt, LastFailedAt *time.Time
	Result                      []byte
	ResultSize                  *int
	CreatedAt, UpdatedAt        time.Time
	DoneAt, DeadAt, LeaseUntil  *time.Time
	ExpiresAt                   time.Time
	DeadCopies                  int
}

// errNoKey is returned by lookupKey for a key with no record.
var errNoKey = errors.New("console: no inbox record")

// lookupKey reads the inbox record of consumer's key.
func (c *Console) lookupKey(ctx context.Context, consumer, key string) (inboxRow, error) {
	d := c.db.Dialect()
	var k inboxRow
	consumer, key = d.InboxKey(clean(consumer), clean(key))
	// A key's record is its row of the inbox table and, when something
	// failed, its row of the failure table; a done key without one was
	// created and last updated when it was done.
	err := c.db.QueryRow(ctx, c.stmt(`SELECT i.status, COALESCE(f.attempts, CASE WHEN i.status = 'done' THEN 1 ELSE 0 END),
	substr(COALESCE(f.first_error, ''), 1, ?), substr(COALESCE(f.last_error, ''), 1, ?),
	`+d.MicrosEach("f.first_failed_at", "f.last_failed_at")+`, substr(i.result, 1, ?), length(i.result),
	`+d.MicrosEach("COALESCE(f.created_at, i.done_at, i.expires_at)", "COALESCE(f.updated_at, i.done_at, i.expires_at)",
		"i.done_at", "f.dead_at", "i.lease_until", "i.expires_at")+`, COALESCE(f.dead_copies, 0)
FROM {INBOX} i LEFT JOIN {INBOX_FAILURES} f ON f.consumer = i.consumer AND f.{key} = i.{key}
WHERE i.consumer = ? AND i.{key} = ?`), maxErrorShown, maxErrorShown, c.cfg.MaxPayload, d.Text(consumer), d.Text(key)).Scan(
		&k.Status, &k.Attempts, &k.FirstError, &k.LastError, sqldb.TimeOrNil(&k.FirstFailedAt), sqldb.TimeOrNil(&k.LastFailedAt),
		&k.Result, &k.ResultSize, sqldb.Time(&k.CreatedAt), sqldb.Time(&k.UpdatedAt), sqldb.TimeOrNil(&k.DoneAt),
		sqldb.TimeOrNil(&k.DeadAt), sqldb.TimeOrNil(&k.LeaseUntil), sqldb.Time(&k.ExpiresAt), &k.DeadCopies)
	if errors.Is(err, sqldb.ErrNoRows) {
		return inboxRow{}, errNoKey
	}
	if err != nil {
		return inboxRow{}, fmt.Errorf("console: look up key: %w", err)
	}
	return k, nil
}

// outboxLag measures the outbox's backlog, as a relay would.
func (c *Console) outboxLag(ctx context.Context) (forwarder.Lag, error) {
	if c.cfg.Pool != nil {
		return forwarder.OutboxLag(ctx, c.cfg.Pool, c.cfg.Schema)
	}
	return forwarder.SQLOutboxLag(ctx, c.cfg.DB, c.cfg.Dialect, c.cfg.Schema)
}

// undefined reports whether err says that a table is missing: the
// migrations did not run there.
func (c *Console) undefined(err error) bool { return c.db.Dialect().UndefinedTable(err) }
