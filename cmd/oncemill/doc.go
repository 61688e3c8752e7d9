// Command oncemill is the operator's tool for oncemill's tables: it lists,
// shows, replays and purges the messages that consumers gave up on (package
// dlq); it lists, retries now and cancels the messages parked for a
// delayed retry (package retry); it serves the operator console over them
// and the inbox and outbox tables; it relays a service's outbox table to the broker as a process of
// its own; it checks the relay's ledger against a consumer's inbox
// (package reconcile). It also declares RabbitMQ topology ahead of the
// consumers, for deploy pipelines.
//
// "oncemill --help" lists the commands and their exit statuses; "oncemill
// <command> --help" (or -h), "oncemill dlq replay --help" for instance,
// says what that command does and lists every flag it takes; flags may
// come before or after the IDs. A mysql:// URL's port defaults to 3306 and
// its parameters are go-sql-driver/mysql's (tls=true for instance).
// docs/operations.md is the manual: how every command opens a database URL
// (postgres://, mysql:// or sqlite://) and which brokers it refuses.
package main
