// Package sqldb is the one seam below every part of oncemill that speaks
// SQL outside the inbox stores: the outbox relay, the dead-letter table,
// the console's data, reconcile and the oncemill command. Each of those is
// written once, over an [Executor] that pgx and database/sql both satisfy
// and a [Dialect] that says how a database family spells what differs
// (placeholders, time, upserts, error codes) and which capabilities it has
// (RETURNING, SKIP LOCKED, advisory locks, transaction snapshots, one
// writer at a time). The logic branches on a capability, never on a
// database's name.
//
// The model is River's riverdriver (one interface, thin drivers) and
// watermill-sql's SchemaAdapter: the statements that differ live in the
// dialect, the logic that is the same lives once above it.
package sqldb

import (
	"context"
	"database/sql"
	"errors"
)

// Executor runs statements: a pool, a connection or a transaction, through
// pgx or database/sql. Statements use the dialect's placeholders; write
// them with '?' and pass them through [Dialect.Rebind] once.
type Executor interface {
	// Exec runs a statement and returns the rows it affected.
	Exec(ctx context.Context, query string, args ...any) (int64, error)
	// Query runs a statement that returns rows.
	Query(ctx context.Context, query string, args ...any) (Rows, error)
	// QueryRow runs a statement that returns at most one row; its Scan
	// returns an error that wraps sql.ErrNoRows when there is none.
	QueryRow(ctx context.Context, query string, args ...any) Row
}

// Rows is the rows a query returned.
type Rows interface {
	Next() bool
	Scan(dest ...any) error
	Err() error
	Close() error
}

// Row is the one row QueryRow returned.
type Row interface {
	Scan(dest ...any) error
}

// Isolation is a transaction's isolation level.
type Isolation int

const (
	// Default is the server's default level.
	Default Isolation = iota
	// ReadUncommitted sees rows of transactions in flight (MySQL).
	ReadUncommitted
	// ReadCommitted sees each statement's committed rows.
	ReadCommitted
	// RepeatableRead reads one snapshot.
	RepeatableRead
	// Serializable is the strictest level.
	Serializable
)

// TxOptions are a transaction's options.
type TxOptions struct {
	// Isolation is the transaction's level. Ignored by SQLite, whose
	// transactions are serializable.
	Isolation Isolation
	// ReadOnly marks a transaction that writes nothing: on SQLite it
	// begins DEFERRED instead of IMMEDIATE, so that it does not take the
	// write lock.
	ReadOnly bool
}

// DB is a database: it runs statements on its pool and begins
// transactions.
type DB interface {
	Executor
	// Dialect is the database's family.
	Dialect() *Dialect
	// Begin begins a transaction on a connection of its own. Unlike
	// database/sql's Tx, the transaction does not end when ctx does: every
	// statement, Commit and Rollback take their own context, so that a
	// transaction that must finish after its caller was cancelled (a
	// relay's delete once the broker has the rows) can.
	Begin(ctx context.Context, opts TxOptions) (Tx, error)
}

// Tx is a transaction.
type Tx interface {
	Executor
	// Commit commits the transaction.
	Commit(ctx context.Context) error
	// Rollback rolls it back; after Commit or Rollback it does nothing
	// and returns nil.
	Rollback(ctx context.Context) error
}

// ErrNoRows is database/sql's: QueryRow's Scan wraps it on every driver.
var ErrNoRows = sql.ErrNoRows

// Collect scans every row of rows with scan and closes rows.
func Collect[T any](rows Rows, err error, scan func(Rows) (T, error)) ([]T, error) {
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []T
	for rows.Next() {
		v, err := scan(rows)
		if err != nil {
			return nil, err
		}
		out = append(out, v)
	}
	if err := rows.Err(); err != nil {
		return nil, err
	}
	return out, rows.Close()
}

// InTx runs f in a transaction of db and commits it when f returns nil,
// else rolls it back. The commit and the rollback run on ctx.
func InTx(ctx context.Context, db DB, opts TxOptions, f func(Tx) error) error {
	tx, err := db.Begin(ctx, opts)
	if err != nil {
		return err
	}
	if err := f(tx); err != nil {
		if rbErr := tx.Rollback(context.WithoutCancel(ctx)); rbErr != nil {
			err = errors.Join(err, rbErr)
		}
		return err
	}
	return tx.Commit(ctx)
}
