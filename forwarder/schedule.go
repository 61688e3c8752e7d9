package forwarder

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/oncemill/oncemill/internal/sqldb"
	"github.com/oncemill/oncemill/sqlschema"
)

// DueAtKey is the metadata key of a message's due time, an RFC 3339 time
// (time.RFC3339Nano, in UTC), as [PublishAt] and [Delay] set it. A
// message written through the outbox's publishers ([TxPublisher],
// [InboxOutbox], [SQLInboxOutbox]) with a due time still ahead is written
// to the outbox's scheduled table (sqlschema.Names.Scheduled, the outbox
// table's name and "_scheduled") instead of the outbox; the relay moves
// it into the outbox once it is due and publishes it from there. Without
// the key the message goes to the outbox as any other, and with a time
// already past too, unless a row of its partition key that is due still
// waits in the scheduled table: then it is written there, due at its
// write, behind that row (see [PublishAt]). The writer decides by its own
// clock which table a message goes to; the relay decides by the
// database's when a row is due. The key stays in the published message's
// metadata.
const DueAtKey = "oncemill_due_at"

// ErrNoScheduledTable is wrapped by the error of a write of a message
// with a due time, ahead or past, and of [Relay.PromoteDue], on a schema
// migrated before the scheduled table existed (PostgreSQL migration 011,
// MySQL 005, SQLite 007). Run sqlschema.Migrate (MigrateSQL,
// MigrateSQLite) to add it. A relay runs on such a schema all the same: it relays the
// outbox and looks for the table again now and then.
var ErrNoScheduledTable = errors.New("forwarder: the outbox's scheduled table does not exist: migrate the schema (sqlschema.Migrate, MigrateSQL or MigrateSQLite) to add it")

// PublishAt marks msg to be published at at, not before: written through
// the outbox's publishers, it waits in the scheduled table until then
// (see [DueAtKey]). A time already past publishes it at once, unless a
// row of its key that is due still waits: then it goes behind that row.
// It sets msg's metadata, so call it before Publish.
//
// Order: the relay moves a due row into the outbox at its due time, where
// it goes out after the rows of its key already there and before those
// written later; the rows it moves together go in (due time, write)
// order. A message whose due time has passed when it is written (a time
// in the past, or a writer slower than its [Delay]) goes to the outbox
// at once when no row of its key that is due waits in the scheduled
// table, as its transaction sees it, and else into the scheduled table,
// due at its write, behind those rows. A key's messages with a due time
// therefore go out in the order of their due times, a time already past
// counting as the write's, and rows due at the same time in their write
// order, whether or not a relay ran meanwhile.
//
// A message without a due time is written to the outbox at once and
// waits for nothing: written while a row of its key is due and not yet
// moved (in the few milliseconds a running relay takes to move it, or
// while no relay runs), it goes out first. Give such messages a due time
// too, PublishAt(msg, time.Now()), to keep them in the order of the
// key's due times, at the cost of one more statement per Publish that
// writes them (the look at the scheduled table).
func PublishAt(msg *message.Message, at time.Time) {
	if msg.Metadata == nil {
		msg.Metadata = make(message.Metadata)
	}
	msg.Metadata.Set(DueAtKey, at.UTC().Format(time.RFC3339Nano))
}

// Delay marks msg to be published d from now, not before: [PublishAt]
// with time.Now().Add(d).
func Delay(msg *message.Message, d time.Duration) {
	PublishAt(msg, time.Now().Add(d))
}

// dueAt returns the due time msg carries, if any.
func dueAt(msg *message.Message) (time.Time, bool, error) {
	v := msg.Metadata.Get(DueAtKey)
	if v == "" {
		return time.Time{}, false, nil
	}
	at, err := time.Parse(time.RFC3339Nano, v)
	if err != nil && yearPast9999(v) {
		return time.Time{}, false, fmt.Errorf("forwarder: message %s: %w: metadata %s %q", msg.UUID, ErrDueTooLate, DueAtKey, v)
	}
	if err != nil {
		return time.Time{}, false, fmt.Errorf("forwarder: message %s: metadata %s %q is not an RFC 3339 time: set it with forwarder.PublishAt or forwarder.Delay", msg.UUID, DueAtKey, v)
	}
	if at.After(MaxDueAt) {
		return time.Time{}, false, fmt.Errorf("forwarder: message %s: %w: metadata %s %q", msg.UUID, ErrDueTooLate, DueAtKey, v)
	}
	return at, true, nil
}

// maxDueMicros is [MaxDueAt] in microseconds since the epoch, as SQL
// reads it (a multiple of 32, which PostgreSQL's interval arithmetic in
// double precision holds exactly).
const maxDueMicros = "253402300799000000"

// MaxDueAt is the latest due time a message may have ([PublishAt]): the
// last second of year 9999, the end of MySQL's DATETIME and of RFC 3339.
var MaxDueAt = time.Date(9999, 12, 31, 23, 59, 59, 0, time.UTC)

// ErrDueTooLate is wrapped by the error of a write of a message whose
// due time ([PublishAt], [DueAtKey]) is after [MaxDueAt]: no database
// holds it, and no relay would reach it. The write fails before anything
// is written; give a due time before year 10000.
var ErrDueTooLate = errors.New("forwarder: the due time is after 9999-12-31T23:59:59Z, the latest a scheduled message may have: give an earlier one (forwarder.PublishAt)")

// yearPast9999 reports whether v starts as an RFC 3339 time of a year of
// five digits or more, which PublishAt writes for a time past year 9999
// and time.Parse refuses.
func yearPast9999(v string) bool {
	digits := 0
	for digits < len(v) && v[digits] >= '0' && v[digits] <= '9' {
		digits++
	}
	return digits > 4 && digits < len(v) && v[digits] == '-'
}

// scheduledRecheck is how long a relay that found no scheduled table
// waits before it looks for it again.
const scheduledRecheck = time.Minute

// scheduled is the outbox's scheduled table, as the relay reads it: it
// looks for the earliest due time and moves the due rows into the outbox.
//
// The writers put a row with a due time ahead here, not in the outbox,
// so that the relay's takes, which walk each lane of the outbox in id
// order, never meet a row that may not go yet: the takes stay as they
// are, and a row enters its lane only once it is due, behind the rows
// already there. A row whose due time has passed comes here too, due at
// its write, while a due row of its key waits here: in the outbox it
// would go out ahead of that row.
type scheduled struct {
	db      sqldb.DB
	d       *sqldb.Dialect
	table   string
	limit   int
	timeout time.Duration
	// look is the earliest due time and the database's clock
	// (microseconds); lookProbe is the relay's probe (whether the outbox
	// has rows that may go out) and look in one statement.
	look, lookProbe string
	// due locks the first due rows' ids (argument: limit); move copies
	// the rows of a JSON array of ids into the outbox in (due_at, id)
	// order; remove deletes them. beyond locks the rows due after
	// MaxDueAt (argument: limit), which refuse dead-letters.
	due, move, remove, beyond string
	refuse                    func(ctx context.Context, tx sqldb.Tx, rows []row) error
	// count is the rows and the earliest due time, for Lag.
	count string
}

// newScheduled returns the scheduled table of names on db; probe is the
// relay's probe, a SELECT of one column, which lookProbe extends.
func newScheduled(cfg RelayConfig, db sqldb.DB, names sqlschema.Names, probe string, refuse func(context.Context, sqldb.Tx, []row) error) *scheduled {
	d := db.Dialect()
	t := names.Scheduled
	now := d.Micros(d.Now())
	// The earliest due time, and whether a row is due after MaxDueAt
	// (PostgreSQL's 'infinity', written by plain SQL, or a year past
	// 9999): such a row is never due, and read as microseconds it would
	// fail the whole statement ("cannot convert infinity to bigint").
	minDue := `(SELECT ` + nextDue(d) + ` FROM ` + t + `), ` + now +
		`, EXISTS (SELECT 1 FROM ` + t + ` WHERE due_at > ` + d.FromMicros(maxDueMicros) + `)`
	// The outbox's columns a writer fills, as the publisher fills them
	// (see outboxSchema.on): the message's, the lane where the writer
	// hashes it, and the writing session where the outbox records it,
	// which is now the relay's.
	cols, vals := "topic, uuid, partition_key, payload, metadata", "t.topic, t.uuid, t.partition_key, t.payload, t.metadata"
	if d.WriterHashes() {
		cols, vals = cols+", lane", vals+", t.lane"
	}
	if recordsWriter(d) {
		cols, vals = cols+", created_at, writer", vals+", "+d.Now()+", "+d.SessionID()
	}
	return &scheduled{
		db:        db,
		d:         d,
		table:     t,
		limit:     cfg.BatchSize,
		timeout:   cfg.DatabaseTimeout,
		look:      `SELECT ` + minDue,
		lookProbe: probe + `, ` + minDue,
		due:       d.Rebind(`SELECT id FROM ` + t + ` WHERE due_at <= ` + d.Now() + ` ORDER BY due_at, id LIMIT ?` + d.LockRow(false)),
		move: d.Rebind(`INSERT INTO ` + names.Outbox + ` (` + cols + `) SELECT ` + vals + d.FromIDs(t) +
			` ORDER BY t.due_at, t.id`),
		remove: d.Rebind(d.ByIDs(t, "", "")),
		beyond: d.Rebind(`SELECT ` + rowColumns + ` FROM ` + t + ` WHERE due_at > ` + d.FromMicros(maxDueMicros) +
			` ORDER BY id LIMIT ?` + d.LockRow(false)),
		refuse: refuse,
		count:  `SELECT COUNT(*), ` + nextDue(d) + ` FROM ` + t,
	}
}

// nextDue is the earliest due time of the scheduled table's rows, in
// microseconds, each due time read within [epoch, MaxDueAt]: a row due
// before 1970 (PostgreSQL's '-infinity') is due, and one past MaxDueAt
// ('infinity') reads as MaxDueAt instead of failing the statement.
func nextDue(d *sqldb.Dialect) string {
	lo, hi := d.FromMicros("0"), d.FromMicros(maxDueMicros)
	return d.Micros("MIN(CASE WHEN due_at < " + lo + " THEN " + lo + " WHEN due_at > " + hi + " THEN " + hi + " ELSE due_at END)")
}

// dueLook is what a look at the scheduled table found.
type dueLook struct {
	// probed: the look was the relay's probe too, and rows tells whether
	// the outbox has rows that may go out.
	probed, rows bool
	// any: the table has rows; wait is how long until the earliest is
	// due, by the database's clock, zero or less when it is.
	any  bool
	wait time.Duration
	// beyond: a row is due after MaxDueAt, which the move refuses.
	beyond bool
}

// lookDue reads the earliest due time, and with probe whether the outbox
// has rows that may go out, in one statement.
func (s *scheduled) lookDue(ctx context.Context, probe bool) (dueLook, error) {
	var (
		l   dueLook
		due *time.Time
		now time.Time
		err error
	)
	if probe {
		l.probed = true
		err = s.db.QueryRow(ctx, s.lookProbe).Scan(&l.rows, sqldb.TimeOrNil(&due), sqldb.Time(&now), &l.beyond)
	} else {
		err = s.db.QueryRow(ctx, s.look).Scan(sqldb.TimeOrNil(&due), sqldb.Time(&now), &l.beyond)
	}
	if err != nil {
		return dueLook{}, err
	}
	if due != nil {
		l.any, l.wait = true, due.Sub(now)
	}
	return l, nil
}

// promote moves the due rows, at most limit of them, into the outbox in
// (due_at, id) order, in one short transaction, and returns how many. It
// locks them first (FOR UPDATE, where the database has row locks), so
// that two relays moving rows at once take turns: a row is moved once,
// and the second relay's rows, due later, get the higher ids. With
// beyond, it first dead-letters the rows due after MaxDueAt (at most
// limit), which no relay would ever move: each alone, refused with the
// reason, as the relay refuses an outbox row. ctx bounds the transaction;
// on any failure it rolls back and the rows stay.
func (s *scheduled) promote(ctx context.Context, beyond bool) (int, error) {
	ctx, cancel := context.WithTimeout(ctx, s.timeout)
	defer cancel()
	var n int
	tx, err := s.db.Begin(ctx, sqldb.TxOptions{Isolation: sqldb.ReadCommitted})
	if err != nil {
		return 0, fmt.Errorf("forwarder: promote due rows of %s: %w", s.table, beginFailed(s.d, s.timeout, err))
	}
	err = inTx(ctx, tx, func(tx sqldb.Tx) error {
		if beyond {
			if err := s.refuseBeyond(ctx, tx); err != nil {
				return err
			}
		}
		rs, err := tx.Query(ctx, s.due, s.limit)
		ids, err := sqldb.Collect(rs, err, sqldb.Value[int64])
		if err != nil || len(ids) == 0 {
			return wrap("take due rows", err)
		}
		list, err := json.Marshal(ids)
		if err != nil {
			return err
		}
		moved, err := tx.Exec(ctx, s.move, string(list))
		if err != nil {
			return fmt.Errorf("move %d due rows to the outbox: %w", len(ids), err)
		}
		removed, err := tx.Exec(ctx, s.remove, string(list))
		if err != nil {
			return fmt.Errorf("delete %d moved rows: %w", len(ids), err)
		}
		if moved != int64(len(ids)) || removed != int64(len(ids)) {
			return fmt.Errorf("%d due rows locked, %d moved, %d deleted (deleted by something other than a relay?)", len(ids), moved, removed)
		}
		n = len(ids)
		return nil
	})
	switch {
	case s.d.UndefinedTable(err):
		return 0, fmt.Errorf("forwarder: promote due rows: %w (%s): %w", ErrNoScheduledTable, s.table, err)
	case err != nil:
		return 0, fmt.Errorf("forwarder: promote due rows of %s: %w", s.table, err)
	}
	return n, nil
}

// inTx runs f in tx, which it commits when f returns nil and else rolls
// back: sqldb.InTx for a transaction begun apart.
func inTx(ctx context.Context, tx sqldb.Tx, f func(sqldb.Tx) error) error {
	if err := f(tx); err != nil {
		if rbErr := tx.Rollback(context.WithoutCancel(ctx)); rbErr != nil {
			err = errors.Join(err, rbErr)
		}
		return err
	}
	return tx.Commit(ctx)
}

// refuseBeyond dead-letters, in tx, the rows due after MaxDueAt, and
// deletes them.
func (s *scheduled) refuseBeyond(ctx context.Context, tx sqldb.Tx) error {
	rs, err := tx.Query(ctx, s.beyond, s.limit)
	rows, err := sqldb.Collect(rs, err, func(r sqldb.Rows) (row, error) {
		var (
			x  row
			md []byte
		)
		if err := r.Scan(&x.id, &x.topic, &x.uuid, &x.key, &x.payload, &md); err != nil {
			return row{}, err
		}
		x.metadata, x.uuid, _ = checkRow(x.topic, x.uuid, md, nil)
		x.refused = fmt.Errorf("%w: scheduled row %d of %s: its due time is after %s (PostgreSQL's 'infinity'?): "+
			"no relay would ever publish it; write a due time up to %s, or -infinity to publish it at once",
			ErrRefusedRow, x.id, s.table, MaxDueAt.Format(time.RFC3339), MaxDueAt.Format(time.RFC3339))
		return x, nil
	})
	if err != nil || len(rows) == 0 {
		return wrap("take the rows due after "+MaxDueAt.Format(time.RFC3339), err)
	}
	if err := s.refuse(ctx, tx, rows); err != nil {
		return err
	}
	ids := make([]int64, len(rows))
	for i, x := range rows {
		ids[i] = x.id
	}
	list, _ := json.Marshal(ids) // integers always encode
	if _, err := tx.Exec(ctx, s.remove, string(list)); err != nil {
		return fmt.Errorf("delete %d refused scheduled rows: %w", len(rows), err)
	}
	return nil
}

// PromoteDue moves the scheduled rows that are due (see [PublishAt]) into
// the outbox, at most RelayConfig.BatchSize of them, in (due time, write)
// order, in one short transaction, and returns how many it moved; a row
// due after [MaxDueAt] (PostgreSQL's 'infinity', written by plain SQL) is
// dead-lettered in the same transaction, alone, refused with
// [ErrRefusedRow] (a row due at '-infinity' is due, and moved); the
// next batches publish them. [Relay.Run] does it before its batches as
// rows come due; call it only when driving the relay with
// [Relay.RelayBatch] yourself. On a schema without the scheduled table
// its error wraps [ErrNoScheduledTable].
func (r *Relay) PromoteDue(ctx context.Context) (int, error) {
	return r.sched.promote(ctx, true)
}

// dueWatch is Run's pacing of its looks at the scheduled table: a look
// when the earliest due time known comes, and otherwise at most one per
// PollInterval (one statement with the probe while the relay idles), or,
// while the table is missing, one per scheduledRecheck.
type dueWatch struct {
	// next is when to look again.
	next time.Time
	// missing: the last look found no table, or one the relay may not
	// use, and said so in the log.
	missing bool
}

// sleep is how long Run may sleep, at most d, before its next look.
func (w *dueWatch) sleep(d time.Duration) time.Duration {
	return max(0, min(d, time.Until(w.next)))
}

// unusable reports whether err says that the scheduled table is missing,
// or that the relay's role may not use it: the outbox is relayed all the
// same.
func (s *scheduled) unusable(err error) bool {
	return s.d.UndefinedTable(err) || s.d.AccessDenied(err)
}

// promoteDue, when w says it is time, looks at the scheduled table (with
// probe, in the same statement as the probe for due outbox rows) and
// moves the due rows into the outbox. It reports whether the probe was
// answered (probed) and by what (rows: the outbox has rows to take,
// which moved rows count as), so that the caller need not probe again.
// A scheduled table that is missing, or that the relay's role may not
// read or move rows from (a least-privilege role granted the outbox
// only), keeps nothing from the outbox: it is said once in the log and
// looked at again every scheduledRecheck.
func (r *Relay) promoteDue(ctx context.Context, w *dueWatch, probe bool) (probed, rows bool, err error) {
	now := time.Now()
	if now.Before(w.next) {
		return false, false, nil
	}
	lctx, cancel := boundDB(ctx, r.cfg.DatabaseTimeout)
	look, err := r.sched.lookDue(lctx, probe && !w.missing)
	cancel()
	switch {
	case r.sched.unusable(err) && probe && !w.missing:
		// The outbox or the scheduled table: the probe alone tells.
		pctx, cancel := boundDB(ctx, r.cfg.DatabaseTimeout)
		rows, perr := r.db.probeRows(pctx)
		cancel()
		if perr != nil {
			return false, false, r.db.named("look for rows", perr)
		}
		r.scheduledUnusable(w, now, err)
		return true, rows, nil
	case r.sched.unusable(err):
		r.scheduledUnusable(w, now, err)
		return false, false, nil
	case err != nil:
		return false, false, r.db.named("look for due scheduled rows", err)
	}
	if !look.beyond && (!look.any || look.wait > 0) {
		r.scheduledUsable(w)
		wait := r.cfg.PollInterval
		if look.any {
			wait = min(wait, look.wait)
		}
		w.next = now.Add(wait)
		return look.probed, look.rows, nil
	}
	n, err := r.sched.promote(ctx, look.beyond)
	if r.sched.d.AccessDenied(err) {
		r.scheduledUnusable(w, now, err)
		return look.probed, look.rows, nil
	}
	if err != nil {
		return false, false, err
	}
	r.scheduledUsable(w)
	// Look again at once: more may be due, and the next due time is
	// unknown.
	w.next = now
	return look.probed, look.rows || n > 0, nil
}

// scheduledUnusable notes that the scheduled table is missing, or not the
// relay's to use (err says which), logs it once, and puts the next look
// scheduledRecheck away.
func (r *Relay) scheduledUnusable(w *dueWatch, now time.Time, err error) {
	if !w.missing {
		fields := watermill.LogFields{"outbox": r.outbox, "table": r.names.Scheduled, "look_again_in": r.recheck.String()}
		if r.sched.d.AccessDenied(err) {
			fields["error"] = err.Error()
			r.cfg.Logger.Info("Outbox scheduled table not usable by the relay's role: messages written with a due time wait there; the outbox is relayed as before; "+
				"grant the relay SELECT and DELETE on the scheduled table and INSERT on the outbox", fields)
		} else {
			r.cfg.Logger.Info("Outbox scheduled table missing: messages written with a due time cannot be written nor moved; the outbox is relayed as before; migrate the schema to add the table",
				fields)
		}
	}
	w.missing = true
	w.next = now.Add(r.recheck)
}

// scheduledUsable notes that the scheduled table answered, and says so
// once after it did not.
func (r *Relay) scheduledUsable(w *dueWatch) {
	if w.missing {
		w.missing = false
		r.cfg.Logger.Info("Outbox scheduled table found: moving due rows to the outbox", watermill.LogFields{"outbox": r.outbox, "table": r.names.Scheduled})
	}
}
