// Package postgres is the PostgreSQL inbox store, on pgx v5.
//
// It implements both modes of [dedup]: a transactional claim, one
// INSERT … ON CONFLICT … DO UPDATE … WHERE status <> 'done' statement inside
// the handler's transaction, and a fenced lease for effects outside the
// database. Concurrent deliveries of one key serialise on its row: exactly one
// commits the effect, the others see it done.
//
// Create the table with [sqlschema.Migrate], then:
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
package postgres
