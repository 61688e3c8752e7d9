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
// partition key; a relay that dies between publish and delete publishes it
// again, and the consumer's inbox absorbs the copy. On a broker error the
// rows stay and the relay backs off. Several relays may run on one
// PostgreSQL or MySQL table: each batch locks a set of lanes (a hash of
// the partition key), so no row goes out twice in normal operation; on
// SQLite, one relay per database file. A row that cannot become a message
// (metadata that is not a JSON object of strings, an empty topic or uuid:
// a writer in another language got the contract wrong) is dead-lettered
// to the dead-letter table and logged, never published and never kept to
// block its lane; see [ErrRefusedRow] and docs/outbox-contract.md.
//
// Per-key order is the order the writers' locks give: a transaction's
// rows go out in the order it inserted them, and a row inserted after
// another writer committed goes out after that writer's rows, so writers
// of one key that insert their outbox row after locking the key's business
// row (held until they commit) publish in their commit order; on SQLite,
// whose writers take turns, every key's rows go out in commit order. See
// [Relay] for the rule on each database and what it does not promise.
//
// # Latency and liveness
//
// Writers pay nothing at commit: the relay polls, at once while rows flow,
// backing off to RelayConfig.PollInterval while the table is empty. On
// PostgreSQL a row comes due when every transaction older than its own
// has ended, server-wide (as with watermill-sql), so a transaction left
// open anywhere on the server holds the outbox until it ends; on MySQL a
// transaction left open after writing an outbox row holds back the rows
// behind it in its lane, one of 64; on SQLite nothing waits.
// [Relay.Lag] names that transaction, and once it has been open for
// RelayConfig.StallWarning the relay logs it, once per StallWarning, while
// rows wait on it.
//
// # Consumer outbox
//
// [InboxOutbox] and [SQLInboxOutbox] plug into
// middleware.InboxConfig.Outbox: the messages a handler produces are
// written to the outbox in the inbox's transaction, so consume, update
// and produce commit as one step.
package forwarder
