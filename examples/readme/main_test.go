package main

import (
	"context"
	"net/url"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/oncemill/oncemill/internal/testing/proctest"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/adapters"
	"github.com/oncemill/oncemill/internal/testing/pgtest"
)

// mainEnv, set to 1, makes the test binary run the program's main instead
// of the tests, so that the tests run the program as a process of its own,
// signals and exit status included.
const mainEnv = "ONCEMILL_EXAMPLE_README"

func TestMain(m *testing.M) {
	if os.Getenv(mainEnv) == "1" {
		main()
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// program is the README's program as a child process with env as its only
// DATABASE_URL and BROKER_URL.
func program(t *testing.T, env ...string) (*exec.Cmd, *proctest.Buffer) {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "DATABASE_URL=") && !strings.HasPrefix(kv, "BROKER_URL=") {
			cmd.Env = append(cmd.Env, kv)
		}
	}
	cmd.Env = append(cmd.Env, append([]string{mainEnv + "=1"}, env...)...)
	stderr := &proctest.Buffer{} // written by the child's copier while the test reads it
	cmd.Stderr = stderr
	return cmd, stderr
}

// A newcomer who forgot DATABASE_URL gets an exit status of 1 and a line
// naming the variable, before anything connects anywhere: pgx would
// otherwise connect to a default database and the program would run there.
func TestUnsetDatabaseURLFailsLoudly(t *testing.T) {
	t.Parallel()
	cmd, stderr := program(t, "BROKER_URL=gochannel://")
	err := cmd.Run()
	var exit *exec.ExitError
	require.ErrorAs(t, err, &exit, "stderr: %s", stderr)
	require.Equal(t, 1, exit.ExitCode())
	require.Equal(t, "orders: DATABASE_URL is not set: give the PostgreSQL URL, e.g. postgres://user:pass@host:5432/db\n", stderr.String())
}

func TestUnsetBrokerURLFailsLoudly(t *testing.T) {
	t.Parallel()
	cmd, stderr := program(t, "DATABASE_URL=postgres://127.0.0.1:1/nowhere")
	err := cmd.Run()
	var exit *exec.ExitError
	require.ErrorAs(t, err, &exit, "stderr: %s", stderr)
	require.Equal(t, 1, exit.ExitCode())
	require.Contains(t, stderr.String(), "orders: BROKER_URL is not set")
}

// A newcomer whose BROKER_URL has a typo gets an exit status of 1 and a
// line naming the variable and the fault, and the database is as it was:
// the program used to migrate it (and create its table) before it looked
// at the broker's URL.
func TestBadBrokerURLLeavesTheDatabaseAlone(t *testing.T) {
	t.Parallel()
	dbURL := privateDatabase(t)
	cmd, stderr := program(t, "DATABASE_URL="+dbURL, "BROKER_URL=amqp//guest:guest@127.0.0.1:5672/")
	err := cmd.Run()
	var exit *exec.ExitError
	require.ErrorAs(t, err, &exit, "stderr: %s", stderr)
	require.Equal(t, 1, exit.ExitCode())
	require.Contains(t, stderr.String(), `orders: BROKER_URL: adapters: unknown broker scheme: "amqp//guest:xxxxx@127.0.0.1:5672/" has no scheme; use kafka://, amqp://`)
	require.NotContains(t, stderr.String(), "guest:guest", "the password stays out of the line")

	db, err := pgxpool.New(context.Background(), dbURL)
	require.NoError(t, err)
	defer db.Close()
	var tables int
	require.NoError(t, db.QueryRow(context.Background(),
		`SELECT count(*) FROM information_schema.tables WHERE table_schema NOT IN ('pg_catalog', 'information_schema')`).Scan(&tables))
	require.Zero(t, tables, "no table created: not oncemill's, not the program's charges")
}

// The program, run as it is in a database of its own with PostgreSQL as
// the broker too, charges an order delivered three times once, a second
// order once, dead-letters the payload that is not JSON, and exits 0 on
// SIGTERM.
func TestChargesOnceAndDeadLetters(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	dbURL := privateDatabase(t)

	broker, err := adapters.Open(ctx, dbURL, adapters.Options{})
	require.NoError(t, err)
	defer func() { require.NoError(t, broker.Close()) }()
	for _, payload := range []string{
		`{"orderId":"A-42","amountCents":1999}`,
		`{"orderId":"A-42","amountCents":1999}`, // a producer's retry: another UUID, the same order
		`{"orderId":"B-7","amountCents":500}`,
		`{"orderId":"A-42","amountCents":1999}`,
		`PAYMENT OK A-42`, // not JSON: no key to read
	} {
		require.NoError(t, broker.Publisher.Publish("orders", message.NewMessage(watermill.NewUUID(), []byte(payload))))
	}

	cmd, stderr := program(t, "DATABASE_URL="+dbURL, "BROKER_URL="+dbURL)
	require.NoError(t, cmd.Start())
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()

	db, err := pgxpool.New(ctx, dbURL)
	require.NoError(t, err)
	defer db.Close()
	count := func(query string) int {
		var n int
		if err := db.QueryRow(ctx, query).Scan(&n); err != nil {
			return -1 // the program has not created the table yet
		}
		return n
	}
	charges := `SELECT count(*) FROM charges`
	deadLetters := `SELECT count(*) FROM oncemill.dlq WHERE topic = 'orders' AND consumer = 'charge-orders'`
	tick := time.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
	deadline := time.After(time.Minute)
	for count(charges) < 2 || count(deadLetters) < 1 {
		select {
		case err := <-exited:
			t.Fatalf("the program exited early: %v\n%s", err, stderr)
		case <-deadline:
			t.Fatalf("charges %d, dead letters %d after a minute\n%s", count(charges), count(deadLetters), stderr)
		case <-tick.C:
		}
	}

	require.NoError(t, cmd.Process.Signal(syscall.SIGTERM))
	select {
	case err := <-exited:
		require.NoError(t, err, "exit after SIGTERM\n%s", stderr)
	case <-time.After(45 * time.Second):
		require.NoError(t, cmd.Process.Kill())
		t.Fatalf("no exit 45s after SIGTERM\n%s", stderr)
	}
	require.Equal(t, 1, count(`SELECT count(*) FROM charges WHERE order_id = 'A-42'`), "A-42 charged once")
	require.Equal(t, 1, count(`SELECT count(*) FROM charges WHERE order_id = 'B-7'`), "B-7 charged once")
	require.Equal(t, 2, count(charges))
	require.Equal(t, 1, count(deadLetters+` AND payload = 'PAYMENT OK A-42'`), "the payload that is not JSON is in the DLQ")
}

// privateDatabase creates a database of the test's own on the test server,
// since the program migrates the default schema and creates its table in
// the public one, and returns its URL.
func privateDatabase(t *testing.T) string {
	t.Helper()
	admin := pgtest.Pool(t, 2)
	u, err := url.Parse(pgtest.URL())
	require.NoError(t, err, "the test server's address must be a postgres:// URL")
	require.True(t, strings.HasPrefix(u.Scheme, "postgres"), "the test server's address must be a postgres:// URL")
	name := pgtest.Name(t)
	_, err = admin.Exec(context.Background(), `CREATE DATABASE `+pgx.Identifier{name}.Sanitize())
	require.NoError(t, err)
	t.Cleanup(func() {
		_, err := admin.Exec(context.Background(), `DROP DATABASE IF EXISTS `+pgx.Identifier{name}.Sanitize()+` WITH (FORCE)`)
		require.NoError(t, err)
	})
	u.Path = "/" + name
	return u.String()
}
