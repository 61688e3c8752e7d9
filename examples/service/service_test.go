package main

import (
	"bufio"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	mrand "math/rand/v2"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/adapters"
	"github.com/oncemill/oncemill/adapters/amqp"
	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/dlq"
	"github.com/oncemill/oncemill/internal/testing/pgtest"
	"github.com/oncemill/oncemill/sqlschema"
)

// serviceEnv, set to 1, makes the test binary run the service's main
// instead of the tests: the tests start the binary they run in as the
// service, so that it is built once, with the flags of the test run (-race
// included), and without a Go toolchain at run time.
const serviceEnv = "ONCEMILL_EXAMPLE_SERVICE"

func TestMain(m *testing.M) {
	if os.Getenv(serviceEnv) == "1" {
		main()
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// amqpURL is the shared RabbitMQ node of the integration tests,
// ONCEMILL_AMQP_URL when set.
var amqpURL = func() string {
	if u := os.Getenv("ONCEMILL_AMQP_URL"); u != "" {
		return u
	}
	return "amqp://guest:guest@127.0.0.1:5672/"
}()

// TestServiceRabbitMQ runs the service against PostgreSQL and RabbitMQ
// with a private Prometheus scraping it: keys published several times in
// a shuffled order, with poison messages among them, are applied once
// each, the metrics in Prometheus count exactly the duplicates sent, the
// dead letters are in the table, and SIGTERM drains the service with
// nothing lost or left behind.
func TestServiceRabbitMQ(t *testing.T) {
	t.Parallel()
	const (
		keys   = 120
		copies = 3
	)
	pool := pgtest.Pool(t, 4)
	requireRabbitMQ(t)
	promBin := requirePrometheus(t)

	schema := freshSchema(t, pool)
	suffix := randomSuffix(t)
	topic, events := "orders_"+suffix, "payments_recorded_"+suffix
	const group, audit = "billing", "audit"
	cleanupAMQP(t, []string{topic, events}, []string{topic + "." + group, events + "." + audit})
	ctx := context.Background()
	// What the deploy pipeline does before producers start. The events'
	// queue is declared later, after the service has found it missing.
	require.NoError(t, amqp.Declare(ctx, amqp.Config{URL: amqpURL, ConsumerGroup: group}, topic))

	addr := freeAddr(t)
	prom := startPrometheus(t, promBin, addr)
	env := map[string]string{
		"DATABASE_URL":   pgtest.URL(),
		"BROKER_URL":     amqpURL,
		"HTTP_ADDR":      addr,
		"DB_SCHEMA":      schema,
		"TOPIC":          topic,
		"EVENTS_TOPIC":   events,
		"CONSUMER_GROUP": group,
	}
	svc := startService(t, env)
	svc.waitHealthy(t, 60*time.Second)
	waitFor(t, 30*time.Second, "Prometheus scrapes the service", func() (bool, string) {
		v, err := prom.query(`up{job="service"}`)
		return err == nil && v == 1, fmt.Sprintf("up = %v, %v", v, err)
	})

	// The traffic: every key copies times under new UUIDs, as producers
	// retrying after lost acks send them, shuffled, and four messages that
	// can never succeed: two that are not JSON (no key to read), two with
	// a negative amount (the handler's permanent error).
	want := map[string]bool{}
	msgs := payments(t, suffix, 0, keys, copies, want)
	for i := range 2 {
		msgs = append(msgs, message.NewMessage(watermill.NewUUID(), []byte(fmt.Sprintf("PAID order-%s-%d", suffix, i))))
		msgs = append(msgs, message.NewMessage(watermill.NewUUID(),
			[]byte(fmt.Sprintf(`{"orderId":"refund-%s-%d","amountCents":-500}`, suffix, i))))
	}
	const poison = 4
	seed := uint64(time.Now().UnixNano())
	t.Logf("shuffle seed %d", seed)
	r := mrand.New(mrand.NewPCG(seed, seed))
	r.Shuffle(len(msgs), func(i, j int) { msgs[i], msgs[j] = msgs[j], msgs[i] })
	producer, err := adapters.Open(ctx, amqpURL, adapters.Options{})
	require.NoError(t, err)
	defer producer.Close()
	for _, m := range msgs {
		require.NoError(t, producer.Publisher.Publish(topic, m))
	}

	// No queue is bound to the events' exchange yet: the relay's publish
	// is refused, the events wait in the outbox, and the service says it
	// is not ready because of the broker.
	waitFor(t, 30*time.Second, "/healthz reports the refused publish", func() (bool, string) {
		code, body := svc.healthz()
		return code == http.StatusServiceUnavailable && strings.Contains(body, "broker: last publish failed"), fmt.Sprintf("%d %s", code, body)
	})
	// The relay measures the backlog meanwhile, and Prometheus sees it.
	waitFor(t, 60*time.Second, "Prometheus sees the outbox's backlog", func() (bool, string) {
		v, err := prom.query(`sum(oncemill_outbox_lag_rows)`)
		return err == nil && v > 0, fmt.Sprintf("oncemill_outbox_lag_rows = %v, %v", v, err)
	})
	require.NoError(t, amqp.Declare(ctx, amqp.Config{URL: amqpURL, ConsumerGroup: audit}, events))
	svc.waitHealthy(t, 30*time.Second)

	waitFor(t, 60*time.Second, "every key applied", func() (bool, string) {
		var n int
		err := pool.QueryRow(ctx, `SELECT count(DISTINCT order_id) FROM `+paymentsTable(schema)).Scan(&n)
		return err == nil && n == keys, fmt.Sprintf("%d of %d keys, %v", n, keys, err)
	})
	duplicates := keys * (copies - 1)
	var applied float64
	waitFor(t, 60*time.Second, "Prometheus counts the duplicates and dead letters", func() (bool, string) {
		dup, err1 := prom.query(`sum(oncemill_inbox_messages_total{outcome="duplicate"})`)
		dead, err2 := prom.query(`sum(oncemill_dlq_messages_total)`)
		var err3 error
		applied, err3 = prom.query(`sum(oncemill_inbox_messages_total{outcome="applied"})`)
		return dup == float64(duplicates) && dead == poison,
			fmt.Sprintf("duplicate = %v (want %d), dead-lettered = %v (want %d), applied = %v; %v",
				dup, duplicates, dead, poison, applied, errors.Join(err1, err2, err3))
	})
	require.Equal(t, float64(keys), applied, "applied")
	waitFor(t, 30*time.Second, "the DLQ collector sees the dead letters", func() (bool, string) {
		v, err := prom.query(`sum(oncemill_dlq_entries)`)
		return err == nil && v == poison, fmt.Sprintf("oncemill_dlq_entries = %v, %v", v, err)
	})

	// The events went through the outbox: one per key, once.
	waitFor(t, 30*time.Second, "the outbox drained", func() (bool, string) {
		n, err := count(ctx, pool, pgx.Identifier{schema, "outbox"}.Sanitize())
		return err == nil && n == 0, fmt.Sprintf("%d rows, %v", n, err)
	})
	waitFor(t, 60*time.Second, "Prometheus sees the backlog gone", func() (bool, string) {
		v, err := prom.query(`sum(oncemill_outbox_lag_rows)`)
		return err == nil && v == 0, fmt.Sprintf("oncemill_outbox_lag_rows = %v, %v", v, err)
	})
	got := consumeEvents(t, events+"."+audit, keys)
	require.Equal(t, want, got, "one event per key")

	// The dashboard's queries are valid PromQL, and every oncemill metric
	// they read is one the service exports.
	exposition, err := svc.get("/metrics")
	require.NoError(t, err)
	for _, q := range dashboardQueries(t) {
		_, err := prom.query(q)
		require.False(t, errors.Is(err, errBadQuery), "dashboard query %s: %v", q, err)
		for _, name := range metricName.FindAllString(q, -1) {
			name = strings.TrimSuffix(name, "_bucket")
			require.Contains(t, exposition, "# TYPE "+name+" ", "the dashboard reads %s", name)
		}
	}

	// SIGTERM: the service drains and exits 0 within Kubernetes' grace
	// period.
	code, took := svc.stop(t, 30*time.Second)
	require.Equal(t, 0, code, "exit code after SIGTERM")
	t.Logf("drained and exited in %s", took.Round(time.Millisecond))
	require.Contains(t, svc.log(), "msg=drained")

	// A deploy under load: a second wave, with copies of keys the first
	// instance applied among it, waits in the queue; a new instance gets
	// SIGTERM halfway through it and a third one finishes it.
	const keys2 = 200
	wave := payments(t, suffix, keys, keys+keys2, copies, want)
	wave = append(wave, payments(t, suffix, 0, 30, 1, nil)...)
	r.Shuffle(len(wave), func(i, j int) { wave[i], wave[j] = wave[j], wave[i] })
	for _, m := range wave {
		require.NoError(t, producer.Publisher.Publish(topic, m))
	}
	second := startService(t, env)
	var applied2 int
	waitFor(t, 60*time.Second, "the second instance applies part of the wave", func() (bool, string) {
		n, err := count(ctx, pool, paymentsTable(schema))
		applied2 = n - keys
		return err == nil && applied2 >= 20, fmt.Sprintf("%d of %d, %v", applied2, keys2, err)
	})
	code, took = second.stop(t, 30*time.Second)
	require.Equal(t, 0, code, "exit code after SIGTERM under load")
	t.Logf("second instance stopped after %d of %d keys of the wave; drained and exited in %s", applied2, keys2, took.Round(time.Millisecond))
	third := startService(t, env)
	waitFor(t, 60*time.Second, "the third instance applies the rest", func() (bool, string) {
		var n int
		err := pool.QueryRow(ctx, `SELECT count(DISTINCT order_id) FROM `+paymentsTable(schema)).Scan(&n)
		return err == nil && n == keys+keys2, fmt.Sprintf("%d of %d keys, %v", n, keys+keys2, err)
	})
	waitFor(t, 30*time.Second, "the outbox drained", func() (bool, string) {
		n, err := count(ctx, pool, pgx.Identifier{schema, "outbox"}.Sanitize())
		return err == nil && n == 0, fmt.Sprintf("%d rows, %v", n, err)
	})
	got2 := consumeEvents(t, events+"."+audit, keys2)
	for k := range got2 {
		require.False(t, got[k], "a second event for %s", k)
		require.True(t, want[k], "an event for %s", k)
	}
	// An operator replays the dead letters to the service (oncemill dlq
	// replay --to-consumer): they come back through its handler chain,
	// fail again (they can never succeed) and are dead-lettered afresh,
	// under the same UUIDs.
	deadLetters, err := dlq.NewStore(pool, sqlschema.Config{Schema: schema})
	require.NoError(t, err)
	before, err := deadLetters.List(ctx, dlq.Filter{All: true})
	require.NoError(t, err)
	require.Len(t, before, poison)
	requested, err := deadLetters.RequestReplay(ctx, dlq.Filter{Consumer: consumerName})
	require.NoError(t, err)
	require.Equal(t, poison, requested)
	waitFor(t, 60*time.Second, "the replays reach the service and are dead-lettered again", func() (bool, string) {
		after, err := deadLetters.List(ctx, dlq.Filter{All: true})
		if err != nil || len(after) != poison {
			return false, fmt.Sprintf("%d entries, %v", len(after), err)
		}
		old := map[int64]bool{}
		uuids := map[string]bool{}
		for _, e := range before {
			old[e.ID], uuids[e.UUID] = true, true
		}
		for _, e := range after {
			if old[e.ID] || !uuids[e.UUID] {
				return false, fmt.Sprintf("entry %d (%s) not replayed yet", e.ID, e.UUID)
			}
		}
		return true, ""
	})
	code, _ = third.stop(t, 30*time.Second)
	require.Equal(t, 0, code, "exit code of the third instance")

	// Nothing lost, nothing doubled, nothing left behind.
	rows, err := pool.Query(ctx, `SELECT order_id, count(*) FROM `+paymentsTable(schema)+` GROUP BY order_id`)
	require.NoError(t, err)
	type keyCount struct {
		Key string
		N   int
	}
	perKey, err := pgx.CollectRows(rows, pgx.RowToStructByPos[keyCount])
	require.NoError(t, err)
	applies := map[string]int{}
	for _, k := range perKey {
		applies[k.Key] = k.N
	}
	require.Len(t, applies, keys+keys2, "keys applied")
	for k := range want {
		require.Equal(t, 1, applies[k], "effects of %s", k)
	}
	dead, err := count(ctx, pool, pgx.Identifier{schema, "dlq"}.Sanitize())
	require.NoError(t, err)
	require.Equal(t, poison, dead, "rows in the dead-letter table")
	outbox, err := count(ctx, pool, pgx.Identifier{schema, "outbox"}.Sanitize())
	require.NoError(t, err)
	require.Zero(t, outbox, "outbox rows left")
	require.Zero(t, queueDepth(t, topic+"."+group), "messages left in the service's queue")
	require.Zero(t, queueDepth(t, events+"."+audit), "events published twice")
}

// payments returns copies messages for each order from..to-1 (new UUIDs:
// a producer retrying after lost acks), and adds their ids to want.
func payments(t *testing.T, suffix string, from, to, copies int, want map[string]bool) []*message.Message {
	t.Helper()
	var msgs []*message.Message
	for i := from; i < to; i++ {
		p := Payment{OrderID: fmt.Sprintf("order-%s-%d", suffix, i), AmountCents: int64(1000 + i)}
		if want != nil {
			want[p.OrderID] = true
		}
		payload, err := json.Marshal(p)
		require.NoError(t, err)
		for range copies {
			m := message.NewMessage(watermill.NewUUID(), payload)
			m.Metadata.Set(delivery.PartitionKey, p.OrderID)
			msgs = append(msgs, m)
		}
	}
	return msgs
}

// TestServiceGoChannel runs the service as `go run ./examples/service
// -produce N` does, on GoChannel, scraping /metrics directly: the demo's
// duplicates are counted, /healthz turns 503 while the database is cut
// off and 200 again once it is back, and SIGTERM exits 0.
func TestServiceGoChannel(t *testing.T) {
	t.Parallel()
	const orders = 30
	pool := pgtest.Pool(t, 2)
	schema := freshSchema(t, pool)
	proxy := startProxy(t, pool.Config().ConnConfig.Host, pool.Config().ConnConfig.Port)

	svc := startService(t, map[string]string{
		"DATABASE_URL": proxy.databaseURL(t, pgtest.URL()),
		"BROKER_URL":   "gochannel://",
		"HTTP_ADDR":    freeAddr(t),
		"DB_SCHEMA":    schema,
	}, "-produce", strconv.Itoa(orders))
	svc.waitHealthy(t, 60*time.Second)
	waitFor(t, 60*time.Second, "/metrics counts the demo", func() (bool, string) {
		body, err := svc.get("/metrics")
		applied := sumSeries(body, "oncemill_inbox_messages_total", `outcome="applied"`)
		dup := sumSeries(body, "oncemill_inbox_messages_total", `outcome="duplicate"`)
		dead := sumSeries(body, "oncemill_dlq_messages_total")
		// One event per order, relayed from the outbox a moment after
		// its order was applied.
		published := sumSeries(body, "oncemill_outbox_published_total")
		return applied == orders && dup == orders*(demoCopies-1) && dead == 1 && published == orders,
			fmt.Sprintf("applied %v, duplicate %v, dead-lettered %v, published %v, %v", applied, dup, dead, published, err)
	})
	body, err := svc.get("/metrics")
	require.NoError(t, err)
	for _, family := range []string{"go_goroutines", "process_cpu_seconds_total", "oncemill_bloom_checks_total",
		"oncemill_outbox_published_total", "oncemill_dlq_entries"} {
		require.Contains(t, body, "\n"+family, "/metrics serves %s", family)
	}

	proxy.setDown(true)
	waitFor(t, 20*time.Second, "/healthz reports the database", func() (bool, string) {
		code, body := svc.healthz()
		return code == http.StatusServiceUnavailable && strings.Contains(body, "database:"), fmt.Sprintf("%d %s", code, body)
	})
	proxy.setDown(false)
	svc.waitHealthy(t, 30*time.Second)

	code, took := svc.stop(t, 30*time.Second)
	require.Equal(t, 0, code, "exit code after SIGTERM")
	t.Logf("drained and exited in %s", took.Round(time.Millisecond))
	var rows, distinct int
	require.NoError(t, pool.QueryRow(context.Background(),
		`SELECT count(*), count(DISTINCT order_id) FROM `+paymentsTable(schema)).Scan(&rows, &distinct))
	require.Equal(t, orders, rows, "payments")
	require.Equal(t, orders, distinct, "orders paid")
}

func TestConfig(t *testing.T) {
	env := func(kv ...string) func(string) string {
		m := map[string]string{}
		for i := 0; i < len(kv); i += 2 {
			m[kv[i]] = kv[i+1]
		}
		return func(k string) string { return m[k] }
	}
	c, err := loadConfig(env())
	require.NoError(t, err)
	require.Equal(t, defaultDatabaseURL, c.DatabaseURL)
	require.Equal(t, "gochannel://", c.BrokerURL)
	require.Equal(t, "127.0.0.1:8081", c.HTTPAddr)
	require.Equal(t, "payments", c.ConsumerGroup)

	c, err = loadConfig(env("BROKER_URL", "amqp://h:5672/?group=ledger"))
	require.NoError(t, err)
	require.Empty(t, c.ConsumerGroup, "the URL's group wins when CONSUMER_GROUP is not set")

	for _, tc := range []struct{ name, value, want string }{
		{"DATABASE_URL", "postgres://u:secret@h:notaport/db", "DATABASE_URL: "},
		{"BROKER_URL", "nats://h:4222", `BROKER_URL: scheme "nats"`},
		{"HTTP_ADDR", "8081", "HTTP_ADDR: want host:port"},
		{"HTTP_ADDR", "127.0.0.1:http", "HTTP_ADDR: port"},
		{"DB_SCHEMA", "Payments", `DB_SCHEMA: "Payments" is not a valid schema name`},
		{"EVENTS_TOPIC", "orders", "EVENTS_TOPIC: must differ from TOPIC"},
		{"LOG_LEVEL", "loud", "LOG_LEVEL: want debug, info, warn or error"},
		{"OTEL_EXPORTER_OTLP_ENDPOINT", "collector:4318", "OTEL_EXPORTER_OTLP_ENDPOINT: want an http:// or https:// URL"},
		{"OTEL_EXPORTER_OTLP_ENDPOINT", "127.0.0.1:4318", "OTEL_EXPORTER_OTLP_ENDPOINT: want an http:// or https:// URL"},
		{"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "grpc://u:secret@collector:4317", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT: want an http://"},
		{"OTEL_SDK_DISABLED", "maybe", "OTEL_SDK_DISABLED: want true or false"},
	} {
		_, err := loadConfig(env(tc.name, tc.value))
		require.ErrorContains(t, err, tc.want, "%s=%s", tc.name, tc.value)
		require.NotContains(t, err.Error(), "secret")
	}
	// Tracing: off unless an endpoint is set; the per-signal URL is used
	// as it is, the base URL gets the traces' path.
	require.Empty(t, c.TracesEndpoint)
	c, err = loadConfig(env("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318"))
	require.NoError(t, err)
	require.Equal(t, "http://collector:4318/v1/traces", c.TracesEndpoint)
	c, err = loadConfig(env("OTEL_EXPORTER_OTLP_ENDPOINT", "https://collector/otlp/"))
	require.NoError(t, err)
	require.Equal(t, "https://collector/otlp/v1/traces", c.TracesEndpoint)
	c, err = loadConfig(env("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://tempo:4318/ingest"))
	require.NoError(t, err)
	require.Equal(t, "http://tempo:4318/ingest", c.TracesEndpoint)
	c, err = loadConfig(env("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318", "OTEL_SDK_DISABLED", "true"))
	require.NoError(t, err)
	require.Empty(t, c.TracesEndpoint, "OTEL_SDK_DISABLED=true turns tracing off")
	_, err = loadConfig(env("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318", "OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"))
	require.ErrorContains(t, err, `OTEL_EXPORTER_OTLP_PROTOCOL: the service exports over HTTP`)
	_, err = loadConfig(env("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"))
	require.NoError(t, err, "the protocol does not matter while nothing is exported")

	_, err = loadConfig(env("HTTP_ADDR", "x", "LOG_LEVEL", "x"))
	require.ErrorContains(t, err, "HTTP_ADDR")
	require.ErrorContains(t, err, "LOG_LEVEL", "every problem is reported")
}

// ---------------------------------------------------------------- service

// service is the service running as a child process.
type service struct {
	cmd     *exec.Cmd
	addr    string
	logPath string
	exited  chan struct{}
	waitErr error
}

// startService starts the test binary as the service with env (on top
// of this process's environment) and args; it is killed when the test
// ends if it still runs, and its log is printed if the test failed.
func startService(t *testing.T, env map[string]string, args ...string) *service {
	t.Helper()
	logPath := filepath.Join(t.TempDir(), "service.log")
	f, err := os.Create(logPath)
	require.NoError(t, err)
	cmd := exec.Command(os.Args[0], args...)
	// Under -race the service is race-enabled too; the detector's pause
	// at exit (1 s by default) is not part of the drain being timed.
	cmd.Env = []string{serviceEnv + "=1", "LOG_LEVEL=info",
		"GORACE=" + strings.TrimSpace(os.Getenv("GORACE")+" atexit_sleep_ms=0")}
	for _, kv := range os.Environ() {
		// The service's own settings come from env alone, OpenTelemetry's
		// included: no tracing unless the test asks for it.
		switch name, _, _ := strings.Cut(kv, "="); {
		case strings.HasPrefix(name, "OTEL_"):
		case name == "DATABASE_URL", name == "BROKER_URL", name == "HTTP_ADDR", name == "DB_SCHEMA", name == "TOPIC",
			name == "EVENTS_TOPIC", name == "CONSUMER_GROUP", name == "LOG_LEVEL", name == "GORACE":
		default:
			cmd.Env = append(cmd.Env, kv)
		}
	}
	for k, v := range env {
		cmd.Env = append(cmd.Env, k+"="+v)
	}
	cmd.Stdout, cmd.Stderr = f, f
	require.NoError(t, cmd.Start())
	s := &service{cmd: cmd, addr: env["HTTP_ADDR"], logPath: logPath, exited: make(chan struct{})}
	go func() {
		s.waitErr = cmd.Wait()
		_ = f.Close()
		close(s.exited)
	}()
	t.Cleanup(func() {
		select {
		case <-s.exited:
		default:
			_ = cmd.Process.Kill()
			<-s.exited
		}
		if t.Failed() {
			t.Logf("service log (last 6 kB):\n%s", tail(s.log(), 6000))
		}
	})
	return s
}

func (s *service) log() string {
	b, _ := os.ReadFile(s.logPath)
	return string(b)
}

func (s *service) get(path string) (string, error) {
	code, body, err := httpGet("http://" + s.addr + path)
	if err == nil && code != http.StatusOK {
		err = fmt.Errorf("GET %s: %d", path, code)
	}
	return body, err
}

// healthz returns the status and body of /healthz; 0 when it did not
// answer.
func (s *service) healthz() (int, string) {
	code, body, err := httpGet("http://" + s.addr + "/healthz")
	if err != nil {
		return 0, err.Error()
	}
	return code, strings.TrimSpace(body)
}

func (s *service) waitHealthy(t *testing.T, timeout time.Duration) {
	t.Helper()
	waitFor(t, timeout, "/healthz answers 200", func() (bool, string) {
		select {
		case <-s.exited:
			t.Fatalf("the service exited: %v", s.waitErr)
		default:
		}
		code, body := s.healthz()
		return code == http.StatusOK, fmt.Sprintf("%d %s", code, body)
	})
}

// stop sends SIGTERM and returns the exit code and how long the exit
// took; it fails the test if the process is still running after timeout.
func (s *service) stop(t *testing.T, timeout time.Duration) (int, time.Duration) {
	t.Helper()
	began := time.Now()
	require.NoError(t, s.cmd.Process.Signal(syscall.SIGTERM))
	select {
	case <-s.exited:
	case <-time.After(timeout):
		t.Fatalf("the service still runs %s after SIGTERM", timeout)
	}
	return s.cmd.ProcessState.ExitCode(), time.Since(began)
}

// ------------------------------------------------------------- prometheus

// requirePrometheus returns the path of the prometheus binary (Debian's
// package prometheus; scripts/services.sh installs it).
func requirePrometheus(t *testing.T) string {
	t.Helper()
	bin, err := exec.LookPath("prometheus")
	if err != nil {
		pgtest.Unavailable(t, "the prometheus binary (apt-get install prometheus, or scripts/services.sh)", err)
	}
	return bin
}

type prometheusServer struct{ url string }

// startPrometheus runs a private Prometheus, on a free port with its
// storage in the test's temporary directory, scraping target every
// second; it stops when the test ends.
func startPrometheus(t *testing.T, bin, target string) *prometheusServer {
	t.Helper()
	dir := t.TempDir()
	cfg := filepath.Join(dir, "prometheus.yml")
	require.NoError(t, os.WriteFile(cfg, []byte(fmt.Sprintf(`global:
  scrape_interval: 1s
  scrape_timeout: 1s
  evaluation_interval: 1s
scrape_configs:
  - job_name: service
    static_configs:
      - targets: ['%s']
`, target)), 0o644))
	addr := freeAddr(t)
	logPath := filepath.Join(dir, "prometheus.log")
	f, err := os.Create(logPath)
	require.NoError(t, err)
	cmd := exec.Command(bin, "--config.file="+cfg, "--storage.tsdb.path="+filepath.Join(dir, "data"),
		"--web.listen-address="+addr, "--log.level=warn")
	cmd.Stdout, cmd.Stderr = f, f
	require.NoError(t, cmd.Start())
	exited := make(chan struct{})
	go func() {
		_ = cmd.Wait()
		_ = f.Close()
		close(exited)
	}()
	t.Cleanup(func() {
		_ = cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-exited:
		case <-time.After(10 * time.Second):
			_ = cmd.Process.Kill()
			<-exited
		}
		if t.Failed() {
			b, _ := os.ReadFile(logPath)
			t.Logf("prometheus log (last 3 kB):\n%s", tail(string(b), 3000))
		}
	})
	p := &prometheusServer{url: "http://" + addr}
	waitFor(t, 60*time.Second, "Prometheus is ready", func() (bool, string) {
		select {
		case <-exited:
			b, _ := os.ReadFile(logPath)
			t.Fatalf("prometheus exited:\n%s", tail(string(b), 3000))
		default:
		}
		code, body, err := httpGet(p.url + "/-/ready")
		return err == nil && code == http.StatusOK, fmt.Sprintf("%d %s %v", code, body, err)
	})
	return p
}

// errBadQuery is the error of a query Prometheus refused.
var errBadQuery = errors.New("query refused")

// query runs an instant query whose answer is one number.
func (p *prometheusServer) query(q string) (float64, error) {
	code, body, err := httpGet(p.url + "/api/v1/query?query=" + url.QueryEscape(q))
	if err != nil {
		return 0, err
	}
	var r struct {
		Status string `json:"status"`
		Error  string `json:"error"`
		Data   struct {
			Result []struct {
				Value [2]any `json:"value"`
			} `json:"result"`
		} `json:"data"`
	}
	if err := json.Unmarshal([]byte(body), &r); err != nil {
		return 0, fmt.Errorf("query %s: %d %s", q, code, tail(body, 200))
	}
	if r.Status != "success" {
		return 0, fmt.Errorf("%w: %s: %s", errBadQuery, q, r.Error)
	}
	if len(r.Data.Result) != 1 {
		return 0, fmt.Errorf("query %s: %d series", q, len(r.Data.Result))
	}
	s, _ := r.Data.Result[0].Value[1].(string)
	return strconv.ParseFloat(s, 64)
}

var metricName = regexp.MustCompile(`oncemill_[a-z_]+`)

// dashboardQueries returns the queries of grafana-dashboard.json, its
// variables replaced by what matches everything.
func dashboardQueries(t *testing.T) []string {
	t.Helper()
	b, err := os.ReadFile("grafana-dashboard.json")
	require.NoError(t, err)
	var d struct {
		Panels []struct {
			Targets []struct {
				Expr string `json:"expr"`
			} `json:"targets"`
		} `json:"panels"`
	}
	require.NoError(t, json.Unmarshal(b, &d))
	vars := strings.NewReplacer("$job", ".*", "$consumer", ".*", "$topic", ".*", "$__rate_interval", "10s")
	var qs []string
	for _, p := range d.Panels {
		for _, tg := range p.Targets {
			qs = append(qs, vars.Replace(tg.Expr))
		}
	}
	require.NotEmpty(t, qs)
	return qs
}

// sumSeries adds up the samples of metric in a text exposition whose
// labels contain every one of match.
func sumSeries(exposition, metric string, match ...string) float64 {
	var sum float64
	sc := bufio.NewScanner(strings.NewReader(exposition))
	sc.Buffer(make([]byte, 64*1024), 1024*1024)
next:
	for sc.Scan() {
		line := sc.Text()
		if !strings.HasPrefix(line, metric+"{") && !strings.HasPrefix(line, metric+" ") {
			continue
		}
		for _, m := range match {
			if !strings.Contains(line, m) {
				continue next
			}
		}
		if v, err := strconv.ParseFloat(line[strings.LastIndexByte(line, ' ')+1:], 64); err == nil {
			sum += v
		}
	}
	return sum
}

// --------------------------------------------------------------- rabbitmq

func requireRabbitMQ(t *testing.T) {
	t.Helper()
	conn, err := amqp091.DialConfig(amqpURL, amqp091.Config{Dial: amqp091.DefaultDial(5 * time.Second)})
	if err != nil {
		pgtest.Unavailable(t, "RabbitMQ at "+redacted(amqpURL), err)
	}
	_ = conn.Close()
}

// withChannel runs f on a channel of a new connection (a failed call
// closes its channel, so each use gets its own).
func withChannel(f func(ch *amqp091.Channel) error) error {
	conn, err := amqp091.Dial(amqpURL)
	if err != nil {
		return err
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		return err
	}
	return f(ch)
}

// queueDepth is the number of ready messages in queue; a consumer's
// unacknowledged messages are ready again once its connection closed.
func queueDepth(t *testing.T, queue string) int {
	t.Helper()
	var n int
	require.NoError(t, withChannel(func(ch *amqp091.Channel) error {
		q, err := ch.QueueDeclarePassive(queue, true, false, false, false, nil)
		n = q.Messages
		return err
	}))
	return n
}

// cleanupAMQP deletes the test's exchanges and queues when it ends.
func cleanupAMQP(t *testing.T, exchanges, queues []string) {
	t.Cleanup(func() {
		for _, q := range queues {
			if err := withChannel(func(ch *amqp091.Channel) error { _, err := ch.QueueDelete(q, false, false, false); return err }); err != nil {
				t.Logf("delete queue %s: %v", q, err)
			}
		}
		for _, x := range exchanges {
			if err := withChannel(func(ch *amqp091.Channel) error { return ch.ExchangeDelete(x, false, false) }); err != nil {
				t.Logf("delete exchange %s: %v", x, err)
			}
		}
	})
}

// consumeEvents takes the events from queue, with basic.get and automatic
// acknowledgement (so that nothing read goes back to the queue), until it
// has want distinct idempotency keys, and returns the keys. A key seen
// twice fails the test; so would an event left behind, which the caller
// checks once the service has stopped.
func consumeEvents(t *testing.T, queue string, want int) map[string]bool {
	t.Helper()
	got := map[string]bool{}
	deadline := time.Now().Add(30 * time.Second)
	require.NoError(t, withChannel(func(ch *amqp091.Channel) error {
		for len(got) < want {
			d, ok, err := ch.Get(queue, true)
			if err != nil {
				return err
			}
			if !ok {
				if time.Now().After(deadline) {
					return fmt.Errorf("%d of %d events received", len(got), want)
				}
				time.Sleep(50 * time.Millisecond)
				continue
			}
			k, _ := d.Headers[delivery.IdempotencyKey].(string)
			if got[k] {
				return fmt.Errorf("event %q (message %s) published twice", k, d.MessageId)
			}
			got[k] = true
		}
		return nil
	}))
	return got
}

// ------------------------------------------------------------- postgres

// freshSchema returns a schema name of its own for the test, which the
// service creates and the test drops when it ends.
func freshSchema(t *testing.T, pool *pgxpool.Pool) string {
	t.Helper()
	schema := pgtest.Name(t)
	t.Cleanup(func() {
		if _, err := pool.Exec(context.Background(), `DROP SCHEMA IF EXISTS `+pgx.Identifier{schema}.Sanitize()+` CASCADE`); err != nil {
			t.Errorf("drop schema %s: %v", schema, err)
		}
	})
	return schema
}

func count(ctx context.Context, pool *pgxpool.Pool, table string) (int, error) {
	var n int
	err := pool.QueryRow(ctx, `SELECT count(*) FROM `+table).Scan(&n)
	return n, err
}

// proxy forwards TCP connections to PostgreSQL and can cut them off: while
// down, it closes every connection it carries and every new one at once,
// as a database that went away does.
type proxy struct {
	l      net.Listener
	target string
	mu     sync.Mutex
	down   bool
	conns  map[net.Conn]bool
}

func startProxy(t *testing.T, host string, port uint16) *proxy {
	t.Helper()
	if strings.HasPrefix(host, "/") {
		t.Skipf("PostgreSQL is reached over a Unix socket (%s): no TCP to cut", host)
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	p := &proxy{l: l, target: net.JoinHostPort(host, strconv.Itoa(int(port))), conns: map[net.Conn]bool{}}
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				p.serve(c)
			}()
		}
	}()
	t.Cleanup(func() {
		_ = l.Close()
		p.setDown(true)
		wg.Wait()
	})
	return p
}

func (p *proxy) serve(client net.Conn) {
	server, err := net.DialTimeout("tcp", p.target, 5*time.Second)
	if err != nil {
		_ = client.Close()
		return
	}
	p.mu.Lock()
	if p.down {
		p.mu.Unlock()
		_ = client.Close()
		_ = server.Close()
		return
	}
	p.conns[client], p.conns[server] = true, true
	p.mu.Unlock()
	done := make(chan struct{}, 2)
	pipe := func(dst, src net.Conn) {
		_, _ = io.Copy(dst, src)
		done <- struct{}{}
	}
	go pipe(server, client)
	go pipe(client, server)
	<-done
	_ = client.Close()
	_ = server.Close()
	<-done
	p.mu.Lock()
	delete(p.conns, client)
	delete(p.conns, server)
	p.mu.Unlock()
}

func (p *proxy) setDown(down bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.down = down
	if down {
		for c := range p.conns {
			_ = c.Close()
		}
	}
}

// databaseURL returns dbURL with its host and port replaced by the
// proxy's.
func (p *proxy) databaseURL(t *testing.T, dbURL string) string {
	t.Helper()
	u, err := url.Parse(dbURL)
	if err != nil || (u.Scheme != "postgres" && u.Scheme != "postgresql") {
		return dbURL + " host=127.0.0.1 port=" + strconv.Itoa(p.l.Addr().(*net.TCPAddr).Port)
	}
	u.Host = p.l.Addr().String()
	return u.String()
}

// ---------------------------------------------------------------- helpers

// waitFor polls cond every 200 ms until it holds, and fails the test with
// cond's last status after timeout.
func waitFor(t *testing.T, timeout time.Duration, what string, cond func() (bool, string)) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		ok, status := cond()
		if ok {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within %s; last: %s", what, timeout, status)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

var httpClient = &http.Client{Timeout: 5 * time.Second}

func httpGet(u string) (int, string, error) {
	resp, err := httpClient.Get(u)
	if err != nil {
		return 0, "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b), err
}

// freeAddr returns a 127.0.0.1 address with a port free a moment ago.
func freeAddr(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer l.Close()
	return l.Addr().String()
}

func randomSuffix(t *testing.T) string {
	var b [4]byte
	_, err := rand.Read(b[:])
	require.NoError(t, err)
	return hex.EncodeToString(b[:])
}

func tail(s string, n int) string {
	if len(s) > n {
		return s[len(s)-n:]
	}
	return s
}
