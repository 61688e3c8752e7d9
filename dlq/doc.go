// Package dlq keeps dead-lettered messages in a PostgreSQL table, or a
// MySQL 8.0+ or MariaDB 10.6+ one, and lets an operator list, inspect,
// replay and purge them.
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
// On MySQL or MariaDB, through database/sql (go-sql-driver/mysql), on the
// table sqlschema.MigrateSQL creates for sqlschema.MySQL,
// [NewSQLPublisher], [NewSQLStore] and [NewSQLReplaySubscriber] return the
// same Publisher, Store and ReplaySubscriber, with the same guarantees: one
// entry per message, consumer and original topic (a unique index decides),
// and a dead letter written under a dedup/sqlstore inbox transaction on the
// same server commits with the key's dead mark.
//
// The oncemill command (cmd/oncemill) is the operator's front end to Store.
package dlq
