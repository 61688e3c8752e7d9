// Package forwarder is the transactional outbox on PostgreSQL, MySQL 8.0+
// and MariaDB 10.6+, and SQLite.
//
// Updating the database and publishing an event are two writes that cannot
// be atomic across systems. The outbox makes them one: [TxPublisher] writes
// the event as a row in the same transaction as the business change
// (through watermill-sql v4's publisher), and a [Relay] publishes the rows to
// any Watermill publisher afterwards and deletes them.
//
//	tx, _ := pool.Begin(ctx)
//	_, _ = tx.Exec(ctx, `UPDATE orders SET status = 'paid' WHERE id = $1`, id)
//	pub, _ := forwarder.NewTxPublisher(ctx, tx, sqlschema.Config{})
//	_ = pub.Publish("orders.paid", event) // a row, committed with the update
//	_ = tx.Commit(ctx)
//
//	relay, _ := forwarder.NewRelay(forwarder.RelayConfig{Pool: pool, Publisher: kafkaPublisher})
//	router.AddPlugin(relay.Plugin) // or go relay.Run(ctx); relay.Close()
//
// Through database/sql, on the tables sqlschema.MigrateSQL creates for
// sqlschema.Postgres, sqlschema.MySQL or sqlschema.SQLite, the same two
// steps are [NewSQLTxPublisher] on a *sql.Tx and a Relay with
// RelayConfig.DB and RelayConfig.Dialect:
//
//	pub, _ := forwarder.NewSQLTxPublisher(ctx, tx, sqlschema.MySQL, sqlschema.Config{})
//	relay, _ := forwarder.NewRelay(forwarder.RelayConfig{DB: db, Dialect: sqlschema.MySQL, Publisher: kafkaPublisher})
//
// # Guarantees
//
// A row is published at least once, with its message's UUID, metadata and
// partition key, by one relay or several sharing the table (see [Relay]:
// what a relay that dies between publish and delete does, and why no row
// goes out twice in normal operation). On a broker error the rows stay and
// the relay backs off. A row that cannot become a message
// (metadata that is not a JSON object of strings, an empty topic or uuid:
// a writer in another language got the contract wrong) is dead-lettered
// to the dead-letter table and logged, never published and never kept to
// block its lane; see [ErrRefusedRow] and docs/outbox-contract.md.
//
// Per-key order is the order the writers' locks give; see [Relay] for the
// rule on each database and what it does not promise.
//
// # Latency and liveness
//
// Writers pay nothing at commit: the relay polls (RelayConfig.PollInterval).
// A transaction left open can hold rows back, on PostgreSQL (as with
// watermill-sql) and MySQL, as [Relay] says; [Relay.Lag] names that
// transaction, and the relay logs it as a stall (RelayConfig.StallWarning).
//
// # Scheduled messages
//
// [PublishAt] and [Delay] mark a message with a due time ([DueAtKey]):
// written through the publishers above, it waits in the outbox's
// scheduled table until then, and the relay moves it into the outbox and
// publishes it, not before its due time. A key's messages with a due
// time go out in (due time, write) order, a time already past counting
// as the write's; one without a due time waits for nothing and can go
// ahead of its key's rows that are due and not yet moved; see [PublishAt]
// and "Scheduled messages" in [Relay].
//
// # Consumer outbox
//
// [InboxOutbox] and [SQLInboxOutbox] plug into
// middleware.InboxConfig.Outbox: the messages a handler produces are
// written to the outbox in the inbox's transaction, so consume, update
// and produce commit as one step.
package forwarder
