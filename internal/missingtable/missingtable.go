// Package missingtable tells whether a database error says that a table,
// or the schema (MySQL: the database) that should hold it, does not
// exist: oncemill's tables were not migrated there. The console and
// reconcile turn such an error into a hint to migrate.
package missingtable

import (
	"errors"

	"github.com/go-sql-driver/mysql"
	"github.com/jackc/pgx/v5/pgconn"
)

// Is reports whether err is PostgreSQL's undefined_table (42P01) or
// invalid_schema_name (3F000), or MySQL's ER_NO_SUCH_TABLE (1146) or
// ER_BAD_DB_ERROR (1049), through pgx or go-sql-driver/mysql.
func Is(err error) bool {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return pgErr.Code == "42P01" || pgErr.Code == "3F000"
	}
	var myErr *mysql.MySQLError
	return errors.As(err, &myErr) && (myErr.Number == 1146 || myErr.Number == 1049)
}
