package main

import (
	"context"
	"errors"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/internal/testing/sqltest"
	"github.com/oncemill/oncemill/sqlschema"
)

// TestSQLiteFileMistakes: a command that reads a SQLite file leaves an
// empty file as it is and says it is not the consumer's database; one
// that cannot write the file's folder (SQLite's WAL journal needs to,
// even to read) names the file and what to fix; a cancel whose
// --dlq-table does not exist says to correct the flag before it says to
// migrate, and moves nothing.
func TestSQLiteFileMistakes(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()

	empty := filepath.Join(dir, "empty.db")
	require.NoError(t, os.WriteFile(empty, nil, 0o644))
	for _, args := range [][]string{{"retries", "list"}, {"dlq", "list"}} {
		r := oncemill(t, nil, append(args, "--database", "sqlite://"+empty)...)
		require.Equal(t, exitUsage, r.code, r.stderr)
		require.Contains(t, r.stderr, `"`+empty+`" is empty (0 bytes), not the consumer's database file`)
		requireOneLine(t, r.stderr)
		fi, err := os.Stat(empty)
		require.NoError(t, err)
		require.Zero(t, fi.Size(), "the read left the empty file empty")
	}

	path := filepath.Join(dir, "consumer", "app.db")
	require.NoError(t, os.Mkdir(filepath.Dir(path), 0o755))
	db := sqltest.OpenSQLite(t, path)
	require.NoError(t, sqlschema.MigrateSQLite(context.Background(), db, sqlschema.Config{}))
	require.NoError(t, db.Close())

	r := oncemill(t, nil, "retries", "cancel", "--all", "--dlq-table", "nosuch", "--database", "sqlite://"+path)
	require.Equal(t, exitFailure, r.code, r.stderr)
	require.Contains(t, r.stderr, `--dlq-table nosuch: no dead-letter table "nosuch" in the database file: correct --dlq-table`)
	require.Contains(t, r.stderr, "or, if it is right, run the consumer's migrations")
	requireOneLine(t, r.stderr)

	for _, f := range []string{path + "-wal", path + "-shm"} {
		if err := os.Remove(f); !errors.Is(err, fs.ErrNotExist) {
			require.NoError(t, err)
		}
	}
	readOnlyFolder(t, filepath.Dir(path))
	r = oncemill(t, nil, "retries", "list", "--database", "sqlite://"+path)
	require.Equal(t, exitFailure, r.code, r.stderr)
	require.Contains(t, r.stderr, `SQLite file "`+path+`"`)
	require.Contains(t, r.stderr, "the user that runs oncemill must be able to write the file and its folder")
	requireOneLine(t, r.stderr)
}

// readOnlyFolder makes dir read-only for this process until the test
// ends: by its mode, or, for root, whom modes do not stop, by the
// immutable attribute.
func readOnlyFolder(t *testing.T, dir string) {
	t.Helper()
	if os.Geteuid() != 0 {
		require.NoError(t, os.Chmod(dir, 0o555))
		t.Cleanup(func() { require.NoError(t, os.Chmod(dir, 0o755)) })
		return
	}
	if out, err := exec.Command("chattr", "+i", dir).CombinedOutput(); err != nil {
		t.Skipf("running as root, and the folder cannot be made immutable here (chattr +i: %v: %s): nothing makes it read-only for root", err, out)
	}
	t.Cleanup(func() {
		out, err := exec.Command("chattr", "-i", dir).CombinedOutput()
		require.NoError(t, err, "%s", out)
	})
}
