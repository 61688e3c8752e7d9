package forwarder

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"hash/fnv"
	"sort"
	"strconv"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/oncemill/oncemill/sqlschema"
)

// lanes is the number of ordering lanes in the outbox table (the lane
// column is hashtext(partition_key) & 63).
const lanes = 64

// RelayConfig configures a [Relay].
type RelayConfig struct {
	// Pool is the database holding the outbox. Required.
	Pool *pgxpool.Pool
	// Publisher receives the rows as messages: any Watermill publisher.
	// Required.
	Publisher message.Publisher
	// Schema names the outbox table, as given to sqlschema.Migrate.
	Schema sqlschema.Config
	// BatchSize is the most rows one transaction publishes. Defaults to
	// 500.
	BatchSize int
	// LanesPerBatch is the most ordering lanes (of 64) one batch takes;
	// relays running at once share the lanes, each key's rows stay in one
	// lane. Defaults to 16.
	LanesPerBatch int
	// PollInterval is how often the relay looks for rows when no
	// notification arrives; notifications wake it at once. Defaults to 5s.
	PollInterval time.Duration
	// MinBackoff and MaxBackoff bound the wait after a failed batch (the
	// broker down, say); it doubles from MinBackoff up to MaxBackoff. The
	// rows stay in the table. Default to 100ms and 10s.
	MinBackoff, MaxBackoff time.Duration
	// Logger receives failed batches. Defaults to watermill.NopLogger.
	Logger watermill.LoggerAdapter
}

func (c *RelayConfig) setDefaults() {
	if c.BatchSize == 0 {
		c.BatchSize = 500
	}
	if c.LanesPerBatch == 0 {
		c.LanesPerBatch = 16
	}
	if c.PollInterval == 0 {
		c.PollInterval = 5 * time.Second
	}
	if c.MinBackoff == 0 {
		c.MinBackoff = 100 * time.Millisecond
	}
	if c.MaxBackoff == 0 {
		c.MaxBackoff = 10 * time.Second
	}
	if c.Logger == nil {
		c.Logger = watermill.NopLogger{}
	}
	c.Schema = c.Schema.WithDefaults()
}

// Validate reports the first field that is missing or out of range.
func (c RelayConfig) Validate() error {
	switch {
	case c.Pool == nil:
		return errors.New("forwarder: RelayConfig.Pool is required")
	case c.Publisher == nil:
		return errors.New("forwarder: RelayConfig.Publisher is required")
	case c.BatchSize < 1 || c.BatchSize > 10000:
		return fmt.Errorf("forwarder: RelayConfig.BatchSize must be 1 to 10000, got %d", c.BatchSize)
	case c.LanesPerBatch < 1 || c.LanesPerBatch > lanes:
		return fmt.Errorf("forwarder: RelayConfig.LanesPerBatch must be 1 to %d, got %d", lanes, c.LanesPerBatch)
	case c.PollInterval < time.Millisecond:
		return fmt.Errorf("forwarder: RelayConfig.PollInterval must be at least 1ms, got %s", c.PollInterval)
	case c.MinBackoff <= 0 || c.MaxBackoff < c.MinBackoff:
		return fmt.Errorf("forwarder: RelayConfig.MinBackoff (%s) must be positive and at most MaxBackoff (%s)", c.MinBackoff, c.MaxBackoff)
	}
	return c.Schema.Validate()
}

// Relay publishes outbox rows to a broker and deletes them. Several relays
// may run against one table: each batch takes a set of lanes under
// transaction-level advisory locks, so no row is published twice in normal
// operation and each partition key's rows go out in transaction order. A
// relay that dies between publish and delete publishes the rows again on
// the next batch, with the same UUIDs; the consumer's inbox absorbs them.
type Relay struct {
	cfg     RelayConfig
	names   sqlschema.Names
	lockKey int32
	q       relayQueries

	mu      sync.Mutex
	cancel  context.CancelFunc
	running chan struct{}
	closed  bool
}

type relayQueries struct {
	lanes, take, lag, any string
}

// NewRelay returns a relay; it starts nothing until Run.
func NewRelay(cfg RelayConfig) (*Relay, error) {
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	names := sqlschema.NamesFor(sqlschema.Postgres, cfg.Schema)
	h := fnv.New32a()
	h.Write([]byte("oncemill:outbox:" + names.Outbox))
	t := names.Outbox
	eligible := `txid < pg_snapshot_xmin(pg_current_snapshot())`
	return &Relay{
		cfg:     cfg,
		names:   names,
		lockKey: int32(h.Sum32()),
		q: relayQueries{
			// Lanes with rows whose transactions are all committed, in a
			// random order, locked until this transaction ends. OFFSET 0
			// keeps the lock call out of the inner query, so that only
			// lanes with work are locked, and LIMIT stops locking early.
			lanes: `SELECT l FROM (
	SELECT l FROM generate_series(0, 63) AS l
	WHERE EXISTS (SELECT 1 FROM ` + t + ` o WHERE o.lane = l AND o.` + eligible + `)
	ORDER BY random() OFFSET 0) s
WHERE pg_try_advisory_xact_lock($1, s.l) LIMIT $2`,
			// Rows are eligible only once every older transaction has
			// ended, so a row committed late by a long transaction is
			// never overtaken by a younger one of the same key.
			take: `DELETE FROM ` + t + ` WHERE id IN (
	SELECT id FROM ` + t + ` WHERE lane = ANY($1) AND ` + eligible + `
	ORDER BY txid, id LIMIT $2)
RETURNING id, txid::text, topic, uuid, payload, metadata`,
			lag: `SELECT count(*), COALESCE(extract(epoch FROM now() - min(created_at)), 0)::float8 FROM ` + t,
			any: `SELECT EXISTS (SELECT 1 FROM ` + t + `)`,
		},
	}, nil
}

// Lag is how far a relay is behind.
type Lag struct {
	// Pending counts rows not yet published.
	Pending int
	// OldestAge is the age of the oldest pending row; zero when none.
	OldestAge time.Duration
}

// Lag returns the outbox's pending rows and the age of the oldest.
func (r *Relay) Lag(ctx context.Context) (Lag, error) {
	var (
		n   int
		age float64
	)
	if err := r.cfg.Pool.QueryRow(ctx, r.q.lag).Scan(&n, &age); err != nil {
		return Lag{}, fmt.Errorf("forwarder: lag: %w", err)
	}
	return Lag{Pending: n, OldestAge: time.Duration(age * float64(time.Second))}, nil
}

type row struct {
	id       int64
	txid     uint64
	topic    string
	uuid     string
	payload  []byte
	metadata map[string]string
}

// RelayBatch publishes one batch and deletes its rows, in one transaction:
// if publishing fails the rows stay. It returns how many rows it published.
func (r *Relay) RelayBatch(ctx context.Context) (int, error) {
	tx, err := r.cfg.Pool.Begin(ctx)
	if err != nil {
		return 0, fmt.Errorf("forwarder: begin: %w", err)
	}
	n, err := r.relay(ctx, tx)
	if err == nil {
		// Once the broker has the rows, delete them even if Close came
		// meanwhile: a cancelled commit would publish them all again.
		err = tx.Commit(context.WithoutCancel(ctx))
		if err != nil {
			err = fmt.Errorf("forwarder: commit after publishing %d rows (they will be published again): %w", n, err)
		}
	}
	if err != nil {
		if rbErr := tx.Rollback(context.WithoutCancel(ctx)); rbErr != nil && !errors.Is(rbErr, pgx.ErrTxClosed) {
			err = errors.Join(err, rbErr)
		}
		return 0, err
	}
	return n, nil
}

func (r *Relay) relay(ctx context.Context, tx pgx.Tx) (int, error) {
	lrows, err := tx.Query(ctx, r.q.lanes, r.lockKey, r.cfg.LanesPerBatch)
	if err != nil {
		return 0, fmt.Errorf("forwarder: take lanes: %w", err)
	}
	taken, err := pgx.CollectRows(lrows, pgx.RowTo[int32])
	if err != nil {
		return 0, fmt.Errorf("forwarder: take lanes: %w", err)
	}
	if len(taken) == 0 {
		return 0, nil
	}
	rows, err := tx.Query(ctx, r.q.take, taken, r.cfg.BatchSize)
	if err != nil {
		return 0, fmt.Errorf("forwarder: take rows: %w", err)
	}
	batch, err := pgx.CollectRows(rows, func(rw pgx.CollectableRow) (row, error) {
		var (
			x     row
			txid  string
			mdRaw []byte
		)
		if err := rw.Scan(&x.id, &txid, &x.topic, &x.uuid, &x.payload, &mdRaw); err != nil {
			return x, err
		}
		var err error
		if x.txid, err = strconv.ParseUint(txid, 10, 64); err != nil {
			return x, fmt.Errorf("row %d: txid %q: %w", x.id, txid, err)
		}
		if err := json.Unmarshal(mdRaw, &x.metadata); err != nil {
			return x, fmt.Errorf("row %d: metadata: %w", x.id, err)
		}
		return x, nil
	})
	if err != nil {
		return 0, fmt.Errorf("forwarder: take rows: %w", err)
	}
	sort.Slice(batch, func(i, j int) bool {
		if batch[i].txid != batch[j].txid {
			return batch[i].txid < batch[j].txid
		}
		return batch[i].id < batch[j].id
	})
	// Publish runs of one topic together, in order.
	for start := 0; start < len(batch); {
		end := start + 1
		for end < len(batch) && batch[end].topic == batch[start].topic {
			end++
		}
		msgs := make([]*message.Message, 0, end-start)
		for _, x := range batch[start:end] {
			m := message.NewMessage(x.uuid, x.payload)
			for k, v := range x.metadata {
				m.Metadata.Set(k, v)
			}
			m.SetContext(ctx)
			msgs = append(msgs, m)
		}
		if err := r.cfg.Publisher.Publish(batch[start].topic, msgs...); err != nil {
			return 0, fmt.Errorf("forwarder: publish %d rows to %q: %w", len(msgs), batch[start].topic, err)
		}
		start = end
	}
	return len(batch), nil
}

// Run relays until ctx is done or Close is called, and returns nil then.
// It holds one connection that LISTENs for the outbox's notifications and
// polls every PollInterval when none come. Failed batches are logged and
// retried with backoff.
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

	for ctx.Err() == nil {
		if err := r.listen(ctx); err != nil {
			if ctx.Err() != nil {
				return nil
			}
			// The listening connection broke or could not be had: its
			// notifications are lost, so start over on a fresh one.
			r.cfg.Logger.Error("Outbox listener lost, reconnecting", err, nil)
			sleep(ctx, r.cfg.MaxBackoff)
		}
	}
	return nil
}

// listen relays on one listening connection until ctx is done (nil) or the
// connection fails (its error).
func (r *Relay) listen(ctx context.Context) error {
	listener, err := r.cfg.Pool.Acquire(ctx)
	if err != nil {
		return fmt.Errorf("forwarder: acquire listener: %w", err)
	}
	defer listener.Release()
	if _, err := listener.Exec(ctx, `LISTEN `+pgx.Identifier{r.names.OutboxChannel}.Sanitize()); err != nil {
		return fmt.Errorf("forwarder: listen: %w", err)
	}
	defer func() {
		// A connection going back to the pool must not keep listening.
		if _, err := listener.Exec(context.WithoutCancel(ctx), `UNLISTEN *`); err != nil {
			listener.Hijack().Close(context.WithoutCancel(ctx)) //nolint:errcheck // dropping a broken connection
		}
	}()

	backoff := r.cfg.MinBackoff
	for ctx.Err() == nil {
		n, err := r.RelayBatch(ctx)
		switch {
		case err != nil && ctx.Err() == nil:
			r.cfg.Logger.Error("Outbox batch failed, rows kept", err, watermill.LogFields{"backoff": backoff.String()})
			sleep(ctx, backoff)
			backoff = min(2*backoff, r.cfg.MaxBackoff)
			continue
		case n > 0:
			backoff = r.cfg.MinBackoff
			continue
		}
		// Nothing eligible. Rows of transactions that are still in
		// progress elsewhere come due without a new notification: look
		// again soon.
		wait := r.cfg.PollInterval
		var pending bool
		if err := r.cfg.Pool.QueryRow(ctx, r.q.any).Scan(&pending); err == nil && pending {
			wait = min(wait, 20*time.Millisecond)
		}
		wctx, wcancel := context.WithTimeout(ctx, wait)
		_, err = listener.Conn().WaitForNotification(wctx)
		wcancel()
		if err != nil && ctx.Err() == nil && !errors.Is(err, context.DeadlineExceeded) {
			return fmt.Errorf("forwarder: wait for notification: %w", err)
		}
	}
	return nil
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
