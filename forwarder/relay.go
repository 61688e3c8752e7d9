package forwarder

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/oncemill/oncemill/adapters"
	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/internal/sqldb"
	"github.com/oncemill/oncemill/internal/typednil"
	"github.com/oncemill/oncemill/observe"
	"github.com/oncemill/oncemill/sqlschema"
)

// ErrLossyPublisher is wrapped by the error NewRelay returns for a
// RelayConfig.Publisher that would lose the rows the relay deletes: one
// that lives inside this process (an embedded broker, a non-persistent
// GoChannel), as adapters.CheckDurable decides; the error wraps
// adapters.ErrInProcess too.
var ErrLossyPublisher = errors.New("forwarder: RelayConfig.Publisher would lose the rows the relay deletes")

// lanes is the number of ordering lanes in the outbox table (the lane
// column is a hash of partition_key & 63).
const lanes = 64

// RelayConfig configures a [Relay].
type RelayConfig struct {
	// Pool is the PostgreSQL database holding the outbox, through pgx.
	// Set either Pool or DB.
	Pool *pgxpool.Pool
	// DB is the database holding the outbox, through database/sql, with
	// Dialect naming its family: sqlschema.Postgres (pgx's stdlib or
	// lib/pq), sqlschema.MySQL (MySQL 8.0 or newer, MariaDB 10.6 or newer,
	// go-sql-driver/mysql) or sqlschema.SQLite (modernc.org/sqlite; one
	// relay per database file, see [Relay]), on the tables that
	// sqlschema.MigrateSQL creates. Set either Pool or DB. See [Relay] for
	// what the relay promises on each.
	DB *sql.DB
	// Dialect is the database family of DB. Required with DB, ignored
	// with Pool.
	Dialect sqlschema.Dialect
	// Publisher receives the rows as messages: any Watermill publisher
	// whose Publish fails when the broker did not take the messages, since
	// the relay deletes the rows it published. A publisher that lives
	// inside this process is refused with [ErrLossyPublisher]
	// (adapters.CheckDurable): the one adapters.Open returns for kafka://
	// or nats:// with no host, and a non-persistent GoChannel. A
	// persistent GoChannel is accepted, for tests and demos. A decorator
	// around a refused publisher cannot be seen through. Required.
	Publisher message.Publisher
	// Schema names the outbox table, as given to sqlschema.Migrate.
	Schema sqlschema.Config
	// BatchSize is the most rows one transaction publishes, and the most
	// due scheduled rows one transaction moves into the outbox. Defaults
	// to 500.
	BatchSize int
	// LockOrderedWriters says that the writers of each partition key are
	// ordered by a lock each holds until it commits, taken before its
	// outbox insert (the key's business row: UPDATE orders … WHERE id =
	// $1, SELECT … FOR UPDATE), which is how the relay's per-key order is
	// meant to be used. The relay then publishes every committed row at
	// once instead of waiting until every older transaction on the server
	// has ended: a later writer's row cannot be committed before an
	// earlier writer's, so per-key order holds all the same, and a
	// transaction left open elsewhere on the server (another database, an
	// idle session, a prepared transaction) no longer stalls the outbox.
	// Writers that nothing orders lose the partial order the wait gives
	// them: their rows go out in commit order. [Lag] then reports no
	// waiting rows. On MySQL the wait is per lane instead (see [Relay]):
	// a row waits while a row with a lower id in its lane is uncommitted,
	// and LockOrderedWriters lets every committed row go at once there
	// too. Defaults to false: wait, as for writers of unknown discipline.
	LockOrderedWriters bool
	// LanesPerBatch is the most ordering lanes (of 64) one batch takes;
	// relays running at once share the lanes, each key's rows stay in one
	// lane. Ignored on SQLite, whose one relay takes every lane. Defaults
	// to 16.
	LanesPerBatch int
	// PollInterval is the longest wait between two looks for rows, reached
	// while the outbox stays empty: after a full batch the relay looks
	// again at once, after a batch that emptied the backlog it waits
	// MinPollInterval, and after an empty look MinPollInterval, then twice
	// as long each time, up to PollInterval. An idle relay therefore sends
	// one query per PollInterval, which also reads the earliest due time
	// of the scheduled rows; a row due less than PollInterval after it was
	// written may be up to PollInterval late, a later one is moved to the
	// outbox at its due time (see "Scheduled messages" in [Relay]).
	// Defaults to 250ms.
	PollInterval time.Duration
	// MinPollInterval is the wait after a batch that was not full and the
	// first wait after an empty look: the most a row waits while rows
	// flow, traded against the writers' throughput (each batch is a
	// transaction on the writers' server). Defaults to 5ms.
	MinPollInterval time.Duration
	// MinBackoff and MaxBackoff bound the wait after a failed batch (the
	// broker down, say); it doubles from MinBackoff up to MaxBackoff. The
	// rows stay in the table. Defaults to 100ms and 10s.
	MinBackoff, MaxBackoff time.Duration
	// DrainTimeout bounds how long Run, once stopped, lets the batch in
	// flight finish publishing and deleting its rows. Past it the relay
	// cancels the batch's context, which is its messages' context
	// (Message.Context): a publisher that honours it returns, the batch
	// rolls back and its rows stay in the outbox for the next run. Run
	// cannot return while Publish has not. Defaults to 5s.
	DrainTimeout time.Duration
	// DatabaseTimeout bounds the relay's waits on its database: a batch's
	// statements up to the publish (begin, take, dead-lettering refused
	// rows), each look for rows, and, once the publisher has the rows,
	// each of the statements that delete them (the delete, the ledger's
	// insert, and on SQLite the dead letters: its write transaction comes
	// after the publish), the commit and a rollback. Those last run even
	// after Run was stopped, so that what was published is deleted; with
	// the bound a database that stops answering fails the batch (its
	// rows stay and go out again, which the consumers' inboxes absorb)
	// instead of holding Run and Close forever. The publish itself is not
	// bounded by it (see DrainTimeout). At least 100ms
	// ([MinDatabaseTimeout]). Defaults to 10s.
	DatabaseTimeout time.Duration
	// StallWarning is how long the transaction that outbox rows wait on
	// (see [Lag.HeldBy]) must have been open before the relay logs it as a
	// stall, naming its pid (or prepared gid), database and age; the relay
	// logs at most one such line per StallWarning while rows wait. A
	// writer that is still in flight, open for less than StallWarning, is
	// not a stall, however many rows wait on it. The relay looks while it
	// finds nothing to publish, every StallWarning/2 (one count of the
	// table, and one look at pg_stat_activity when rows wait), so the
	// first line comes between StallWarning and about 1.5 × StallWarning
	// after the transaction began. Defaults to 10s.
	StallWarning time.Duration
	// Hooks are told of each batch that took rows or failed
	// (observe.RelayHook), of the backlog every LagInterval
	// (observe.OutboxLagHook), and see each row's message before it is
	// published (observe.MessageOutHook), which is where a trace hook
	// starts the relay's span and carries the trace on.
	Hooks []observe.Hook
	// LagInterval is how often the relay measures its backlog for the
	// lag hooks (one count of the table). Defaults to 5s.
	LagInterval time.Duration
	// Ledger makes the relay record each row it publishes in the ledger
	// table (sqlschema.Config.LedgerTable), in the batch's transaction,
	// which deletes the row from the outbox, so that the record commits
	// with the delete, once the broker took the message: uuid, topic,
	// partition key, the idempotency key the inbox's default KeyFunc
	// derives (the idempotency_key metadata, else the UUID) and the time
	// the relay took the row. A row the relay refuses and dead-letters
	// gets no record. `oncemill reconcile` compares the ledger with a
	// consumer's inbox. On PostgreSQL it costs no extra statement per
	// batch (the statement that deletes the rows records them), on MySQL
	// and SQLite one INSERT per batch; either way the ledger rows'
	// inserts.
	// Defaults to false: no ledger.
	Ledger bool
	// LedgerRetention is how long ledger rows are kept: the relay deletes
	// older ones at start and then every minute, 1000 rows per
	// statement. Keep it longer than the window reconcile checks
	// (--since). Only with Ledger. Defaults to 7 days.
	LedgerRetention time.Duration
	// Logger receives failed batches and stalls. Watermill's LoggerAdapter
	// has no Warn level: a logger that also has a method
	// Warn(msg string, fields watermill.LogFields) gets the stall lines
	// there, any other gets them at Error with [ErrStalled]. Defaults to
	// watermill.NopLogger.
	Logger watermill.LoggerAdapter
}

// MinDatabaseTimeout is the shortest RelayConfig.DatabaseTimeout: the
// relay's statements take a few milliseconds on a server that answers,
// and a bound below that fails every batch with nothing published.
const MinDatabaseTimeout = 100 * time.Millisecond

func (c *RelayConfig) setDefaults() {
	if c.BatchSize == 0 {
		c.BatchSize = 500
	}
	if c.LanesPerBatch == 0 {
		c.LanesPerBatch = 16
	}
	if c.PollInterval == 0 {
		c.PollInterval = 250 * time.Millisecond
	}
	if c.MinPollInterval == 0 {
		c.MinPollInterval = min(5*time.Millisecond, c.PollInterval)
	}
	if c.MinBackoff == 0 {
		c.MinBackoff = 100 * time.Millisecond
	}
	if c.MaxBackoff == 0 {
		c.MaxBackoff = 10 * time.Second
	}
	if c.DrainTimeout == 0 {
		c.DrainTimeout = 5 * time.Second
	}
	if c.DatabaseTimeout == 0 {
		c.DatabaseTimeout = 10 * time.Second
	}
	if c.StallWarning == 0 {
		c.StallWarning = 10 * time.Second
	}
	if c.LagInterval == 0 {
		c.LagInterval = 5 * time.Second
	}
	if c.Logger == nil {
		c.Logger = watermill.NopLogger{}
	}
	if c.Ledger && c.LedgerRetention == 0 {
		c.LedgerRetention = DefaultLedgerRetention
	}
	c.Schema = c.Schema.WithDefaults()
}

// Validate reports the first field that is missing or out of range.
func (c RelayConfig) Validate() error {
	c.setDefaults()
	switch {
	case c.Pool == nil && c.DB == nil:
		return errors.New("forwarder: RelayConfig.Pool (pgx, PostgreSQL) or RelayConfig.DB (database/sql, with Dialect) is required")
	case c.Pool != nil && c.DB != nil:
		return errors.New("forwarder: RelayConfig.Pool and RelayConfig.DB are both set: set the one that holds the outbox")
	case c.DB != nil && c.Dialect != sqlschema.Postgres && c.Dialect != sqlschema.MySQL && c.Dialect != sqlschema.SQLite:
		return fmt.Errorf("forwarder: RelayConfig.Dialect must be sqlschema.Postgres, sqlschema.MySQL or sqlschema.SQLite with RelayConfig.DB, got %q", c.Dialect)
	case c.Publisher == nil:
		return errors.New("forwarder: RelayConfig.Publisher is required")
	case typednil.Is(c.Publisher):
		return fmt.Errorf("forwarder: RelayConfig.Publisher holds a nil %T: pass a publisher made by its constructor", c.Publisher)
	case c.BatchSize < 1 || c.BatchSize > 10000:
		return fmt.Errorf("forwarder: RelayConfig.BatchSize must be 1 to 10000, got %d", c.BatchSize)
	case c.LanesPerBatch < 1 || c.LanesPerBatch > lanes:
		return fmt.Errorf("forwarder: RelayConfig.LanesPerBatch must be 1 to %d, got %d", lanes, c.LanesPerBatch)
	case c.PollInterval < time.Millisecond:
		return fmt.Errorf("forwarder: RelayConfig.PollInterval must be at least 1ms, got %s", c.PollInterval)
	case c.MinPollInterval <= 0 || c.MinPollInterval > c.PollInterval:
		return fmt.Errorf("forwarder: RelayConfig.MinPollInterval (%s) must be positive and at most PollInterval (%s)", c.MinPollInterval, c.PollInterval)
	case c.MinBackoff <= 0 || c.MaxBackoff < c.MinBackoff:
		return fmt.Errorf("forwarder: RelayConfig.MinBackoff (%s) must be positive and at most MaxBackoff (%s)", c.MinBackoff, c.MaxBackoff)
	case c.DrainTimeout < 0:
		return fmt.Errorf("forwarder: RelayConfig.DrainTimeout must not be negative, got %s", c.DrainTimeout)
	case c.DatabaseTimeout < MinDatabaseTimeout:
		return fmt.Errorf("forwarder: RelayConfig.DatabaseTimeout must be at least %s (it bounds each of the relay's statements, and a shorter bound fails them on a server that answers), got %s",
			MinDatabaseTimeout, c.DatabaseTimeout)
	case c.StallWarning < 0:
		return fmt.Errorf("forwarder: RelayConfig.StallWarning must not be negative, got %s", c.StallWarning)
	case c.LagInterval < 0:
		return fmt.Errorf("forwarder: RelayConfig.LagInterval must not be negative, got %s", c.LagInterval)
	}
	if err := adapters.CheckDurable(c.Publisher); err != nil {
		return fmt.Errorf("%w: %w", ErrLossyPublisher, err)
	}
	if err := c.validateLedger(); err != nil {
		return err
	}
	return c.Schema.Validate()
}

// Relay publishes outbox rows to a broker and deletes them. Several relays
// may run against one table: each batch takes a set of lanes under
// transaction-level locks (advisory locks on PostgreSQL, the lane's row of
// the lanes table on MySQL), so no row is published twice in normal
// operation, and a partition key's rows stay in one lane. A relay that dies
// between publish and delete publishes the rows again on the next batch,
// with the same UUIDs; the consumer's inbox absorbs them.
//
// # Order
//
// Within a lane the relay walks the committed rows by id, the order of
// their inserts, and stops at the first row it may not take yet: a row
// goes out only once every transaction older than its own (by transaction
// id) has ended, server-wide, so that it does not overtake rows such a
// transaction inserted before it and has not committed yet.
//
// What that promises, for one partition key: the rows of one transaction
// go out in the order it inserted them, and a row inserted after another
// writer's commit goes out after that writer's rows. Writers of one key
// are usually ordered so by a lock the earlier holds until it commits,
// the key's business row (UPDATE orders … WHERE id = $1, SELECT … FOR
// UPDATE), taken before the outbox insert: the later writer's row then has
// the higher id and is committed later, so it cannot leave first, whatever
// the two transaction ids. Their rows go out in their commit order.
//
// What it does not promise: any order between writers that nothing orders,
// neither insertion order nor commit order. A row can leave before a row
// with a lower id that an open transaction inserted: if T1 took its
// transaction id first, T2 inserts row 10 and stays open, and T1 inserts
// row 11 and commits, row 11 is committed and due (T1 is older than every
// open transaction) while row 10 is not yet visible, so row 11 goes out
// first. Nor is there any order between keys: lanes go out concurrently.
//
// # Order on MySQL
//
// MySQL has no transaction ids to compare nor a snapshot to read them
// from, and an AUTO_INCREMENT id can become visible after a higher one.
// The relay keeps no cursor: each batch takes each lane's committed rows
// from its lowest id, so a row that commits late is the lowest of its lane
// and goes next, never skipped. What makes a row wait is its own lane: a
// row goes out only while no row with a lower id in its lane is still
// uncommitted, as far as the relay can see (it reads the lane's
// uncommitted rows, READ UNCOMMITTED, after the committed ones). With
// LockOrderedWriters it does not look: every committed row may go.
//
// What that promises, for one partition key, in both modes, as on
// PostgreSQL: the rows of one transaction go out in the order it inserted
// them, and a row inserted after another writer's commit goes out after
// that writer's rows, so lock-ordered writers' rows go out in their commit
// order. Without LockOrderedWriters, also: of two rows of a lane, the one
// with the lower id goes out first when it was in the table before the
// relay read the other, committed or not: writers that nothing orders
// go out in the order their inserts took their ids, but for a row whose
// INSERT had taken its id and not yet written the row when the relay
// looked. A transaction left open after inserting holds back the rows
// behind it in its lane (one lane of 64), not the whole outbox. Nor is
// there any order between keys.
//
// # Scheduled messages
//
// A message written with a due time still ahead ([PublishAt], [Delay])
// waits in the outbox's scheduled table, not in the outbox. Before its
// batches, Run moves the rows that are due into the outbox, in (due time,
// write) order, in one short transaction ([Relay.PromoteDue]); from there
// they go out as any row, after the rows of their key already in the
// outbox and before those written later. A message whose due time has
// passed when it is written goes to the outbox at once, or, while a row
// of its key that is due still waits, into the scheduled table behind it.
// So a key's messages with a due time go out in the order of their due
// times (a time already past counting as the write's), rows due together
// in their write order, whether or not a relay ran meanwhile. A message
// without a due time waits for nothing: written while a row of its key is
// due and not yet moved (the few milliseconds a running relay takes to
// move it, or an outage), it goes out first; see [PublishAt]. Run
// remembers the earliest due time and wakes for it, and otherwise reads
// the scheduled table at most once per PollInterval (while idle, in the
// statement that looks for rows). Relays moving rows at once take turns
// (the rows are locked), so each row is moved once. On a schema migrated
// before the scheduled table, Run relays the outbox as before, logs the
// missing table once (at Info) and looks for it again every minute.
//
// # On SQLite
//
// SQLite has one writer at a time and hands out ids in commit order: a
// committed row can never be overtaken by one with a lower id. The relay
// reads the first BatchSize rows by id, without a lock, publishes them,
// and then deletes them (and dead-letters the refused ones, and records
// the ledger) in one short write transaction: it never holds the write
// lock while it waits on the broker, and rows go out in the writers'
// commit order, each transaction's in its insert order, for every key.
// Nothing waits, and [Lag] reports no waiting rows. One relay per
// database file: there are no lanes to share, and a second relay would
// publish the rows the first is publishing again, which the consumers'
// inboxes absorb, and dead-letter a refused row twice.
type Relay struct {
	cfg   RelayConfig
	hooks observe.Hooks
	names sqlschema.Names
	// outbox names the table for people: schema.table, unquoted, as the
	// hooks, the logs and the router's handler name give it.
	outbox string
	db     *outbox
	sched  *scheduled
	// recheck is how long Run waits to look again for a scheduled table
	// it did not find.
	recheck time.Duration

	mu      sync.Mutex
	cancel  context.CancelFunc
	running chan struct{}
	closed  bool
}

// NewRelay returns a relay; it starts nothing until Run.
func NewRelay(cfg RelayConfig) (*Relay, error) {
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	db := sqldb.Pgx(cfg.Pool)
	if cfg.DB != nil {
		d, _ := sqldb.For(cfg.Dialect) // Validate checked it
		db = sqldb.SQL(cfg.DB, d)
	}
	names := db.Dialect().Names(cfg.Schema)
	o := newOutbox(cfg, db, names)
	return &Relay{
		cfg:     cfg,
		hooks:   observe.New(cfg.Hooks...),
		names:   names,
		outbox:  cfg.Schema.Schema + "." + cfg.Schema.OutboxTable,
		db:      o,
		sched:   newScheduled(cfg, db, names, o.probe, o.deadLetterRows),
		recheck: scheduledRecheck,
	}, nil
}

type row struct {
	id       int64
	topic    string
	uuid     string
	key      string
	payload  []byte
	metadata map[string]string
	// at is when the batch took the row, by the database's clock
	// (microseconds since the epoch): its ledger record's published_at.
	at int64
	// refused is why the row cannot be published (see [ErrRefusedRow]);
	// such a row is dead-lettered with the batch, not published.
	refused error
	// recorded: the take recorded the row in the ledger.
	recorded bool
	// exact: the metadata column keeps bytes under sqldb.ExactKey, which
	// a reader of its JSON does not see.
	exact bool
}

// RelayBatch publishes one batch and deletes its rows, in one transaction:
// if publishing fails the rows stay. It returns how many rows it published.
// It does not move due scheduled rows into the outbox: Run does, or
// [Relay.PromoteDue].
func (r *Relay) RelayBatch(ctx context.Context) (int, error) {
	began := time.Now()
	n, err := r.db.batch(ctx, r.publish)
	if n > 0 || err != nil {
		r.hooks.RelayBatch(ctx, observe.RelayBatch{Outbox: r.outbox, Rows: n, Duration: time.Since(began), Err: err})
	}
	return n, err
}

// boundDB returns the context of a batch's statements up to its publish:
// ctx, within timeout. The broker's part of the batch runs on ctx itself
// (see [publishOn]).
func boundDB(ctx context.Context, timeout time.Duration) (context.Context, context.CancelFunc) {
	return context.WithTimeout(ctx, timeout)
}

// afterPublish returns the context of a statement that follows a
// successful publish (delete, ledger, commit, rollback): it outlives ctx,
// whose end would otherwise publish the rows again, and ends after
// timeout, so that a database that stops answering fails the batch
// instead of holding the relay.
func afterPublish(ctx context.Context, timeout time.Duration) (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.WithoutCancel(ctx), timeout)
}

// publish publishes batch, in id order, to the relay's publisher: runs of
// one topic together. Refused rows are logged and skipped: the batch
// dead-letters them. It returns how many rows it published.
func (r *Relay) publish(ctx context.Context, batch []row) (int, error) {
	published := 0
	for start := 0; start < len(batch); {
		if x := batch[start]; x.refused != nil {
			r.cfg.Logger.Error("Outbox row refused, dead-lettered", x.refused, watermill.LogFields{
				"outbox": r.outbox, "row_id": x.id, "uuid": delivery.Bound(x.uuid), "topic": delivery.Bound(x.topic), "dlq_consumer": relayConsumer(r.outbox),
			})
			start++
			continue
		}
		end := start + 1
		for end < len(batch) && batch[end].refused == nil && batch[end].topic == batch[start].topic {
			end++
		}
		msgs := make([]*message.Message, 0, end-start)
		for _, x := range batch[start:end] {
			m := message.NewMessage(x.uuid, x.payload)
			for k, v := range x.metadata {
				// A delivery fact a producer wrote (a consumed message
				// published again, a forged decode error) would lie about
				// the delivery this publish makes.
				if !delivery.IsAdapterFact(k) {
					m.Metadata.Set(k, v)
				}
			}
			m.SetContext(ctx)
			r.hooks.MessageOut(ctx, observe.OutRelay, m)
			msgs = append(msgs, m)
		}
		if err := r.cfg.Publisher.Publish(batch[start].topic, msgs...); err != nil {
			return 0, fmt.Errorf("forwarder: publish %d rows to %q: %w", len(msgs), batch[start].topic, err)
		}
		published += len(msgs)
		start = end
	}
	return published, nil
}

// Run relays until ctx is done or Close is called, and returns nil then;
// the batch in flight at that moment finishes (within DrainTimeout), so
// that rows it published are deleted. It polls adaptively (see
// RelayConfig.PollInterval), and moves scheduled rows into the outbox as
// they come due (see "Scheduled messages" in [Relay]). Failed batches and
// moves are logged and retried with
// backoff; while rows wait on a transaction open for StallWarning or
// longer, the relay logs it once per StallWarning (see
// RelayConfig.StallWarning and RelayConfig.Logger).
func (r *Relay) Run(ctx context.Context) error {
	r.mu.Lock()
	if r.closed {
		r.mu.Unlock()
		return errors.New("forwarder: relay is closed")
	}
	if r.running != nil {
		r.mu.Unlock()
		return errors.New("forwarder: relay is already running")
	}
	ctx, cancel := context.WithCancel(ctx)
	r.cancel, r.running = cancel, make(chan struct{})
	done := r.running
	r.mu.Unlock()
	defer close(done)
	defer cancel()

	// A batch runs on its own context, which outlives ctx by DrainTimeout:
	// a batch cut short after publishing would publish its rows again.
	batchCtx, stopBatches := context.WithCancel(context.WithoutCancel(ctx))
	defer stopBatches()
	stopDrain := context.AfterFunc(ctx, func() {
		t := time.AfterFunc(r.cfg.DrainTimeout, stopBatches)
		<-batchCtx.Done()
		t.Stop()
	})
	defer stopDrain()

	var (
		wait    time.Duration // after an empty look; zero after rows
		backoff = r.cfg.MinBackoff
		stall   stallWatch
		lag     lagReading
		pruned  time.Time
		dues    dueWatch
	)
	for ctx.Err() == nil {
		if r.hooks.ObservesLag() && time.Since(lag.at) >= r.cfg.LagInterval {
			r.reportLag(ctx, &lag)
		}
		if r.cfg.Ledger && time.Since(pruned) >= ledgerPruneInterval {
			r.pruneLedger(ctx)
			pruned = time.Now()
		}
		n, err := r.poll(batchCtx, wait > 0, &dues)
		switch {
		case err != nil && ctx.Err() == nil:
			r.cfg.Logger.Error("Outbox batch failed, rows kept", err, watermill.LogFields{"backoff": backoff.String()})
			sleep(ctx, backoff)
			backoff = min(2*backoff, r.cfg.MaxBackoff)
			continue
		case err != nil:
			return nil
		case n > 0:
			backoff, wait = r.cfg.MinBackoff, 0
			stall.flowed = time.Now()
			if n < r.cfg.BatchSize {
				// The backlog is gone: let the next rows gather for a
				// moment rather than take them one batch each, which
				// would cost the writers more than it saves in latency.
				sleep(ctx, r.cfg.MinPollInterval)
			}
			continue
		}
		r.watchStall(ctx, &stall, &lag)
		wait = max(r.cfg.MinPollInterval, min(2*wait, r.cfg.PollInterval))
		sleep(ctx, dues.sleep(wait))
	}
	return nil
}

// poll moves the scheduled rows that are due into the outbox, when dues
// says it is time to look, and runs one batch; after an empty look
// (probe), it first looks for rows that may go out with one query outside
// a transaction (the look at the scheduled table's earliest due time in
// the same query), so that an idle relay sends one query per wait.
func (r *Relay) poll(ctx context.Context, probe bool, dues *dueWatch) (int, error) {
	probed, rows, err := r.promoteDue(ctx, dues, probe)
	if err != nil {
		return 0, err
	}
	if probed {
		if !rows {
			return 0, nil
		}
		probe = false
	}
	if probe {
		pctx, cancel := boundDB(ctx, r.cfg.DatabaseTimeout)
		due, err := r.db.probeRows(pctx)
		cancel()
		if err != nil {
			return 0, r.db.named("look for rows", err)
		}
		if !due {
			return 0, nil
		}
	}
	return r.RelayBatch(ctx)
}

// Close stops Run and waits for it to return. It is safe to call more than
// once.
func (r *Relay) Close() error {
	r.mu.Lock()
	r.closed = true
	cancel, running := r.cancel, r.running
	r.mu.Unlock()
	if cancel != nil {
		cancel()
		<-running
	}
	return nil
}

func sleep(ctx context.Context, d time.Duration) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
	case <-t.C:
	}
}
