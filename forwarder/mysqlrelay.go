package forwarder

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"time"

	"github.com/go-sql-driver/mysql"

	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/sqlschema"
)

// mysqlOutbox is the outbox on MySQL 8.0+ and MariaDB 10.6+ through
// database/sql (go-sql-driver/mysql), on the InnoDB tables of
// sqlschema/mysql/002_outbox.up.sql. Every statement of the MySQL relay is
// here.
//
// A batch is one transaction:
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
//     RelayConfig.Ledger, recorded in the ledger (one INSERT for the
//     batch's published rows); commit.
//
// The writers never wait for the relay: it locks rows of the lanes table,
// which they never touch, and outbox rows they no longer hold; no gap is
// locked, as READ COMMITTED and READ UNCOMMITTED take none.
type mysqlOutbox struct {
	db *sql.DB
	// validate is the publisher's TopicValidator, or nil.
	validate                 func(string) error
	timeout                  time.Duration
	consumer                 string
	lockOrdered              bool
	lanesPerBatch, batchSize int
	q                        mysqlRelaySQL
}

// mysqlRelaySQL is the statements of a MySQL relay on one outbox table.
// Statements that take a list end in "(", for the placeholders and a ")"
// (see [inList]).
type mysqlRelaySQL struct {
	// lanesWithRows lists the lanes that hold a committed row: one index
	// probe per lane, whatever the backlog.
	lanesWithRows string
	// lockLanes locks the listed lanes that no other relay holds.
	lockLanes string
	// committedPart is one lane's first committed rows (arguments: lane,
	// limit), parenthesised for a UNION ALL that ends in committedEnd.
	committedPart, committedEnd string
	// inFlightPart is one lane's rows below an id (arguments: lane, id),
	// read uncommitted.
	inFlightPart string
	// rows reads rows by id, and with the ledger the server's time in UTC
	// (the rows' published_at); remove deletes the rows of a JSON array
	// of ids.
	rows, remove string
	// record starts the INSERT of ledger rows, which a "(?, ?, ?, ?, ?)"
	// per row completes; empty without a ledger.
	record string
	// deadLetter writes a refused row to the dead-letter table.
	deadLetter string
	probe      string
	lagQueries mysqlLagQueries
}

// mysqlLagQueries measure the backlog of a MySQL outbox table: shared by
// [Relay.Lag] and [SQLOutboxLag].
type mysqlLagQueries struct {
	// committed is per lane: the committed rows, the lowest id, the age
	// of the oldest row (µs).
	committed string
	// lowest is per lane the lowest id of any row, committed or not, read
	// uncommitted.
	lowest string
	// inFlight is a row's writer (its session's connection id) and age
	// (µs), read uncommitted.
	inFlight string
	// holder is a session's open transaction.
	holder string
}

func mysqlLanesTable(names sqlschema.Names) string {
	return names.Schema + ".`" + names.OutboxName + "_lanes`"
}

func newMySQLLagQueries(names sqlschema.Names) mysqlLagQueries {
	t := names.Outbox
	return mysqlLagQueries{
		committed: `SELECT lane, COUNT(*), MIN(id), COALESCE(TIMESTAMPDIFF(MICROSECOND, MIN(created_at), UTC_TIMESTAMP(6)), 0)
FROM ` + t + ` GROUP BY lane`,
		lowest:   `SELECT lane, MIN(id) FROM ` + t + ` GROUP BY lane`,
		inFlight: `SELECT writer, TIMESTAMPDIFF(MICROSECOND, created_at, UTC_TIMESTAMP(6)) FROM ` + t + ` WHERE id = ?`,
		// InnoDB's own view of open transactions: trx_started (to the
		// second) and NOW() are both in the session's time zone.
		holder: `SELECT COALESCE(p.DB, ''), COALESCE(p.USER, ''), COALESCE(p.COMMAND, ''),
	COALESCE(LEFT(t.trx_query, 200), ''), TIMESTAMPDIFF(MICROSECOND, t.trx_started, NOW(6))
FROM information_schema.INNODB_TRX t LEFT JOIN information_schema.PROCESSLIST p ON p.ID = t.trx_mysql_thread_id
WHERE t.trx_mysql_thread_id = ?`,
	}
}

func newMySQLOutbox(cfg RelayConfig, names sqlschema.Names) *mysqlOutbox {
	t, lanes := names.Outbox, mysqlLanesTable(names)
	// Every statement that locks outbox rows goes through an index to the
	// rows it means, never by a scan: a DELETE that scans waits on every
	// row it passes that another relay holds (unlike UPDATE, it has no
	// semi-consistent read), and two relays deleting their batches would
	// deadlock on each other's rows. The optimizer scans a small table
	// rather than use an index for an IN list, and an outbox the relays
	// keep drained is small.
	byLane := t + " FORCE INDEX (`" + names.OutboxName + "_lane_id_idx`)"
	lock := ""
	if !cfg.LockOrderedWriters {
		lock = " FOR UPDATE SKIP LOCKED"
	}
	takenAt, record := "", ""
	if cfg.Ledger {
		takenAt = ", UTC_TIMESTAMP(6)"
		record = `INSERT INTO ` + names.Ledger + ` (uuid, topic, partition_key, idempotency_key, published_at) VALUES `
	}
	return &mysqlOutbox{
		db:            cfg.DB,
		validate:      topicValidation(cfg.Publisher),
		timeout:       cfg.DatabaseTimeout,
		consumer:      relayConsumer(cfg.Schema.Schema + "." + cfg.Schema.OutboxTable),
		lockOrdered:   cfg.LockOrderedWriters,
		lanesPerBatch: cfg.LanesPerBatch,
		batchSize:     cfg.BatchSize,
		q: mysqlRelaySQL{
			lanesWithRows: `SELECT l.lane FROM ` + lanes + ` l WHERE EXISTS (SELECT 1 FROM ` + t + ` o WHERE o.lane = l.lane)`,
			lockLanes:     `SELECT lane FROM ` + lanes + ` WHERE lane IN (`,
			committedPart: `(SELECT id, lane FROM ` + byLane + ` WHERE lane = ? ORDER BY id LIMIT ?` + lock + `)`,
			committedEnd:  ` ORDER BY id LIMIT ?`,
			inFlightPart:  `(SELECT id, lane FROM ` + byLane + ` WHERE lane = ? AND id < ?)`,
			rows:          `SELECT id, topic, uuid, partition_key, payload, metadata` + takenAt + ` FROM ` + t + ` FORCE INDEX (PRIMARY) WHERE id IN (`,
			// One primary-key lookup per id (eq_ref), whatever the table's
			// size: the ids (a JSON array) are the outer table of the join.
			remove: `DELETE o FROM JSON_TABLE(?, '$[*]' COLUMNS (id BIGINT UNSIGNED PATH '$')) AS j
STRAIGHT_JOIN ` + t + ` AS o ON o.id = j.id`,
			record:     record,
			deadLetter: mysqlDeadLetter(names),
			probe:      `SELECT EXISTS (SELECT 1 FROM ` + t + `)`,
			lagQueries: newMySQLLagQueries(names),
		},
	}
}

// inList completes a statement that ends in "IN (" with a placeholder per
// value, and returns it with the values as arguments.
func inList[T any](prefix string, values []T, suffix string) (string, []any) {
	var b strings.Builder
	b.WriteString(prefix)
	args := make([]any, len(values))
	for i, v := range values {
		if i > 0 {
			b.WriteString(", ")
		}
		b.WriteByte('?')
		args[i] = v
	}
	b.WriteString(")")
	b.WriteString(suffix)
	return b.String(), args
}

func (o *mysqlOutbox) probe(ctx context.Context) (bool, error) {
	var any bool
	err := o.db.QueryRowContext(ctx, o.q.probe).Scan(&any)
	return any, err
}

func (o *mysqlOutbox) batch(ctx context.Context, publish func(context.Context, []row) (int, error)) (int, error) {
	dbCtx, cancel := boundDB(ctx, o.timeout)
	defer cancel()
	lanes, err := o.lanesWithRows(dbCtx)
	if err != nil || len(lanes) == 0 {
		return 0, err
	}
	rand.Shuffle(len(lanes), func(i, j int) { lanes[i], lanes[j] = lanes[j], lanes[i] })
	lanes = lanes[:min(len(lanes), o.lanesPerBatch)]

	// The transaction is the connection's own statements, not a sql.Tx:
	// database/sql would roll back a transaction whose context ends, and
	// a batch that published its rows must still delete them; and
	// sql.Tx.Commit (go-sql-driver/mysql's COMMIT) honours no context, so
	// a server that stopped answering would hold it forever. Each
	// statement here runs on a context with a deadline, which the driver
	// honours by closing the connection; the server then rolls back.
	conn, err := o.db.Conn(dbCtx)
	if err != nil {
		return 0, fmt.Errorf("forwarder: connect: %w", err)
	}
	defer conn.Close()
	level := "READ UNCOMMITTED"
	if o.lockOrdered {
		level = "READ COMMITTED"
	}
	if _, err := conn.ExecContext(dbCtx, "SET TRANSACTION ISOLATION LEVEL "+level); err != nil {
		return 0, fmt.Errorf("forwarder: begin: %w", err)
	}
	if _, err := conn.ExecContext(dbCtx, "START TRANSACTION"); err != nil {
		return 0, fmt.Errorf("forwarder: begin: %w", err)
	}
	n, err := o.take(dbCtx, conn, lanes, publishOn(ctx, publish))
	if err == nil {
		// Once the broker has the rows, delete them even if Close came
		// meanwhile: a rollback would publish them all again.
		post, cancel := afterPublish(ctx, o.timeout)
		_, err = conn.ExecContext(post, "COMMIT")
		cancel()
		if err != nil {
			err = fmt.Errorf("forwarder: commit after publishing %d rows (they will be published again): %w", n, err)
		}
	}
	if err != nil {
		post, cancel := afterPublish(ctx, o.timeout)
		defer cancel()
		if _, rbErr := conn.ExecContext(post, "ROLLBACK"); rbErr != nil {
			err = errors.Join(err, rbErr)
			// The connection may still hold the transaction: close it
			// rather than give it back to the pool (Raw closes the
			// connection when its function reports driver.ErrBadConn,
			// which it then returns).
			_ = conn.Raw(func(any) error { return driver.ErrBadConn })
		}
		return 0, err
	}
	return n, nil
}

// lanesWithRows returns the lanes that hold a committed row.
func (o *mysqlOutbox) lanesWithRows(ctx context.Context) ([]int16, error) {
	rows, err := o.db.QueryContext(ctx, o.q.lanesWithRows)
	if err != nil {
		return nil, fmt.Errorf("forwarder: find lanes: %w", err)
	}
	lanes, err := collect(rows, func(rs *sql.Rows) (int16, error) {
		var l int16
		return l, rs.Scan(&l)
	})
	if err != nil {
		return nil, fmt.Errorf("forwarder: find lanes: %w", err)
	}
	return lanes, nil
}

// laneRow is a row's place: its id and lane.
type laneRow struct {
	id   uint64
	lane int16
}

func (o *mysqlOutbox) take(ctx context.Context, tx *sql.Conn, lanes []int16, publish func(context.Context, []row) (int, error)) (int, error) {
	q, args := inList(o.q.lockLanes, lanes, " FOR UPDATE SKIP LOCKED")
	rs, err := tx.QueryContext(ctx, q, args...)
	if err != nil {
		return 0, fmt.Errorf("forwarder: lock lanes: %w", err)
	}
	locked, err := collect(rs, func(rs *sql.Rows) (int16, error) {
		var l int16
		return l, rs.Scan(&l)
	})
	if err != nil {
		return 0, fmt.Errorf("forwarder: lock lanes: %w", err)
	}
	if len(locked) == 0 {
		return 0, nil // other relays hold them all
	}

	parts := make([]string, len(locked))
	args = make([]any, 0, 2*len(locked)+1)
	for i, l := range locked {
		parts[i] = o.q.committedPart
		args = append(args, l, o.batchSize)
	}
	args = append(args, o.batchSize)
	taken, err := queryLaneRows(ctx, tx, strings.Join(parts, " UNION ALL ")+o.q.committedEnd, args)
	if err != nil {
		return 0, fmt.Errorf("forwarder: take rows: %w", err)
	}
	if !o.lockOrdered {
		if taken, err = o.cutBeforeInFlight(ctx, tx, taken); err != nil {
			return 0, err
		}
	}
	if len(taken) == 0 {
		return 0, nil
	}

	ids := make([]uint64, len(taken))
	for i, x := range taken {
		ids[i] = x.id
	}
	q, args = inList(o.q.rows, ids, " ORDER BY id")
	rs, err = tx.QueryContext(ctx, q, args...)
	if err != nil {
		return 0, fmt.Errorf("forwarder: read rows: %w", err)
	}
	// takenAt is the server's UTC_TIMESTAMP(6) with the ledger: text, or a
	// time.Time in the driver's loc under parseTime, sent back as it came.
	var takenAt any
	batch, err := collect(rs, func(rs *sql.Rows) (row, error) {
		var (
			x                        row
			topic, uuid, key, mdJSON []byte
		)
		dest := []any{&x.id, &topic, &uuid, &key, &x.payload, &mdJSON}
		if o.q.record != "" {
			dest = append(dest, &takenAt)
		}
		if err := rs.Scan(dest...); err != nil {
			return x, err
		}
		x.topic, x.uuid, x.key = string(topic), string(uuid), string(key)
		x.metadata, x.refused = checkRow(x.topic, x.uuid, mdJSON, o.validate)
		return x, nil
	})
	if err != nil {
		return 0, fmt.Errorf("forwarder: read rows: %w", err)
	}
	if len(batch) != len(ids) {
		return 0, fmt.Errorf("forwarder: read rows: %d of the %d rows taken are gone (deleted by something other than a relay?)", len(ids)-len(batch), len(ids))
	}
	for _, x := range batch {
		if x.refused == nil {
			continue
		}
		payload := x.payload
		if payload == nil {
			payload = []byte{}
		}
		err := deadLetterRow(x, func(uuid, metadata string) (bool, error) {
			_, err := tx.ExecContext(ctx, o.q.deadLetter, []byte(uuid), []byte(delivery.Bound(x.topic)), []byte(delivery.Bound(o.consumer)),
				[]byte(delivery.Bound(x.key)), x.refused.Error(), payload, metadata)
			if n, ok := mysqlErrorNumber(err); ok && n == erDupEntry {
				return false, nil
			}
			return err == nil, err
		})
		if err != nil {
			return 0, fmt.Errorf("forwarder: dead-letter refused row %d: %w", x.id, err)
		}
	}
	published, err := publish(ctx, batch)
	if err != nil {
		return 0, err
	}
	// The broker has the rows: delete them even if ctx ends now, each
	// statement within DatabaseTimeout.
	post, cancel := afterPublish(ctx, o.timeout)
	defer cancel()
	idsJSON, err := json.Marshal(ids)
	if err != nil {
		return 0, fmt.Errorf("forwarder: delete %d published rows (they will be published again): %w", len(ids), err)
	}
	if _, err := tx.ExecContext(post, o.q.remove, string(idsJSON)); err != nil {
		return 0, fmt.Errorf("forwarder: delete %d published rows (they will be published again): %w", len(ids), err)
	}
	if o.q.record != "" {
		if err := o.record(post, tx, batch, takenAt); err != nil {
			return 0, fmt.Errorf("forwarder: record %d published rows in the ledger (they will be published again): %w", published, err)
		}
	}
	return published, nil
}

// record inserts the ledger rows of batch's published rows, in one
// statement: five placeholders a row, which BatchSize (at most 10000)
// keeps under the server's 65535. Refused rows were dead-lettered, not
// published: they get none. at is their published_at, the time the
// batch read them.
func (o *mysqlOutbox) record(ctx context.Context, tx *sql.Conn, batch []row, at any) error {
	var (
		b    strings.Builder
		args = make([]any, 0, 5*len(batch))
	)
	b.WriteString(o.q.record)
	for _, x := range batch {
		if x.refused != nil {
			continue
		}
		if len(args) > 0 {
			b.WriteString(", ")
		}
		b.WriteString("(?, ?, ?, ?, ?)")
		args = append(args, []byte(x.uuid), []byte(x.topic), []byte(x.key), []byte(delivery.Bound(ledgerKey(x))), at)
	}
	if len(args) == 0 {
		return nil
	}
	_, err := tx.ExecContext(ctx, b.String(), args...)
	return err
}

// cutBeforeInFlight reads, after taken was read, the rows of taken's
// lanes below the highest taken id of each lane, uncommitted rows
// included, and cuts each lane before its first row that is not in taken:
// one that was in flight when taken was read.
func (o *mysqlOutbox) cutBeforeInFlight(ctx context.Context, tx *sql.Conn, taken []laneRow) ([]laneRow, error) {
	highest := map[int16]uint64{}
	for _, x := range taken {
		highest[x.lane] = max(highest[x.lane], x.id)
	}
	if len(highest) == 0 {
		return taken, nil
	}
	parts := make([]string, 0, len(highest))
	args := make([]any, 0, 2*len(highest))
	for lane, id := range highest {
		parts = append(parts, o.q.inFlightPart)
		args = append(args, lane, id)
	}
	seen, err := queryLaneRows(ctx, tx, strings.Join(parts, " UNION ALL "), args)
	if err != nil {
		return nil, fmt.Errorf("forwarder: look for rows in flight: %w", err)
	}
	isTaken := make(map[uint64]bool, len(taken))
	for _, x := range taken {
		isTaken[x.id] = true
	}
	// cut[lane] is the lowest id in flight in the lane.
	cut := map[int16]uint64{}
	for _, x := range seen {
		if isTaken[x.id] {
			continue
		}
		if c, ok := cut[x.lane]; !ok || x.id < c {
			cut[x.lane] = x.id
		}
	}
	if len(cut) == 0 {
		return taken, nil
	}
	kept := taken[:0:0]
	for _, x := range taken {
		if c, ok := cut[x.lane]; ok && x.id > c {
			continue
		}
		kept = append(kept, x)
	}
	return kept, nil
}

func queryLaneRows(ctx context.Context, tx *sql.Conn, q string, args []any) ([]laneRow, error) {
	rs, err := tx.QueryContext(ctx, q, args...)
	if err != nil {
		return nil, err
	}
	out, err := collect(rs, func(rs *sql.Rows) (laneRow, error) {
		var x laneRow
		return x, rs.Scan(&x.id, &x.lane)
	})
	if err != nil {
		return nil, err
	}
	slices.SortFunc(out, func(a, b laneRow) int {
		switch {
		case a.id < b.id:
			return -1
		case a.id > b.id:
			return 1
		}
		return 0
	})
	return out, nil
}

// collect scans every row of rs with scan and closes rs.
func collect[T any](rs *sql.Rows, scan func(*sql.Rows) (T, error)) ([]T, error) {
	defer rs.Close()
	var out []T
	for rs.Next() {
		v, err := scan(rs)
		if err != nil {
			return nil, err
		}
		out = append(out, v)
	}
	if err := rs.Err(); err != nil {
		return nil, err
	}
	return out, rs.Close()
}

func (o *mysqlOutbox) lag(ctx context.Context) (Lag, error) {
	return measureMySQLLag(ctx, o.db, o.q.lagQueries, o.lockOrdered)
}

// SQLOutboxLag returns what [Relay.Lag] returns, for the outbox table that
// schema names (as given to sqlschema.MigrateSQL) on db, a database of
// dialect d, without a relay: for a dashboard or an operator's console that
// watches the outbox from another process. d must be sqlschema.MySQL (for
// PostgreSQL see [OutboxLag]). Its Waiting rows are the ones a relay
// without LockOrderedWriters would hold back.
func SQLOutboxLag(ctx context.Context, db *sql.DB, d sqlschema.Dialect, schema sqlschema.Config) (Lag, error) {
	if db == nil {
		return Lag{}, errors.New("forwarder: SQLOutboxLag: db is nil")
	}
	if d != sqlschema.MySQL {
		return Lag{}, fmt.Errorf("forwarder: SQLOutboxLag: dialect must be sqlschema.MySQL, got %q (for PostgreSQL use OutboxLag)", d)
	}
	schema = schema.WithDefaults()
	if err := schema.Validate(); err != nil {
		return Lag{}, fmt.Errorf("forwarder: SQLOutboxLag: %w", err)
	}
	return measureMySQLLag(ctx, db, newMySQLLagQueries(sqlschema.NamesFor(d, schema)), false)
}

// laneCount is one lane's committed rows.
type laneCount struct {
	rows   int
	lowest uint64
}

// measureMySQLLag counts the committed rows, then (unless lockOrdered)
// reads each lane's lowest row uncommitted: a lane whose lowest row is not
// its lowest committed one waits, with all its committed rows.
func measureMySQLLag(ctx context.Context, db *sql.DB, q mysqlLagQueries, lockOrdered bool) (Lag, error) {
	rs, err := db.QueryContext(ctx, q.committed)
	if err != nil {
		return Lag{}, fmt.Errorf("forwarder: lag: %w", err)
	}
	var (
		lag    Lag
		oldest int64
		lanes  = map[int16]laneCount{}
	)
	type laneLine struct {
		lane  int16
		count laneCount
		age   int64
	}
	lines, err := collect(rs, func(rs *sql.Rows) (laneLine, error) {
		var l laneLine
		return l, rs.Scan(&l.lane, &l.count.rows, &l.count.lowest, &l.age)
	})
	if err != nil {
		return Lag{}, fmt.Errorf("forwarder: lag: %w", err)
	}
	for _, l := range lines {
		lanes[l.lane] = l.count
		lag.Pending += l.count.rows
		oldest = max(oldest, l.age)
	}
	lag.OldestAge = time.Duration(oldest) * time.Microsecond
	if lockOrdered || lag.Pending == 0 {
		return lag, nil
	}

	tx, err := db.BeginTx(ctx, &sql.TxOptions{Isolation: sql.LevelReadUncommitted, ReadOnly: true})
	if err != nil {
		return Lag{}, fmt.Errorf("forwarder: lag: begin: %w", err)
	}
	defer tx.Rollback() //nolint:errcheck // read only; the outcome is the reads'
	rs, err = tx.QueryContext(ctx, q.lowest)
	if err != nil {
		return Lag{}, fmt.Errorf("forwarder: lag: rows in flight: %w", err)
	}
	type lowestLine struct {
		lane int16
		id   uint64
	}
	lows, err := collect(rs, func(rs *sql.Rows) (lowestLine, error) {
		var l lowestLine
		return l, rs.Scan(&l.lane, &l.id)
	})
	if err != nil {
		return Lag{}, fmt.Errorf("forwarder: lag: rows in flight: %w", err)
	}
	var blocking uint64 // the lowest row in flight of a waiting lane
	for _, l := range lows {
		c, ok := lanes[l.lane]
		if !ok || l.id >= c.lowest {
			continue
		}
		lag.Waiting += c.rows
		if blocking == 0 || l.id < blocking {
			blocking = l.id
		}
	}
	if lag.Waiting == 0 {
		return lag, nil
	}
	var (
		writer uint64
		age    int64
	)
	switch err := tx.QueryRowContext(ctx, q.inFlight, blocking).Scan(&writer, &age); {
	case errors.Is(err, sql.ErrNoRows):
		return lag, nil // rolled back meanwhile
	case err != nil:
		return Lag{}, fmt.Errorf("forwarder: lag: row in flight: %w", err)
	}
	// Without the details (information_schema.INNODB_TRX needs the
	// PROCESS privilege, and a row written otherwise than by the
	// publisher names no writer), the row's age is the transaction's, at
	// least.
	h := Holder{PID: int(writer), State: "in a transaction", Age: time.Duration(age) * time.Microsecond}
	lag.HeldBy = &h
	if writer == 0 {
		return lag, nil
	}
	var open int64
	err = tx.QueryRowContext(ctx, q.holder, writer).Scan(&h.Database, &h.User, &h.State, &h.Query, &open)
	switch {
	case errors.Is(err, sql.ErrNoRows):
		// It ended between the queries, or the server shows only the
		// sessions of this user.
	case err != nil:
		if !mysqlAccessDenied(err) {
			return Lag{}, fmt.Errorf("forwarder: lag: find the open transaction: %w", err)
		}
	default:
		// trx_started is to the second, rounded down: the transaction
		// has been open for at least the reading less a second, and at
		// least as long as its row.
		h.Age = max(h.Age, time.Duration(open)*time.Microsecond-time.Second)
	}
	return lag, nil
}

// mysqlAccessDenied reports whether err is the server's refusal for lack
// of a privilege: ER_SPECIFIC_ACCESS_DENIED_ERROR (1227),
// ER_TABLEACCESS_DENIED_ERROR (1142) or ER_DBACCESS_DENIED_ERROR (1044).
func mysqlAccessDenied(err error) bool {
	var me *mysql.MySQLError
	return errors.As(err, &me) && (me.Number == 1227 || me.Number == 1142 || me.Number == 1044)
}

// erDupEntry is MySQL's ER_DUP_ENTRY: a unique index holds the value.
const erDupEntry = 1062

// mysqlErrorNumber returns the server's error number of err, if it is a
// server error.
func mysqlErrorNumber(err error) (uint16, bool) {
	var me *mysql.MySQLError
	if errors.As(err, &me) {
		return me.Number, true
	}
	return 0, false
}
