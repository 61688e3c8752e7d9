package pgdb

import _ "embed" // schema.sql

// Schema is schema.sql, the ledger's tables, for the example to create
// them (a service runs its own migrations).
//
//go:embed schema.sql
var Schema string
