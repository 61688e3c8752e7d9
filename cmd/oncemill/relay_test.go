package main

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/dedup/postgres"
	"github.com/oncemill/oncemill/internal/testing/nodetest"
	"github.com/oncemill/oncemill/internal/testing/pgtest"
	"github.com/oncemill/oncemill/internal/testing/proctest"
	"github.com/oncemill/oncemill/middleware"
)

// relayConsumerRole is the Go service downstream of the relay: the
// standard stack (Poison, Inbox on PostgreSQL), whose handler records one
// effect per event in the inbox's transaction. Each handler run is also
// recorded, outside the transaction, in runs.
var relayConsumerRole = proctest.NewRole("relay-consumer", func(cfg proctest.Stack, term <-chan os.Signal) error {
	c := &proctest.Consumer{Stack: cfg, RecordRuns: true, StrictClose: true, Poison: &middleware.PoisonConfig{
		Topic: "dlq", MaxAttempts: 5, InitialBackoff: 20 * time.Millisecond, MaxBackoff: 200 * time.Millisecond,
	}}
	effects := cfg.Table("effects")
	return c.Run(term, func(msg *message.Message) error {
		ctx := msg.Context()
		_, err := postgres.Tx(ctx).Exec(ctx, `INSERT INTO `+effects+` (key) VALUES ($1)`, middleware.IdempotencyKey(ctx))
		return err
	})
})

// relayTables are the Node service's business table and the consumer's
// effects and handler runs, beside oncemill's tables.
const relayTables = `
CREATE TABLE {S}.orders (id text PRIMARY KEY);
CREATE TABLE {S}.effects (key text NOT NULL);
CREATE TABLE {S}.runs (key text NOT NULL, pid integer NOT NULL);`

// buildOncemill builds this command into a directory of the test's own.
func buildOncemill(t *testing.T) string {
	t.Helper()
	goBin, err := exec.LookPath("go")
	require.NoError(t, err, "the go command, to build oncemill")
	bin := filepath.Join(t.TempDir(), "oncemill")
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	out, err := exec.CommandContext(ctx, goBin, "build", "-o", bin, ".").CombinedOutput()
	require.NoError(t, err, "go build: %s", out)
	return bin
}

// writeResult is one transaction of the Node writer.
type writeResult struct {
	ID        string `json:"id"`
	Committed bool   `json:"committed"`
}

// nodeWriter installs testdata/nodewriter (the npm package pg, at the
// version its lock file pins) in a directory of the test's own and
// returns a function that runs its writer: count transactions on schema,
// each an order and its event on topic, every fifth rolled back.
func nodeWriter(t *testing.T) func(schema, topic string, count int) ([]writeResult, error) {
	t.Helper()
	node, dir := nodetest.Install(t, filepath.Join("testdata", "nodewriter"), "writer.js", "the npm package pg")
	return func(schema, topic string, count int) ([]writeResult, error) {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		cmd := exec.CommandContext(ctx, node, "writer.js", pgtest.URL(), schema, topic, fmt.Sprint(count))
		cmd.Dir = dir
		var stderr strings.Builder
		cmd.Stderr = &stderr
		out, err := cmd.Output()
		if err != nil {
			return nil, fmt.Errorf("node writer.js: %w: %s", err, stderr.String())
		}
		var results []writeResult
		sc := bufio.NewScanner(strings.NewReader(string(out)))
		for sc.Scan() {
			var r writeResult
			if err := json.Unmarshal(sc.Bytes(), &r); err != nil {
				return nil, fmt.Errorf("writer output %q: %w", sc.Text(), err)
			}
			results = append(results, r)
		}
		return results, nil
	}
}

// relayProcess is a running "oncemill relay".
type relayProcess struct {
	cmd  *exec.Cmd
	out  *proctest.Buffer
	done chan struct{}
	err  error // Wait's, once done is closed
}

// startRelay runs bin relay with args and waits for its "running" line.
func startRelay(t *testing.T, bin string, env []string, args ...string) *relayProcess {
	t.Helper()
	p := &relayProcess{cmd: exec.Command(bin, append([]string{"relay"}, args...)...), out: &proctest.Buffer{}, done: make(chan struct{})}
	p.cmd.Env = append(os.Environ(), env...)
	p.cmd.Stdout, p.cmd.Stderr = p.out, p.out
	require.NoError(t, p.cmd.Start())
	go func() {
		defer close(p.done)
		p.err = p.cmd.Wait()
	}()
	t.Cleanup(func() {
		_ = p.cmd.Process.Kill()
		<-p.done
	})
	waitFor(t, "the relay runs", func() (bool, string) {
		select {
		case <-p.done:
			require.FailNow(t, "the relay exited before it ran", "%v; output:\n%s", p.err, p.out.String())
		default:
		}
		_, ok := logLine(p.out.String(), "oncemill relay running")
		return ok, p.out.String()
	})
	return p
}

// kill SIGKILLs the relay and waits until it is gone.
func (p *relayProcess) kill() {
	_ = p.cmd.Process.Kill()
	<-p.done
}

// terminate sends SIGTERM and requires the relay to exit 0.
func (p *relayProcess) terminate(t *testing.T) {
	t.Helper()
	require.NoError(t, p.cmd.Process.Signal(syscall.SIGTERM))
	select {
	case <-p.done:
	case <-time.After(time.Minute):
		require.FailNow(t, "the relay still runs a minute after SIGTERM", p.out.String())
	}
	require.NoError(t, p.err, "the relay exits 0 after SIGTERM; output:\n%s", p.out.String())
	_, stopped := logLine(p.out.String(), "oncemill relay stopped")
	require.True(t, stopped, "the relay says it stopped; output:\n%s", p.out.String())
}

// waitFor polls cond until it holds, for up to two minutes; what it
// returns second describes the state for the failure.
func waitFor(t *testing.T, what string, cond func() (bool, string)) {
	t.Helper()
	deadline := time.Now().Add(2 * time.Minute)
	for {
		ok, state := cond()
		if ok {
			return
		}
		if time.Now().After(deadline) {
			require.FailNow(t, "timed out waiting: "+what, state)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestRelayNodeWriter: a Node.js service writes orders and their events
// to the outbox with the npm package pg, one transaction each, and rolls
// every fifth back; "oncemill relay" runs as a process of its own into
// RabbitMQ, then Kafka, and is SIGKILLed while it relays and started
// again; a Go consumer (router, Poison, Inbox on PostgreSQL) records one
// effect per event. Every committed event has exactly one effect, no
// rolled-back one reached the handler, and the outbox ends empty.
func TestRelayNodeWriter(t *testing.T) {
	t.Parallel()
	write := nodeWriter(t)
	bin := buildOncemill(t)
	const count = 300

	cases := []struct {
		name string
		// broker returns the URL of the broker and a topic of its own,
		// consumed by group, ready for the relay's first publish.
		broker func(t *testing.T, group string) (url, topic string)
	}{
		{"rabbitmq", func(t *testing.T, group string) (string, string) {
			r := newRabbit(t)
			topic := r.topic("relay", "$."+group)
			// RabbitMQ drops a publish to an exchange with no queue bound:
			// the consumer's queue is declared before the relay runs.
			d := oncemill(t, nil, "amqp", "declare", "--topic", topic, "--group", group, "--url", r.url)
			require.Equal(t, exitOK, d.code, d.stderr)
			return r.url, topic
		}},
		{"kafka", func(t *testing.T, _ string) (string, string) {
			return "kafka://" + strings.Join(proctest.StartKafka(t), ","), "orders-" + pgtest.Name(t)
		}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			db := proctest.NewDB(t, relayTables)
			const group = "billing"
			brokerURL, topic := tc.broker(t, group)
			consumer := relayConsumerRole.Start(t, db.Stack(brokerURL, group, topic, "billing"))

			written := make(chan []writeResult, 1)
			writeErr := make(chan error, 1)
			go func() {
				res, err := write(db.Schema, topic, count)
				writeErr <- err
				written <- res
			}()

			args := []string{"--database", pgtest.URL(), "--schema", db.Schema, "--listen", "",
				"--batch-size", "10", "--lanes-per-batch", "4", "--poll-interval", "20ms",
				// Each transaction locks its order's row before it inserts
				// the event: lock-ordered. The relay then waits for no
				// transaction open elsewhere on the server.
				"--lock-ordered-writers"}
			env := []string{"BROKER_URL=" + brokerURL}
			relay := startRelay(t, bin, env, args...)
			// Killed while rows flow, twice, and started again each time:
			// a batch the kill cut short stays in the outbox and goes out
			// again, and the inbox absorbs what had reached the broker.
			for kill := 1; kill <= 2; kill++ {
				waitFor(t, fmt.Sprintf("effects before kill %d", kill), func() (bool, string) {
					n := db.Count(t, `SELECT count(*) FROM {S}.effects`)
					return n >= kill*count/10, fmt.Sprintf("%d effects; relay output:\n%s", n, relay.out.String())
				})
				relay.kill()
				t.Logf("relay killed with %d rows in the outbox", db.Count(t, `SELECT count(*) FROM {S}.outbox`))
				relay = startRelay(t, bin, env, args...)
			}
			// Then stopped as an orchestrator stops it, and started again:
			// the batch in flight finishes, the relay exits 0.
			waitFor(t, "effects before SIGTERM", func() (bool, string) {
				n := db.Count(t, `SELECT count(*) FROM {S}.effects`)
				return n >= 3*count/10, fmt.Sprintf("%d effects; relay output:\n%s", n, relay.out.String())
			})
			relay.terminate(t)
			relay = startRelay(t, bin, env, args...)

			require.NoError(t, <-writeErr)
			results := <-written
			require.Len(t, results, count)
			var committed, rolledBack []string
			for _, r := range results {
				if r.Committed {
					committed = append(committed, r.ID)
				} else {
					rolledBack = append(rolledBack, r.ID)
				}
			}
			require.NotEmpty(t, rolledBack, "the writer rolls some transactions back")
			require.ElementsMatch(t, committed, ids(t, db, `SELECT id FROM {S}.orders`), "the business rows are the committed ones")

			waitFor(t, "every committed event applied and the outbox empty", func() (bool, string) {
				applied := db.Count(t, `SELECT count(DISTINCT key) FROM {S}.effects`)
				left := db.Count(t, `SELECT count(*) FROM {S}.outbox`)
				return applied == len(committed) && left == 0,
					fmt.Sprintf("%d of %d applied, %d rows in the outbox; relay output:\n%s", applied, len(committed), left, relay.out.String())
			})
			relay.terminate(t)
			stats := consumer.Stop(t, time.Minute)
			t.Logf("consumer: %+v", stats)

			require.Zero(t, db.Count(t, `SELECT count(*) FROM {S}.outbox`), "the outbox ends empty")
			require.Zero(t, db.Count(t, `SELECT count(*) FROM (SELECT key FROM {S}.effects GROUP BY key HAVING count(*) > 1) d`),
				"every event applied once")
			require.ElementsMatch(t, committed, ids(t, db, `SELECT key FROM {S}.effects`), "the effects are the committed events'")
			require.Zero(t, db.Count(t, `SELECT count(*) FROM {S}.runs WHERE key = ANY($1)`, rolledBack),
				"no rolled-back event reached the handler")
			require.Zero(t, db.Count(t, `SELECT count(*) FROM {S}.dlq`), "nothing dead-lettered")
		})
	}
}

// ids runs query, which returns one text column.
func ids(t *testing.T, db *proctest.DB, query string) []string {
	t.Helper()
	rows, err := db.Pool.Query(context.Background(), db.Q(query))
	require.NoError(t, err)
	out, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	return out
}

// TestRelayHealthMetricsAndDrain: without --migrate the relay refuses a
// schema with no outbox table, naming it; with it, it creates the table,
// relays rows into RabbitMQ, answers /healthz and /metrics with the
// oncemill_outbox_ series, and exits 0 on SIGTERM with the outbox empty.
func TestRelayHealthMetricsAndDrain(t *testing.T) {
	t.Parallel()
	bin := buildOncemill(t)
	pool := pgtest.Pool(t, 2)
	schema := pgtest.Name(t)
	t.Cleanup(func() {
		_, err := pool.Exec(context.Background(), `DROP SCHEMA IF EXISTS `+pgx.Identifier{schema}.Sanitize()+` CASCADE`)
		require.NoError(t, err)
	})
	r := newRabbit(t)
	topic := r.topic("relay", "$.audit")
	d := oncemill(t, nil, "amqp", "declare", "--topic", topic, "--group", "audit", "--url", r.url)
	require.Equal(t, exitOK, d.code, d.stderr)

	// No table and no --migrate: a clear error naming the table, exit 1.
	out, err := exec.Command(bin, "relay", "--database", pgtest.URL(), "--broker", r.url, "--schema", schema, "--listen", "").CombinedOutput()
	var exit *exec.ExitError
	require.ErrorAs(t, err, &exit, "%s", out)
	require.Equal(t, exitFailure, exit.ExitCode(), "%s", out)
	require.Contains(t, string(out), `"`+schema+`"."outbox" does not exist`)
	require.Contains(t, string(out), "--migrate")

	// The schema and the HTTP address from the environment, --migrate by flag.
	relay := startRelay(t, bin, []string{"DATABASE_URL=" + pgtest.URL(), "BROKER_URL=" + r.url,
		"ONCEMILL_RELAY_SCHEMA=" + schema, "ONCEMILL_RELAY_LISTEN=127.0.0.1:0",
		// One transaction writes all the rows below: lock-ordered.
		"ONCEMILL_RELAY_LOCK_ORDERED_WRITERS=true"}, "--migrate")
	attrs, ok := logLine(relay.out.String(), "oncemill relay serving /healthz and /metrics")
	require.True(t, ok, relay.out.String())
	base := strings.TrimSuffix(attrs["url"], "/")

	outbox := pgx.Identifier{schema, "outbox"}.Sanitize()
	const rows = 20
	_, err = pool.Exec(context.Background(), `INSERT INTO `+outbox+` (topic, uuid, partition_key, payload, metadata)
		SELECT $1, gen_random_uuid()::text, 'k' || i, '{}', jsonb_build_object('idempotency_key', 'k' || i)
		FROM generate_series(1, $2) AS i`, topic, rows)
	require.NoError(t, err)

	waitFor(t, "the rows in the queue", func() (bool, string) {
		n := r.ready(topic + ".audit")
		return n == rows, fmt.Sprintf("%d of %d in the queue; relay output:\n%s", n, rows, relay.out.String())
	})
	var left int
	require.NoError(t, pool.QueryRow(context.Background(), `SELECT count(*) FROM `+outbox).Scan(&left))
	require.Zero(t, left, "the relayed rows are deleted")

	code, body := httpGet(t, base+"/healthz")
	require.Equal(t, http.StatusOK, code, body)
	waitFor(t, "the relayed rows in /metrics", func() (bool, string) {
		_, body := httpGet(t, base+"/metrics")
		want := fmt.Sprintf(`oncemill_outbox_published_total{outbox="%s.outbox"} %d`, schema, rows)
		return strings.Contains(body, want), body
	})

	relay.terminate(t)
	require.NoError(t, pool.QueryRow(context.Background(), `SELECT count(*) FROM `+outbox).Scan(&left))
	require.Zero(t, left)
	require.Equal(t, rows, r.ready(topic+".audit"), "each row published once")
}

// httpGet fetches url and returns the status and the body. The
// connection is not kept: no client goroutine outlives the request.
func httpGet(t *testing.T, url string) (int, string) {
	t.Helper()
	req, err := http.NewRequest(http.MethodGet, url, nil)
	require.NoError(t, err)
	req.Close = true
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return resp.StatusCode, string(b)
}

// TestRelayHealthzAndHelp: /healthz answers 503, with the
// reason, while the relay does not run or its database does not answer;
// the help names the variables and says that copies may run at once.
func TestRelayHealthzAndHelp(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t, 1)
	for _, tc := range []struct {
		name    string
		running bool
		db      func() database
		code    int
		body    string
	}{
		{"running", true, func() database { return database{Pool: pool} }, http.StatusOK, "ok"},
		{"stopped", false, func() database { return database{Pool: pool} }, http.StatusServiceUnavailable, "relay not running"},
		{"database gone", true, func() database {
			gone, err := pgxpool.New(context.Background(), pgtest.URL())
			require.NoError(t, err)
			gone.Close()
			return database{Pool: gone}
		}, http.StatusServiceUnavailable, "database unreachable: "},
	} {
		w := httptest.NewRecorder()
		relayHealth(w, httptest.NewRequest(http.MethodGet, "/healthz", nil), tc.running, tc.db())
		require.Equal(t, tc.code, w.Code, tc.name)
		require.Contains(t, w.Body.String(), tc.body, tc.name)
	}
	help := oncemill(t, nil, "relay", "--help")
	require.Equal(t, exitOK, help.code)
	for _, want := range []string{"$DATABASE_URL", "$BROKER_URL", "$ONCEMILL_RELAY_BATCH_SIZE", "Several copies may run at once", "--drain-timeout"} {
		require.Contains(t, help.stdout, want)
	}
}

// TestRelayUsageErrors: the relay's command line and variables are
// checked before anything connects; errors name the flag, or the
// variable that set it, and a flag beats its variable.
func TestRelayUsageErrors(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		args []string
		env  map[string]string
		want string
	}{
		{nil, map[string]string{"DATABASE_URL": pgtest.URL()}, "--broker is required (or set BROKER_URL)"},
		{[]string{"--broker", "amqp://127.0.0.1:1/"}, nil, "--database is required (or set DATABASE_URL)"},
		{[]string{"--batch-size", "0"}, map[string]string{"BROKER_URL": "amqp://127.0.0.1:1/"}, "--batch-size must be 1 to 10000, got 0"},
		{nil, map[string]string{"BROKER_URL": "amqp://127.0.0.1:1/", "ONCEMILL_RELAY_LANES_PER_BATCH": "65"},
			"$ONCEMILL_RELAY_LANES_PER_BATCH (--lanes-per-batch) must be 1 to 64, got 65"},
		{nil, map[string]string{"BROKER_URL": "amqp://127.0.0.1:1/", "ONCEMILL_RELAY_POLL_INTERVAL": "soon"},
			`$ONCEMILL_RELAY_POLL_INTERVAL="soon" (--poll-interval) is not valid: want a duration such as 500ms, 30s or 5m`},
		{nil, map[string]string{"BROKER_URL": "amqp://127.0.0.1:1/", "ONCEMILL_RELAY_BATCH_SIZE": "abc"},
			`$ONCEMILL_RELAY_BATCH_SIZE="abc" (--batch-size) is not valid: want a whole number, like 500 (the default)`},
		{nil, map[string]string{"BROKER_URL": "amqp://127.0.0.1:1/", "ONCEMILL_RELAY_LOCK_ORDERED_WRITERS": "maybe"},
			`$ONCEMILL_RELAY_LOCK_ORDERED_WRITERS="maybe" (--lock-ordered-writers) is not valid: want true or false`},
		// The flag beats its variable, which is then not even read.
		{[]string{"--drain-timeout", "0s"}, map[string]string{"BROKER_URL": "amqp://127.0.0.1:1/", "ONCEMILL_RELAY_DRAIN_TIMEOUT": "bad"},
			"--drain-timeout must be positive, got 0s"},
		{[]string{"--listen", "nowhere"}, map[string]string{"BROKER_URL": "amqp://127.0.0.1:1/"}, `--listen "nowhere" is not host:port`},
		{[]string{"--broker", "gochannel://"}, nil, "--broker: adapters: not a durable destination: gochannel:// lives inside this process"},
		{[]string{"--schema", "bad name", "--broker", "amqp://127.0.0.1:1/", "--database", pgtest.URL()}, nil, "--schema"},
		{[]string{"extra"}, nil, `unexpected argument "extra"`},
	} {
		r := oncemill(t, tc.env, append([]string{"relay"}, tc.args...)...)
		require.Equal(t, exitUsage, r.code, "%v %v: %s", tc.args, tc.env, r.stderr)
		require.Contains(t, r.stderr, tc.want, "%v %v", tc.args, tc.env)
		requireOneLine(t, r.stderr)
	}
}

// logLine finds in out the first line of slog's text format whose msg is
// msg, and returns its attributes; every line of the relay is one.
func logLine(out, msg string) (map[string]string, bool) {
	for _, line := range strings.Split(out, "\n") {
		attrs, ok := slogText(line)
		if ok && attrs["msg"] == msg {
			return attrs, true
		}
	}
	return nil, false
}

// slogText reads a line that slog.TextHandler wrote: key=value pairs
// separated by one space, a value quoted (strconv.Quote) when it must be,
// time, level and msg among them. It reports false for any other line.
func slogText(line string) (map[string]string, bool) {
	attrs := map[string]string{}
	for rest := line; rest != ""; {
		key, after, ok := strings.Cut(rest, "=")
		if !ok || key == "" || strings.ContainsAny(key, " \"") {
			return nil, false
		}
		var value string
		if strings.HasPrefix(after, `"`) {
			quoted, err := strconv.QuotedPrefix(after)
			if err != nil {
				return nil, false
			}
			value, _ = strconv.Unquote(quoted)
			after = after[len(quoted):]
		} else if i := strings.IndexByte(after, ' '); i >= 0 {
			value, after = after[:i], after[i:]
		} else {
			value, after = after, ""
		}
		attrs[key] = value
		if after == "" {
			break
		}
		if rest, ok = strings.CutPrefix(after, " "); !ok || rest == "" {
			return nil, false
		}
	}
	_, hasTime := attrs["time"]
	_, hasLevel := attrs["level"]
	_, hasMsg := attrs["msg"]
	return attrs, hasTime && hasLevel && hasMsg
}

// TestRelayLogsOneFormat: everything the relay writes, from its start to
// its stop on SIGTERM, is one slog text line each, its own lines and the
// broker adapter's alike ("Connected to AMQP"), as a consumer's slog
// lines are: it used to mix Watermill's standard-library lines on
// standard error with plain lines of its own on standard output.
func TestRelayLogsOneFormat(t *testing.T) {
	t.Parallel()
	bin := buildOncemill(t)
	r := newRabbit(t)
	pool := pgtest.Pool(t, 1)
	schema := pgtest.Schema(t, pool)
	relay := startRelay(t, bin, nil, "--database", pgtest.URL(), "--broker", r.url, "--schema", schema, "--migrate", "--listen", "127.0.0.1:0")
	relay.terminate(t)
	out := relay.out.String()
	lines := strings.Split(strings.TrimSuffix(out, "\n"), "\n")
	for _, line := range lines {
		_, ok := slogText(line)
		require.True(t, ok, "not a slog text line: %q; output:\n%s", line, out)
	}
	running, ok := logLine(out, "oncemill relay running")
	require.True(t, ok, out)
	require.Equal(t, schema+".outbox", running["outbox"])
	require.Equal(t, "INFO", running["level"])
	_, ok = logLine(out, "Connected to AMQP")
	require.True(t, ok, "the adapter's lines go through the same logger: %s", out)
	_, ok = logLine(out, "oncemill relay serving /healthz and /metrics")
	require.True(t, ok, out)
}
