package dlq

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

	"github.com/oncemill/oncemill/internal/merge"
	"github.com/oncemill/oncemill/internal/sqldb"
	"github.com/oncemill/oncemill/sqlschema"
)

// RequestReplay marks the entries f selects for a replay to their own
// consumer, and returns how many it marked. Nothing is published: the
// consumer's [ReplaySubscriber] delivers each entry to that consumer only
// and deletes it once the consumer acked it, so other consumers of the
// original topic never see it (a consumer whose done key has expired
// would apply it again). Entries already marked are left as they are.
//
// An empty f is refused with [ErrNoSelection] unless f.All is set.
func (s *Store) RequestReplay(ctx context.Context, f Filter) (int, error) {
	if err := f.selection(); err != nil {
		return 0, err
	}
	return s.onSelected(ctx, f, "request replay", "UPDATE "+s.t.names.DLQ+" SET replay_requested_at = "+s.t.d.Now(),
		"replay_requested_at IS NULL", s.t.q.request)
}

// ReplaySubscriberConfig configures a [ReplaySubscriber].
type ReplaySubscriberConfig struct {
	// Consumer is the consumer whose entries are delivered: the name the
	// dead letters carry (the inbox's consumer, by default the router
	// handler's name). Required.
	Consumer string
	// PollInterval is how often the table is read while no replay is
	// requested. Defaults to 1 second.
	PollInterval time.Duration
	// Logger receives a line for every replay delivered and every read
	// that failed. Defaults to watermill.NopLogger.
	Logger watermill.LoggerAdapter
	// Granter writes the replay grant of each entry on its dead key before
	// the entry is delivered (see [Granter]). Defaults to the inbox table
	// beside the dead-letter table; set it to the consumer's
	// inbox store when that is elsewhere. An entry whose key has no record
	// there is not delivered: its request is withdrawn and an error
	// wrapping [ErrNoDeadKey] is logged, and the entry stays.
	Granter Granter
	// BeatEvery is how often each subscription announces, in the table
	// beside the dead-letter table, that the consumer's replays are picked
	// up ([Store.Replayer]): a consumer that missed three beats counts as
	// having no replay subscriber, and replays to it are refused before
	// they are requested. Defaults to [DefaultBeatEvery].
	BeatEvery time.Duration
}

func (c *ReplaySubscriberConfig) setDefaults() {
	if c.PollInterval == 0 {
		c.PollInterval = time.Second
	}
	if c.Logger == nil {
		c.Logger = watermill.NopLogger{}
	}
	if c.BeatEvery == 0 {
		c.BeatEvery = DefaultBeatEvery
	}
}

// Validate reports the first field that is missing or out of range.
func (c ReplaySubscriberConfig) Validate() error {
	c.setDefaults()
	switch {
	case c.Consumer == "":
		return errors.New("dlq: ReplaySubscriberConfig.Consumer is required: the consumer whose replays are delivered")
	case c.PollInterval < 0:
		return fmt.Errorf("dlq: ReplaySubscriberConfig.PollInterval must not be negative, got %s", c.PollInterval)
	case c.BeatEvery < 0:
		return fmt.Errorf("dlq: ReplaySubscriberConfig.BeatEvery must not be negative, got %s", c.BeatEvery)
	}
	return nil
}

// ReplaySubscriber is a Watermill subscriber over the dead-letter table:
// Subscribe(ctx, topic) delivers, one at a time and in id order, the
// entries of its consumer and topic whose replay was requested
// ([Store.RequestReplay]). An entry is locked (FOR UPDATE SKIP LOCKED, so
// several instances share the work) while its message is handled, deleted
// when the message is acked, and left for the next poll when it is
// nacked. Merge it into the consumer's own subscription with
// [WithReplays], so that the replay runs through the same handler and
// inbox. Each subscription starts a goroutine that ends with its context
// or Close, and holds one connection of the pool while a message is out.
// On SQLite, whose one writer must not wait on a handler, nothing is
// locked while the message is out: instances running at once may both
// deliver an entry, under its UUID, which the consumer's inbox absorbs.
type ReplaySubscriber struct {
	t   *table
	cfg ReplaySubscriberConfig

	closing   chan struct{}
	closeOnce sync.Once
	wg        sync.WaitGroup
}

var _ message.Subscriber = (*ReplaySubscriber)(nil)

// NewReplaySubscriber returns a subscriber on the PostgreSQL dead-letter
// table that schema names, through a pgx pool; cfg is copied, defaulted
// and validated.
func NewReplaySubscriber(pool *pgxpool.Pool, schema sqlschema.Config, cfg ReplaySubscriberConfig) (*ReplaySubscriber, error) {
	t, err := openPool(pool, schema)
	if err != nil {
		return nil, err
	}
	return newReplaySubscriber(t, cfg)
}

// NewSQLReplaySubscriber returns a [ReplaySubscriber] on the dead-letter
// table that schema names on db, a database of dialect d through
// database/sql (sqlschema.Postgres, sqlschema.MySQL or sqlschema.SQLite),
// as [NewReplaySubscriber] does for a pgx pool; cfg is copied, defaulted
// and validated.
func NewSQLReplaySubscriber(db *sql.DB, d sqlschema.Dialect, schema sqlschema.Config, cfg ReplaySubscriberConfig) (*ReplaySubscriber, error) {
	t, err := openSQL(db, d, schema)
	if err != nil {
		return nil, err
	}
	return newReplaySubscriber(t, cfg)
}

func newReplaySubscriber(t *table, cfg ReplaySubscriberConfig) (*ReplaySubscriber, error) {
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if cfg.Granter == nil {
		cfg.Granter = tableGranter{t}
	}
	return &ReplaySubscriber{t: t, cfg: cfg, closing: make(chan struct{})}, nil
}

// Subscribe delivers the requested replays of topic for the consumer until
// ctx is done or the subscriber closes; then the channel closes.
func (r *ReplaySubscriber) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	select {
	case <-r.closing:
		return nil, errors.New("dlq: replay subscriber is closed")
	default:
	}
	out := make(chan *message.Message)
	r.wg.Add(2)
	go r.announce(ctx, topic)
	go func() {
		defer r.wg.Done()
		defer close(out)
		for {
			delivered, err := r.deliverOne(ctx, topic, out)
			if err != nil && ctx.Err() == nil {
				r.cfg.Logger.Error("Replay read failed", err, watermill.LogFields{"consumer": r.cfg.Consumer, "topic": topic})
			}
			if delivered && err == nil {
				continue
			}
			select {
			case <-ctx.Done():
				return
			case <-r.closing:
				return
			case <-time.After(r.cfg.PollInterval):
			}
		}
	}()
	return out, nil
}

// announce writes the consumer's beat at once and every BeatEvery until
// ctx is done or the subscriber closes. A failed beat is logged: the
// replays still run, the console and the command only warn wrongly.
func (r *ReplaySubscriber) announce(ctx context.Context, topic string) {
	defer r.wg.Done()
	for {
		if err := r.t.beat(ctx, r.cfg.Consumer, r.cfg.BeatEvery); err != nil && ctx.Err() == nil {
			r.cfg.Logger.Error("Replay subscriber beat failed", err, watermill.LogFields{"consumer": r.cfg.Consumer, "topic": topic})
		}
		select {
		case <-ctx.Done():
			return
		case <-r.closing:
			return
		case <-time.After(r.cfg.BeatEvery):
		}
	}
}

// deliverOne hands out the first requested entry, if any, and ends its
// transaction with the message's ack (delete) or nack (keep).
func (r *ReplaySubscriber) deliverOne(ctx context.Context, topic string, out chan<- *message.Message) (delivered bool, err error) {
	h, err := r.t.take(ctx, r.t.q.nextReplay, r.t.d.Text(sqldb.Ident(r.cfg.Consumer)), r.t.d.Text(sqldb.Ident(topic)))
	if err != nil || h == nil {
		if err != nil {
			err = r.t.wrap("replay: read", err)
		}
		return false, err
	}
	defer func() {
		// A no-op after the delete; otherwise the entry stays, unlocked.
		if rbErr := h.release(context.WithoutCancel(ctx)); rbErr != nil {
			err = errors.Join(err, r.t.wrap("replay: rollback", rbErr))
		}
	}()
	e := h.Entry
	// A fresh grant for every delivery, committed before the consumer can
	// see the message: a copy handed out before and nacked no longer
	// reopens the key.
	grant, err := grantReplay(ctx, r.cfg.Granter, e, false)
	if errors.Is(err, ErrNoDeadKey) {
		// Delivered, the copy would be acked as a dead copy where the key
		// is dead, and the entry deleted; asked again at every poll, it
		// would hold up the replays behind it. The request is withdrawn,
		// the entry stays.
		var kept int64
		werr := h.done(ctx, func(tx sqldb.Executor) (err error) {
			kept, err = r.t.withdrawRequest(ctx, tx, e.ID)
			return err
		})
		if werr != nil {
			return false, errors.Join(err, r.t.wrap(fmt.Sprintf("replay entry %d: withdraw the request", e.ID), werr))
		}
		r.cfg.Logger.Error("Replay refused, its request withdrawn; the entry stays", err,
			watermill.LogFields{"consumer": r.cfg.Consumer, "topic": topic, "entry": kept, "message_uuid": e.UUID})
		return true, nil
	}
	if err != nil {
		return false, err
	}
	msg := e.Message(grant)
	msgCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	msg.SetContext(msgCtx)
	select {
	case out <- msg:
	case <-ctx.Done():
		return false, nil
	case <-r.closing:
		return false, nil
	}
	select {
	case <-msg.Acked():
	case <-msg.Nacked():
		return true, nil
	case <-ctx.Done():
		return true, nil
	case <-r.closing:
		return true, nil
	}
	// The consumer took it durably: the entry goes, even if ctx ends now.
	wctx, wcancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer wcancel()
	if err := h.done(wctx, func(tx sqldb.Executor) error {
		_, err := tx.Exec(wctx, r.t.q.removeOne, e.ID)
		return err
	}); err != nil {
		return true, r.t.wrap(fmt.Sprintf("replay entry %d: delete after ack (it is delivered again, a duplicate to the inbox)", e.ID), err)
	}
	r.cfg.Logger.Info("Dead letter replayed to its consumer", watermill.LogFields{"consumer": r.cfg.Consumer, "topic": topic, "entry": e.ID, "message_uuid": e.UUID})
	return true, nil
}

// A withdrawn replay request leaves the message one entry. While its
// replay is requested an entry is outside the one-entry rule, so the same
// message dead-lettered again meanwhile (a redelivery that failed again)
// has a second entry, its twin, and taking the request back as it is
// would put two entries under the rule, which the unique index refuses.
// Of the two, the older one (lower id: its id and dead_at say when the
// message first died) stays and takes over the newer one's failure
// (attempts, error, permanent, last failure, Kafka position, payload and
// metadata; its first failure too, if it knew none), and the newer one
// goes: an operator keeps the entry they asked about and the newest error,
// and the request is withdrawn in one transaction, never refused at every
// poll. A twin written while the steps run makes the last one fail on
// the unique index; the transaction rolls back and the next poll
// withdraws again, twin included.

// twinOf joins entry a to b, its twin: another entry of the same
// consumer, topic and message (its uuid and key) with no replay requested
// (at most one, by the unique index).
func twinOf(d *sqldb.Dialect) string {
	key := d.Quote("key")
	return `b.consumer = a.consumer AND b.topic = a.topic AND b.uuid = a.uuid AND b.` + key + ` = a.` + key + `
AND b.replay_requested_at IS NULL AND b.id <> a.id`
}

// adoptNewer is the SET list that gives entry a the failure of entry b.
func adoptNewer(d *sqldb.Dialect) []string {
	set := []string{"first_failed_at = COALESCE(a.first_failed_at, b.first_failed_at)"}
	for _, c := range []string{"attempts", "error", "permanent", "last_failed_at", "kafka_partition", "kafka_offset", "payload", "metadata"} {
		set = append(set, d.Quote(c)+" = b."+d.Quote(c))
	}
	return set
}

// withdrawRequest takes the replay request of entry id back in tx, and
// returns the id of the entry the message is left with: id, or its older
// twin. The caller commits.
func (t *table) withdrawRequest(ctx context.Context, tx sqldb.Executor, id int64) (kept int64, err error) {
	var twin int64
	err = tx.QueryRow(ctx, t.q.twin, id).Scan(&twin)
	if err != nil && !errors.Is(err, sqldb.ErrNoRows) {
		return 0, fmt.Errorf("find the entry of the same message dead-lettered again: %w", err)
	}
	kept = id
	if err == nil {
		older, newer := min(id, twin), max(id, twin)
		if _, err := tx.Exec(ctx, t.q.adopt, older, newer); err != nil {
			return 0, fmt.Errorf("give entry %d the newer failure of entry %d: %w", older, newer, err)
		}
		if _, err := tx.Exec(ctx, t.q.removeOne, newer); err != nil {
			return 0, fmt.Errorf("delete entry %d, merged into entry %d: %w", newer, older, err)
		}
		kept = older
	}
	if _, err := tx.Exec(ctx, t.q.clear, kept); err != nil {
		return 0, err
	}
	return kept, nil
}

// Close stops every subscription and waits for them; the messages out are
// left to their next delivery. It is safe to call more than once.
func (r *ReplaySubscriber) Close() error {
	r.closeOnce.Do(func() { close(r.closing) })
	r.wg.Wait()
	return nil
}

// WithReplays returns sub with r's replays merged into every subscription:
// Subscribe(ctx, topic) delivers the topic's messages from sub and the
// requested replays of topic for r's consumer, so that one handler, with
// its inbox, takes both. Close closes sub and r.
func WithReplays(sub message.Subscriber, r *ReplaySubscriber) message.Subscriber {
	return merge.Subscribers(sub, r)
}
