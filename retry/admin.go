package retry

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/internal/sqldb"
)

// What operators do with parked messages: list them, hand them back now,
// or cancel them into the dead-letter queue. Every change leaves a
// message that is out to its consumer (leased) alone: its handler runs,
// and its ack or failure decides.

// DefaultOverdue is the threshold past which a due message that was not
// handed back counts as overdue, for the console, the oncemill command
// and the metrics. A retry subscriber reads the table every second by
// default: a message due a minute ago and still waiting means that no
// subscriber of its consumer and topic runs (retry.Merge was left out, or
// the consumer is down), or that it is far behind.
const DefaultOverdue = time.Minute

// CancelReason starts the error of the dead letter of a cancelled parked
// message: a filter on it (dlq.Filter.ErrorContains, oncemill dlq list
// --error) finds them.
const CancelReason = "cancelled by operator"

var (
	// ErrInvalidFilter is returned, wrapped, for a [Filter] that is out
	// of range; the message names the field.
	ErrInvalidFilter = errors.New("retry: invalid filter")
	// ErrNoSelection is returned by [Store.RetryNow] and [Store.Cancel]
	// for a [Filter] that selects nothing in particular (no IDs, no
	// criterion) without Filter.All: acting on every parked message must
	// be asked for.
	ErrNoSelection = errors.New("retry: no parked messages selected: give IDs or a criterion, or set Filter.All to act on every parked message")
)

// Filter selects parked messages. Its fields combine with AND; a zero
// field does not filter. The zero Filter selects every parked message,
// which [Store.List] accepts and [Store.RetryNow] and [Store.Cancel]
// refuse unless All is set.
type Filter struct {
	// IDs selects these messages only. Each must be positive.
	IDs []int64
	// Consumer selects the messages parked by this consumer.
	Consumer string
	// Topic selects the messages consumed from this topic.
	Topic string
	// UUID selects the message with this UUID.
	UUID string
	// Key selects the messages of this idempotency key.
	Key string
	// OrderKey selects the messages of this ordering key.
	OrderKey string
	// Limit, when positive, keeps the first Limit matching messages, in
	// the order they are handed back (due time, then id). Zero means no
	// limit. It is not a criterion: a Filter with only a Limit is empty.
	Limit int
	// All lets [Store.RetryNow] and [Store.Cancel] act on an empty
	// Filter, that is on every parked message. With IDs or criteria it
	// changes nothing.
	All bool
}

// IsEmpty reports whether f has no IDs and no criterion (Limit and All
// are not criteria).
func (f Filter) IsEmpty() bool {
	return len(f.IDs) == 0 && f.Consumer == "" && f.Topic == "" && f.UUID == "" && f.Key == "" && f.OrderKey == ""
}

// Validate reports the first field of f that is out of range; the error
// wraps [ErrInvalidFilter] and names the field.
func (f Filter) Validate() error {
	if f.Limit < 0 {
		return fmt.Errorf("%w: Limit must be 0 (no limit) or more, got %d", ErrInvalidFilter, f.Limit)
	}
	for i, id := range f.IDs {
		if id <= 0 {
			return fmt.Errorf("%w: IDs[%d] must be positive, got %d", ErrInvalidFilter, i, id)
		}
	}
	return nil
}

// selection validates f for an operation that changes messages.
func (f Filter) selection() error {
	if err := f.Validate(); err != nil {
		return err
	}
	if f.IsEmpty() && !f.All {
		return ErrNoSelection
	}
	return nil
}

// query renders a query of what (on the table as p) for the messages f
// selects, in the order they are handed back with the limit applied, in
// the dialect's placeholders, and its arguments.
func (s *Store) query(f Filter, what string) (string, []any) {
	d := s.d
	var (
		conds []string
		args  []any
	)
	add := func(cond string, arg any) { conds, args = append(conds, cond), append(args, arg) }
	if len(f.IDs) > 0 {
		add("p.id IN ("+d.JSONInts("?")+")", idsJSON(f.IDs))
	}
	for _, c := range []struct{ col, v string }{
		{"p.consumer", f.Consumer}, {"p.topic", f.Topic}, {"p.uuid", f.UUID}, {"p." + d.Quote("key"), f.Key}, {"p.order_key", f.OrderKey},
	} {
		if c.v != "" {
			add(c.col+" = ?", s.text(c.v)) // as Park stored it
		}
	}
	q := "SELECT " + what + " FROM " + s.names.Retries + " AS p"
	if len(conds) > 0 {
		q += " WHERE " + strings.Join(conds, " AND ")
	}
	q += " ORDER BY p.due_at, p.id"
	if f.Limit > 0 {
		q += " LIMIT ?"
		args = append(args, f.Limit)
	}
	return d.Rebind(q), args
}

// waitsFor is the column of Message.WaitsFor, on the table as p.
func (s *Store) waitsFor() string {
	return `(SELECT MIN(e.id) FROM ` + s.names.Retries + ` AS e
	WHERE e.consumer = p.consumer AND e.topic = p.topic AND e.order_key = p.order_key AND e.id < p.id)`
}

// idsJSON is ids as the JSON array that Dialect.JSONInts and ByIDs take.
func idsJSON(ids []int64) string {
	b, _ := json.Marshal(ids) // integers always encode
	return string(b)
}

// List returns the parked messages f selects, in the order they are
// handed back: by due time, then id. Each says which message of its
// ordering key it waits for ([Message.WaitsFor]).
func (s *Store) List(ctx context.Context, f Filter) ([]Message, error) {
	if err := s.Ready(); err != nil {
		return nil, err
	}
	if err := f.Validate(); err != nil {
		return nil, err
	}
	q, args := s.query(f, s.cols+", "+s.waitsFor())
	rows, err := s.db.Query(ctx, q, args...)
	out, err := sqldb.Collect(rows, err, func(r sqldb.Rows) (Message, error) {
		var w sql.NullInt64
		m, err := scanMessage(r, &w)
		m.WaitsFor = w.Int64
		return m, err
	})
	if err != nil {
		return nil, s.wrap("list parked messages", err)
	}
	return out, nil
}

// Count returns how many parked messages f selects (at most f.Limit when
// it is set).
func (s *Store) Count(ctx context.Context, f Filter) (int, error) {
	if err := s.Ready(); err != nil {
		return 0, err
	}
	if err := f.Validate(); err != nil {
		return 0, err
	}
	q, args := s.query(f, "p.id")
	var n int
	if err := s.db.QueryRow(ctx, `SELECT COUNT(*) FROM (`+q+`) AS s`, args...).Scan(&n); err != nil {
		return 0, s.wrap("count parked messages", err)
	}
	return n, nil
}

// Missing returns those of ids that are not parked, in ascending order
// and without repeats; none when all are.
func (s *Store) Missing(ctx context.Context, ids []int64) ([]int64, error) {
	if err := s.Ready(); err != nil {
		return nil, err
	}
	if len(ids) == 0 {
		return nil, nil
	}
	found, err := s.selectIDs(ctx, Filter{IDs: ids}, "look up ids")
	if err != nil {
		return nil, err
	}
	var missing []int64
	for _, id := range ids {
		if !slices.Contains(found, id) && !slices.Contains(missing, id) {
			missing = append(missing, id)
		}
	}
	slices.Sort(missing)
	return missing, nil
}

// selectIDs returns the ids f selects, in the order they are handed back.
func (s *Store) selectIDs(ctx context.Context, f Filter, op string) ([]int64, error) {
	q, args := s.query(f, "p.id")
	rows, err := s.db.Query(ctx, q, args...)
	ids, err := sqldb.Collect(rows, err, sqldb.Value[int64])
	if err != nil {
		return nil, s.wrap(op, err)
	}
	return ids, nil
}

// Out reports whether m is out to its consumer at now: a subscriber
// handed it out and its lease still runs. Its handler decides its fate,
// and no operator's change touches it.
func (m Message) Out(now time.Time) bool {
	return m.LeasedUntil != nil && m.LeasedUntil.After(now)
}

// Due reports whether m may go out at now and waits for a subscriber to
// take it: its due time has passed, it is not out, and it waits for no
// message of its ordering key ([Message.WaitsFor], as [Store.List] sets
// it).
func (m Message) Due(now time.Time) bool {
	return m.WaitsFor == 0 && !m.DueAt.After(now) && !m.Out(now)
}

// Overdue reports whether m is [Message.Due] at now and has been for more
// than after ([DefaultOverdue]): no subscriber of its consumer and topic
// hands it back.
func (m Message) Overdue(now time.Time, after time.Duration) bool {
	return m.Due(now) && m.DueAt.Before(now.Add(-after))
}

// RetryNow makes the parked messages f selects due now, so that their
// consumer's subscriber hands them back at its next read, and returns how
// many it changed. It leaves alone a message that is due already (among
// them a message behind another of its ordering key, which goes out
// right after that one: retry the first of the key) and one that is out
// to its consumer. A message whose lease ran out without an ack or a
// nack is taken back: the copy still out can no longer park it again
// ([Store.Repark] reports false). The due time is the database's clock.
// An empty f is refused with [ErrNoSelection] unless f.All is set.
func (s *Store) RetryNow(ctx context.Context, f Filter) (int, error) {
	if err := s.Ready(); err != nil {
		return 0, err
	}
	if err := f.selection(); err != nil {
		return 0, err
	}
	now := s.d.Now()
	set := "due_at = " + now + ", leased_until = NULL, version = version + 1"
	cond := "due_at > " + now + " AND (leased_until IS NULL OR leased_until < " + now + ")"
	var (
		n   int64
		err error
	)
	if s.d.WriteFromSelf {
		// One statement: the selection is a subquery of the UPDATE.
		sel, args := s.query(f, "p.id")
		q := "UPDATE " + s.names.Retries + " SET " + set + " WHERE id IN (" + sel + ") AND " + cond
		n, err = s.exec(ctx, q, args...)
	} else {
		// MySQL's UPDATE may not select from its own table: the ids
		// first, then each row through the primary key. cond holds again
		// at the write.
		var ids []int64
		if ids, err = s.selectIDs(ctx, f, "retry now: select"); err != nil || len(ids) == 0 {
			return 0, err
		}
		n, err = s.exec(ctx, s.d.Rebind(s.d.ByIDs(s.names.Retries, set, cond)), idsJSON(ids))
	}
	if err != nil {
		return 0, s.wrap("retry now", err)
	}
	return int(n), nil
}

// exec runs q in a READ COMMITTED transaction of its own: on MySQL an
// UPDATE that way neither waits on nor blocks what it does not change.
func (s *Store) exec(ctx context.Context, q string, args ...any) (n int64, err error) {
	err = sqldb.InTx(ctx, s.db, readCommitted, func(tx sqldb.Tx) error {
		n, err = tx.Exec(ctx, q, args...)
		return err
	})
	return n, err
}

// cancelBatch is how many parked messages one transaction of Cancel
// moves.
const cancelBatch = 100

// topicNamer is a dead-letter publisher that names the topic it files
// dead letters under (dlq.Publisher: "dlq").
type topicNamer interface{ DefaultTopic() string }

// distinctPublisher is a dead-letter publisher that can file each
// message as an entry of its own, never merged into an entry its table
// holds already (dlq.Publisher.PublishDistinct).
type distinctPublisher interface {
	PublishDistinct(topic string, msgs ...*message.Message) error
}

// Cancel moves the parked messages f selects to the dead-letter queue,
// through dead, under the dead-letter topic topic ("" takes dead's
// DefaultTopic, as dlq.Publisher has: "dlq"), and returns how many it
// moved. A message is never dropped: its dead letter is published before
// its row is deleted, and a publish that fails leaves the row.
//
// With the dead-letter table on the same database (dlq.NewPublisher or
// dlq.NewSQLPublisher with the same sqlschema.Config), the dead letters
// are written in the transaction that deletes the rows, cancelBatch
// messages at a time: both happen or neither. With any other publisher
// (a broker's topic), the rows are locked while it publishes and deleted
// once it returned; a commit that fails then leaves a message parked and
// dead-lettered too, never neither.
//
// Each dead letter carries the message's UUID, payload and metadata and
// the facts of its failures (delivery.Dead*: topic, consumer, key,
// attempts, first and last failure), with an error that starts with
// [CancelReason] and ends with the last error. The message's key keeps
// the inbox record its last attempt left (failed, or none for a message
// that waited behind another): a replay of the dead letter runs it as a
// retry. A message out to its consumer is left alone: its handler runs,
// and decides. The messages of an ordering key that waited behind a
// cancelled one are handed back next, as after an ack.
//
// A cancelled message is never merged into a dead letter that is there
// already: the dead-letter table keeps one entry per message (consumer,
// topic, UUID and key), and one of the same message may be there, written
// when another copy of it was dead-lettered. Through a publisher that
// can (dlq.Publisher's PublishDistinct) the cancelled message gets an
// entry of its own, filed under a uuid made unique for it with its own
// UUID in delivery.DeadUUID, so that its payload is not deleted with its
// row unseen.
//
// An empty f is refused with [ErrNoSelection] unless f.All is set.
func (s *Store) Cancel(ctx context.Context, f Filter, dead message.Publisher, topic string) (int, error) {
	if err := s.Ready(); err != nil {
		return 0, err
	}
	if dead == nil {
		return 0, errors.New("retry: cancel: the dead-letter publisher is nil: pass dlq.NewPublisher's (or NewSQLPublisher's) on this database")
	}
	if topic == "" {
		n, ok := dead.(topicNamer)
		if !ok {
			return 0, fmt.Errorf("retry: cancel: the dead-letter topic is empty: name it, or pass a publisher that names its own (dlq.Publisher); %T does not", dead)
		}
		topic = n.DefaultTopic()
	}
	if err := f.selection(); err != nil {
		return 0, err
	}
	ids, err := s.selectIDs(ctx, f, "cancel: select")
	if err != nil {
		return 0, err
	}
	moved := 0
	for batch := range slices.Chunk(ids, cancelBatch) {
		n, err := s.cancel(ctx, batch, dead, topic)
		moved += n
		if err != nil {
			return moved, err
		}
	}
	return moved, nil
}

// cancel moves the messages of ids that are not out to the dead-letter
// queue in one transaction. It waits for the rows a lease holds (FOR
// UPDATE, not SKIP LOCKED: on MySQL a subscriber's read of the due
// messages locks, for an instant, rows it does not take), and skips those
// the lease took, which the condition reads again once it has them.
func (s *Store) cancel(ctx context.Context, ids []int64, dead message.Publisher, topic string) (int, error) {
	r := s.names.Retries
	lock := s.d.Rebind(`SELECT ` + s.cols + ` FROM ` + r + ` WHERE id IN (` + s.d.JSONInts("?") + `)
AND (leased_until IS NULL OR leased_until < ` + s.d.FromMicros("?") + `) ORDER BY id` + s.d.LockRow(false))
	remove := s.d.Rebind(s.d.ByIDs(r, "", ""))
	n := 0
	err := sqldb.InTx(ctx, s.db, readCommitted, func(tx sqldb.Tx) error {
		rows, err := tx.Query(ctx, lock, idsJSON(ids), time.Now().UnixMicro())
		ms, err := sqldb.Collect(rows, err, func(r sqldb.Rows) (Message, error) { return scanMessage(r) })
		if err != nil || len(ms) == 0 {
			return err
		}
		// The dead-letter table's publisher finds the transaction in
		// the context and writes in it, on the same database.
		joined := sqldb.Join(ctx, tx)
		letters := make([]*message.Message, len(ms))
		taken := make([]int64, len(ms))
		for i, m := range ms {
			letters[i] = deadLetter(m)
			letters[i].SetContext(joined)
			taken[i] = m.ID
		}
		publish := dead.Publish
		if d, ok := dead.(distinctPublisher); ok {
			publish = d.PublishDistinct
		}
		if err := publish(topic, letters...); err != nil {
			return fmt.Errorf("publish %d dead letters to %q (the messages stay parked): %w", len(letters), topic, err)
		}
		if _, err := tx.Exec(ctx, remove, idsJSON(taken)); err != nil {
			return fmt.Errorf("delete %d parked messages after their dead letters: %w", len(taken), err)
		}
		n = len(ms)
		return nil
	})
	if err != nil {
		return 0, s.wrap("cancel", err)
	}
	return n, nil
}

// deadLetter is the dead letter of m, cancelled: as the poison
// middleware dead-letters a message, with the reason.
func deadLetter(m Message) *message.Message {
	msg := message.NewMessage(m.UUID, m.Payload)
	for k, v := range m.Metadata {
		msg.Metadata.Set(k, v)
	}
	reason := CancelReason + " while it waited behind a parked message of its ordering key"
	if !m.Behind {
		reason = fmt.Sprintf("%s while parked for a delayed retry after %d failed %s; last error: %s",
			CancelReason, m.Attempts, plural(m.Attempts, "attempt", "attempts"), m.Error)
	}
	md := msg.Metadata
	md.Set(delivery.DeadTopic, m.Topic)
	md.Set(delivery.DeadConsumer, m.Consumer)
	md.Set(delivery.DeadKey, m.Key)
	md.Set(delivery.DeadAttempts, strconv.Itoa(m.Attempts))
	md.Set(delivery.DeadError, reason)
	md.Set(delivery.DeadPermanent, "false")
	for k, t := range map[string]time.Time{delivery.DeadFirstFailedAt: m.FirstFailedAt, delivery.DeadLastFailedAt: m.LastFailedAt} {
		if !t.IsZero() {
			md.Set(k, t.UTC().Format(time.RFC3339Nano))
		}
	}
	return msg
}

func plural(n int, one, many string) string {
	if n == 1 {
		return one
	}
	return many
}
