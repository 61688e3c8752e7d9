// Command sqlc shows an sqlc-style handler behind the inbox, on
// PostgreSQL or on MySQL/MariaDB through database/sql: every order is
// delivered several times, some attempts fail after the queries wrote the
// charge, and each order is still charged exactly once.
//
// The inbox claims the message's key in a *sql.Tx; the handler runs its
// sqlc queries in it with Queries.WithTx(sqlstore.Tx(ctx)), so that the
// charge, the balance update and the claim commit together or not at all.
// pgdb and mydb are the queries for each database, in the shape sqlc
// generates for database/sql.
//
//	go run ./examples/sqlc                  # PostgreSQL of DATABASE_URL
//	go run ./examples/sqlc -dialect mysql   # MariaDB/MySQL of MYSQL_DSN
//
// It prints one summary line and exits non-zero unless every order was
// charged exactly once.
package main

import (
	"context"
	"database/sql"
	"errors"
	"flag"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	_ "github.com/go-sql-driver/mysql" // registers "mysql"
	_ "github.com/jackc/pgx/v5/stdlib" // registers "pgx"

	"github.com/oncemill/oncemill/dedup/sqlstore"
	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/examples/sqlc/mydb"
	"github.com/oncemill/oncemill/examples/sqlc/pgdb"
	"github.com/oncemill/oncemill/middleware"
	"github.com/oncemill/oncemill/sqlschema"
)

// config is what a run needs.
type config struct {
	// Dialect is "postgres" or "mysql".
	Dialect string
	// DSN is the database: a PostgreSQL URL for pgx, or a
	// go-sql-driver/mysql DSN.
	DSN string
	// Schema names the inbox tables (the PostgreSQL schema or the MySQL
	// database).
	Schema sqlschema.Config
	// Orders and Copies: how many orders, each delivered how many times.
	Orders, Copies int
}

func main() {
	cfg := config{}
	flag.StringVar(&cfg.Dialect, "dialect", "postgres", "postgres or mysql")
	flag.IntVar(&cfg.Orders, "orders", 50, "number of orders")
	flag.IntVar(&cfg.Copies, "copies", 3, "deliveries of each order")
	flag.Parse()
	switch cfg.Dialect {
	case "postgres":
		cfg.DSN = env("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/test?sslmode=disable")
	case "mysql":
		cfg.DSN = env("MYSQL_DSN", "root@tcp(127.0.0.1:3306)/test")
	}
	charged, err := run(context.Background(), cfg)
	if err != nil {
		fmt.Fprintln(os.Stderr, "sqlc:", err)
		os.Exit(1)
	}
	fmt.Printf("sqlc (%s): %d orders delivered %d times each, with failures: %d charged, each once\n",
		cfg.Dialect, cfg.Orders, cfg.Copies, charged)
}

func env(name, fallback string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return fallback
}

// ledger is the part of the queries the run needs outside the handler,
// for either database.
type ledger struct {
	schema  string
	create  func(ctx context.Context, run string) error
	count   func(ctx context.Context, run string) (charges, orders int64, err error)
	balance func(ctx context.Context, run string) (int64, error)
	handler func(runID string) message.NoPublishHandlerFunc
}

// postgresLedger runs pgdb's queries: on the pool outside the handler, in
// the inbox's transaction inside it.
func postgresLedger(db *sql.DB) ledger {
	q := pgdb.New(db)
	return ledger{
		schema: pgdb.Schema,
		create: q.CreateAccount,
		count: func(ctx context.Context, run string) (int64, int64, error) {
			r, err := q.CountCharges(ctx, run)
			return r.Charges, r.Orders, err
		},
		balance: q.GetBalance,
		handler: func(runID string) message.NoPublishHandlerFunc {
			return chargeWith(func(ctx context.Context, order string, amount int64) error {
				tx := q.WithTx(sqlstore.Tx(ctx)) // the inbox's transaction
				if err := tx.CreateCharge(ctx, pgdb.CreateChargeParams{Run: runID, OrderID: order, Amount: amount}); err != nil {
					return err
				}
				_, err := tx.AddToBalance(ctx, pgdb.AddToBalanceParams{Amount: amount, Run: runID})
				return err
			})
		},
	}
}

// mysqlLedger is postgresLedger with mydb's queries.
func mysqlLedger(db *sql.DB) ledger {
	q := mydb.New(db)
	return ledger{
		schema: mydb.Schema,
		create: q.CreateAccount,
		count: func(ctx context.Context, run string) (int64, int64, error) {
			r, err := q.CountCharges(ctx, run)
			return r.Charges, r.Orders, err
		},
		balance: q.GetBalance,
		handler: func(runID string) message.NoPublishHandlerFunc {
			return chargeWith(func(ctx context.Context, order string, amount int64) error {
				tx := q.WithTx(sqlstore.Tx(ctx)) // the inbox's transaction
				if err := tx.CreateCharge(ctx, mydb.CreateChargeParams{Run: runID, OrderID: order, Amount: amount}); err != nil {
					return err
				}
				_, err := tx.AddToBalance(ctx, mydb.AddToBalanceParams{Amount: amount, Run: runID})
				return err
			})
		},
	}
}

// chargeWith is the handler around charge: every fifth order's first
// attempt fails after the charge was written, and is rolled back; the
// redelivery charges the order once.
func chargeWith(charge func(ctx context.Context, order string, amount int64) error) message.NoPublishHandlerFunc {
	var failed sync.Map
	return func(msg *message.Message) error {
		amount, err := strconv.ParseInt(msg.Metadata.Get("amount"), 10, 64)
		if err != nil {
			return middleware.Permanent(err)
		}
		order := string(msg.Payload)
		if err := charge(msg.Context(), order, amount); err != nil {
			return err
		}
		if _, again := failed.LoadOrStore(order, true); !again && amount%5 == 0 {
			return errors.New("payment provider timed out after the charge was written")
		}
		return nil
	}
}

// run charges cfg.Orders orders, each delivered cfg.Copies times, and
// returns how many were charged; it fails unless each was charged once.
func run(ctx context.Context, cfg config) (int, error) {
	var (
		dialect sqlstore.Dialect
		driver  string
		open    func(*sql.DB) ledger
	)
	switch cfg.Dialect {
	case "postgres":
		dialect, driver, open = sqlstore.Postgres, "pgx", postgresLedger
	case "mysql":
		dialect, driver, open = sqlstore.MySQL, "mysql", mysqlLedger
	default:
		return 0, fmt.Errorf("-dialect must be postgres or mysql, got %q", cfg.Dialect)
	}
	db, err := sql.Open(driver, cfg.DSN)
	if err != nil {
		return 0, err
	}
	defer db.Close()
	if err := sqlschema.MigrateSQL(ctx, db, dialect.Schema(), cfg.Schema); err != nil {
		return 0, err
	}
	store, err := sqlstore.New(db, sqlstore.Config{Dialect: dialect, Schema: cfg.Schema})
	if err != nil {
		return 0, err
	}
	l := open(db)
	for _, stmt := range strings.Split(l.schema, ";\n") {
		if strings.TrimSpace(stmt) == "" {
			continue
		}
		if _, err := db.ExecContext(ctx, stmt); err != nil {
			return 0, fmt.Errorf("create the ledger: %w", err)
		}
	}
	runID := watermill.NewShortUUID()
	if err := l.create(ctx, runID); err != nil {
		return 0, err
	}

	inbox, err := middleware.NewInbox(middleware.InboxConfig{TxStore: store})
	if err != nil {
		return 0, err
	}
	logger := watermill.NopLogger{}
	pubSub := gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: int64(cfg.Orders * cfg.Copies)}, logger)
	defer pubSub.Close()
	router, err := message.NewRouter(message.RouterConfig{}, logger)
	if err != nil {
		return 0, err
	}
	var acked atomic.Int64
	all := make(chan struct{})
	router.AddMiddleware(func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			out, err := h(msg)
			if err == nil && acked.Add(1) == int64(cfg.Orders*cfg.Copies) {
				close(all)
			}
			return out, err
		}
	}, inbox.Middleware)
	router.AddConsumerHandler("charge", "orders", pubSub, l.handler(runID))
	done := make(chan error, 1)
	go func() { done <- router.Run(ctx) }()
	<-router.Running()

	for c := 0; c < cfg.Copies; c++ {
		for i := 0; i < cfg.Orders; i++ {
			order := runID + "-" + strconv.Itoa(i)
			msg := message.NewMessage(watermill.NewUUID(), []byte(order))
			msg.Metadata.Set(delivery.IdempotencyKey, order)
			msg.Metadata.Set("amount", strconv.Itoa(i+1))
			if err := pubSub.Publish("orders", msg); err != nil {
				return 0, err
			}
		}
	}
	select {
	case <-all:
	case <-time.After(time.Minute):
		return 0, errors.New("not every delivery was acked within a minute")
	}
	if err := errors.Join(router.Close(), <-done); err != nil {
		return 0, err
	}

	charges, orders, err := l.count(ctx, runID)
	if err != nil {
		return 0, err
	}
	balance, err := l.balance(ctx, runID)
	if err != nil {
		return 0, err
	}
	want := int64(cfg.Orders) * int64(cfg.Orders+1) / 2
	if charges != int64(cfg.Orders) || orders != charges || balance != want {
		return int(charges), fmt.Errorf("%d charges for %d orders (%d distinct), balance %d, want %d", charges, cfg.Orders, orders, balance, want)
	}
	return int(charges), nil
}
