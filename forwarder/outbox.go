package forwarder

import (
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"strings"
	"time"

	"github.com/oncemill/oncemill/internal/sqldb"
	"github.com/oncemill/oncemill/sqlschema"
)

// outbox is the relay's outbox table on one database, through sqldb: one
// batch lifecycle, one way to dead-letter refused rows and to record
// published ones in the ledger; only the take, how a batch finds its rows,
// depends on what the database can do (see [newOutbox]).
type outbox struct {
	db sqldb.DB
	d  *sqldb.Dialect
	// validate is the publisher's TopicValidator, or nil.
	validate func(string) error
	timeout  time.Duration
	consumer string
	ledger   bool
	// take returns a batch's rows in id order. It begins the batch's
	// transaction with begin and takes the rows in it, unless it reads
	// them without one: the batch then begins its transaction after the
	// publish, to delete them.
	take func(ctx context.Context, begin func(sqldb.TxOptions) (sqldb.Tx, error)) ([]row, error)
	// remove deletes the rows of a JSON array of ids; empty when the take
	// deletes the rows it takes. probe looks for rows; deadLetter files a
	// refused row (arguments: uuid, topic, consumer, key, error, payload,
	// metadata); unledger takes a refused row's record, written by the
	// take, out of the ledger (arguments: uuid, topic); record starts the
	// INSERT of ledger rows, which a values tuple per row completes (see
	// [outbox.recordRows]).
	remove, probe, deadLetter, unledger, record string
	// recordRow is record's values tuple for one row.
	recordRow string
	lag       lagSQL
}

// rowColumns are the columns of an outbox row as [outbox.scanRow] reads them;
// the take adds the time it took them, microseconds since the epoch.
const rowColumns = "id, topic, uuid, partition_key, payload, metadata"

// newOutbox returns the outbox of cfg on db; the take is the one the
// database's capabilities allow:
//
//   - snapshots and advisory locks (PostgreSQL): one statement takes the
//     lanes, cuts them before rows that may still be overtaken, deletes
//     the rows and records them in the ledger ([snapshotTake]);
//   - SKIP LOCKED and READ UNCOMMITTED (MySQL): the lanes table locks the
//     lanes, the rows in flight cut them ([laneTake]);
//   - one writer (SQLite): the first rows by id, read without a lock,
//     deleted after the publish in one short write transaction
//     ([oneWriterTake]).
func newOutbox(cfg RelayConfig, db sqldb.DB, names sqlschema.Names) *outbox {
	d := db.Dialect()
	t := names.Outbox
	o := &outbox{
		db:       db,
		d:        d,
		validate: topicValidation(cfg.Publisher),
		timeout:  cfg.DatabaseTimeout,
		consumer: relayConsumer(cfg.Schema.Schema + "." + cfg.Schema.OutboxTable),
		ledger:   cfg.Ledger,
		probe:    `SELECT EXISTS (SELECT 1 FROM ` + t + ` WHERE ` + due(d, "txid", cfg.LockOrderedWriters) + `)`,
		deadLetter: d.Rebind(`INSERT INTO ` + names.DLQ + ` (uuid, topic, dlq_topic, consumer, ` + d.Quote("key") + `, ` + d.Quote("error") +
			`, permanent, first_failed_at, last_failed_at, payload, metadata, dead_at)
VALUES (?, ?, '', ?, ?, ?, TRUE, ` + d.Now() + `, ` + d.Now() + `, ?, ` + d.JSON("?") + `, ` + d.Now() + `)` +
			d.InsertOnce("", "id")),
		lag: newLagSQL(d, names, cfg.LockOrderedWriters),
	}
	if cfg.Ledger {
		o.record = `INSERT INTO ` + names.Ledger + ` (uuid, topic, partition_key, idempotency_key, published_at) VALUES `
		o.recordRow = "(?, ?, ?, ?, " + d.FromMicros("?") + ")"
	}
	takenAt := ", " + d.Micros(d.Now())
	switch {
	case d.Snapshots && d.AdvisoryLocks:
		h := fnv.New32a()
		h.Write([]byte("oncemill:outbox:" + names.Outbox))
		s := &snapshotTake{o: o, lockKey: int32(h.Sum32()), lanesPerBatch: cfg.LanesPerBatch, batchSize: cfg.BatchSize,
			sql: d.Rebind(snapshotTakeSQL(d, names, cfg.LockOrderedWriters, cfg.Ledger))}
		o.take = s.take
		if cfg.Ledger {
			o.unledger = d.Rebind(`DELETE FROM ` + names.Ledger + ` WHERE uuid = ? AND topic = ? AND published_at = ` + d.Now())
		}
	case d.SkipLocked && d.ReadUncommitted:
		o.take = newLaneTake(o, cfg, names, takenAt).take
	default: // d.OneWriter
		w := &oneWriterTake{o: o, batchSize: cfg.BatchSize, read: d.Rebind(`SELECT ` + rowColumns + takenAt + ` FROM ` + t + ` ORDER BY id LIMIT ?`)}
		o.take = w.take
		o.remove = d.Rebind(d.ByIDs(t, "", ""))
	}
	return o
}

// due is the SQL condition on an outbox row's transaction id column under
// which the row may go out: on a database with snapshots, its transaction
// is older than every open one, unless the writers are lock-ordered; any
// committed row elsewhere (the take cuts the lanes otherwise, if at all).
func due(d *sqldb.Dialect, txid string, lockOrdered bool) string {
	if !d.Snapshots || lockOrdered {
		return "TRUE"
	}
	return txid + " < pg_snapshot_xmin(pg_current_snapshot())"
}

// batch runs one batch: take, dead-letter the refused rows, publish,
// delete, record in the ledger, commit; on any failure it rolls back and
// the rows stay. The statements up to the publish run within
// DatabaseTimeout of ctx ([boundDB]); the publish on ctx; the ones after
// it, even once ctx has ended, each within DatabaseTimeout
// ([afterPublish]): a cancelled commit would publish the rows again.
func (o *outbox) batch(ctx context.Context, publish func(context.Context, []row) (int, error)) (n int, err error) {
	dbCtx, cancel := boundDB(ctx, o.timeout)
	defer cancel()
	var tx sqldb.Tx
	begin := func(ctx context.Context, opts sqldb.TxOptions) (sqldb.Tx, error) {
		t, err := o.db.Begin(ctx, opts)
		if err != nil {
			return nil, beginFailed(o.d, o.timeout, err)
		}
		tx = t
		return t, nil
	}
	defer func() {
		if err != nil && tx != nil {
			post, cancel := afterPublish(ctx, o.timeout)
			defer cancel()
			if rbErr := tx.Rollback(post); rbErr != nil {
				err = errors.Join(err, rbErr)
			}
			n = 0
		}
	}()
	batch, err := o.take(dbCtx, func(opts sqldb.TxOptions) (sqldb.Tx, error) { return begin(dbCtx, opts) })
	if err != nil {
		return 0, err
	}
	if tx != nil {
		if err := o.settle(dbCtx, tx, batch); err != nil {
			return 0, err
		}
	}
	if len(batch) > 0 {
		if n, err = publish(ctx, batch); err != nil {
			return 0, err
		}
	}
	post, cancel := afterPublish(ctx, o.timeout)
	defer cancel()
	if tx == nil {
		if len(batch) == 0 {
			return 0, nil
		}
		if _, err := begin(post, sqldb.TxOptions{}); err != nil {
			return 0, err
		}
		if err := o.settle(post, tx, batch); err != nil {
			return 0, err
		}
	}
	if o.remove != "" && len(batch) > 0 {
		if _, err := tx.Exec(post, o.remove, idsJSON(batch)); err != nil {
			return 0, fmt.Errorf("forwarder: delete %d published rows (they will be published again): %w", len(batch), err)
		}
	}
	if err := o.recordRows(post, tx, batch); err != nil {
		return 0, fmt.Errorf("forwarder: record %d published rows in the ledger (they will be published again): %w", n, err)
	}
	if err := tx.Commit(post); err != nil {
		return 0, fmt.Errorf("forwarder: commit after publishing %d rows (they will be published again): %w", n, err)
	}
	return n, nil
}

// settle dead-letters the refused rows of batch in tx, and takes out of
// the ledger the records the take wrote for them: they are not published.
func (o *outbox) settle(ctx context.Context, tx sqldb.Tx, batch []row) error {
	if err := o.deadLetterRows(ctx, tx, batch); err != nil {
		return err
	}
	if o.unledger == "" {
		return nil
	}
	for _, x := range batch {
		if x.refused == nil {
			continue
		}
		if _, err := tx.Exec(ctx, o.unledger, sqldb.Ident(x.uuid), sqldb.Ident(x.topic)); err != nil {
			return fmt.Errorf("forwarder: dead-letter refused row %d: ledger: %w", x.id, err)
		}
	}
	return nil
}

// deadLetterRows dead-letters, in tx, the refused rows of rows.
func (o *outbox) deadLetterRows(ctx context.Context, tx sqldb.Tx, rows []row) error {
	for _, x := range rows {
		if x.refused == nil {
			continue
		}
		payload := x.payload
		if payload == nil {
			payload = []byte{}
		}
		err := deadLetterRow(x, func(uuid, metadata string) (bool, error) {
			n, err := tx.Exec(ctx, o.deadLetter, o.d.Text(uuid), o.d.Text(sqldb.Ident(x.topic)), o.d.Text(sqldb.Ident(o.consumer)),
				o.d.Text(sqldb.Ident(x.key)), sqldb.CleanText(x.refused.Error()), payload, metadata)
			if o.d.UniqueViolation(err) {
				return false, nil
			}
			return n > 0, err
		})
		if err != nil {
			return fmt.Errorf("forwarder: dead-letter refused row %d: %w", x.id, err)
		}
	}
	return nil
}

// recordRows records in the ledger, in tx, the published rows of batch
// that the take did not record: refused rows were dead-lettered, not
// published, and get no record. Each record's published_at is the time
// the batch took its row. A statement records at most 1000 rows, five
// placeholders a row.
func (o *outbox) recordRows(ctx context.Context, tx sqldb.Tx, batch []row) error {
	if !o.ledger {
		return nil
	}
	var (
		b    strings.Builder
		args []any
	)
	flush := func() error {
		if len(args) == 0 {
			return nil
		}
		_, err := tx.Exec(ctx, o.d.Rebind(b.String()), args...)
		b.Reset()
		args = args[:0]
		return err
	}
	for _, x := range batch {
		if x.refused != nil || x.recorded {
			continue
		}
		if len(args) == 0 {
			b.WriteString(o.record)
		} else {
			b.WriteString(", ")
		}
		b.WriteString(o.recordRow)
		// The ledger's columns are identifiers: their stored form.
		args = append(args, o.d.Text(sqldb.Ident(x.uuid)), o.d.Text(sqldb.Ident(x.topic)), o.d.Text(sqldb.Ident(x.key)),
			o.d.Text(sqldb.Ident(ledgerKey(x))), x.at)
		if len(args) == 5*1000 {
			if err := flush(); err != nil {
				return err
			}
		}
	}
	return flush()
}

// named is err of op, a statement of the relay bounded by
// RelayConfig.DatabaseTimeout, saying so when that bound ran out: a
// context's "deadline exceeded" alone does not say which setting to look
// at.
func (o *outbox) named(op string, err error) error {
	if errors.Is(err, context.DeadlineExceeded) {
		return fmt.Errorf("forwarder: %s: the database did not answer within RelayConfig.DatabaseTimeout (%s): %w", op, o.timeout, err)
	}
	return fmt.Errorf("forwarder: %s: %w", op, err)
}

// beginFailed is the error of a write transaction of the relay that
// could not begin. On a database with one writer (SQLite) a begin that
// ran out of time waited for the write lock: another connection holds a
// write transaction on the file, which the error names, rather than a
// bare "context deadline exceeded".
func beginFailed(d *sqldb.Dialect, timeout time.Duration, err error) error {
	switch {
	case errors.Is(err, context.DeadlineExceeded) && d.OneWriter:
		return fmt.Errorf("forwarder: begin: the database file is locked: another connection has held its write lock for RelayConfig.DatabaseTimeout (%s) "+
			"(SQLite has one writer: a long write transaction, or a tool that holds the file); the rows stay and go out once it is released: %w", timeout, err)
	case errors.Is(err, context.DeadlineExceeded):
		return fmt.Errorf("forwarder: begin: the database did not answer within RelayConfig.DatabaseTimeout (%s): %w", timeout, err)
	}
	return fmt.Errorf("forwarder: begin: %w", err)
}

func (o *outbox) probeRows(ctx context.Context) (bool, error) {
	var any bool
	err := o.db.QueryRow(ctx, o.probe).Scan(&any)
	return any, err
}

// scanRow reads a row of a take, for [sqldb.Collect]: [rowColumns] and
// the time taken.
func (o *outbox) scanRow(rs sqldb.Rows) (row, error) {
	var (
		x  row
		md []byte
	)
	if err := rs.Scan(&x.id, &x.topic, &x.uuid, &x.key, &x.payload, &md, &x.at); err != nil {
		return row{}, err
	}
	x.metadata, x.uuid, x.refused = checkRow(x.topic, x.uuid, md, o.validate)
	x.exact = sqldb.HasExact(md)
	return x, nil
}
