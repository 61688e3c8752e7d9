// Package sqlite keeps inbox records in a SQLite database, for services
// whose effects live in the same SQLite file. It implements
// [dedup.TxStore] and [dedup.Expirer]; lease mode is not offered.
//
// # Transactions
//
// [Store.InboxBegin] starts a write transaction in which the inbox claims the
// message's key and the handler writes its effect, reading the transaction
// from its context with [Tx]. The claim writes the key's row as done at
// once: the row becomes visible only when the transaction commits, together
// with the effect, and disappears with it if the handler fails and the
// transaction is rolled back. SQLite admits one writer at a time, so a second
// delivery of the same key waits for the first transaction to end and then
// finds the key done, or claims it itself if the first rolled back.
//
// # Opening the database
//
// [Open] opens a database file with the settings the store relies on: WAL
// journal, a busy timeout so that writers wait for each other instead of
// failing with SQLITE_BUSY, foreign keys, and transactions that take the
// write lock when they begin (_txlock=immediate), and creates the inbox table
// with [sqlschema.MigrateSQLite]. [New] wraps a *sql.DB the caller opened and
// migrated; it should be opened with the same settings.
//
// # Time
//
// Timestamps are stored as INTEGER microseconds since the Unix epoch, taken
// from the Go clock of the process that writes them.
package sqlite
