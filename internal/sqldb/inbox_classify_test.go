package sqldb

import (
	"context"
	"database/sql"
	"errors"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"
	_ "modernc.org/sqlite"

	"github.com/oncemill/oncemill/dedup"
)

// TestBusyIsAConflict: a second writer that waits out its busy timeout on
// a real SQLite database file gets SQLITE_BUSY, which the inbox reports as
// a conflict to run again, not as the message's failure, both as its own
// call's error and among the errors a handler returns.
func TestBusyIsAConflict(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	dir := t.TempDir()
	open := func(name string) *sql.DB {
		db, err := sql.Open("sqlite", "file:"+filepath.Join(dir, name)+"?_pragma=busy_timeout(20)&_pragma=journal_mode(WAL)&_txlock=immediate")
		require.NoError(t, err)
		t.Cleanup(func() { require.NoError(t, db.Close()) })
		return db
	}
	holder, other := open("busy.db"), open("busy.db")
	_, err := holder.ExecContext(ctx, `CREATE TABLE t (x INTEGER)`)
	require.NoError(t, err)
	tx, err := holder.BeginTx(ctx, nil)
	require.NoError(t, err)
	t.Cleanup(func() { _ = tx.Rollback() })
	_, err = tx.ExecContext(ctx, `INSERT INTO t VALUES (1)`)
	require.NoError(t, err)

	_, err = other.BeginTx(ctx, nil) // BEGIN IMMEDIATE waits for the write lock
	require.Error(t, err)
	in := NewSQLInbox(open("inbox.db"), SQLite, InboxConfig{Name: "sqlite", NotMigrated: errors.New("not migrated")})
	require.ErrorIs(t, in.wrap(ctx, "begin", err), dedup.ErrConflict)
	itx, berr := in.InboxBegin(ctx)
	require.NoError(t, berr)
	defer func() { require.NoError(t, itx.Rollback(ctx)) }()
	c := itx.(*inboxTx)
	require.ErrorIs(t, c.InboxClassify(err), dedup.ErrConflict)
	require.NotErrorIs(t, c.InboxClassify(errors.New("card declined")), dedup.ErrConflict)
}
