// Command gorm shows a GORM handler behind the inbox, on PostgreSQL or on
// MySQL/MariaDB through database/sql: every order is delivered several
// times, some attempts crash after GORM wrote the charge (an error, a
// panic), and each order is still charged exactly once.
//
// The inbox claims the message's key in a *sql.Tx; the handler binds GORM
// to it, so that the charge, the balance update and the claim commit
// together or not at all.
//
//	go run ./examples/gorm                                   # PostgreSQL of DATABASE_URL
//	go run ./examples/gorm -dialect mysql                    # MariaDB/MySQL of MYSQL_DSN
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
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/go-sql-driver/mysql"
	_ "github.com/jackc/pgx/v5/stdlib" // registers "pgx"
	gormmysql "gorm.io/driver/mysql"
	gormpostgres "gorm.io/driver/postgres"
	"gorm.io/gorm"
	"gorm.io/gorm/logger"

	"github.com/oncemill/oncemill/dedup/sqlstore"
	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/middleware"
	"github.com/oncemill/oncemill/sqlschema"
)

// Charge is one order's charge: the effect that must happen once.
type Charge struct {
	ID        uint   `gorm:"primaryKey"`
	Run       string `gorm:"size:64;index"`
	OrderID   string `gorm:"size:64"`
	Amount    int64
	CreatedAt time.Time
}

// Account is the balance the charges add to: a read-modify-write effect.
type Account struct {
	Run     string `gorm:"primaryKey;size:64"`
	Balance int64
}

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
	// OpenPerMessage opens GORM on the transaction for every message
	// (gorm.Open with the dialector's Conn), instead of binding a
	// session of one GORM handle to it.
	OpenPerMessage bool
}

func main() {
	cfg := config{}
	flag.StringVar(&cfg.Dialect, "dialect", "postgres", "postgres or mysql")
	flag.IntVar(&cfg.Orders, "orders", 50, "number of orders")
	flag.IntVar(&cfg.Copies, "copies", 3, "deliveries of each order")
	flag.BoolVar(&cfg.OpenPerMessage, "open-per-message", false, "gorm.Open on each message's transaction")
	flag.Parse()
	switch cfg.Dialect {
	case "postgres":
		cfg.DSN = env("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/test?sslmode=disable")
	case "mysql":
		cfg.DSN = env("MYSQL_DSN", "root@tcp(127.0.0.1:3306)/test")
	}
	charged, err := run(context.Background(), cfg)
	if err != nil {
		fmt.Fprintln(os.Stderr, "gorm:", err)
		os.Exit(1)
	}
	fmt.Printf("gorm (%s): %d orders delivered %d times each, with crashes: %d charged, each once\n",
		cfg.Dialect, cfg.Orders, cfg.Copies, charged)
}

func env(name, fallback string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return fallback
}

// run charges cfg.Orders orders, each delivered cfg.Copies times, and
// returns how many were charged; it fails unless each was charged once.
func run(ctx context.Context, cfg config) (int, error) {
	db, dialect, err := openDB(cfg)
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
	// One GORM handle on the pool, for the schema and the checks; each
	// message's GORM runs in the inbox's transaction.
	base, err := gorm.Open(dialector(cfg.Dialect, db), gormConfig())
	if err != nil {
		return 0, err
	}
	if err := base.AutoMigrate(&Charge{}, &Account{}); err != nil {
		return 0, err
	}
	runID := watermill.NewShortUUID()
	if err := base.Create(&Account{Run: runID}).Error; err != nil {
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
	router.AddConsumerHandler("charge", "orders", pubSub, charge(base, cfg, runID))
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

	var charges, distinct int64
	var account Account
	if err := base.Model(&Charge{}).Where("run = ?", runID).Count(&charges).Error; err != nil {
		return 0, err
	}
	if err := base.Model(&Charge{}).Where("run = ?", runID).Distinct("order_id").Count(&distinct).Error; err != nil {
		return 0, err
	}
	if err := base.First(&account, "run = ?", runID).Error; err != nil {
		return 0, err
	}
	want := int64(cfg.Orders) * int64(cfg.Orders+1) / 2
	if charges != int64(cfg.Orders) || distinct != charges || account.Balance != want {
		return int(charges), fmt.Errorf("%d charges for %d orders (%d distinct), balance %d, want %d", charges, cfg.Orders, distinct, account.Balance, want)
	}
	return int(charges), nil
}

// charge is the handler: it charges the order with GORM in the inbox's
// transaction. Every fifth order's first attempt fails after writing the
// charge, and every seventh's panics: both roll back, and the redelivery
// charges the order once.
func charge(base *gorm.DB, cfg config, runID string) message.NoPublishHandlerFunc {
	var crashed sync.Map
	return func(msg *message.Message) error {
		ctx := msg.Context()
		order := string(msg.Payload)
		amount, err := strconv.ParseInt(msg.Metadata.Get("amount"), 10, 64)
		if err != nil {
			return middleware.Permanent(err)
		}
		tx, err := gormTx(ctx, base, cfg)
		if err != nil {
			return err
		}
		if err := tx.Create(&Charge{Run: runID, OrderID: order, Amount: amount}).Error; err != nil {
			return err
		}
		if err := tx.Model(&Account{}).Where("run = ?", runID).
			Update("balance", gorm.Expr("balance + ?", amount)).Error; err != nil {
			return err
		}
		if _, again := crashed.LoadOrStore(order, true); !again {
			switch {
			case amount%5 == 0:
				return errors.New("payment provider timed out after the charge was written")
			case amount%7 == 0:
				panic("crash after the charge was written")
			}
		}
		return nil
	}
}

// gormTx returns GORM running in the inbox's transaction in ctx.
//
// The cheap way binds a session of one GORM handle to the *sql.Tx, as
// GORM's own Begin binds a session to the transaction it begins: the
// models' parsed schemas and the callbacks are shared. gorm.Open with the
// dialector's Conn works as well, at the cost of a new GORM handle (and a
// fresh parse of every model) per message.
func gormTx(ctx context.Context, base *gorm.DB, cfg config) (*gorm.DB, error) {
	tx := sqlstore.Tx(ctx)
	if tx == nil {
		return nil, errors.New("no inbox transaction in the message's context")
	}
	if cfg.OpenPerMessage {
		db, err := gorm.Open(dialector(cfg.Dialect, tx), gormConfig())
		if err != nil {
			return nil, err
		}
		return db.WithContext(ctx), nil
	}
	session := base.Session(&gorm.Session{Context: ctx, NewDB: true})
	session.Statement.ConnPool = tx
	return session, nil
}

// dialector is GORM's driver for conn, a *sql.DB or the inbox's *sql.Tx.
func dialector(dialect string, conn gorm.ConnPool) gorm.Dialector {
	if dialect == "mysql" {
		// SkipInitializeWithVersion: no SELECT VERSION() in every
		// message's transaction.
		return gormmysql.New(gormmysql.Config{Conn: conn, SkipInitializeWithVersion: true})
	}
	return gormpostgres.New(gormpostgres.Config{Conn: conn})
}

func gormConfig() *gorm.Config {
	// SkipDefaultTransaction: GORM would otherwise wrap each write in a
	// transaction of its own on the pool (on the inbox's *sql.Tx it sees
	// a transaction already and does not).
	return &gorm.Config{SkipDefaultTransaction: true, Logger: logger.Default.LogMode(logger.Silent)}
}

// openDB opens the database with the driver the dialect takes: pgx's
// stdlib for PostgreSQL, go-sql-driver/mysql (with parseTime, which GORM's
// time fields need) for MySQL.
func openDB(cfg config) (*sql.DB, sqlstore.Dialect, error) {
	switch cfg.Dialect {
	case "postgres":
		db, err := sql.Open("pgx", cfg.DSN)
		return db, sqlstore.Postgres, err
	case "mysql":
		mc, err := mysql.ParseDSN(cfg.DSN)
		if err != nil {
			return nil, sqlstore.Dialect{}, err
		}
		mc.ParseTime = true
		connector, err := mysql.NewConnector(mc)
		if err != nil {
			return nil, sqlstore.Dialect{}, err
		}
		return sql.OpenDB(connector), sqlstore.MySQL, nil
	}
	return nil, sqlstore.Dialect{}, fmt.Errorf("-dialect must be postgres or mysql, got %q", cfg.Dialect)
}
