package forwarder

import (
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"slices"
	"sort"
	"strconv"
	"strings"

	"github.com/jackc/pgx/v5"

	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/internal/sqldb"
	"github.com/oncemill/oncemill/sqlschema"
)

// snapshotTake is the take of a database with transaction snapshots and
// advisory locks (PostgreSQL): one statement takes a batch. It picks the
// lanes whose first row (by id) may go out, in a random order, locked
// until the transaction ends (OFFSET 0 keeps the lock call out of the
// inner query, so that only lanes with work are locked, and LIMIT stops
// locking early); then the first rows of those lanes by id, cut in each
// lane before the first row whose transaction is not older than every
// open one (unless LockOrderedWriters): a row after it was inserted later
// and must not overtake it. It deletes them and, with the ledger, records
// them, and returns them.
type snapshotTake struct {
	o                        *outbox
	sql                      string
	lockKey                  int32
	lanesPerBatch, batchSize int
}

func snapshotTakeSQL(d *sqldb.Dialect, names sqlschema.Names, lockOrdered, ledger bool) string {
	t := names.Outbox
	return `WITH lanes AS MATERIALIZED (
	SELECT l FROM (
		SELECT l FROM generate_series(0, 63) AS l
		WHERE (SELECT ` + due(d, "o.txid", lockOrdered) + ` FROM ` + t + ` o WHERE o.lane = l ORDER BY o.id LIMIT 1)
		ORDER BY random() OFFSET 0) s
	WHERE pg_try_advisory_xact_lock(?, s.l) LIMIT ?),
candidates AS MATERIALIZED (
	SELECT id, lane, txid FROM ` + t + ` WHERE lane IN (SELECT l FROM lanes) ORDER BY id LIMIT ?),
due AS (
	SELECT id FROM (
		SELECT id, bool_and(` + due(d, "txid", lockOrdered) + `) OVER (PARTITION BY lane ORDER BY id) AS ok FROM candidates) w
	WHERE ok)` + takeDue(d, names, ledger)
}

// takeDue ends the snapshot take, whose CTEs end with "due", the ids of
// the rows to publish: it deletes them and returns them. With the ledger,
// the same statement records them in the ledger table (but for a row
// whose key is longer than delivery.MaxBoundBytes, or whose metadata
// keeps bytes under sqldb.ExactKey, which the batch records, see
// [ledgerKey] and [recordedByTake]), so that the record is in the batch's
// transaction (it commits with the delete, after the publish, or rolls
// back with it) and costs no round trip of its own.
func takeDue(d *sqldb.Dialect, names sqlschema.Names, ledger bool) string {
	if !ledger {
		// No time taken: nothing records it.
		return `
DELETE FROM ` + names.Outbox + ` WHERE id IN (SELECT id FROM due)
RETURNING ` + rowColumns + `, 0::bigint`
	}
	at := ", " + d.Micros(d.Now())
	return `,
taken AS (
	DELETE FROM ` + names.Outbox + ` WHERE id IN (SELECT id FROM due)
	RETURNING ` + rowColumns + `),
recorded AS (
	INSERT INTO ` + names.Ledger + ` (uuid, topic, partition_key, idempotency_key)
	SELECT uuid, topic, partition_key, k FROM (
		SELECT uuid, topic, partition_key, metadata, COALESCE(metadata->>'` + delivery.IdempotencyKey + `', uuid) AS k FROM taken) t
	WHERE octet_length(k) <= ` + strconv.Itoa(delivery.MaxBoundBytes) + ` AND metadata->>'` + sqldb.ExactKey + `' IS NULL)
SELECT ` + rowColumns + at + ` FROM taken`
}

// recordedByTake reports whether the snapshot take's statement recorded
// x in the ledger: its key is at most delivery.MaxBoundBytes, and its
// metadata keeps nothing byte for byte under sqldb.ExactKey (its key or
// UUID may be there, which only the batch reads: it records such a row).
func recordedByTake(x row) bool {
	return len(ledgerKey(x)) <= delivery.MaxBoundBytes && !x.exact
}

// asyncCommit: the batch's commit need not wait for its WAL to reach
// disk: a delete lost in a server crash only publishes its rows again,
// which the consumers' inboxes absorb, and the writers' commits no longer
// queue behind the relay's.
const asyncCommit = `SET LOCAL synchronous_commit TO off`

func (s *snapshotTake) take(ctx context.Context, begin func(sqldb.TxOptions) (sqldb.Tx, error)) ([]row, error) {
	tx, err := begin(sqldb.TxOptions{})
	if err != nil {
		return nil, err
	}
	batch, err := s.run(ctx, tx)
	if err != nil {
		return nil, fmt.Errorf("forwarder: take rows: %w", err)
	}
	// RETURNING gives no order.
	sort.Slice(batch, func(i, j int) bool { return batch[i].id < batch[j].id })
	for i, x := range batch {
		batch[i].recorded = s.o.ledger && recordedByTake(x)
	}
	return batch, nil
}

// run sends asyncCommit and the take, in one round trip where the driver
// pipelines them (pgx), else one after the other.
func (s *snapshotTake) run(ctx context.Context, tx sqldb.Tx) ([]row, error) {
	args := []any{s.lockKey, s.lanesPerBatch, s.batchSize}
	if ptx, ok := sqldb.PgxTx(tx); ok && s.o.d.Pipeline {
		b := &pgx.Batch{}
		b.Queue(asyncCommit)
		b.Queue(s.sql, args...)
		br := ptx.SendBatch(ctx, b)
		defer br.Close()
		if _, err := br.Exec(); err != nil {
			return nil, err
		}
		rows, err := br.Query()
		batch, err := sqldb.Collect(sqldb.PgxRows(rows), err, s.o.scanRow)
		if err != nil {
			return nil, err
		}
		return batch, br.Close()
	}
	if _, err := tx.Exec(ctx, asyncCommit); err != nil {
		return nil, err
	}
	rs, err := tx.Query(ctx, s.sql, args...)
	return sqldb.Collect(rs, err, s.o.scanRow)
}

// laneTake is the take of a database with SKIP LOCKED and READ
// UNCOMMITTED but no snapshots (MySQL 8.0+, MariaDB 10.6+), on the
// InnoDB tables of sqlschema/mysql/002_outbox.up.sql. A batch is one
// transaction:
//
//  1. the lanes that hold committed rows, a random LanesPerBatch of them;
//  2. those lanes' rows of the lanes table, locked FOR UPDATE SKIP LOCKED:
//     lanes another relay holds are skipped, and the locks last until the
//     batch ends, or its session does;
//  3. the first BatchSize committed rows of the locked lanes by id (a
//     bounded index range per lane);
//  4. unless LockOrderedWriters, the uncommitted rows below them: the
//     transaction is READ UNCOMMITTED, so step 3 is a locking read (FOR
//     UPDATE SKIP LOCKED reads committed rows and skips the rows of
//     transactions in flight) and step 4 a plain read, which sees those
//     too; step 4 comes after step 3, so a row that was in flight when
//     step 3 read the lane is seen by step 4, committed by then or not,
//     and each lane is cut before its first such row;
//  5. the rows themselves, published in id order, then deleted and, with
//     RelayConfig.Ledger, recorded in the ledger; commit.
//
// The writers never wait for the relay: it locks rows of the lanes table,
// which they never touch, and outbox rows they no longer hold; no gap is
// locked, as READ COMMITTED and READ UNCOMMITTED take none.
type laneTake struct {
	o                        *outbox
	lockOrdered              bool
	lanesPerBatch, batchSize int
	// lanesWithRows lists the lanes that hold a committed row: one index
	// probe per lane, whatever the backlog. lockLanes locks the listed
	// lanes that no other relay holds. committedPart is one lane's first
	// committed rows (arguments: lane, limit), parenthesised for a UNION
	// ALL that ends in committedEnd. inFlightPart is one lane's rows below
	// an id (arguments: lane, id), read uncommitted. rows reads rows by
	// id. Statements that take a list end in "(" (see [inList]).
	lanesWithRows, lockLanes, committedPart, committedEnd, inFlightPart, rows string
}

func newLaneTake(o *outbox, cfg RelayConfig, names sqlschema.Names, takenAt string) *laneTake {
	t, lanes := names.Outbox, names.Schema+"."+o.d.Quote(names.OutboxName+"_lanes")
	// Every statement that locks outbox rows goes through an index to the
	// rows it means, never by a scan: a DELETE that scans waits on every
	// row it passes that another relay holds (unlike UPDATE, it has no
	// semi-consistent read), and two relays deleting their batches would
	// deadlock on each other's rows. The optimizer scans a small table
	// rather than use an index for an IN list, and an outbox the relays
	// keep drained is small.
	byLane := t + " FORCE INDEX (" + o.d.Quote(names.OutboxName+"_lane_id_idx") + ")"
	lock := ""
	if !cfg.LockOrderedWriters {
		lock = o.d.LockRow(true)
	}
	o.remove = o.d.ByIDs(t, "", "") // one primary-key lookup per id
	return &laneTake{
		o:             o,
		lockOrdered:   cfg.LockOrderedWriters,
		lanesPerBatch: cfg.LanesPerBatch,
		batchSize:     cfg.BatchSize,
		lanesWithRows: `SELECT l.lane FROM ` + lanes + ` l WHERE EXISTS (SELECT 1 FROM ` + t + ` o WHERE o.lane = l.lane)`,
		lockLanes:     `SELECT lane FROM ` + lanes + ` WHERE lane IN `,
		committedPart: `(SELECT id, lane FROM ` + byLane + ` WHERE lane = ? ORDER BY id LIMIT ?` + lock + `)`,
		committedEnd:  ` ORDER BY id LIMIT ?`,
		inFlightPart:  `(SELECT id, lane FROM ` + byLane + ` WHERE lane = ? AND id < ?)`,
		rows:          `SELECT ` + rowColumns + takenAt + ` FROM ` + t + ` FORCE INDEX (PRIMARY) WHERE id IN `,
	}
}

// inList completes a statement that ends in "IN " with a placeholder per
// value, and returns it with the values as arguments.
func inList[T any](prefix string, values []T, suffix string) (string, []any) {
	args := make([]any, len(values))
	for i, v := range values {
		args[i] = v
	}
	return prefix + sqldb.List(len(values)) + suffix, args
}

func (l *laneTake) take(ctx context.Context, begin func(sqldb.TxOptions) (sqldb.Tx, error)) ([]row, error) {
	rs, err := l.o.db.Query(ctx, l.lanesWithRows)
	lanes, err := sqldb.Collect(rs, err, sqldb.Value[int16])
	if err != nil || len(lanes) == 0 {
		return nil, wrap("forwarder: find lanes", err)
	}
	rand.Shuffle(len(lanes), func(i, j int) { lanes[i], lanes[j] = lanes[j], lanes[i] })
	lanes = lanes[:min(len(lanes), l.lanesPerBatch)]
	level := sqldb.ReadUncommitted
	if l.lockOrdered {
		level = sqldb.ReadCommitted
	}
	tx, err := begin(sqldb.TxOptions{Isolation: level})
	if err != nil {
		return nil, err
	}
	q, args := inList(l.lockLanes, lanes, l.o.d.LockRow(true))
	rs, err = tx.Query(ctx, q, args...)
	locked, err := sqldb.Collect(rs, err, sqldb.Value[int16])
	if err != nil || len(locked) == 0 { // none: other relays hold them all
		return nil, wrap("forwarder: lock lanes", err)
	}
	parts := make([]string, len(locked))
	args = make([]any, 0, 2*len(locked)+1)
	for i, lane := range locked {
		parts[i] = l.committedPart
		args = append(args, lane, l.batchSize)
	}
	taken, err := queryLaneRows(ctx, tx, strings.Join(parts, " UNION ALL ")+l.committedEnd, append(args, l.batchSize))
	if err != nil {
		return nil, fmt.Errorf("forwarder: take rows: %w", err)
	}
	if !l.lockOrdered && len(taken) > 0 {
		if taken, err = l.cutBeforeInFlight(ctx, tx, taken); err != nil {
			return nil, err
		}
	}
	if len(taken) == 0 {
		return nil, nil
	}
	ids := make([]int64, len(taken))
	for i, x := range taken {
		ids[i] = x.id
	}
	q, args = inList(l.rows, ids, " ORDER BY id")
	rs, err = tx.Query(ctx, q, args...)
	batch, err := sqldb.Collect(rs, err, l.o.scanRow)
	if err != nil {
		return nil, fmt.Errorf("forwarder: read rows: %w", err)
	}
	if len(batch) != len(ids) {
		return nil, fmt.Errorf("forwarder: read rows: %d of the %d rows taken are gone (deleted by something other than a relay?)", len(ids)-len(batch), len(ids))
	}
	return batch, nil
}

// wrap is err with what in front, or nil.
func wrap(what string, err error) error {
	if err == nil {
		return nil
	}
	return fmt.Errorf("%s: %w", what, err)
}

// laneRow is a row's place: its id and lane.
type laneRow struct {
	id   int64
	lane int16
}

// cutBeforeInFlight reads, after taken was read, the rows of taken's
// lanes below the highest taken id of each lane, uncommitted rows
// included, and cuts each lane before its first row that is not in taken:
// one that was in flight when taken was read.
func (l *laneTake) cutBeforeInFlight(ctx context.Context, tx sqldb.Tx, taken []laneRow) ([]laneRow, error) {
	highest, isTaken := map[int16]int64{}, map[int64]bool{}
	for _, x := range taken {
		highest[x.lane], isTaken[x.id] = max(highest[x.lane], x.id), true
	}
	parts, args := make([]string, 0, len(highest)), make([]any, 0, 2*len(highest))
	for lane, id := range highest {
		parts, args = append(parts, l.inFlightPart), append(args, lane, id)
	}
	seen, err := queryLaneRows(ctx, tx, strings.Join(parts, " UNION ALL "), args)
	if err != nil {
		return nil, fmt.Errorf("forwarder: look for rows in flight: %w", err)
	}
	cut := map[int16]int64{} // the lowest id in flight of each lane
	for _, x := range seen {
		if c, ok := cut[x.lane]; !isTaken[x.id] && (!ok || x.id < c) {
			cut[x.lane] = x.id
		}
	}
	return slices.DeleteFunc(taken, func(x laneRow) bool { c, ok := cut[x.lane]; return ok && x.id > c }), nil
}

func queryLaneRows(ctx context.Context, tx sqldb.Tx, q string, args []any) ([]laneRow, error) {
	rs, err := tx.Query(ctx, q, args...)
	out, err := sqldb.Collect(rs, err, func(rs sqldb.Rows) (laneRow, error) {
		var x laneRow
		return x, rs.Scan(&x.id, &x.lane)
	})
	slices.SortFunc(out, func(a, b laneRow) int { return cmp.Compare(a.id, b.id) })
	return out, err
}

// oneWriterTake is the take of a database with one writer at a time
// (SQLite): the first BatchSize rows by id, read without a lock, need no
// cut; the batch deletes them after the publish. See "On SQLite" in
// [Relay].
type oneWriterTake struct {
	o         *outbox
	read      string
	batchSize int
}

func (w *oneWriterTake) take(ctx context.Context, _ func(sqldb.TxOptions) (sqldb.Tx, error)) ([]row, error) {
	rs, err := w.o.db.Query(ctx, w.read, w.batchSize)
	batch, err := sqldb.Collect(rs, err, w.o.scanRow)
	return batch, wrap("forwarder: take rows", err)
}

// idsJSON is the ids of batch as a JSON array.
func idsJSON(batch []row) string {
	ids := make([]int64, len(batch))
	for i, x := range batch {
		ids[i] = x.id
	}
	b, _ := json.Marshal(ids) // integers: cannot fail
	return string(b)
}
