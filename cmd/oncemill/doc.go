// Command oncemill is the operator's tool for oncemill's tables: it lists,
// shows, replays and purges the messages that consumers gave up on (package
// dlq); it serves the operator console over them and the inbox and outbox
// tables; it relays a service's outbox table to the broker as a process of
// its own; it checks the relay's ledger against a consumer's inbox
// (package reconcile). It also declares RabbitMQ topology ahead of the
// consumers, for deploy pipelines.
//
// Usage:
//
//	oncemill dlq list   [filter flags] [--json]
//	oncemill dlq show   ID [--json]
//	oncemill dlq replay [ID ...] [filter flags] [--all] [--broker URL] [--inbox URL] [--force] [--json]
//	oncemill dlq purge  [ID ...] [filter flags] [--all] [--json]
//	oncemill console [--addr HOST:PORT] [--token T] [--read-only] [--broker URL]
//	oncemill relay --database URL --broker URL [--migrate] [--ledger]
//	oncemill reconcile --database URL --consumer NAME [--inbox-database URL]
//	                   [--grace DURATION] [--since DURATION] [--strict]
//	oncemill amqp declare --topic T [--topic T ...] [--group G] [--url URL]
//	                      [--delivery-limit N] [--dead-letter-exchange X]
//
// "oncemill --help" lists the commands; "oncemill <command> --help" (or -h),
// "oncemill dlq replay --help" for instance, says what that command does
// and lists every flag it takes. docs/operations.md is the manual.
//
// Filter flags select entries; they combine with each other and with IDs:
//
//	--topic T       the original topic the message was consumed from
//	--consumer C    the consumer (handler) that gave up on it
//	--error TEXT    its last error contains TEXT, ignoring case
//	--since TIME    dead-lettered at or after TIME
//	--until TIME    dead-lettered at or before TIME
//	--limit N       the first N matching entries, by id (0: all)
//
// TIME is RFC 3339 (2026-03-01T10:00:00Z) or a duration meaning that long
// ago: 90m, 2h, 7d. Flags may come before or after the IDs.
//
// Every command that reads oncemill's tables takes --database URL (default
// $DATABASE_URL) and --schema (default "oncemill"), and opens the database
// the same way, whichever the command:
//
//	postgres://user:password@host:5432/db    PostgreSQL, through pgx
//	mysql://user:password@host:3306/db       MySQL or MariaDB
//	sqlite:///absolute/path                  a SQLite file
//	sqlite://relative/path
//
// A PostgreSQL URL is pgx's, with a connect timeout of 10s unless it gives
// one. A MySQL URL's port defaults to 3306 and its parameters are
// go-sql-driver/mysql's (tls=true for instance); its tables are in the
// database --schema names (the URL's database is only the connection's);
// each connect, the handshake included, is bounded by timeout (10s) and
// each statement by readTimeout and writeTimeout (30s). A SQLite file is
// opened with a busy timeout and the WAL journal; it has no schemas, and
// it must exist (run the consumer, or sqlschema.MigrateSQLite, first)
// unless relay --migrate creates it. The tables are those sqlschema.Migrate
// (sqlschema.MigrateSQL for database/sql) created.
//
// A broker inside this process (gochannel://, kafka:// or nats:// with no
// host, which start an embedded broker) is refused as a usage error by
// every command that publishes (dlq replay, console --broker, relay):
// nothing else subscribes to it, so what it was given would be lost.
//
// Exit status: 0 on success, also when nothing matched ("no entries
// matched"); 1 when the work failed (database or broker unreachable, an ID
// that does not exist, the broker refusing a message); 2 for a usage error
// (unknown command or flag, a bad ID, time or URL, a missing --database,
// --broker, --url or --topic, a broker inside this process, no selection),
// reported in one line that names the flag or argument; reconcile exits 3
// when its check could not run.
package main
