// Package pgdb is the ledger's queries for PostgreSQL, written in the shape
// sqlc generates for database/sql from schema.sql and query.sql beside
// it: a Queries type over the DBTX interface, which *sql.DB, *sql.Conn
// and *sql.Tx all satisfy, and WithTx to run them in a transaction, such
// as the inbox's (sqlstore.Tx).
package pgdb

import (
	"context"
	"database/sql"
)

// DBTX is what the queries run on.
type DBTX interface {
	ExecContext(context.Context, string, ...interface{}) (sql.Result, error)
	PrepareContext(context.Context, string) (*sql.Stmt, error)
	QueryContext(context.Context, string, ...interface{}) (*sql.Rows, error)
	QueryRowContext(context.Context, string, ...interface{}) *sql.Row
}

// New returns the queries on db.
func New(db DBTX) *Queries {
	return &Queries{db: db}
}

// Queries runs the ledger's statements.
type Queries struct {
	db DBTX
}

// WithTx returns the queries running in tx.
func (q *Queries) WithTx(tx *sql.Tx) *Queries {
	return &Queries{
		db: tx,
	}
}
