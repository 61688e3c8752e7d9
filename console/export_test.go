package console

import "github.com/oncemill/oncemill/internal/sqldb"

// NormalizeSQL, NormalizeMySQL and NormalizeSQLite expose the SQL form of
// NormalizeError in each dialect, for the tests that run both on one
// corpus.
var (
	NormalizeSQL    = func(col string) string { return normalizeSQL(sqldb.Postgres, col) }
	NormalizeMySQL  = func(col string) string { return normalizeSQL(sqldb.MySQL, col) }
	NormalizeSQLite = func(col string) string { return normalizeSQL(sqldb.SQLite, col) }
)

// FormatRanges and ParseRanges expose how the confirm step carries ids.
var (
	FormatRanges = formatRanges
	ParseRanges  = parseRanges
)
