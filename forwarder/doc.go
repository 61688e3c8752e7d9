// Package forwarder is the transactional outbox on PostgreSQL.
//
// Updating the database and publishing an event are two writes that cannot
// be atomic across systems. The outbox makes them one: [TxPublisher] writes
// the event as a row in the same pgx transaction as the business change
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
// # Guarantees
//
// A row is published at least once, with its message's UUID, metadata and
// partition key; a relay that dies between publish and delete publishes it
// again, and the consumer's inbox absorbs the copy. On a broker error the
// rows stay and the relay backs off. Several relays may run on one table:
// each batch locks a set of lanes (a hash of the partition key), so no row
// goes out twice in normal operation and each key's rows go out in the
// order they were inserted (see [Relay] for what that means for concurrent
// writers).
//
// # Latency and liveness
//
// Writers pay nothing at commit: the relay polls, at once while rows flow,
// backing off to RelayConfig.PollInterval while the table is empty. A row
// comes due when every transaction older than its own has ended,
// server-wide (as with watermill-sql): that is what keeps a key's order
// when transactions commit out of order, and it means a transaction left
// open anywhere on the server holds the outbox until it ends. [Relay.Lag]
// names that transaction, and the relay logs it while the stall lasts.
//
// # Consumer outbox
//
// [InboxOutbox] plugs into middleware.InboxConfig.Outbox: the messages a
// handler produces are written to the outbox in the inbox's transaction, so
// consume, update and produce commit as one step.
package forwarder
