package proctest

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/oncemill/oncemill/adapters"
	"github.com/oncemill/oncemill/dedup"
	"github.com/oncemill/oncemill/dedup/postgres"
	"github.com/oncemill/oncemill/dlq"
	"github.com/oncemill/oncemill/middleware"
	"github.com/oncemill/oncemill/retry"
	"github.com/oncemill/oncemill/sqlschema"
)

// Stack is where a child consumer works, as its parent tells it.
type Stack struct {
	// BrokerURL is opened with adapters.Open, in the consumer group Group.
	BrokerURL string
	Group     string
	Topic     string
	// DatabaseURL and Schema are the PostgreSQL database and schema of the
	// inbox, the dead-letter table and the test's own tables.
	DatabaseURL string
	Schema      string
	// Consumer is the inbox's consumer name and the router handler's.
	Consumer string
}

// Table is the quoted name of the test's table name in the schema.
func (s Stack) Table(name string) string { return pgx.Identifier{s.Schema, name}.Sanitize() }

// Stats is what a [Consumer] prints on its last line when it exits
// cleanly, and what [Process.Shutdown] returns.
type Stats struct {
	// Deliveries counts the messages the router handed to the stack.
	Deliveries int64
	// Runs counts the handler's runs.
	Runs int64
	// FinishedAtShutdown counts handler runs that returned nil after the
	// consumer was sent SIGTERM: the inbox commits them on a detached
	// context, and the router acks them.
	FinishedAtShutdown int64
	Inbox              middleware.InboxStats
	Poison             middleware.PoisonStats
	// Extra is what [Consumer.Extra] returned.
	Extra json.RawMessage `json:",omitempty"`
	// Took is how long the process took to exit after SIGTERM; the parent
	// sets it.
	Took time.Duration `json:"-"`
}

// Consumer is the standard consumer of a child process: the broker of
// Stack.BrokerURL opened with adapters.Open (on Kafka with the PostgreSQL
// store's hand-out marks), a PostgreSQL pool, and on a
// Watermill router the middlewares Poison (with the PostgreSQL dead-letter
// table), Bloom and Inbox (the PostgreSQL store) around the handler.
type Consumer struct {
	Stack
	// MaxConns is the size of the database pool. Defaults to 8.
	MaxConns int32
	// Pool, if set, changes the pool's configuration further.
	Pool func(*pgxpool.Config)
	// Verbose sends the adapter's and router's info logs to the parent,
	// which shows them when a check fails. Defaults to no logs.
	Verbose bool
	// Store, if set, makes the inbox's store from the PostgreSQL one.
	Store func(*postgres.Store) (dedup.TxStore, error)
	// Poison, if set, puts the poison middleware outermost; its Publisher
	// defaults to the dead-letter table, and without a Consumer or Key of
	// its own it is built from the inbox.
	Poison *middleware.PoisonConfig
	// Retries, with Poison, parks failing messages in the schema's
	// retries table for their delayed attempts (PoisonConfig.Retries),
	// and merges the retry subscriber of this configuration (its
	// Consumer defaults to Stack.Consumer) into the subscription.
	Retries *retry.SubscriberConfig
	// Bloom puts the Bloom prefilter in front of the inbox.
	Bloom bool
	// Inbox is the inbox's configuration; its TxStore defaults to the
	// store, its Consumer to Stack.Consumer.
	Inbox middleware.InboxConfig
	// RecordRuns records each handler run, before the handler, as a row
	// (key, pid) of the test's table runs. The row is written outside the
	// inbox's transaction, on a pool of its own: it stays whatever becomes
	// of the attempt, and a handler never waits for a second connection
	// of the inbox's pool while the inbox holds one.
	RecordRuns bool
	// Subscriptions is how many router handlers consume Topic, named
	// Consumer_0, Consumer_1… when more than one. Defaults to 1.
	Subscriptions int
	// CloseTimeout is the router's. Defaults to 10s.
	CloseTimeout time.Duration
	// StrictClose makes a failed close of the broker an ExitBadClose;
	// otherwise it is only printed.
	StrictClose bool
	// Extra, if set, is printed with the stats, as Stats.Extra.
	Extra func() any

	once       sync.Once
	terminated chan struct{}
}

// Terminated is closed when the consumer is sent SIGTERM, before its
// router closes: the inbox hands the handler a context that outlives the
// message's cancellation, so that the handler cannot tell the shutdown
// from it.
func (c *Consumer) Terminated() <-chan struct{} {
	c.once.Do(func() { c.terminated = make(chan struct{}) })
	return c.terminated
}

// Run is the consumer's life: it sets the stack up around handler, runs
// it until term receives, closes it and prints its stats. Its error
// decides the exit code (see [ExitCode]).
func (c *Consumer) Run(term <-chan os.Signal, handler message.NoPublishHandlerFunc) error {
	ctx := context.Background()
	terminated := c.Terminated()
	poolCfg, err := pgxpool.ParseConfig(c.DatabaseURL)
	if err != nil {
		return Setup(err)
	}
	poolCfg.MaxConns = 8
	if c.MaxConns > 0 {
		poolCfg.MaxConns = c.MaxConns
	}
	if c.Pool != nil {
		c.Pool(poolCfg)
	}
	pool, err := pgxpool.NewWithConfig(ctx, poolCfg)
	if err != nil {
		return Setup(err)
	}
	defer pool.Close()
	var books *pgxpool.Pool
	if c.RecordRuns {
		booksCfg := poolCfg.Copy()
		booksCfg.MaxConns = 4
		if books, err = pgxpool.NewWithConfig(ctx, booksCfg); err != nil {
			return Setup(err)
		}
		defer books.Close()
	}
	pg, err := postgres.New(pool, postgres.Config{Schema: c.Schema})
	if err != nil {
		return Setup(err)
	}
	var store dedup.TxStore = pg
	if c.Store != nil {
		if store, err = c.Store(pg); err != nil {
			return Setup(err)
		}
	}
	var logger watermill.LoggerAdapter = watermill.NopLogger{}
	if c.Verbose {
		logger = watermill.NewStdLogger(false, false)
	}
	inboxCfg := c.Inbox
	if inboxCfg.TxStore == nil {
		inboxCfg.TxStore = store
	}
	if inboxCfg.Consumer == "" {
		inboxCfg.Consumer = c.Consumer
	}
	inbox, err := middleware.NewInbox(inboxCfg)
	if err != nil {
		return Setup(err)
	}
	var (
		parked       *retry.Store
		poison       *middleware.Poison
		deliveries   atomic.Int64
		runs, finish atomic.Int64
	)
	middlewares := []message.HandlerMiddleware{func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			deliveries.Add(1)
			return h(msg)
		}
	}}
	if c.Poison != nil {
		poisonCfg := *c.Poison
		if poisonCfg.Inbox == nil && poisonCfg.Consumer == "" && poisonCfg.Key == nil {
			poisonCfg.Inbox = inbox
		}
		if poisonCfg.Publisher == nil {
			if poisonCfg.Publisher, err = dlq.NewPublisher(pool, sqlschema.Config{Schema: c.Schema}); err != nil {
				return Setup(err)
			}
		}
		if c.Retries != nil {
			if parked, err = retry.NewStore(pool, sqlschema.Config{Schema: c.Schema}); err != nil {
				return Setup(err)
			}
			poisonCfg.Retries = parked
		}
		if poison, err = middleware.NewPoison(poisonCfg); err != nil {
			return Setup(err)
		}
		middlewares = append(middlewares, poison.Middleware)
	}
	if c.Bloom {
		bloom, err := middleware.NewBloom(middleware.BloomConfig{Inbox: inbox})
		if err != nil {
			return Setup(err)
		}
		middlewares = append(middlewares, bloom.Middleware)
	}
	middlewares = append(middlewares, inbox.Middleware)
	runsTable := c.Table("runs")
	pid := os.Getpid()
	counted := func(msg *message.Message) error {
		runs.Add(1)
		if books != nil {
			ctx := msg.Context()
			// Outside the transaction, so that it stays whatever becomes
			// of the attempt.
			if _, err := books.Exec(context.WithoutCancel(ctx), `INSERT INTO `+runsTable+` (key, pid) VALUES ($1, $2)`,
				middleware.IdempotencyKey(ctx), pid); err != nil {
				return err
			}
		}
		if err := handler(msg); err != nil {
			return err
		}
		select {
		case <-terminated:
			finish.Add(1)
		default:
		}
		return nil
	}

	ps, err := adapters.Open(ctx, c.BrokerURL, adapters.Options{ConsumerGroup: c.Group, Logger: logger, HandOutMarks: pg})
	if err != nil {
		return Setup(err)
	}
	closeTimeout := c.CloseTimeout
	if closeTimeout == 0 {
		closeTimeout = 10 * time.Second
	}
	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: closeTimeout}, logger)
	if err != nil {
		return Setup(errors.Join(err, ps.Close()))
	}
	r.AddMiddleware(middlewares...)
	var sub message.Subscriber = ps.Subscriber
	if parked != nil {
		rc := *c.Retries
		if rc.Consumer == "" {
			rc.Consumer = c.Consumer
		}
		rs, err := parked.Subscriber(rc)
		if err != nil {
			return Setup(errors.Join(err, ps.Close()))
		}
		defer rs.Close()
		sub = retry.Merge(ps.Subscriber, rs)
	}
	n := max(c.Subscriptions, 1)
	for i := range n {
		name := c.Consumer
		if n > 1 {
			name = fmt.Sprintf("%s_%d", c.Consumer, i)
		}
		r.AddNoPublisherHandler(name, c.Topic, sub, counted)
	}

	// SIGTERM closes terminated, then the router.
	routerTerm := make(chan os.Signal, 1)
	relayStop, relayDone := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(relayDone)
		select {
		case sig := <-term:
			close(c.terminated)
			routerTerm <- sig
		case <-relayStop:
		}
	}()
	defer func() { close(relayStop); <-relayDone }()

	err = RunRouter(ctx, r, routerTerm)
	if errors.Is(err, ErrRouterNotStarted) || errors.Is(err, ErrRouterStopped) {
		return errors.Join(err, ps.Close())
	}
	if cerr := ps.Close(); cerr != nil {
		if c.StrictClose {
			err = errors.Join(err, fmt.Errorf("close broker: %w", cerr))
		} else {
			fmt.Fprintln(os.Stderr, "close broker:", cerr)
		}
	}
	stats := Stats{Deliveries: deliveries.Load(), Runs: runs.Load(), FinishedAtShutdown: finish.Load(), Inbox: inbox.Stats()}
	if poison != nil {
		stats.Poison = poison.Stats()
	}
	if c.Extra != nil {
		raw, merr := json.Marshal(c.Extra())
		if merr != nil {
			return errors.Join(err, merr)
		}
		stats.Extra = raw
	}
	raw, merr := json.Marshal(stats)
	if merr != nil {
		return errors.Join(err, merr)
	}
	fmt.Println(StatsLine + string(raw))
	return err
}
