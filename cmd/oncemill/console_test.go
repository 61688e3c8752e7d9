package main

import (
	"context"
	"io"
	"net"
	"net/http"
	"net/url"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/oncemill/oncemill/internal/testing/proctest"

	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/internal/testing/pgtest"
	"github.com/oncemill/oncemill/reconcile"
	"github.com/oncemill/oncemill/sqlschema"
)

// consoleRun is "oncemill console" running in the background.
type consoleRun struct {
	url    string // base URL, ending in "/"
	stdout *proctest.Buffer
	stderr *proctest.Buffer
	cancel context.CancelFunc
	done   chan int
}

var listeningLine = regexp.MustCompile(`oncemill console listening on (http://\S+/)`)

// startConsole runs "oncemill console args..." until the test stops it
// (or ends), and waits until it listens.
func startConsole(t *testing.T, env map[string]string, args ...string) *consoleRun {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	r := &consoleRun{stdout: &proctest.Buffer{}, stderr: &proctest.Buffer{}, cancel: cancel, done: make(chan int, 1)}
	go func() {
		r.done <- run(ctx, append([]string{"console"}, args...), func(k string) string { return env[k] }, r.stdout, r.stderr)
	}()
	t.Cleanup(func() {
		cancel()
		select {
		case <-r.done:
		case <-time.After(30 * time.Second):
			t.Errorf("oncemill console did not stop within 30s of its cancellation")
		}
	})
	deadline := time.Now().Add(20 * time.Second)
	for {
		if m := listeningLine.FindStringSubmatch(r.stdout.String()); m != nil {
			r.url = m[1]
			return r
		}
		select {
		case code := <-r.done:
			r.done <- code
			t.Fatalf("oncemill console exited with %d before listening; stdout %q, stderr %q", code, r.stdout, r.stderr)
		case <-time.After(20 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			t.Fatalf("oncemill console not listening after 20s; stdout %q, stderr %q", r.stdout, r.stderr)
		}
	}
}

// stop cancels the command's context, as SIGINT does, and returns its exit
// status.
func (r *consoleRun) stop(t *testing.T) int {
	t.Helper()
	r.cancel()
	select {
	case code := <-r.done:
		r.done <- code // for the cleanup
		return code
	case <-time.After(30 * time.Second):
		t.Fatalf("oncemill console did not stop within 30s of its cancellation")
		return -1
	}
}

// consoleClient keeps no idle connections, so that nothing outlives the
// test.
var consoleClient = &http.Client{
	Transport: &http.Transport{DisableKeepAlives: true},
	Timeout:   20 * time.Second,
	CheckRedirect: func(*http.Request, []*http.Request) error {
		return http.ErrUseLastResponse
	},
}

// get requests path (without the leading "/") with the token, if any, and
// returns the status and the body.
func get(t *testing.T, base, path, token string) (int, string) {
	t.Helper()
	req, err := http.NewRequest(http.MethodGet, base+path, nil)
	require.NoError(t, err)
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	resp, err := consoleClient.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return resp.StatusCode, string(body)
}

// post submits form to path with the token and the CSRF token the console
// gives a GET of path "" with it, and returns the status and the body.
func post(t *testing.T, base, path, token string, form url.Values) (int, string) {
	t.Helper()
	req, err := http.NewRequest(http.MethodGet, base, nil)
	require.NoError(t, err)
	req.Header.Set("Authorization", "Bearer "+token)
	resp, err := consoleClient.Do(req)
	require.NoError(t, err)
	resp.Body.Close()
	csrf := resp.Header.Get("X-CSRF-Token")
	require.NotEmpty(t, csrf, "an authenticated page carries the session's CSRF token")

	form.Set("csrf", csrf)
	req, err = http.NewRequest(http.MethodPost, base+path, strings.NewReader(form.Encode()))
	require.NoError(t, err)
	req.Header.Set("Authorization", "Bearer "+token)
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	resp, err = consoleClient.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return resp.StatusCode, string(body)
}

func TestConsoleUsageErrors(t *testing.T) {
	t.Parallel()
	// Never contacted: usage errors are found before connecting.
	const db = "postgres://postgres@127.0.0.1:1/never"
	for _, tc := range []struct {
		env  map[string]string
		args []string
		want string
	}{
		{nil, []string{"--addr", "8080", "--database", db}, `--addr "8080" is not host:port`},
		{nil, []string{"--addr", "127.0.0.1:http", "--database", db}, `port "http" is not a number`},
		{nil, []string{"--addr", "127.0.0.1:65536", "--database", db}, `port "65536" is not a number from 0 to 65535`},
		{nil, []string{"--addr", "", "--database", db}, `--addr "" is not host:port`},
		{nil, []string{"serve", "--database", db}, `unexpected argument "serve": console takes only flags`},
		{nil, []string{"--bogus", "--database", db}, "oncemill console: flag provided but not defined: -bogus"},
		{nil, []string{"--json", "--database", db}, "flag provided but not defined: -json"},
		{nil, []string{"--token", "hunter2", "--database", db}, "--token (or $ONCEMILL_CONSOLE_TOKEN) must be at least 16 characters, got 7"},
		{map[string]string{"ONCEMILL_CONSOLE_TOKEN": "short"}, []string{"--database", db}, "must be at least 16 characters, got 5"},
		{nil, []string{"--token", "sixteen chars or more", "--database", db}, "must be printable ASCII without spaces"},
		{nil, []string{"--read-only", "--broker", "kafka://127.0.0.1:1", "--database", db}, "--read-only replays nothing: drop --broker"},
		{nil, []string{"--broker", "gochannel://", "--database", db}, "--broker: adapters: not a durable destination: gochannel:// lives inside this process"},
		{nil, []string{"--schema", "Billing", "--database", db}, `--schema "Billing" is not a valid identifier`},
		{nil, []string{"--table", "dead-letters", "--database", db}, `--table "dead-letters" is not a valid identifier`},
		{nil, []string{"--inbox-table", "in box", "--database", db}, `--inbox-table "in box" is not a valid identifier`},
		{nil, []string{"--outbox-table", "Out", "--database", db}, `--outbox-table "Out" is not a valid identifier`},
		{nil, nil, "--database is required (or set DATABASE_URL)"},
		{nil, []string{"--database", "postgres://h:notaport/db"}, "--database: "},
		{nil, []string{"--reconcile", "=orders", "--database", db}, `flag -reconcile: "=orders" names no consumer`},
		{nil, []string{"--reconcile", "charge=orders,", "--database", db}, `"charge=orders," holds an empty topic`},
		{nil, []string{"--reconcile", "charge", "--reconcile-since", "1m", "--database", db}, "--reconcile-since (1m0s) must be longer than --reconcile-grace (5m0s)"},
	} {
		r := oncemill(t, tc.env, append([]string{"console"}, tc.args...)...)
		require.Equal(t, exitUsage, r.code, "%v: %s", tc.args, r.stderr)
		require.Contains(t, r.stderr, tc.want, tc.args)
		require.True(t, strings.HasPrefix(r.stderr, "oncemill console: "), r.stderr)
		requireOneLine(t, r.stderr)
		require.Empty(t, r.stdout, tc.args)
	}
}

func TestConsoleHelp(t *testing.T) {
	t.Parallel()
	for _, args := range [][]string{{"console", "--help"}, {"console", "-h", "--addr", "x"}} {
		r := oncemill(t, nil, args...)
		require.Equal(t, exitOK, r.code, args)
		require.Contains(t, r.stdout, "Usage: oncemill console [--addr HOST:PORT] [--token T] [--read-only] [--broker URL]", args)
		require.Empty(t, r.stderr, args)
	}
	r := oncemill(t, nil, "frobnicate")
	require.Contains(t, r.stderr, "(want dlq, retries, amqp, console, publish, relay or reconcile)")
}

// consoleOptionsOf parses a console command line without running it.
func consoleOptionsOf(t *testing.T, env map[string]string, args ...string) consoleOptions {
	t.Helper()
	c := &cmd{name: "oncemill console", env: func(k string) string { return env[k] }, now: time.Now()}
	o, err := c.consoleOptions(args)
	require.NoError(t, err)
	return o
}

func TestConsoleOptions(t *testing.T) {
	t.Parallel()
	const db = "postgres://postgres@127.0.0.1:1/never"
	env := map[string]string{"ONCEMILL_CONSOLE_TOKEN": "token-from-the-environment"}

	o := consoleOptionsOf(t, env, "--database", db, "--token", "token-from-the-flag-0001")
	require.Equal(t, "token-from-the-flag-0001", o.token, "the flag wins over the environment")
	require.False(t, o.minted)

	o = consoleOptionsOf(t, env, "--database", db)
	require.Equal(t, "token-from-the-environment", o.token)
	require.False(t, o.minted)
	require.Equal(t, defaultConsoleAddr, o.addr)
	require.False(t, o.readOnly)
	require.False(t, o.config(database{}, nil, nil, nil).ReadOnly)

	o = consoleOptionsOf(t, nil, "--database", db)
	require.True(t, o.minted, "neither flag nor environment: generated")
	require.Regexp(t, `^[0-9a-f]{64}$`, o.token, "32 random bytes in hex")
	require.NotEqual(t, o.token, consoleOptionsOf(t, nil, "--database", db).token, "a fresh token each run")

	o = consoleOptionsOf(t, env, "--read-only", "--addr", "0.0.0.0:9999", "--schema", "ops", "--table", "dead", "--inbox-table", "in", "--outbox-table", "out",
		"--retry-table", "parked", "--database", db)
	require.True(t, o.readOnly)
	require.Equal(t, "0.0.0.0:9999", o.addr)
	cfg := o.config(database{}, nil, nil, nil)
	require.True(t, cfg.ReadOnly, "--read-only reaches the console")
	require.Equal(t, "token-from-the-environment", cfg.Token)
	require.Nil(t, cfg.Publisher, "no --broker: replays go to the consumers")
	require.Equal(t, sqlschema.Config{Schema: "ops", DLQTable: "dead", InboxTable: "in", OutboxTable: "out", RetryTable: "parked"}, cfg.Schema)
	require.False(t, cfg.DisableAuth)

	require.Empty(t, cfg.Reconcile, "no --reconcile: no checks")

	o = consoleOptionsOf(t, env, "--database", db, "--reconcile", "charge=orders.created, orders.paid", "--reconcile", "ship", "--reconcile-since", "2h")
	require.Equal(t, []reconcile.Config{
		{Consumer: "charge", Topics: []string{"orders.created", "orders.paid"}, Grace: reconcile.DefaultGrace, Since: 2 * time.Hour},
		{Consumer: "ship", Grace: reconcile.DefaultGrace, Since: 2 * time.Hour},
	}, o.config(database{}, nil, nil, nil).Reconcile)

	o = consoleOptionsOf(t, map[string]string{"DATABASE_URL": db}, "--broker", "kafka://127.0.0.1:1")
	require.Equal(t, "kafka://127.0.0.1:1", o.broker)
	o = consoleOptionsOf(t, map[string]string{"DATABASE_URL": db, "BROKER_URL": "kafka://127.0.0.1:1"})
	require.Empty(t, o.broker, "$BROKER_URL does not turn on replays to the topic: only --broker does")
}

// TestConsole runs the console against a real table: it prints the token
// it generated, refuses requests without it, lists the dead letters with
// it, and stops, closing its port, when its context is cancelled.
func TestConsole(t *testing.T) {
	t.Parallel()
	f := setup(t)
	ids := f.seed(t,
		dead("payments", "billing", "card declined for order 1234"),
		dead("payments", "billing", "card declined for order 5678"),
		dead("shipments", "labels", "carrier timeout after 30s"))

	r := startConsole(t, nil, "--addr", "127.0.0.1:0", "--database", pgtest.URL(), "--schema", f.schema)
	require.NotContains(t, r.stdout.String(), "(read-only)")
	m := regexp.MustCompile(`(?m)^console token: ([0-9a-f]{64})$`).FindStringSubmatch(r.stdout.String())
	require.NotNil(t, m, "the generated token is printed: %q", r.stdout)
	token := m[1]
	require.Contains(t, r.stdout.String(), "open "+r.url+"login")
	require.Equal(t, 1, strings.Count(r.stdout.String(), token), "printed once")
	require.Empty(t, r.stderr.String(), "loopback: no warning")

	code, _ := get(t, r.url, "", "")
	require.Equal(t, http.StatusSeeOther, code, "the console's address with no token leads to the login page")
	code, body := get(t, r.url, "login", "")
	require.Equal(t, http.StatusOK, code)
	require.Contains(t, body, `id="login-form"`)
	code, _ = get(t, r.url, "dlq", "")
	require.Equal(t, http.StatusUnauthorized, code, "no token")
	code, _ = get(t, r.url, "", strings.Repeat("0", 64))
	require.Equal(t, http.StatusUnauthorized, code, "a wrong token")
	code, body = get(t, r.url, "", token)
	require.Equal(t, http.StatusOK, code, body)
	require.Contains(t, body, `id="overview-dlq"`)
	for _, text := range []string{"billing", "payments", "labels", "shipments", "card declined for order &lt;n&gt;"} {
		require.Contains(t, body, text, "the overview counts the dead letters by consumer, topic and error")
	}
	code, body = get(t, r.url, "dlq", token)
	require.Equal(t, http.StatusOK, code, body)
	for _, text := range []string{"card declined for order 1234", "card declined for order 5678", "carrier timeout after 30s", "billing", "labels"} {
		require.Contains(t, body, text)
	}
	require.Len(t, f.ids(t), len(ids), "looking changes nothing")

	host := strings.TrimSuffix(strings.TrimPrefix(r.url, "http://"), "/")
	require.Equal(t, exitOK, r.stop(t), "stderr: %s", r.stderr)
	require.Contains(t, r.stdout.String(), "oncemill console stopped")
	conn, err := net.DialTimeout("tcp", host, 2*time.Second)
	if err == nil {
		conn.Close()
	}
	require.Error(t, err, "the port is closed once the command returned")
}

// TestConsoleReadOnly: --read-only is announced and reaches the console,
// which refuses to purge; a token given is not printed.
func TestConsoleReadOnly(t *testing.T) {
	t.Parallel()
	f := setup(t)
	ids := f.seed(t, dead("payments", "billing", "card declined"))
	const token = "read-only-console-token"
	r := startConsole(t, map[string]string{"ONCEMILL_CONSOLE_TOKEN": token}, "--addr", "127.0.0.1:0", "--read-only",
		"--database", pgtest.URL(), "--schema", f.schema)
	require.Contains(t, r.stdout.String(), r.url+" (read-only)")
	require.NotContains(t, r.stdout.String(), token, "a token the operator chose is not printed")
	require.NotContains(t, r.stdout.String(), "console token:")

	code, body := get(t, r.url, "dlq", token)
	require.Equal(t, http.StatusOK, code, body)
	require.Contains(t, body, "card declined")

	form := url.Values{"action": {"purge"}, "scope": {"entry"}, "id": {strconv.FormatInt(ids[0], 10)}}
	code, body = post(t, r.url, "dlq/confirm", token, form)
	require.Equal(t, http.StatusForbidden, code, body)
	require.Contains(t, body, "read-only")
	form.Set("confirm", "1")
	form.Set("ids", strconv.FormatInt(ids[0], 10))
	code, body = post(t, r.url, "dlq/confirm", token, form)
	require.Equal(t, http.StatusForbidden, code, body)
	require.Equal(t, ids, f.ids(t), "nothing purged")
	require.Equal(t, exitOK, r.stop(t), "stderr: %s", r.stderr)
}

// TestConsoleRuntimeErrors: an unreachable database and a port in use fail
// with status 1, in one line.
func TestConsoleRuntimeErrors(t *testing.T) {
	t.Parallel()
	f := setup(t)
	r := oncemill(t, nil, "console", "--addr", "127.0.0.1:0", "--database", "postgres://postgres:hunter2@127.0.0.1:1/x?connect_timeout=5")
	require.Equal(t, exitFailure, r.code, r.stderr)
	require.Contains(t, r.stderr, "oncemill console: connect to the database:")
	require.NotContains(t, r.stderr, "hunter2")
	requireOneLine(t, r.stderr)

	busy, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer busy.Close()
	r = oncemill(t, nil, "console", "--addr", busy.Addr().String(), "--database", pgtest.URL(), "--schema", f.schema)
	require.Equal(t, exitFailure, r.code, r.stderr)
	require.Contains(t, r.stderr, "oncemill console: listen on "+busy.Addr().String()+": ")
	requireOneLine(t, r.stderr)
	require.NotContains(t, r.stdout, "listening")
}

// TestConsoleReplayToTopic: with --broker the console offers the replay
// to the original topic, and publishes through that broker.
func TestConsoleReplayToTopic(t *testing.T) {
	t.Parallel()
	f := setup(t)
	topic := pgtest.Name(t)
	broker := pgBroker(t, f.pool, topic)
	msgs := subscribe(t, broker, topic)
	m := dead(topic, "billing", "card declined")
	ids := f.seed(t, m, dead(topic, "billing", "card declined"))

	const token = "replay-to-topic-console-token"
	r := startConsole(t, nil, "--addr", "127.0.0.1:0", "--token", token, "--broker", broker,
		"--database", pgtest.URL(), "--schema", f.schema)
	code, body := get(t, r.url, "dlq", token)
	require.Equal(t, http.StatusOK, code, body)
	require.Contains(t, body, `value="replay-topic"`, "a publisher: the replay to the topic is offered")

	id := strconv.FormatInt(ids[0], 10)
	code, body = post(t, r.url, "dlq/confirm", token, url.Values{"action": {"replay-topic"}, "scope": {"entry"}, "id": {id}})
	require.Equal(t, http.StatusOK, code, body)
	require.Contains(t, body, "Replay 1 entry to topic "+topic)
	code, body = post(t, r.url, "dlq/confirm", token, url.Values{"action": {"replay-topic"}, "scope": {"entry"}, "ids": {id}, "confirm": {"1"}})
	require.Equal(t, http.StatusSeeOther, code, body)
	requireReplayed(t, m, receive(t, msgs, 1)[m.UUID])
	require.Equal(t, ids[1:], f.ids(t), "the replayed entry is gone, the other stays")
	require.Equal(t, exitOK, r.stop(t), "stderr: %s", r.stderr)
}

func TestConsoleURL(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		addr net.Addr
		want string
	}{
		{&net.TCPAddr{IP: net.IPv4(127, 0, 0, 1), Port: 8080}, "http://127.0.0.1:8080/"},
		{&net.TCPAddr{IP: net.IPv4zero, Port: 8080}, "http://localhost:8080/"},
		{&net.TCPAddr{IP: net.IPv6unspecified, Port: 9000}, "http://localhost:9000/"},
		{&net.TCPAddr{IP: net.IPv6loopback, Port: 9000}, "http://[::1]:9000/"},
		{&net.TCPAddr{IP: net.IPv4(10, 1, 2, 3), Port: 80}, "http://10.1.2.3:80/"},
	} {
		require.Equal(t, tc.want, consoleURL(tc.addr), tc.addr.String())
	}
}
