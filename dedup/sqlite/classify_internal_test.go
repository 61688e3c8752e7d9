package sqlite

import (
	"context"
	"database/sql"
	"errors"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/dedup"
)

// TestBusyIsAConflict: a second writer that waits out its busy timeout on
// a real database file gets SQLITE_BUSY, which the store reports as a
// conflict to run again, not as the message's failure.
func TestBusyIsAConflict(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	path := filepath.Join(t.TempDir(), "busy.db")
	open := func() *sql.DB {
		db, err := sql.Open("sqlite", "file:"+path+"?_pragma=busy_timeout(20)&_pragma=journal_mode(WAL)&_txlock=immediate")
		require.NoError(t, err)
		t.Cleanup(func() { require.NoError(t, db.Close()) })
		return db
	}
	holder, other := open(), open()
	_, err := holder.ExecContext(ctx, `CREATE TABLE t (x INTEGER)`)
	require.NoError(t, err)
	tx, err := holder.BeginTx(ctx, nil)
	require.NoError(t, err)
	t.Cleanup(func() { _ = tx.Rollback() })
	_, err = tx.ExecContext(ctx, `INSERT INTO t VALUES (1)`)
	require.NoError(t, err)

	_, err = other.BeginTx(ctx, nil) // BEGIN IMMEDIATE waits for the write lock
	require.Error(t, err)
	require.ErrorIs(t, interpret("begin", err), dedup.ErrConflict)
	require.ErrorIs(t, (&inboxTx{}).InboxClassify(err), dedup.ErrConflict)
	require.NotErrorIs(t, (&inboxTx{}).InboxClassify(errors.New("card declined")), dedup.ErrConflict)
}
