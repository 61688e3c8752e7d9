// Package inboxtx finds the inbox transaction a handler's context
// carries, whichever SQL inbox store began it, for the writers that join
// it: the consumer outbox (forwarder) and the dead-letter publisher (dlq).
// One lookup, so that a store added later is found by both.
package inboxtx

import (
	"context"
	"database/sql"

	"github.com/jackc/pgx/v5"

	"github.com/oncemill/oncemill/dedup/postgres"
	"github.com/oncemill/oncemill/dedup/sqlite"
	"github.com/oncemill/oncemill/dedup/sqlstore"
	"github.com/oncemill/oncemill/internal/sqldb"
)

// Of returns the inbox transaction ctx carries: a pgx one (dedup/postgres)
// or a database/sql one (dedup/sqlstore, dedup/sqlite); both are nil when
// ctx carries none.
func Of(ctx context.Context) (pgx.Tx, *sql.Tx) {
	if tx := postgres.Tx(ctx); tx != nil {
		return tx, nil
	}
	if tx := sqlstore.Tx(ctx); tx != nil {
		return nil, tx
	}
	return nil, sqlite.Tx(ctx)
}

// Executor returns the inbox transaction ctx carries as an
// sqldb.Executor, or nil. A transaction that sqldb.Join put in ctx comes
// first: a writer that joins the inbox's joins it the same way.
func Executor(ctx context.Context) sqldb.Executor {
	if tx := sqldb.Joined(ctx); tx != nil {
		return tx
	}
	switch pgxTx, sqlTx := Of(ctx); {
	case pgxTx != nil:
		return sqldb.PgxTxOf(pgxTx)
	case sqlTx != nil:
		return sqldb.SQLTxOf(sqlTx)
	}
	return nil
}
