package console

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/dlq"
)

// The console reads the tables with queries of its own, which select only
// what a page shows: a list row takes the start of the error and no
// payload, an entry's page the first MaxPayload bytes of its payload and
// its length. Every value from a request is a parameter; the only names
// in the SQL are sqlschema's, validated.

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

// isEmpty reports whether cr selects every entry.
func (cr criteria) isEmpty() bool {
	return len(cr.IDs) == 0 && cr.Topic == "" && cr.Consumer == "" && cr.Error == "" && cr.Group == "" &&
		cr.Since.IsZero() && cr.Until.IsZero()
}

// args numbers a query's parameters.
type args []any

// add appends v and returns its placeholder.
func (a *args) add(v any) string {
	*a = append(*a, v)
	return "$" + strconv.Itoa(len(*a))
}

// where renders cr as a WHERE clause (empty when cr selects everything),
// its parameters appended to a.
func (cr criteria) where(a *args) string {
	var conds []string
	if len(cr.IDs) > 0 {
		conds = append(conds, "id = ANY("+a.add(cr.IDs)+")")
	}
	// Strings are cleaned as dlq's publisher cleans what it stores.
	if cr.Topic != "" {
		conds = append(conds, "topic = "+a.add(clean(cr.Topic)))
	}
	if cr.Consumer != "" {
		conds = append(conds, "consumer = "+a.add(clean(cr.Consumer)))
	}
	if cr.Error != "" {
		conds = append(conds, "strpos(lower(error), lower("+a.add(clean(cr.Error))+")) > 0")
	}
	if cr.Group != "" {
		conds = append(conds, normalizeSQL("error")+" = "+a.add(clean(cr.Group)))
	}
	if !cr.Since.IsZero() {
		conds = append(conds, "dead_at >= "+a.add(cr.Since))
	}
	if !cr.Until.IsZero() {
		conds = append(conds, "dead_at <= "+a.add(cr.Until))
	}
	if len(conds) == 0 {
		return ""
	}
	return " WHERE " + strings.Join(conds, " AND ")
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
func counted(attempts int, source, stream string) dlq.Counted {
	md := map[string]string{}
	if source != "" {
		md[delivery.DeadAttemptsSource] = source
	}
	if stream != "" {
		md[delivery.DeadStream] = stream
	}
	return dlq.Entry{Attempts: attempts, Metadata: md}.AttemptsCounted()
}

// countDead counts the entries cr selects.
func (c *Console) countDead(ctx context.Context, cr criteria) (int, error) {
	if c.my != nil {
		return c.my.countDead(ctx, cr)
	}
	var a args
	var n int
	if err := c.cfg.Pool.QueryRow(ctx, `SELECT count(*) FROM `+c.names.DLQ+cr.where(&a), a...).Scan(&n); err != nil {
		return 0, fmt.Errorf("console: count dead letters: %w", err)
	}
	return n, nil
}

// listDead returns one page of the entries cr selects, newest (highest id)
// first.
func (c *Console) listDead(ctx context.Context, cr criteria, limit, offset int) ([]listRow, error) {
	if c.my != nil {
		return c.my.listDead(ctx, cr, limit, offset)
	}
	var a args
	where := cr.where(&a)
	q := `SELECT id, uuid, topic, consumer, key, attempts, left(error, ` + strconv.Itoa(maxErrorListed) + `),
	length(error) > ` + strconv.Itoa(maxErrorListed) + `, permanent, dead_at, replay_requested_at IS NOT NULL, length(payload),
	COALESCE(metadata->>'` + delivery.DeadAttemptsSource + `', ''), COALESCE(metadata->>'` + delivery.DeadStream + `', '')
FROM ` + c.names.DLQ + where + ` ORDER BY id DESC LIMIT ` + a.add(limit) + ` OFFSET ` + a.add(offset)
	rows, err := c.cfg.Pool.Query(ctx, q, a...)
	if err != nil {
		return nil, fmt.Errorf("console: list dead letters: %w", err)
	}
	list, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (listRow, error) {
		var (
			l              listRow
			source, stream string
		)
		err := row.Scan(&l.ID, &l.UUID, &l.Topic, &l.Consumer, &l.Key, &l.Attempts, &l.Error, &l.ErrorTruncated,
			&l.Permanent, &l.DeadAt, &l.ReplayRequested, &l.PayloadSize, &source, &stream)
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
	if c.my != nil {
		return c.my.groups(ctx, cr, limit)
	}
	var a args
	where := cr.where(&a)
	q := `SELECT g, count(*), min(dead_at), max(dead_at), count(DISTINCT consumer), min(consumer),
	count(DISTINCT topic), min(topic), count(*) OVER ()
FROM (SELECT ` + normalizeSQL("error") + ` AS g, dead_at, consumer, topic FROM ` + c.names.DLQ + where + `) s
GROUP BY g ORDER BY count(*) DESC, g LIMIT ` + a.add(limit)
	rows, err := c.cfg.Pool.Query(ctx, q, a...)
	if err != nil {
		return nil, fmt.Errorf("console: group dead letters: %w", err)
	}
	groups, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (group, error) {
		var g group
		err := row.Scan(&g.Text, &g.Entries, &g.First, &g.Last, &g.Consumers, &g.Consumer, &g.Topics, &g.Topic, &g.GroupsInTotal)
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

// getEntry reads the entry id.
func (c *Console) getEntry(ctx context.Context, id int64) (entryRow, error) {
	if c.my != nil {
		return c.my.getEntry(ctx, id, c.cfg.MaxPayload)
	}
	var (
		e  entryRow
		md []byte
	)
	err := c.cfg.Pool.QueryRow(ctx, `SELECT id, uuid, topic, dlq_topic, consumer, key, attempts,
	left(error, `+strconv.Itoa(maxErrorShown)+`), length(error) > `+strconv.Itoa(maxErrorShown)+`, permanent,
	first_failed_at, last_failed_at, kafka_partition, kafka_offset,
	substring(payload FROM 1 FOR $2), length(payload), metadata, dead_at, replay_requested_at
FROM `+c.names.DLQ+` WHERE id = $1`, id, c.cfg.MaxPayload).Scan(
		&e.ID, &e.UUID, &e.Topic, &e.DLQTopic, &e.Consumer, &e.Key, &e.Attempts, &e.Error, &e.ErrorIsTruncated, &e.Permanent,
		&e.FirstFailedAt, &e.LastFailedAt, &e.Partition, &e.Offset, &e.Payload, &e.PayloadSize, &md, &e.DeadAt, &e.ReplayRequestedAt)
	if errors.Is(err, pgx.ErrNoRows) {
		return entryRow{}, errNoEntry
	}
	if err != nil {
		return entryRow{}, fmt.Errorf("console: read dead letter %d: %w", id, err)
	}
	if err := json.Unmarshal(md, &e.Metadata); err != nil {
		return entryRow{}, fmt.Errorf("console: dead letter %d: metadata: %w", id, err)
	}
	return e, nil
}

// target is one entry an action would touch.
type target struct {
	ID              int64
	Consumer, Topic string
	ReplayRequested bool
}

// targets returns, in id order, at most limit of the entries cr selects.
func (c *Console) targets(ctx context.Context, cr criteria, limit int) ([]target, error) {
	if c.my != nil {
		return c.my.targets(ctx, cr, limit)
	}
	var a args
	where := cr.where(&a)
	rows, err := c.cfg.Pool.Query(ctx, `SELECT id, consumer, topic, replay_requested_at IS NOT NULL FROM `+c.names.DLQ+where+
		` ORDER BY id LIMIT `+a.add(limit), a...)
	if err != nil {
		return nil, fmt.Errorf("console: select dead letters: %w", err)
	}
	ts, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (target, error) {
		var t target
		err := row.Scan(&t.ID, &t.Consumer, &t.Topic, &t.ReplayRequested)
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
	if c.my != nil {
		return c.my.inboxStats(ctx, now)
	}
	rows, err := c.cfg.Pool.Query(ctx, `SELECT consumer,
	count(*) FILTER (WHERE status = 'done' AND done_at >= $1),
	count(*) FILTER (WHERE status = 'done' AND done_at >= $2),
	count(*) FILTER (WHERE status = 'processing'),
	count(*) FILTER (WHERE status = 'failed'),
	count(*) FILTER (WHERE status = 'dead'),
	COALESCE(sum(dead_copies), 0)::bigint
FROM `+c.names.Inbox+` GROUP BY consumer ORDER BY consumer`, now.Add(-time.Hour), now.Add(-24*time.Hour))
	if err != nil {
		return nil, fmt.Errorf("console: inbox by consumer: %w", err)
	}
	stats, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (inboxStat, error) {
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
	if c.my != nil {
		return c.my.consumers(ctx)
	}
	t := c.names.Inbox
	rows, err := c.cfg.Pool.Query(ctx, `WITH RECURSIVE c(consumer) AS (
	(SELECT consumer FROM `+t+` ORDER BY consumer LIMIT 1)
	UNION ALL
	SELECT (SELECT i.consumer FROM `+t+` i WHERE i.consumer > c.consumer ORDER BY i.consumer LIMIT 1)
	FROM c WHERE c.consumer IS NOT NULL)
SELECT consumer FROM c WHERE consumer IS NOT NULL LIMIT $1`, maxConsumers)
	if err != nil {
		return nil, fmt.Errorf("console: inbox consumers: %w", err)
	}
	names, err := pgx.CollectRows(rows, pgx.RowTo[string])
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
	if c.my != nil {
		return c.my.lookupKey(ctx, consumer, key, c.cfg.MaxPayload)
	}
	var k inboxRow
	err := c.cfg.Pool.QueryRow(ctx, `SELECT status, attempts,
	left(COALESCE(first_error, ''), $3), left(COALESCE(last_error, ''), $3), first_failed_at, last_failed_at,
	substring(result FROM 1 FOR $4), length(result), created_at, updated_at, done_at, dead_at, lease_until, expires_at, dead_copies
FROM `+c.names.Inbox+` WHERE consumer = $1 AND key = $2`, clean(consumer), clean(key), maxErrorShown, c.cfg.MaxPayload).Scan(
		&k.Status, &k.Attempts, &k.FirstError, &k.LastError, &k.FirstFailedAt, &k.LastFailedAt,
		&k.Result, &k.ResultSize, &k.CreatedAt, &k.UpdatedAt, &k.DoneAt, &k.DeadAt, &k.LeaseUntil, &k.ExpiresAt, &k.DeadCopies)
	if errors.Is(err, pgx.ErrNoRows) {
		return inboxRow{}, errNoKey
	}
	if err != nil {
		return inboxRow{}, fmt.Errorf("console: look up key: %w", err)
	}
	return k, nil
}
