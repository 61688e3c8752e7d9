// Package sqlstore is the transactional inbox store on database/sql, for
// PostgreSQL (through pgx's stdlib or lib/pq) and for MySQL 8 and MariaDB
// 10.6+ (through go-sql-driver/mysql): the store for services whose data
// layer is GORM, sqlc, sqlx or plain database/sql. It implements
// [dedup.TxStore] with every guarantee of dedup/postgres's transactional
// mode; lease mode is not offered.
//
// # Use
//
// Create the tables with sqlschema.MigrateSQL, then:
//
//	schema := sqlschema.Config{}
//	err := sqlschema.MigrateSQL(ctx, db, sqlschema.MySQL, schema)
//	store, err := sqlstore.New(db, sqlstore.Config{Dialect: sqlstore.MySQL, Schema: schema})
//	inbox, err := middleware.NewInbox(middleware.InboxConfig{TxStore: store})
//
// A handler writes its effect through [Tx], the *sql.Tx in which the inbox
// claimed the message's key, or through a library over it:
//
//	func charge(msg *message.Message) error {
//		ctx := msg.Context()
//		_, err := sqlstore.Tx(ctx).ExecContext(ctx, `INSERT INTO charges …`)
//		return err
//	}
//
// GORM takes the transaction as its connection (gorm.io/driver/postgres's
// and gorm.io/driver/mysql's Config.Conn), sqlc's Queries take it with
// WithTx: see examples/gorm and examples/sqlc.
//
// # Guarantees
//
// The claim is a statement in the handler's transaction that writes the
// key's record as done: claim, effect and done mark commit together, or
// not at all. Of any number of concurrent deliveries of one key, one
// commits the effect; the others wait on its uncommitted row and then see
// the key done (and its stored result), or take it if it rolled back.
// Before the transaction, a start counts the attempt in a statement that
// commits at once, so that an attempt whose process dies is counted and a
// crash loop is dead-lettered; the count is deleted in the claim's
// transaction. Failed and dead keys, replay grants and expiry work as in
// dedup/postgres.
//
// # Dialects
//
// [Postgres] uses dedup/postgres's tables and statements (the two stores
// may share a schema). [MySQL] has neither RETURNING (MySQL 8) nor
// ON CONFLICT nor UNLOGGED tables, so its claim and start take two
// statements where PostgreSQL takes one, and its starts table is an
// InnoDB table whose writes are flushed like any other. Where MySQL and
// PostgreSQL differ for a user:
//
//   - Consumers and keys are VARBINARY, compared byte for byte (a _ci
//     collation would take "Order-1" and "order-1" for one key). A
//     consumer longer than 255 bytes or a key longer than 1024 bytes is
//     stored as "sha256:" and its hex digest; [Store.InboxDoneKeys] lists
//     it so.
//   - Error texts are cut to 64 KiB.
//   - Tables live in the database sqlschema.Config.Schema names
//     ("oncemill" by default), which may differ from the DSN's: a MySQL
//     transaction spans the databases of one server.
//   - A DSN with interpolateParams=true saves a round trip per
//     statement (without it the driver prepares each one); the store
//     works with any value of it, of parseTime, loc and clientFoundRows.
//
// # Errors
//
// The store tells the infrastructure's faults from the message's in one
// place, from what it knows of its own connection and calls: an
// unreachable server, a lost connection or a server that cannot serve wrap
// [dedup.ErrUnavailable]; a serialization failure or deadlock
// (PostgreSQL 40001, 40P01; MySQL 1213 deadlock, 1205 lock wait timeout)
// wraps [dedup.ErrConflict], which the inbox runs again at once; a commit
// whose connection failed after COMMIT was sent wraps [dedup.ErrAmbiguous].
// For an error the handler returns, the transaction asks its connection
// through the driver ([dedupdriver.Classifier]), never what the error wraps.
//
// database/sql's Commit takes no context: bound it with the driver's
// timeouts (go-sql-driver/mysql's readTimeout and writeTimeout, a
// statement_timeout or the TCP keepalives for PostgreSQL).
package sqlstore
