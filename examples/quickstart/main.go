// Command quickstart shows the whole product on one database file, with no
// server: the inbox turning redeliveries into one effect, the outbox
// relaying the events those effects cause, a failing order parked for a
// delayed retry and handed back, and the dead-letter table keeping the
// message no retry can mend.
//
// It publishes every order several times over an in-process Watermill
// GoChannel, as a broker does after crashes and retries, plus one
// malformed order. A handler charges each order inside the inbox's
// transaction and writes an "order charged" event to the outbox in that
// same transaction; a relay on the same database publishes the events,
// and a second handler counts them. One order's payment provider times out
// three times: the poison middleware parks it in the retries table, off
// the consumer, and hands it back half a second later, when it is charged.
// The malformed order is dead-lettered by the poison middleware into the
// dead-letter table.
//
// The database is SQLite, one file in a temporary directory that is kept
// so that the oncemill command can look at it afterwards (the last lines
// say how), or PostgreSQL when DATABASE_URL is set. The run prints one
// summary line and exits non-zero unless every order was charged exactly
// once, every event was relayed once, the flaky order was parked once, and
// the malformed order is the one dead letter.
//
//	go run ./examples/quickstart
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/oncemill/oncemill/dedup"
	"github.com/oncemill/oncemill/dedup/postgres"
	"github.com/oncemill/oncemill/dedup/sqlite"
	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/dlq"
	"github.com/oncemill/oncemill/forwarder"
	"github.com/oncemill/oncemill/middleware"
	"github.com/oncemill/oncemill/retry"
	"github.com/oncemill/oncemill/sqlschema"
)

// The topics and the consumer of the example.
const (
	ordersTopic  = "orders"
	chargedTopic = "orders.charged"
	consumer     = "charge-orders"
	// flakyOrder's payment provider times out its first flakyAttempts
	// attempts.
	flakyOrder    = "order-7"
	flakyAttempts = 3
)

func main() {
	orders := flag.Int("orders", 100, "number of orders")
	copies := flag.Int("copies", 4, "deliveries of each order")
	flag.Parse()
	if err := run(context.Background(), *orders, *copies); err != nil {
		fmt.Fprintln(os.Stderr, "quickstart:", err)
		os.Exit(1)
	}
}

// order is the orders topic's payload.
type order struct {
	ID          string `json:"id"`
	AmountCents int64  `json:"amount_cents"`
}

// backend is the database: the inbox store, the outbox writer and relay,
// the dead-letter table, and where the business effect lives.
type backend struct {
	store dedup.TxStore
	// outbox writes a handler's events in the inbox's transaction.
	outbox func(ctx context.Context, produced []*message.Message) error
	// relay is the relay's config with its database set.
	relay       forwarder.RelayConfig
	deadLetters *dlq.Publisher
	deadStore   *dlq.Store
	// retries is where a failing message waits for its delayed retry.
	retries *retry.Store
	charge  func(ctx context.Context, run string, o order) error
	count   func(ctx context.Context, run string) (int, error)
	// database is what the oncemill command's --database takes.
	database string
	// kept, when set, is the directory the run leaves behind.
	kept  string
	close func()
}

func run(ctx context.Context, orders, copies int) error {
	if orders < 1 || copies < 1 {
		return fmt.Errorf("-orders and -copies must be at least 1, got %d and %d", orders, copies)
	}
	b, err := openBackend(ctx)
	if err != nil {
		return err
	}
	defer b.close()

	logger := watermill.NopLogger{}
	// Persistent: the relay deletes the rows it published and the poison
	// middleware acks what it dead-lettered, so both refuse a broker that
	// drops messages nobody subscribed to yet.
	pubSub := gochannel.NewGoChannel(gochannel.Config{Persistent: true, OutputChannelBuffer: int64(orders*copies + 1)}, logger)
	defer pubSub.Close()

	inbox, err := middleware.NewInbox(middleware.InboxConfig{TxStore: b.store, Consumer: consumer, Outbox: b.outbox})
	if err != nil {
		return err
	}
	// Three attempts in process, then parked for half a second (the
	// defaults wait 5 s … 5 min), then dead-lettered.
	poison, err := middleware.NewPoison(middleware.PoisonConfig{Inbox: inbox, Publisher: b.deadLetters, MaxAttempts: 3,
		Retries: b.retries, Delays: []time.Duration{500 * time.Millisecond}})
	if err != nil {
		return err
	}
	// The orders, and the parked ones when due.
	ordersSub, err := poison.Subscriber(pubSub)
	if err != nil {
		return err
	}
	b.relay.Publisher = pubSub
	b.relay.Ledger = true // for `oncemill reconcile` and the console's overview
	relay, err := forwarder.NewRelay(b.relay)
	if err != nil {
		return err
	}
	router, err := message.NewRouter(message.RouterConfig{}, logger)
	if err != nil {
		return err
	}

	// Every order gets a fresh run id, so that a second run against the
	// same PostgreSQL counts only its own orders.
	runID := watermill.NewShortUUID()
	malformed := message.NewMessage(watermill.NewUUID(), []byte(`{"id": "order-0", "amount_cents": "twelve"`))
	malformed.Metadata.Set(delivery.IdempotencyKey, runID+"/malformed")

	var deliveries, handled, events, timeouts atomic.Int64
	var relayedMu sync.Mutex
	relayed := map[string]int{}
	want := int64(orders*copies + 1)
	// countHandled counts the deliveries of the broker (the GoChannel)
	// that ended acked; a parked message handed back is not one.
	countHandled := func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			out, err := h(msg)
			if err == nil && msg.Metadata.Get(delivery.RetryID) == "" {
				if msg.UUID != malformed.UUID {
					deliveries.Add(1)
				}
				handled.Add(1)
			}
			return out, err
		}
	}
	// The handler is business code: it writes its effect through the
	// transaction in which the inbox claimed the key, and returns the
	// event the effect causes, which the inbox writes to the outbox in
	// that same transaction.
	charge := router.AddHandler(consumer, ordersTopic, ordersSub, chargedTopic, pubSub, func(msg *message.Message) ([]*message.Message, error) {
		var o order
		if err := json.Unmarshal(msg.Payload, &o); err != nil || o.ID == "" {
			return nil, middleware.Permanent(fmt.Errorf("malformed order %q: %v", msg.Payload, err))
		}
		if o.ID == flakyOrder && timeouts.Load() < flakyAttempts {
			timeouts.Add(1)
			return nil, errors.New("payment provider timed out")
		}
		if err := b.charge(msg.Context(), runID, o); err != nil {
			return nil, err
		}
		event := message.NewMessage(watermill.NewUUID(), msg.Payload)
		event.Metadata.Set(delivery.IdempotencyKey, runID+"/charged/"+o.ID)
		event.Metadata.Set(delivery.PartitionKey, o.ID)
		return []*message.Message{event}, nil
	})
	charge.AddMiddleware(countHandled, poison.Middleware, inbox.Middleware)
	router.AddConsumerHandler("count-charged", chargedTopic, pubSub, func(msg *message.Message) error {
		if key := msg.Metadata.Get(delivery.IdempotencyKey); strings.HasPrefix(key, runID+"/") {
			relayedMu.Lock()
			relayed[key]++
			relayedMu.Unlock()
			events.Add(1)
		}
		return nil
	})
	// The relay runs with the router, on the same database.
	router.AddPlugin(relay.Plugin)

	runCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	routerErr := make(chan error, 1)
	go func() { routerErr <- router.Run(runCtx) }()
	<-router.Running()

	for c := 0; c < copies; c++ {
		for o := 1; o <= orders; o++ {
			id := fmt.Sprintf("order-%d", o)
			payload, err := json.Marshal(order{ID: id, AmountCents: int64(100 * o)})
			if err != nil {
				return err
			}
			msg := message.NewMessage(watermill.NewUUID(), payload)
			msg.Metadata.Set(delivery.IdempotencyKey, runID+"/"+id)
			if err := pubSub.Publish(ordersTopic, msg); err != nil {
				return err
			}
		}
		if c == 0 {
			if err := pubSub.Publish(ordersTopic, malformed); err != nil {
				return err
			}
		}
	}

	deadline := time.After(2 * time.Minute)
	for handled.Load() < want || events.Load() < int64(orders) {
		select {
		case <-deadline:
			return fmt.Errorf("timed out: %d of %d deliveries handled, %d of %d events relayed", handled.Load(), want, events.Load(), orders)
		case <-time.After(10 * time.Millisecond):
		}
	}
	// A moment for an event relayed twice to show.
	time.Sleep(200 * time.Millisecond)
	cancel()
	if err := errors.Join(<-routerErr, router.Close()); err != nil {
		return err
	}

	effects, err := b.count(ctx, runID)
	if err != nil {
		return err
	}
	entries, err := b.deadStore.List(ctx, dlq.Filter{Consumer: consumer})
	if err != nil {
		return err
	}
	deadLettered := 0
	for _, e := range entries {
		if strings.HasPrefix(e.Key, runID+"/") {
			deadLettered++
		}
	}
	relayedMu.Lock()
	distinct := len(relayed)
	relayedMu.Unlock()

	stats := inbox.Stats()
	parked := poison.Stats().Parked
	fmt.Printf("orders=%d deliveries=%d effects=%d duplicates_dropped=%d parked=%d events_relayed=%d dead_lettered=%d\n",
		orders, deliveries.Load(), effects, stats.Duplicates, parked, events.Load(), deadLettered)
	if b.kept != "" {
		fmt.Printf("The database is kept in %s (delete it when done); look at it with:\n", b.kept)
	} else {
		fmt.Println("Look at the database with:")
	}
	// go run, so that the commands work from this repository with nothing
	// installed; `oncemill` once installed (go install ./cmd/oncemill).
	fmt.Printf("  go run ./cmd/oncemill console --database %s\n", b.database)
	fmt.Printf("  go run ./cmd/oncemill dlq list --database %s\n", b.database)

	var wrong []error
	if effects != orders {
		wrong = append(wrong, fmt.Errorf("%d orders charged %d times", orders, effects))
	}
	if events.Load() != int64(orders) || distinct != orders {
		wrong = append(wrong, fmt.Errorf("%d events relayed for %d orders (%d distinct)", events.Load(), orders, distinct))
	}
	if orders >= 7 && parked != 1 {
		wrong = append(wrong, fmt.Errorf("%s parked %d times, not once", flakyOrder, parked))
	}
	if deadLettered != 1 {
		wrong = append(wrong, fmt.Errorf("%d dead letters for the one malformed order", deadLettered))
	}
	return errors.Join(wrong...)
}

func openBackend(ctx context.Context) (*backend, error) {
	if url := os.Getenv("DATABASE_URL"); url != "" {
		return openPostgres(ctx, url)
	}
	return openSQLite(ctx)
}

// openSQLite opens quickstart.db in a new temporary directory, which the
// run keeps: every table is in that one file.
func openSQLite(ctx context.Context) (*backend, error) {
	dir, err := os.MkdirTemp("", "oncemill-quickstart-")
	if err != nil {
		return nil, err
	}
	path := filepath.Join(dir, "quickstart.db")
	store, err := sqlite.Open(ctx, path, sqlite.Config{})
	if err != nil {
		return nil, errors.Join(err, os.RemoveAll(dir))
	}
	db := store.DB()
	schema := sqlschema.Config{}
	// A run that cannot start leaves nothing behind.
	fail := func(err error) (*backend, error) { return nil, errors.Join(err, store.Close(), os.RemoveAll(dir)) }
	// sqlite.Open made every table: the inbox, the outbox, the
	// dead-letter table and the ledger.
	if _, err := db.ExecContext(ctx, `CREATE TABLE charges (run TEXT NOT NULL, order_id TEXT NOT NULL)`); err != nil {
		return fail(err)
	}
	deadLetters, err := dlq.NewSQLPublisher(db, sqlschema.SQLite, schema)
	if err != nil {
		return fail(err)
	}
	deadStore, err := dlq.NewSQLStore(db, sqlschema.SQLite, schema)
	if err != nil {
		return fail(err)
	}
	retries, err := retry.NewSQLStore(db, sqlschema.SQLite, schema)
	if err != nil {
		return fail(err)
	}
	return &backend{
		store:       store,
		retries:     retries,
		outbox:      forwarder.SQLInboxOutbox(chargedTopic, sqlschema.SQLite, schema),
		relay:       forwarder.RelayConfig{DB: db, Dialect: sqlschema.SQLite, Schema: schema},
		deadLetters: deadLetters,
		deadStore:   deadStore,
		charge: func(ctx context.Context, run string, o order) error {
			_, err := sqlite.Tx(ctx).ExecContext(ctx, `INSERT INTO charges (run, order_id) VALUES (?, ?)`, run, o.ID)
			return err
		},
		count: func(ctx context.Context, run string) (n int, err error) {
			err = db.QueryRowContext(ctx, `SELECT count(*) FROM charges WHERE run = ?`, run).Scan(&n)
			return n, err
		},
		database: "sqlite://" + filepath.ToSlash(path),
		kept:     dir,
		close: func() {
			if err := store.Close(); err != nil {
				fmt.Fprintln(os.Stderr, "quickstart: close:", err)
			}
		},
	}, nil
}

func openPostgres(ctx context.Context, url string) (*backend, error) {
	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		return nil, fmt.Errorf("connect to DATABASE_URL: %w", err)
	}
	schema := sqlschema.Config{}
	fail := func(err error) (*backend, error) { pool.Close(); return nil, err }
	if err := sqlschema.Migrate(ctx, pool, schema); err != nil {
		return fail(err)
	}
	if _, err := pool.Exec(ctx, `CREATE TABLE IF NOT EXISTS oncemill.quickstart_charges (run text NOT NULL, order_id text NOT NULL)`); err != nil {
		return fail(err)
	}
	store, err := postgres.New(pool, schema)
	if err != nil {
		return fail(err)
	}
	deadLetters, err := dlq.NewPublisher(pool, schema)
	if err != nil {
		return fail(err)
	}
	deadStore, err := dlq.NewStore(pool, schema)
	if err != nil {
		return fail(err)
	}
	retries, err := retry.NewStore(pool, schema)
	if err != nil {
		return fail(err)
	}
	return &backend{
		store:       store,
		retries:     retries,
		outbox:      forwarder.InboxOutbox(chargedTopic, schema),
		relay:       forwarder.RelayConfig{Pool: pool, Schema: schema},
		deadLetters: deadLetters,
		deadStore:   deadStore,
		charge: func(ctx context.Context, run string, o order) error {
			_, err := postgres.Tx(ctx).Exec(ctx, `INSERT INTO oncemill.quickstart_charges (run, order_id) VALUES ($1, $2)`, run, o.ID)
			return err
		},
		count: func(ctx context.Context, run string) (n int, err error) {
			err = pool.QueryRow(ctx, `SELECT count(*) FROM oncemill.quickstart_charges WHERE run = $1`, run).Scan(&n)
			return n, err
		},
		database: `"$DATABASE_URL"`,
		close:    pool.Close,
	}, nil
}
