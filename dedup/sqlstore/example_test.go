package sqlstore_test

import (
	"context"
	"database/sql"
	"log"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/go-sql-driver/mysql"

	"github.com/oncemill/oncemill/dedup/sqlstore"
	"github.com/oncemill/oncemill/middleware"
	"github.com/oncemill/oncemill/sqlschema"
)

// A service on MySQL or MariaDB: one sqlschema.Config for the migrator and
// the store, and a handler that writes its effect through sqlstore.Tx.
func Example() {
	ctx := context.Background()
	cfg := mysql.NewConfig()
	cfg.Net, cfg.Addr, cfg.User, cfg.DBName = "tcp", "127.0.0.1:3306", "root", "shop"
	cfg.InterpolateParams = true // one round trip per statement instead of two
	connector, err := mysql.NewConnector(cfg)
	if err != nil {
		log.Fatal(err)
	}
	db := sql.OpenDB(connector)
	defer db.Close()

	schema := sqlschema.Config{} // the tables in the database "oncemill"
	if err := sqlschema.MigrateSQL(ctx, db, sqlschema.MySQL, schema); err != nil {
		log.Fatal(err)
	}
	store, err := sqlstore.New(db, sqlstore.Config{Dialect: sqlstore.MySQL, Schema: schema})
	if err != nil {
		log.Fatal(err)
	}
	inbox, err := middleware.NewInbox(middleware.InboxConfig{TxStore: store})
	if err != nil {
		log.Fatal(err)
	}

	charge := func(msg *message.Message) error {
		ctx := msg.Context()
		// The effect commits with the claim of the message's key, or not
		// at all: a redelivery finds the key done.
		_, err := sqlstore.Tx(ctx).ExecContext(ctx, `INSERT INTO charges (order_id) VALUES (?)`, string(msg.Payload))
		return err
	}
	router, err := message.NewRouter(message.RouterConfig{}, nil)
	if err != nil {
		log.Fatal(err)
	}
	router.AddMiddleware(inbox.Middleware)
	_ = charge // router.AddConsumerHandler("charge", "orders", subscriber, charge)
}
