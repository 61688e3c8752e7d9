// Command oncemill is the operator's tool for oncemill's PostgreSQL or
// MySQL/MariaDB dead-letter queue (package dlq): it lists, shows, replays and purges the
// messages that consumers gave up on; it serves the operator console over
// them and the inbox and outbox tables. It also declares RabbitMQ topology
// ahead of the consumers, for deploy pipelines.
//
// Usage:
//
//	oncemill dlq list   [filter flags] [--json]
//	oncemill dlq show   ID [--json]
//	oncemill dlq replay [ID ...] [filter flags] [--all] [--broker URL] [--inbox URL] [--force] [--json]
//	oncemill dlq purge  [ID ...] [filter flags] [--all] [--json]
//	oncemill console [--addr HOST:PORT] [--token T] [--read-only] [--broker URL]
//	oncemill amqp declare --topic T [--topic T ...] [--group G] [--url URL]
//	                      [--delivery-limit N] [--dead-letter-exchange X]
//	oncemill reconcile --database URL --consumer NAME [--inbox-database URL]
//	                   [--grace DURATION] [--since DURATION] [--strict]
//
// "oncemill --help" lists the commands; "oncemill <command> --help" (or -h),
// "oncemill dlq replay --help" for instance, prints that command's usage
// with every flag it takes.
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
// ago: 90m, 2h, 7d.
//
// Every dlq command takes --database URL (default $DATABASE_URL), --schema
// (default "oncemill") and --table (default "dlq"), naming the table that
// sqlschema.Migrate created; --json prints JSON instead of a table. Flags
// may come before or after the IDs.
//
// A MySQL or MariaDB database is named mysql://user:password@host:3306/db
// (the port defaults to 3306; the parameters are go-sql-driver/mysql's,
// tls=true for instance): its tables are the ones sqlschema.MigrateSQL
// created for sqlschema.MySQL, in the database --schema names (the URL's
// database is only the connection's).
//
// replay publishes each selected entry to its original topic with its
// original UUID, payload and metadata, the delivery facts removed,
// through the broker --broker names (default $BROKER_URL; kafka://, amqp://,
// sqs://, nats:// or postgres://, as adapters.Open takes them), and deletes
// the entry once the broker has it. It stops at the first entry the broker
// refuses (on RabbitMQ also one whose topic has no queue bound:
// unroutable; on NATS one whose topic has no stream, unless the URL says
// create=true); that entry and the rest stay. A broker inside this process
// (gochannel://, kafka:// or nats:// with no host, which start an embedded
// broker) is refused as a usage error before any entry is read: nothing
// else subscribes to it, so the replayed messages would be lost. With more than 20 entries and a terminal
// on stderr it draws a progress bar there. Before publishing an entry it
// writes a replay grant on the key's dead record (see dlq.Granter), in the
// inbox table beside the dead-letter table or in the store --inbox names
// (redis://…?prefix=P, sqlite:PATH?table=T, postgres://…?schema=S&table=T,
// mysql://…?schema=DB&table=T);
// an entry whose key has no record there stops the replay and stays, and
// --force replays it as a new key. purge deletes the selected
// entries. Both refuse to run with no selection: give IDs, a filter flag or
// --all. Named IDs must all exist, or nothing is done.
//
// console serves the operator console (package console) on --addr
// (default 127.0.0.1:8080) until interrupted. Every request needs --token
// (default $ONCEMILL_CONSOLE_TOKEN; without either one is generated and
// printed once), as an Authorization: Bearer header or through the login
// form. --read-only refuses replays and purges. --broker URL also enables
// replay to the original topic (a broker inside this process is refused,
// as for dlq replay); otherwise a
// replay goes only to the entry's consumer, through its
// dlq.ReplaySubscriber. It takes --database, --schema, --table,
// --inbox-table and --outbox-table.
//
// amqp declare creates on RabbitMQ, for each --topic, the topology a
// subscriber of consumer group --group declares when it subscribes (see
// adapters/amqp.Declare): the topic's durable fanout exchange, named after
// the topic, the durable quorum queue "<topic>.<group>" ("<topic>" without a
// group) and the binding between them. Run it before producers start,
// Go or not: RabbitMQ drops what is published while no queue is bound.
// --url (default $BROKER_URL) is an amqp:// or amqps:// URL; its group,
// delivery_limit, dead_letter_exchange and connect_timeout parameters are
// read as adapters.Open reads them. --group, --delivery-limit and
// --dead-letter-exchange set the same as the first three, and must not
// differ from them when both are given. The queue arguments must be those
// the consumers use: the broker refuses to redeclare a queue with others.
// Declaring what exists with the same settings changes nothing.
//
// reconcile compares the relay's ledger (forwarder.RelayConfig.Ledger)
// with a consumer's inbox: it lists the events published more than
// --grace ago and within --since that the inbox holds neither as done nor
// as dead (dead-lettered), and with --strict the done keys no ledger row
// explains. It exits 0 when nothing is missing, 1 when something is, 2 for
// a usage error and 3 when the check could not run.
//
// Exit status: 0 on success, also when nothing matched ("no entries
// matched"); 1 when the work failed (database or broker unreachable, an ID
// that does not exist, the broker refusing a message); 2 for a usage error
// (unknown command or flag, a bad ID, time or URL, a missing --database,
// --broker, --url or --topic, a broker inside this process for a relay
// or a replay, no
// selection), reported in one line that names the flag or argument.
package main
