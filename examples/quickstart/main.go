// Command quickstart shows the inbox turning redeliveries into one effect.
//
// It publishes every order several times over an in-process Watermill
// GoChannel, as a broker does after crashes and retries, and charges each
// order inside the inbox's transaction. The store is SQLite in a temporary
// directory, or PostgreSQL when DATABASE_URL is set. It prints one summary
// line and exits non-zero unless every order was charged exactly once.
//
//	go run ./examples/quickstart
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"path/filepath"
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
	"github.com/oncemill/oncemill/middleware"
	"github.com/oncemill/oncemill/sqlschema"
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

// ledger is where the business effect lives: the store's own database.
type ledger struct {
	store  dedup.TxStore
	charge func(ctx context.Context, run, order string) error
	count  func(ctx context.Context, run string) (int, error)
	close  func()
}

func run(ctx context.Context, orders, copies int) error {
	if orders < 1 || copies < 1 {
		return fmt.Errorf("-orders and -copies must be at least 1, got %d and %d", orders, copies)
	}
	l, err := openLedger(ctx)
	if err != nil {
		return err
	}
	defer l.close()

	logger := watermill.NopLogger{}
	pubSub := gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: int64(orders * copies)}, logger)
	defer pubSub.Close()

	inbox, err := middleware.NewInbox(middleware.InboxConfig{TxStore: l.store})
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
	var handled atomic.Int64
	done := make(chan struct{})
	countHandled := func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			out, err := h(msg)
			if err == nil && handled.Add(1) == int64(orders*copies) {
				close(done)
			}
			return out, err
		}
	}
	router.AddMiddleware(countHandled, inbox.Middleware)
	router.AddConsumerHandler("charge-orders", "orders", pubSub, func(msg *message.Message) error {
		// The handler is unchanged business code: it writes its effect
		// through the transaction in which the inbox claimed the key.
		return l.charge(msg.Context(), runID, string(msg.Payload))
	})

	runCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	routerErr := make(chan error, 1)
	go func() { routerErr <- router.Run(runCtx) }()
	<-router.Running()

	for c := 0; c < copies; c++ {
		for o := 1; o <= orders; o++ {
			order := fmt.Sprintf("order-%d", o)
			msg := message.NewMessage(watermill.NewUUID(), []byte(order))
			msg.Metadata.Set(delivery.IdempotencyKey, runID+"/"+order)
			if err := pubSub.Publish("orders", msg); err != nil {
				return err
			}
		}
	}

	select {
	case <-done:
	case <-time.After(2 * time.Minute):
		return fmt.Errorf("timed out: %d of %d deliveries handled", handled.Load(), orders*copies)
	}
	cancel()
	if err := errors.Join(<-routerErr, router.Close()); err != nil {
		return err
	}

	effects, err := l.count(ctx, runID)
	if err != nil {
		return err
	}
	stats := inbox.Stats()
	fmt.Printf("orders=%d deliveries=%d effects=%d duplicates_dropped=%d\n", orders, handled.Load(), effects, stats.Duplicates)
	if effects != orders {
		return fmt.Errorf("%d orders charged %d times", orders, effects)
	}
	return nil
}

func openLedger(ctx context.Context) (*ledger, error) {
	if url := os.Getenv("DATABASE_URL"); url != "" {
		return openPostgres(ctx, url)
	}
	return openSQLite(ctx)
}

func openSQLite(ctx context.Context) (*ledger, error) {
	dir, err := os.MkdirTemp("", "oncemill-quickstart-")
	if err != nil {
		return nil, err
	}
	store, err := sqlite.Open(ctx, filepath.Join(dir, "quickstart.db"), sqlite.Config{})
	if err != nil {
		return nil, errors.Join(err, os.RemoveAll(dir))
	}
	db := store.DB()
	if _, err := db.ExecContext(ctx, `CREATE TABLE charges (run TEXT NOT NULL, order_id TEXT NOT NULL)`); err != nil {
		return nil, errors.Join(err, store.Close(), os.RemoveAll(dir))
	}
	return &ledger{
		store: store,
		charge: func(ctx context.Context, run, order string) error {
			_, err := sqlite.Tx(ctx).ExecContext(ctx, `INSERT INTO charges (run, order_id) VALUES (?, ?)`, run, order)
			return err
		},
		count: func(ctx context.Context, run string) (n int, err error) {
			err = db.QueryRowContext(ctx, `SELECT count(*) FROM charges WHERE run = ?`, run).Scan(&n)
			return n, err
		},
		close: func() {
			if err := errors.Join(store.Close(), os.RemoveAll(dir)); err != nil {
				fmt.Fprintln(os.Stderr, "quickstart: cleanup:", err)
			}
		},
	}, nil
}

func openPostgres(ctx context.Context, url string) (*ledger, error) {
	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		return nil, fmt.Errorf("connect to DATABASE_URL: %w", err)
	}
	if err := sqlschema.Migrate(ctx, pool, sqlschema.Config{}); err != nil {
		pool.Close()
		return nil, err
	}
	if _, err := pool.Exec(ctx, `CREATE TABLE IF NOT EXISTS oncemill.quickstart_charges (run text NOT NULL, order_id text NOT NULL)`); err != nil {
		pool.Close()
		return nil, err
	}
	store, err := postgres.New(pool, postgres.Config{})
	if err != nil {
		pool.Close()
		return nil, err
	}
	return &ledger{
		store: store,
		charge: func(ctx context.Context, run, order string) error {
			_, err := postgres.Tx(ctx).Exec(ctx, `INSERT INTO oncemill.quickstart_charges (run, order_id) VALUES ($1, $2)`, run, order)
			return err
		},
		count: func(ctx context.Context, run string) (n int, err error) {
			err = pool.QueryRow(ctx, `SELECT count(*) FROM oncemill.quickstart_charges WHERE run = $1`, run).Scan(&n)
			return n, err
		},
		close: pool.Close,
	}, nil
}
