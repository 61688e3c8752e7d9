// Package nodetest installs the Node.js programs of the tests that check
// oncemill from another runtime: a directory under testdata holding
// package.json, package-lock.json and the program, installed with npm ci
// at the versions its lock file pins.
package nodetest

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/internal/testing/pgtest"
)

// Install copies package.json, package-lock.json and program from src to
// a directory of the test's own, runs npm ci there and returns the node
// binary and that directory. Without node, npm or the packages it fails
// the test under CI and skips it elsewhere; what names the packages in
// that message.
func Install(t testing.TB, src, program, what string) (node, dir string) {
	t.Helper()
	node, err := exec.LookPath("node")
	if err != nil {
		pgtest.Unavailable(t, "node", fmt.Errorf("not installed (Debian package nodejs, Node 20 or newer): %w", err))
	}
	npm, err := exec.LookPath("npm")
	if err != nil {
		pgtest.Unavailable(t, "npm", fmt.Errorf("not installed (Debian package npm): %w", err))
	}
	dir = t.TempDir()
	for _, f := range []string{"package.json", "package-lock.json", program} {
		b, err := os.ReadFile(filepath.Join(src, f))
		require.NoError(t, err)
		require.NoError(t, os.WriteFile(filepath.Join(dir, f), b, 0o644))
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	install := exec.CommandContext(ctx, npm, "ci", "--no-audit", "--no-fund", "--loglevel=error")
	install.Dir = dir
	if out, err := install.CombinedOutput(); err != nil {
		pgtest.Unavailable(t, what+" (npm ci)", fmt.Errorf("%w: %s", err, out))
	}
	return node, dir
}
