package main

import (
	"bufio"
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/internal/testing/pgtest"
)

// The README's first steps, as a newcomer takes them, with the command
// built and the consumer run as processes of their own: start the
// consumer, "oncemill publish" an order, the same order again (a
// producer's retry: another UUID) and a payload that is not JSON; read the
// consumer's own log (its default logger, nothing configured) for the dead
// letter, and find the entry with "oncemill dlq list". On RabbitMQ, and on
// PostgreSQL as the broker.
func TestNewcomer(t *testing.T) {
	t.Parallel()
	bin := buildCommand(t)
	t.Run("postgres", func(t *testing.T) {
		t.Parallel()
		dbURL := privateDatabase(t)
		newcomer(t, bin, dbURL, dbURL)
	})
	t.Run("rabbitmq", func(t *testing.T) {
		t.Parallel()
		u := os.Getenv("ONCEMILL_AMQP_URL")
		if u == "" {
			u = "amqp://guest:guest@127.0.0.1:5672/"
		}
		conn, err := amqp091.DialConfig(u, amqp091.Config{Dial: amqp091.DefaultDial(3 * time.Second)})
		if err != nil {
			pgtest.Unavailable(t, "RabbitMQ", err)
		}
		t.Cleanup(func() { require.NoError(t, conn.Close()) })
		// The README's consumer reads topic "orders" as group "billing":
		// start from an empty queue, and leave none behind.
		dropQueue := func() {
			ch, err := conn.Channel()
			require.NoError(t, err)
			defer ch.Close()
			_, err = ch.QueueDelete("orders.billing", false, false, false)
			require.NoError(t, err)
		}
		dropQueue()
		t.Cleanup(dropQueue)
		newcomer(t, bin, privateDatabase(t), u)
	})
}

// buildCommand builds cmd/oncemill as a newcomer's "go install" would and
// returns its path.
func buildCommand(t *testing.T) string {
	t.Helper()
	bin := filepath.Join(t.TempDir(), "oncemill")
	build := exec.Command("go", "build", "-o", bin, "github.com/oncemill/oncemill/cmd/oncemill")
	out, err := build.CombinedOutput()
	require.NoError(t, err, "go build ./cmd/oncemill:\n%s", out)
	return bin
}

// logLines collects a process's standard error, line by line.
type logLines struct {
	mu    sync.Mutex
	lines []string
	done  chan struct{}
}

func (l *logLines) read(t *testing.T, r *bufio.Scanner) {
	defer close(l.done)
	for r.Scan() {
		l.mu.Lock()
		l.lines = append(l.lines, r.Text())
		l.mu.Unlock()
	}
}

// matching are the lines so far that contain every one of parts.
func (l *logLines) matching(parts ...string) []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []string
	for _, line := range l.lines {
		ok := true
		for _, p := range parts {
			ok = ok && strings.Contains(line, p)
		}
		if ok {
			out = append(out, line)
		}
	}
	return out
}

func (l *logLines) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return strings.Join(l.lines, "\n")
}

func newcomer(t *testing.T, bin, dbURL, brokerURL string) {
	ctx := context.Background()
	consumer, _ := program(t, "DATABASE_URL="+dbURL, "BROKER_URL="+brokerURL)
	consumer.Stderr = nil
	stderr, err := consumer.StderrPipe()
	require.NoError(t, err)
	logs := &logLines{done: make(chan struct{})}
	require.NoError(t, consumer.Start())
	go logs.read(t, bufio.NewScanner(stderr))
	exited := make(chan error, 1)
	go func() {
		<-logs.done
		exited <- consumer.Wait()
	}()
	t.Cleanup(func() {
		_ = consumer.Process.Kill() // a consumer still running after a failed step
	})

	// waitFor waits until the consumer's log holds a line with every one
	// of parts, and returns it.
	waitFor := func(parts ...string) string {
		t.Helper()
		deadline := time.After(time.Minute)
		for {
			if m := logs.matching(parts...); len(m) > 0 {
				return m[0]
			}
			select {
			case err := <-exited:
				t.Fatalf("the consumer exited early: %v\n%s", err, logs)
			case <-deadline:
				t.Fatalf("no line with %q in a minute:\n%s", parts, logs)
			case <-time.After(50 * time.Millisecond):
			}
		}
	}
	waitFor("Starting handler", "topic=orders")

	env := append(os.Environ(), "BROKER_URL="+brokerURL, "DATABASE_URL="+dbURL)
	oncemill := func(stdin string, args ...string) string {
		t.Helper()
		c := exec.Command(bin, args...)
		c.Env = env
		c.Stdin = strings.NewReader(stdin)
		var stderr strings.Builder
		c.Stderr = &stderr
		out, err := c.Output()
		require.NoError(t, err, "oncemill %s: %s", strings.Join(args, " "), stderr.String())
		return string(out)
	}
	// The README's command: the order, the same order again (a
	// producer's retry: another UUID) and a payload that is not JSON.
	order := `{"orderId":"A-42","amountCents":1999}`
	out := oncemill("", "publish", "--topic", "orders", order, order, "PAYMENT OK A-42")
	var sent []string
	for _, l := range strings.Split(strings.TrimSuffix(out, "\n"), "\n") {
		id, ok := strings.CutPrefix(strings.TrimSuffix(l, " key -"), "sent ")
		require.True(t, ok, "one line per message sent: %q", out)
		sent = append(sent, id)
	}
	require.Len(t, sent, 3, out)
	malformed := sent[2]

	line := waitFor("Message dead-lettered", "message_uuid="+malformed)
	t.Logf("the consumer's line: %s", line)
	require.Contains(t, line, "INFO")
	require.Contains(t, line, "consumer=charge-orders")
	require.Contains(t, line, "topic=orders")
	require.Contains(t, line, "error=", "the reason is on the line")
	require.Len(t, logs.matching("Message dead-lettered"), 1, "one line per dead letter:\n%s", logs)

	require.NoError(t, consumer.Process.Signal(syscall.SIGTERM))
	select {
	case err := <-exited:
		require.NoError(t, err, "exit after SIGTERM\n%s", logs)
	case <-time.After(45 * time.Second):
		t.Fatalf("no exit 45s after SIGTERM\n%s", logs)
	}

	db, err := pgxpool.New(ctx, dbURL)
	require.NoError(t, err)
	defer db.Close()
	var charged int
	require.NoError(t, db.QueryRow(ctx, `SELECT count(*) FROM charges WHERE order_id = 'A-42'`).Scan(&charged))
	require.Equal(t, 1, charged, "the order sent twice is charged once\n%s", logs)

	list := oncemill("", "dlq", "list", "--topic", "orders")
	rows := strings.Split(strings.TrimSuffix(list, "\n"), "\n")
	require.Len(t, rows, 2, "a header and the malformed entry:\n%s", list)
	require.Contains(t, rows[1], "charge-orders", list)
	var entries []struct {
		UUID    string `json:"uuid"`
		Payload string `json:"payload"`
	}
	require.NoError(t, json.Unmarshal([]byte(oncemill("", "dlq", "list", "--topic", "orders", "--json")), &entries))
	require.Len(t, entries, 1)
	require.Equal(t, malformed, entries[0].UUID)
	require.Equal(t, "PAYMENT OK A-42", entries[0].Payload)

	// NEXT STEP, when the command has "dlq reopen": reopen the entry,
	// publish the corrected order with "oncemill publish", and assert
	// that the consumer charges it, and A-42 still once.
}
