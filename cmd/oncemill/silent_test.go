package main

import (
	"context"
	"os/exec"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"

	"github.com/oncemill/oncemill/internal/testing/netfault"
)

// TestMySQLServerThatNeverAnswers: against a mysql:// server that accepts
// the connection and never answers, "dlq list", "reconcile" and "relay"
// (the built command, as an operator runs it) exit with a failure (for
// reconcile: the check could not be made) that
// says the database did not answer, within the connect bound (10 s by
// default, the URL's timeout when it sets one), as they do on PostgreSQL,
// instead of hanging in the driver's handshake.
func TestMySQLServerThatNeverAnswers(t *testing.T) {
	t.Parallel()
	bin := buildOncemill(t)
	silent := netfault.Silent(t)
	db := "mysql://root:hunter2@" + silent + "/test"
	runs := []struct {
		name  string
		bound time.Duration
		code  int
		args  []string
	}{
		{"dlq list", 15 * time.Second, exitFailure, []string{"dlq", "list", "--database", db}},
		{"dlq list, timeout=3s", 6 * time.Second, exitFailure, []string{"dlq", "list", "--database", db + "?timeout=3s"}},
		{"reconcile", 15 * time.Second, exitCannotCheck, []string{"reconcile", "--consumer", "billing", "--database", db}},
		{"relay", 15 * time.Second, exitFailure, []string{"relay", "--listen", "", "--database", db, "--broker", "amqp://guest:guest@127.0.0.1:5672/"}},
	}
	var wg sync.WaitGroup
	for _, r := range runs {
		wg.Go(func() {
			// Past 45 s the command is hanging: stop it and say so.
			ctx, cancel := context.WithTimeout(context.Background(), 45*time.Second)
			defer cancel()
			began := time.Now()
			out, err := exec.CommandContext(ctx, bin, r.args...).CombinedOutput()
			took := time.Since(began)
			t.Logf("%s: exited after %s: %s", r.name, took.Round(100*time.Millisecond), out)
			if ctx.Err() != nil {
				t.Errorf("%s: still running after %s", r.name, took.Round(time.Second))
				return
			}
			var exit *exec.ExitError
			if assert.ErrorAs(t, err, &exit, r.name) {
				assert.Equal(t, r.code, exit.ExitCode(), r.name)
			}
			if took > r.bound {
				t.Errorf("%s: took %s, want under %s", r.name, took, r.bound)
			}
			assert.Contains(t, string(out), "did not answer", r.name)
			assert.Contains(t, string(out), silent, r.name)
			assert.NotContains(t, string(out), "hunter2", r.name)
		})
	}
	wg.Wait()
}
