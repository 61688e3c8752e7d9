package main

import (
	"context"
	"errors"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/internal/testing/pgtest"
	"github.com/oncemill/oncemill/internal/testing/proctest"
	"github.com/oncemill/oncemill/sqlschema"
)

// inProcessBrokers are broker URLs that name no broker outside the
// command (a template whose ${HOST} was empty): kafka:// and nats:// with
// no host start an embedded broker on a temporary directory.
var inProcessBrokers = []struct{ url, want string }{
	{"kafka://", "kafka:// has no host, which starts an embedded broker that lives and dies with this process: name the brokers, e.g. kafka://broker:9092"},
	{"kafka://?group=billing", "kafka:// has no host"},
	{"nats://?group=x", "nats:// has no host, which starts an embedded broker that lives and dies with this process: name the brokers, e.g. nats://nats:4222"},
}

// runUntilExit runs the built command with args and returns its exit code
// and output once it exits. A command whose output instead comes to hold
// running (it would relay or serve) is killed after a grace of up to ten
// seconds, in which it may do its damage, and reported with code -1.
func runUntilExit(t *testing.T, bin, running string, args ...string) (int, string) {
	t.Helper()
	cmd := exec.Command(bin, args...)
	out := &proctest.Buffer{}
	cmd.Stdout, cmd.Stderr = out, out
	require.NoError(t, cmd.Start())
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	deadline := time.After(2 * time.Minute)
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for {
		select {
		case err := <-done:
			var exit *exec.ExitError
			if errors.As(err, &exit) {
				return exit.ExitCode(), out.String()
			}
			require.NoError(t, err, out.String())
			return 0, out.String()
		case <-tick.C:
			if strings.Contains(out.String(), running) {
				// Let it work on what it was given, then stop it.
				select {
				case <-done:
				case <-time.After(10 * time.Second):
					_ = cmd.Process.Kill()
					<-done
				}
				return -1, out.String()
			}
		case <-deadline:
			_ = cmd.Process.Kill()
			<-done
			require.FailNow(t, "the command neither exited nor ran", out.String())
		}
	}
}

// TestInProcessBrokersRefused: "oncemill relay", "oncemill dlq replay"
// and "oncemill console --broker" given kafka:// or nats:// with no host
// exit 2 with an error that names the missing host and the fix, before
// anything is published: the outbox rows and the dead-letter entries are
// all still there.
func TestInProcessBrokersRefused(t *testing.T) {
	t.Parallel()
	bin := buildOncemill(t)
	ctx := context.Background()

	t.Run("relay", func(t *testing.T) {
		t.Parallel()
		pool := pgtest.Pool(t, 2)
		schema := pgtest.Schema(t, pool)
		require.NoError(t, sqlschema.Migrate(ctx, pool, sqlschema.Config{Schema: schema}))
		outbox := pgx.Identifier{schema, "outbox"}.Sanitize()
		const rows = 2
		_, err := pool.Exec(ctx, `INSERT INTO `+outbox+` (topic, uuid, partition_key, payload, metadata)
			SELECT 'orders', gen_random_uuid()::text, 'k' || i, '{}', '{}' FROM generate_series(1, $1) AS i`, rows)
		require.NoError(t, err)
		count := func() int {
			var n int
			require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM `+outbox).Scan(&n))
			return n
		}
		for _, b := range inProcessBrokers {
			code, out := runUntilExit(t, bin, `msg="oncemill relay running"`, "relay", "--broker", b.url,
				"--database", pgtest.URL(), "--schema", schema, "--lock-ordered-writers", "--listen", "")
			left := count()
			require.Equal(t, rows, left, "%s: outbox rows %d before, %d after; output:\n%s", b.url, rows, left, out)
			require.Equal(t, exitUsage, code, "%s: %s", b.url, out)
			require.Contains(t, out, "oncemill relay: --broker: ")
			require.Contains(t, out, b.want, b.url)
			requireOneLine(t, out)
		}
	})

	t.Run("dlq replay", func(t *testing.T) {
		t.Parallel()
		f := setup(t)
		ids := f.seed(t, dead("orders", "c", "e"), dead("orders", "c", "e"))
		for _, b := range inProcessBrokers {
			code, out := runUntilExit(t, bin, "never printed", "dlq", "replay", "--all", "--broker", b.url,
				"--database", pgtest.URL(), "--schema", f.schema)
			left := f.ids(t)
			require.Equal(t, ids, left, "%s: entries %d before, %d after; output:\n%s", b.url, len(ids), len(left), out)
			require.Equal(t, exitUsage, code, "%s: %s", b.url, out)
			require.Contains(t, out, "oncemill dlq replay: --broker: ")
			require.Contains(t, out, b.want, b.url)
			requireOneLine(t, out)
		}
	})

	t.Run("console", func(t *testing.T) {
		t.Parallel()
		f := setup(t)
		ids := f.seed(t, dead("orders", "c", "e"))
		for _, b := range inProcessBrokers {
			code, out := runUntilExit(t, bin, "oncemill console listening on ", "console", "--broker", b.url,
				"--addr", "127.0.0.1:0", "--token", "a-token-of-16-chars-"+strconv.Itoa(len(b.url)),
				"--database", pgtest.URL(), "--schema", f.schema)
			require.Equal(t, exitUsage, code, "%s: the console must not serve replays to an in-process broker: %s", b.url, out)
			require.Contains(t, out, "oncemill console: --broker: ")
			require.Contains(t, out, b.want, b.url)
			requireOneLine(t, out)
			require.Equal(t, ids, f.ids(t))
		}
	})
}
