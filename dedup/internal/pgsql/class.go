package pgsql

import (
	"strings"

	"github.com/oncemill/oncemill/dedup"
)

// Class is the class of the server's answer, by its SQLSTATE, to one of
// the store's own statements (start, claim, complete, fail, …), for
// dedup/postgres on pgx and dedup/sqlstore's PostgreSQL dialect alike. It
// is never asked of a statement the handler ran: a handler's own failure
// is the message's whatever its code.
//
//   - dedup.ErrConflict: a serialization failure or a deadlock, to run
//     again at once.
//   - dedup.ErrUnavailable: the server cannot serve (shutting down, out of
//     connections, a broken connection, a read-only standby after a
//     failover), or the store may not use its own tables ([Unusable]).
//     Neither says anything about the message: never counted, never
//     dead-lettered, nacked with a backoff until the operator or the
//     server puts it right.
//   - nil: the statement's own answer.
func Class(code string) error {
	switch {
	case code == "40001", code == "40P01": // serialization_failure, deadlock_detected
		return dedup.ErrConflict
	case strings.HasPrefix(code, "08"), // connection_exception
		code == "57P01", code == "57P02", code == "57P03", // admin/crash shutdown, cannot_connect_now
		code == "53300", code == "53400", // too_many_connections, configuration_limit_exceeded
		code == "25006", // read_only_sql_transaction: a standby, or default_transaction_read_only
		Unusable(code):
		return dedup.ErrUnavailable
	}
	return nil
}

// Unusable reports whether code says that the store cannot use its own
// tables: one is missing (the schema was never migrated, or a table was
// dropped) or the store's database user was not granted it.
func Unusable(code string) bool {
	return UndefinedTable(code) || code == "42501" // insufficient_privilege
}

// UndefinedTable reports whether code says that a table or its schema does
// not exist: the store's error then names the migration to run.
func UndefinedTable(code string) bool {
	return code == "42P01" || code == "3F000" // undefined_table, invalid_schema_name
}
