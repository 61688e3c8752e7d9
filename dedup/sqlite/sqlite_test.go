package sqlite_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/oncemill/oncemill/dedup"
	"github.com/oncemill/oncemill/dedup/sqlite"
	"github.com/oncemill/oncemill/sqlschema"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

const window = time.Hour

func openStore(t *testing.T) *sqlite.Store {
	t.Helper()
	s, err := sqlite.Open(t.Context(), filepath.Join(t.TempDir(), "inbox.db"), sqlite.Config{})
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, s.Close()) })
	return s
}

// claim claims key in a new transaction, stores result if the key is new,
// and commits (or rolls back when commit is false).
func claim(t *testing.T, s *sqlite.Store, key dedup.Key, result []byte, commit bool) dedup.Claim {
	t.Helper()
	ctx := t.Context()
	tx, err := s.InboxBegin(ctx)
	require.NoError(t, err)
	defer func() { require.NoError(t, tx.Rollback(ctx)) }()
	c, err := tx.InboxClaim(ctx, key, window)
	require.NoError(t, err)
	if c.State == dedup.StateNew {
		require.NoError(t, tx.InboxComplete(ctx, key, result))
	}
	if commit {
		require.NoError(t, tx.Commit(ctx))
	}
	return c
}

type row struct {
	status                        string
	attempts                      int
	firstError, lastError         sql.NullString
	firstFailedAt, lastFailedAt   sql.NullInt64
	result                        []byte
	createdAt, updatedAt, expires int64
	doneAt                        sql.NullInt64
}

func readRow(t *testing.T, s *sqlite.Store, key dedup.Key) (row, bool) {
	t.Helper()
	var r row
	err := s.DB().QueryRowContext(t.Context(), `SELECT i.status, COALESCE(f.attempts, CASE WHEN i.status = 'done' THEN 1 ELSE 0 END), f.first_error, f.last_error,
		f.first_failed_at, f.last_failed_at, i.result, COALESCE(f.created_at, i.done_at, 0), COALESCE(f.updated_at, i.done_at, 0), i.expires_at, i.done_at
		FROM inbox i LEFT JOIN inbox_failures f USING (consumer, key) WHERE consumer = ? AND key = ?`, key.Consumer, key.Key).
		Scan(&r.status, &r.attempts, &r.firstError, &r.lastError, &r.firstFailedAt, &r.lastFailedAt,
			&r.result, &r.createdAt, &r.updatedAt, &r.expires, &r.doneAt)
	if errors.Is(err, sql.ErrNoRows) {
		return row{}, false
	}
	require.NoError(t, err)
	return r, true
}

func TestClaimNewKey(t *testing.T) {
	t.Parallel()
	s := openStore(t)
	key := dedup.Key{Consumer: "c", Key: "k1"}

	before := time.Now()
	c := claim(t, s, key, nil, true)
	require.Equal(t, dedup.Claim{State: dedup.StateNew, Attempts: 1}, c)

	r, ok := readRow(t, s, key)
	require.True(t, ok)
	require.Equal(t, "done", r.status)
	require.Nil(t, r.result)
	require.True(t, r.doneAt.Valid)
	require.GreaterOrEqual(t, r.expires, before.Add(window).UnixMicro())
	require.LessOrEqual(t, r.expires, time.Now().Add(window).UnixMicro())
}

func TestClaimDoneAfterCommit(t *testing.T) {
	t.Parallel()
	s := openStore(t)
	key := dedup.Key{Consumer: "c", Key: "k1"}

	require.Equal(t, dedup.StateNew, claim(t, s, key, []byte("receipt-42"), true).State)

	c := claim(t, s, key, nil, true)
	require.Equal(t, dedup.Claim{State: dedup.StateDone, Attempts: 1, Result: []byte("receipt-42")}, c)

	// A done key without a stored result answers a nil result.
	other := dedup.Key{Consumer: "c", Key: "k2"}
	claim(t, s, other, nil, true)
	c = claim(t, s, other, []byte("ignored"), true)
	require.Equal(t, dedup.StateDone, c.State)
	require.Nil(t, c.Result)
}

func TestConsumersAreSeparate(t *testing.T) {
	t.Parallel()
	s := openStore(t)

	a := claim(t, s, dedup.Key{Consumer: "a", Key: "k"}, []byte("a"), true)
	b := claim(t, s, dedup.Key{Consumer: "b", Key: "k"}, []byte("b"), true)
	require.Equal(t, dedup.StateNew, a.State)
	require.Equal(t, dedup.StateNew, b.State)

	require.Equal(t, []byte("a"), claim(t, s, dedup.Key{Consumer: "a", Key: "k"}, nil, true).Result)
	require.Equal(t, []byte("b"), claim(t, s, dedup.Key{Consumer: "b", Key: "k"}, nil, true).Result)
}

func TestRollbackLeavesNothing(t *testing.T) {
	t.Parallel()
	s := openStore(t)
	key := dedup.Key{Consumer: "c", Key: "k"}

	require.Equal(t, dedup.StateNew, claim(t, s, key, []byte("x"), false).State)
	_, ok := readRow(t, s, key)
	require.False(t, ok)

	c := claim(t, s, key, nil, true)
	require.Equal(t, dedup.Claim{State: dedup.StateNew, Attempts: 1}, c)
}

func TestRollbackAfterCommitIsNoop(t *testing.T) {
	t.Parallel()
	s := openStore(t)
	ctx := t.Context()

	tx, err := s.InboxBegin(ctx)
	require.NoError(t, err)
	_, err = tx.InboxClaim(ctx, dedup.Key{Consumer: "c", Key: "k"}, window)
	require.NoError(t, err)
	require.NoError(t, tx.Commit(ctx))
	require.NoError(t, tx.Rollback(ctx))
	require.NoError(t, tx.Rollback(ctx))
}

func TestTxInContext(t *testing.T) {
	t.Parallel()
	s := openStore(t)
	ctx := t.Context()
	require.Nil(t, sqlite.Tx(ctx))

	tx, err := s.InboxBegin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx)
	require.NotNil(t, sqlite.Tx(tx.WithTx(ctx)))
}

func TestFailTwiceThenClaim(t *testing.T) {
	t.Parallel()
	s := openStore(t)
	ctx := t.Context()
	key := dedup.Key{Consumer: "c", Key: "k"}

	t1 := time.Now().Add(-2 * time.Minute).Truncate(time.Microsecond)
	t2 := time.Now().Add(-time.Minute).Truncate(time.Microsecond)
	require.NoError(t, s.InboxFail(ctx, key, dedup.Failure{Err: "first", At: t1}, window))
	r, ok := readRow(t, s, key)
	require.True(t, ok)
	require.Equal(t, "failed", r.status)
	require.Equal(t, 1, r.attempts)

	require.NoError(t, s.InboxFail(ctx, key, dedup.Failure{Err: "second", At: t2}, window))
	r, _ = readRow(t, s, key)
	require.Equal(t, "failed", r.status)
	require.Equal(t, 2, r.attempts)
	require.Equal(t, "first", r.firstError.String)
	require.Equal(t, "second", r.lastError.String)
	require.Equal(t, t1.UnixMicro(), r.firstFailedAt.Int64)
	require.Equal(t, t2.UnixMicro(), r.lastFailedAt.Int64)
	require.False(t, r.doneAt.Valid)

	c := claim(t, s, key, []byte("ok"), true)
	require.True(t, c.FirstFailedAt.Equal(t1), "the claim reports the first failure: got %s, want %s", c.FirstFailedAt, t1)
	c.FirstFailedAt = time.Time{}
	require.Equal(t, dedup.Claim{State: dedup.StateNew, Attempts: 3}, c)

	r, _ = readRow(t, s, key)
	require.Equal(t, "done", r.status)
	require.Equal(t, 3, r.attempts)
	require.Equal(t, "first", r.firstError.String, "failure history is kept")
	require.Equal(t, "second", r.lastError.String)
	require.Equal(t, []byte("ok"), r.result)
}

func TestFailOnDoneKeyChangesNothing(t *testing.T) {
	t.Parallel()
	s := openStore(t)
	key := dedup.Key{Consumer: "c", Key: "k"}

	claim(t, s, key, []byte("r"), true)
	before, _ := readRow(t, s, key)
	require.NoError(t, s.InboxFail(t.Context(), key, dedup.Failure{Err: "late", At: time.Now()}, 10*window))
	after, _ := readRow(t, s, key)
	require.Equal(t, before, after)
}

func TestConcurrentClaimsApplyOnce(t *testing.T) {
	t.Parallel()
	s := openStore(t)
	ctx := t.Context()
	_, err := s.DB().ExecContext(ctx, `CREATE TABLE effects (id INTEGER PRIMARY KEY, key TEXT NOT NULL)`)
	require.NoError(t, err)

	const n = 50
	key := dedup.Key{Consumer: "c", Key: "same"}
	var (
		wg     sync.WaitGroup
		start  = make(chan struct{})
		states = make([]dedup.State, n)
		errs   = make([]error, n)
	)
	for i := range n {
		wg.Go(func() {
			<-start
			states[i], errs[i] = applyOnce(ctx, s, key)
		})
	}
	close(start)
	wg.Wait()

	news := 0
	for i := range n {
		require.NoError(t, errs[i], "goroutine %d", i)
		switch states[i] {
		case dedup.StateNew:
			news++
		case dedup.StateDone:
		default:
			t.Fatalf("goroutine %d: state %v", i, states[i])
		}
	}
	require.Equal(t, 1, news)
	var effects int
	require.NoError(t, s.DB().QueryRowContext(ctx, `SELECT count(*) FROM effects`).Scan(&effects))
	require.Equal(t, 1, effects)
}

// applyOnce is what the inbox middleware does for one delivery: claim, write
// the effect through the context's transaction, commit.
func applyOnce(ctx context.Context, s *sqlite.Store, key dedup.Key) (dedup.State, error) {
	tx, err := s.InboxBegin(ctx)
	if err != nil {
		return 0, err
	}
	defer tx.Rollback(ctx)
	c, err := tx.InboxClaim(ctx, key, window)
	if err != nil {
		return 0, err
	}
	if c.State == dedup.StateNew {
		hctx := tx.WithTx(ctx)
		if _, err := sqlite.Tx(hctx).ExecContext(hctx, `INSERT INTO effects (key) VALUES (?)`, key.Key); err != nil {
			return 0, fmt.Errorf("effect: %w", err)
		}
		if err := tx.InboxComplete(ctx, key, []byte("done")); err != nil {
			return 0, err
		}
	}
	return c.State, tx.Commit(ctx)
}

func TestDeleteExpiredInBatches(t *testing.T) {
	t.Parallel()
	s := openStore(t)
	ctx := t.Context()

	for i := range 35 {
		key := dedup.Key{Consumer: "c", Key: fmt.Sprintf("old-%d", i)}
		require.NoError(t, s.InboxFail(ctx, key, dedup.Failure{Err: "e"}, -time.Minute))
	}
	for i := range 5 {
		claim(t, s, dedup.Key{Consumer: "c", Key: fmt.Sprintf("live-%d", i)}, nil, true)
	}

	var got []int
	for {
		n, err := s.InboxDeleteExpired(ctx, 10)
		require.NoError(t, err)
		got = append(got, n)
		if n == 0 {
			break
		}
	}
	require.Equal(t, []int{10, 10, 10, 5, 0}, got)

	var live int
	require.NoError(t, s.DB().QueryRowContext(ctx, `SELECT count(*) FROM inbox WHERE key LIKE 'live-%'`).Scan(&live))
	require.Equal(t, 5, live)
	var all int
	require.NoError(t, s.DB().QueryRowContext(ctx, `SELECT count(*) FROM inbox`).Scan(&all))
	require.Equal(t, 5, all)

	_, err := s.InboxDeleteExpired(ctx, 0)
	require.Error(t, err)
}

func TestMigrateTwiceIsNoop(t *testing.T) {
	t.Parallel()
	s := openStore(t) // migrated once by Open
	ctx := t.Context()

	require.NoError(t, sqlschema.MigrateSQLite(ctx, s.DB(), sqlschema.Config{}))
	var versions int
	require.NoError(t, s.DB().QueryRowContext(ctx, `SELECT count(*) FROM oncemill_migrations`).Scan(&versions))
	require.Equal(t, sqliteMigrations(t), versions)

	var index string
	require.NoError(t, s.DB().QueryRowContext(ctx,
		`SELECT name FROM sqlite_master WHERE type = 'index' AND tbl_name = 'inbox' AND name = 'inbox_expires_at_idx'`).Scan(&index))
}

func TestConcurrentMigrators(t *testing.T) {
	t.Parallel()
	path := filepath.Join(t.TempDir(), "inbox.db")

	const n = 8
	var wg sync.WaitGroup
	errs := make([]error, n)
	stores := make([]*sqlite.Store, n)
	for i := range n {
		wg.Go(func() {
			stores[i], errs[i] = sqlite.Open(t.Context(), path, sqlite.Config{})
		})
	}
	wg.Wait()
	for i := range n {
		require.NoError(t, errs[i])
		t.Cleanup(func() { require.NoError(t, stores[i].Close()) })
	}
	var versions int
	require.NoError(t, stores[0].DB().QueryRowContext(t.Context(), `SELECT count(*) FROM oncemill_migrations`).Scan(&versions))
	require.Equal(t, sqliteMigrations(t), versions)
}

func TestCustomTable(t *testing.T) {
	t.Parallel()
	path := filepath.Join(t.TempDir(), "inbox.db")
	s, err := sqlite.Open(t.Context(), path, sqlite.Config{Table: "payments_inbox"})
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, s.Close()) })

	key := dedup.Key{Consumer: "c", Key: "k"}
	require.Equal(t, dedup.StateNew, claim(t, s, key, nil, true).State)
	var n int
	require.NoError(t, s.DB().QueryRowContext(t.Context(), `SELECT count(*) FROM payments_inbox`).Scan(&n))
	require.Equal(t, 1, n)
}

func TestBadTableName(t *testing.T) {
	t.Parallel()
	cfg := sqlite.Config{Table: `inbox"; DROP TABLE x; --`}

	err := cfg.Validate()
	require.ErrorContains(t, err, "Table")

	_, err = sqlite.Open(t.Context(), filepath.Join(t.TempDir(), "x.db"), cfg)
	require.ErrorContains(t, err, "Table")

	db, err := sql.Open("sqlite", filepath.Join(t.TempDir(), "y.db"))
	require.NoError(t, err)
	defer db.Close()
	_, err = sqlite.New(t.Context(), db, cfg)
	require.ErrorContains(t, err, "Table")

	require.NoError(t, sqlite.Config{}.Validate())
}

func TestOpenRejectsMemoryAndURIs(t *testing.T) {
	t.Parallel()
	for _, path := range []string{"", ":memory:", "file:x.db?mode=memory"} {
		_, err := sqlite.Open(t.Context(), path, sqlite.Config{})
		require.Error(t, err, "path %q", path)
	}
}

func TestNewOnUnmigratedDB(t *testing.T) {
	t.Parallel()
	db, err := sql.Open("sqlite", filepath.Join(t.TempDir(), "x.db"))
	require.NoError(t, err)
	defer db.Close()

	_, err = sqlite.New(t.Context(), db, sqlite.Config{})
	require.ErrorIs(t, err, sqlite.ErrNotMigrated)
	require.NoError(t, sqlschema.MigrateSQLite(t.Context(), db, sqlschema.Config{}))
	s, err := sqlite.New(t.Context(), db, sqlite.Config{})
	require.NoError(t, err)

	// Close does not close a caller's database.
	require.NoError(t, s.Close())
	require.NoError(t, db.PingContext(t.Context()))

	require.NoError(t, sqlschema.MigrateSQLite(t.Context(), db, sqlschema.Config{}))
	require.NoError(t, s.InboxFail(t.Context(), dedup.Key{Consumer: "c", Key: "k"}, dedup.Failure{Err: "e"}, window))

	_, err = sqlite.New(t.Context(), nil, sqlite.Config{})
	require.Error(t, err)
}

func TestMigrateSQLiteCanceled(t *testing.T) {
	t.Parallel()
	db, err := sql.Open("sqlite", filepath.Join(t.TempDir(), "x.db"))
	require.NoError(t, err)
	defer db.Close()

	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	require.Error(t, sqlschema.MigrateSQLite(ctx, db, sqlschema.Config{}))
	require.NoError(t, sqlschema.MigrateSQLite(t.Context(), db, sqlschema.Config{}))
}

func TestOpenSettings(t *testing.T) {
	t.Parallel()
	s := openStore(t)
	ctx := t.Context()

	var (
		busy, fk int
		journal  string
	)
	require.NoError(t, s.DB().QueryRowContext(ctx, `PRAGMA busy_timeout`).Scan(&busy))
	require.NoError(t, s.DB().QueryRowContext(ctx, `PRAGMA foreign_keys`).Scan(&fk))
	require.NoError(t, s.DB().QueryRowContext(ctx, `PRAGMA journal_mode`).Scan(&journal))
	require.Equal(t, int(sqlite.BusyTimeout.Milliseconds()), busy)
	require.Equal(t, 1, fk)
	require.Equal(t, "wal", journal)

	// Transactions take the write lock at BEGIN: a second one waits for the
	// first, here until its context ends.
	tx, err := s.InboxBegin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx)
	short, cancel := context.WithTimeout(ctx, 100*time.Millisecond)
	defer cancel()
	_, err = s.InboxBegin(short)
	require.ErrorIs(t, err, context.DeadlineExceeded)
}

// sqliteMigrations is how many versions a migrated SQLite database records.
func sqliteMigrations(t *testing.T) int {
	ms, err := sqlschema.Migrations(sqlschema.SQLite, sqlschema.Config{})
	require.NoError(t, err)
	return len(ms)
}
