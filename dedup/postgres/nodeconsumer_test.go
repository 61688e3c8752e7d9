package postgres_test

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/adapters/amqp"
	"github.com/oncemill/oncemill/dedup/postgres"
	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/internal/testing/nodetest"
	"github.com/oncemill/oncemill/internal/testing/pgtest"
	"github.com/oncemill/oncemill/middleware"
)

// nodeConsumer installs testdata/nodeconsumer (the npm packages pg and
// amqplib, at the versions its lock file pins) in a directory of the
// test's own and returns the node binary and that directory.
func nodeConsumer(t *testing.T) (node, dir string) {
	t.Helper()
	return nodetest.Install(t, filepath.Join("testdata", "nodeconsumer"), "consumer.js", "the npm packages pg and amqplib")
}

// nodeProcess is a running consumer.js; commits gets a line per commit.
type nodeProcess struct {
	cmd     *exec.Cmd
	commits chan string
	stderr  *strings.Builder
	done    chan struct{}
}

func startNode(t *testing.T, node, dir string, args ...string) *nodeProcess {
	t.Helper()
	cmd := exec.Command(node, append([]string{"consumer.js"}, args...)...)
	cmd.Dir = dir
	p := &nodeProcess{cmd: cmd, commits: make(chan string, 1024), stderr: &strings.Builder{}, done: make(chan struct{})}
	cmd.Stderr = p.stderr
	out, err := cmd.StdoutPipe()
	require.NoError(t, err)
	require.NoError(t, cmd.Start())
	go func() {
		defer close(p.done)
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			select {
			case p.commits <- sc.Text():
			default:
			}
		}
		_, _ = io.Copy(io.Discard, out)
		_ = cmd.Wait()
	}()
	t.Cleanup(p.kill)
	return p
}

// kill sends SIGKILL and waits for the process to end.
func (p *nodeProcess) kill() {
	_ = p.cmd.Process.Signal(syscall.SIGKILL)
	<-p.done
}

// TestNodeConsumerKeepsTheInboxBesideGo: the SQL recipe of
// docs/consumers.md, run by a Node.js consumer (npm pg and amqplib) of one
// consumer group, and a Go consumer (router, middleware.Inbox on this
// store) of another group, on one RabbitMQ topic and one inbox table. Each
// event is published three times, and the Node.js consumer is killed
// (SIGKILL) once mid-stream and started again. Each group applies each
// event exactly once, counted in the database, and every key of both
// groups is done in the inbox. The Node.js consumer's first attempt on one
// key fails: the failure is recorded as failed, and the redelivery claims
// the key again and applies it once.
func TestNodeConsumerKeepsTheInboxBesideGo(t *testing.T) {
	t.Parallel()
	url := os.Getenv("ONCEMILL_AMQP_URL")
	if url == "" {
		url = "amqp://guest:guest@127.0.0.1:5672/"
	}
	admin, err := amqp091.DialConfig(url, amqp091.Config{Dial: amqp091.DefaultDial(3 * time.Second)})
	if err != nil {
		pgtest.Unavailable(t, "RabbitMQ", err)
	}
	node, dir := nodeConsumer(t)

	b := setup(t, 8)
	ctx := context.Background()
	_, err = b.pool.Exec(ctx, `CREATE TABLE "`+b.schema+`".effects (
		consumer text NOT NULL, key text NOT NULL, applied integer NOT NULL, PRIMARY KEY (consumer, key))`)
	require.NoError(t, err)

	topic := "oncemill-test-" + pgtest.Name(t)
	goCfg := amqp.Config{URL: url, ConsumerGroup: "go"}
	nodeCfg := amqp.Config{URL: url, ConsumerGroup: "node"}
	require.NoError(t, amqp.Declare(ctx, goCfg, topic))
	require.NoError(t, amqp.Declare(ctx, nodeCfg, topic))
	t.Cleanup(func() {
		ch, err := admin.Channel()
		require.NoError(t, err)
		for _, q := range []string{goCfg.QueueName(topic), nodeCfg.QueueName(topic)} {
			_, err = ch.QueueDelete(q, false, false, false)
			require.NoError(t, err)
		}
		require.NoError(t, ch.ExchangeDelete(goCfg.ExchangeName(topic), false, false))
		require.NoError(t, ch.Close())
		require.NoError(t, admin.Close())
	})

	const (
		events     = 40
		copies     = 3
		goGroup    = "billing-go"
		nodeGroup  = "billing-node"
		failingKey = "order-7:paid"
	)
	keys := make([]string, events)
	for i := range keys {
		keys[i] = fmt.Sprintf("order-%d:paid", i)
	}

	// The Go consumer: a router with the inbox on this store.
	inbox, err := middleware.NewInbox(middleware.InboxConfig{TxStore: b.store, Consumer: goGroup})
	require.NoError(t, err)
	sub, err := amqp.NewSubscriber(goCfg, nil)
	require.NoError(t, err)
	router, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	require.NoError(t, err)
	router.AddMiddleware(inbox.Middleware)
	router.AddConsumerHandler("go-consumer", topic, sub, func(msg *message.Message) error {
		_, err := postgres.Tx(msg.Context()).Exec(msg.Context(), `INSERT INTO "`+b.schema+`".effects (consumer, key, applied) VALUES ($1, $2, 1)
			ON CONFLICT (consumer, key) DO UPDATE SET applied = effects.applied + 1`, goGroup, msg.Metadata.Get(delivery.IdempotencyKey))
		return err
	})
	routerDone := make(chan error, 1)
	go func() { routerDone <- router.Run(context.Background()) }()
	t.Cleanup(func() {
		require.NoError(t, router.Close())
		require.NoError(t, <-routerDone)
		require.NoError(t, sub.Close())
	})
	<-router.Running()

	// Every event three times, as a relay that died between publish and
	// delete, and a producer's retry, would publish it: the same UUID and
	// idempotency key on each copy.
	pub, err := amqp.NewPublisher(goCfg, nil)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, pub.Close()) })
	uuids := make([]string, events)
	for i := range uuids {
		uuids[i] = watermill.NewUUID()
	}
	for c := 0; c < copies; c++ {
		for i, k := range keys {
			m := message.NewMessage(uuids[i], []byte(`{"order":"`+k+`"}`))
			m.Metadata.Set(delivery.IdempotencyKey, k)
			require.NoError(t, pub.Publish(topic, m))
		}
	}

	args := []string{url, pgtest.URL(), b.schema, nodeCfg.QueueName(topic), nodeGroup, failingKey}
	first := startNode(t, node, dir, args...)
	for i := 0; i < 5; i++ {
		select {
		case <-first.commits:
		case <-first.done:
			t.Fatalf("the Node.js consumer ended: %s", first.stderr.String())
		case <-time.After(time.Minute):
			t.Fatalf("the Node.js consumer committed %d effects: %s", i, first.stderr.String())
		}
	}
	done := func(consumer string) int {
		var n int
		require.NoError(t, b.pool.QueryRow(ctx, `SELECT count(*) FROM "`+b.schema+`".inbox WHERE consumer = $1 AND status = 'done'`, consumer).Scan(&n))
		return n
	}
	first.kill() // mid-stream: its unacked message goes back to the queue
	require.Less(t, done(nodeGroup), events, "the Node.js consumer was killed before it was through")
	startNode(t, node, dir, args...)
	require.Eventually(t, func() bool { return done(goGroup) == events && done(nodeGroup) == events },
		2*time.Minute, 10*time.Millisecond, "every key of both groups done")
	// Every copy handled: the queues are empty (nothing left to apply a
	// second time).
	ch, err := admin.Channel()
	require.NoError(t, err)
	require.Eventually(t, func() bool {
		for _, q := range []string{goCfg.QueueName(topic), nodeCfg.QueueName(topic)} {
			st, err := ch.QueueDeclarePassive(q, true, false, false, false, goCfg.QueueArguments())
			require.NoError(t, err)
			if st.Messages > 0 {
				return false
			}
		}
		return true
	}, 2*time.Minute, 10*time.Millisecond, "every copy consumed")
	require.NoError(t, ch.Close())

	applied := map[string]map[string]int{goGroup: {}, nodeGroup: {}}
	rows, err := b.pool.Query(ctx, `SELECT consumer, key, applied FROM "`+b.schema+`".effects`)
	require.NoError(t, err)
	for rows.Next() {
		var (
			consumer, key string
			n             int
		)
		require.NoError(t, rows.Scan(&consumer, &key, &n))
		applied[consumer][key] = n
	}
	require.NoError(t, rows.Err())
	for _, group := range []string{goGroup, nodeGroup} {
		require.Len(t, applied[group], events, "group %s applied every event", group)
		for _, k := range keys {
			require.Equal(t, 1, applied[group][k], "group %s applied %s once", group, k)
		}
	}

	var (
		status   string
		attempts int
		firstErr *string
	)
	require.NoError(t, b.pool.QueryRow(ctx, `SELECT i.status, COALESCE(f.attempts, CASE WHEN i.status = 'done' THEN 1 ELSE 0 END), f.first_error FROM "`+b.schema+`".inbox i
		LEFT JOIN "`+b.schema+`".inbox_failures f USING (consumer, key) WHERE consumer = $1 AND key = $2`,
		nodeGroup, failingKey).Scan(&status, &attempts, &firstErr))
	require.Equal(t, "done", status)
	require.Equal(t, 2, attempts, "the failed attempt and the one that applied it")
	require.NotNil(t, firstErr)
	require.Equal(t, "the first attempt fails", *firstErr)
}
