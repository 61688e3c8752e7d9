// Package dlq keeps dead-lettered messages in a table of PostgreSQL,
// MySQL 8.0+ or MariaDB 10.6+, or SQLite, and lets an operator list,
// inspect, replay and purge them.
//
// [Publisher] is a Watermill publisher that writes each message it is given
// as one row of the table that [sqlschema.Migrate] creates
// (sqlschema.Config.DLQTable, "dlq" by default). It is meant as the
// destination of oncemill's poison middleware, which publishes a message it
// gives up on with its UUID, payload and metadata unchanged plus the
// delivery.Dead* keys; the publisher parses those keys into columns and
// keeps the full metadata as well. It accepts any message: a missing or
// garbled field becomes NULL or the column's zero value, never an error.
//
// [Store] reads the table. [Store.Replay] publishes entries back to their
// original topic, with their original UUID, payload and metadata (minus the
// facts of the failed delivery, [delivery.IsDeliveryFact]), and deletes each entry in the
// same transaction that locked it, after the broker took it: an entry is
// never deleted unless it was republished, and two replays running at once
// never publish one entry twice. A replay that fails between the broker and
// the commit leaves the entry to be published again, under the same UUID,
// which the consumer's inbox absorbs.
//
// [NewPublisher], [NewStore] and [NewReplaySubscriber] take a pgx pool
// on PostgreSQL; [NewSQLPublisher], [NewSQLStore] and
// [NewSQLReplaySubscriber] take a database/sql database of
// sqlschema.Postgres, sqlschema.MySQL or sqlschema.SQLite, on the table
// sqlschema.MigrateSQL creates, and return the same Publisher, Store and
// ReplaySubscriber, with the same guarantees: one entry per message,
// consumer and original topic (a unique index decides), and a dead letter
// written under an inbox transaction of dedup/postgres, dedup/sqlstore or
// dedup/sqlite on the same database commits with the key's dead mark. One
// difference follows from SQLite's one writer, which must not wait on a
// broker or a handler: there a replay locks no entry while it is out, so
// replays running at once may both publish one entry, under its UUID,
// which the consumer's inbox absorbs.
//
// The oncemill command (cmd/oncemill) is the operator's front end to Store.
package dlq
