// Package postgres is the PostgreSQL inbox store, on pgx v5.
//
// It implements both modes of [dedup]: a transactional claim, a statement
// inside the handler's transaction that writes the key's record as done
// (INSERT … ON CONFLICT DO NOTHING, visible at commit with the effect), and
// a fenced lease for effects outside the database. Concurrent deliveries
// of one key serialise on its row: exactly one commits the effect, the
// others see it done.
//
// Create the tables with [sqlschema.Migrate], then:
//
//	store, err := postgres.New(pool, postgres.Config{})
//	inbox, err := middleware.NewInbox(middleware.InboxConfig{TxStore: store})
//
// A handler writes its effect with [Tx]:
//
//	func charge(msg *message.Message) error {
//		_, err := postgres.Tx(msg.Context()).Exec(msg.Context(), `INSERT INTO charges …`)
//		return err
//	}
//
// # One protocol, pgx's capabilities
//
// The claim protocol is the one dedup/sqlstore and dedup/sqlite run,
// written once over oncemill's SQL layer; this package is its constructor
// on pgx, which adds what only pgx does. On a *pgxpool.Pool a delivery's
// first statements go out in one round trip
// ([dedupdriver.StartClaimer], [dedupdriver.BeginClaimer]): the attempt
// record, a Sync that commits it on its own, BEGIN and the claim. The
// transaction [Tx] then returns is not pgx's own (pgx did not send the
// BEGIN): Exec, Query, QueryRow, SendBatch, CopyFrom, Prepare, Conn and
// nested Begin (savepoints) behave as on a pgx transaction, and so do
// Commit and Rollback; LargeObjects is not supported (call the server's
// lo_* functions through Exec). Group commit claims many keys in one
// statement ([dedupdriver.BatchClaimer]), and a transaction tells whether
// a statement failed in it ([dedupdriver.AbortReporter]). On a single
// connection or a transaction the statements go one at a time.
package postgres
