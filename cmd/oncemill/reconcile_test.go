package main

import (
	"context"
	"fmt"
	"net/http"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/adapters"
	"github.com/oncemill/oncemill/dedup/postgres"
	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/forwarder"
	"github.com/oncemill/oncemill/internal/testing/pgtest"
	"github.com/oncemill/oncemill/middleware"
	"github.com/oncemill/oncemill/sqlschema"
)

// reconcile runs "oncemill reconcile" on the fixture's schema, with a
// grace short enough for the events the test just relayed.
func (f fixture) reconcile(t *testing.T, consumer string, args ...string) result {
	t.Helper()
	full := append([]string{"reconcile", "--database", pgtest.URL(), "--schema", f.schema, "--consumer", consumer, "--grace", "1ms", "--since", "1h"}, args...)
	return oncemill(t, nil, full...)
}

// reconcileRows returns the event lines of a report: its first word and
// UUID (or key) per line.
func reconcileRows(out string) map[string]string {
	rows := map[string]string{}
	for _, line := range strings.Split(out, "\n") {
		f := strings.Fields(line)
		if len(f) >= 2 && (f[0] == "lost" || f[0] == "stuck") {
			rows[f[1]] = f[0]
		}
	}
	return rows
}

// TestReconcile: a relay with its ledger on publishes a service's events
// to RabbitMQ, and a consumer with the PostgreSQL inbox applies them:
// reconcile finds nothing missing. Then a done inbox row is lost, a
// relayed message is purged from its queue before the consumer sees it,
// and a key is marked done that no event explains: reconcile lists each,
// and exits 1; an event dead-lettered by the consumer is not missing.
func TestReconcile(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := setup(t)
	rb := newRabbit(t)
	const group, consumer = "billing", "charge"
	topic := rb.topic("reconcile", "$."+group)
	queue := topic + "." + group
	r := oncemill(t, nil, "amqp", "declare", "--topic", topic, "--group", group, "--url", rb.url)
	require.Equal(t, exitOK, r.code, r.stderr)

	u, err := url.Parse(rb.url)
	require.NoError(t, err)
	q := u.Query()
	q.Set("group", group)
	u.RawQuery = q.Encode()
	ps, err := adapters.Open(ctx, u.String(), adapters.Options{})
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, ps.Close()) })

	schema := sqlschema.Config{Schema: f.schema}
	relay, err := forwarder.NewRelay(forwarder.RelayConfig{Pool: f.pool, Publisher: ps.Publisher, Schema: schema, Ledger: true, LockOrderedWriters: true})
	require.NoError(t, err)
	write := func(events ...*message.Message) {
		t.Helper()
		tx, err := f.pool.Begin(ctx)
		require.NoError(t, err)
		defer tx.Rollback(ctx) //nolint:errcheck // no-op after commit
		pub, err := forwarder.NewTxPublisher(ctx, tx, schema)
		require.NoError(t, err)
		require.NoError(t, pub.Publish(topic, events...))
		require.NoError(t, tx.Commit(ctx))
		relayed := 0
		require.Eventually(t, func() bool {
			n, err := relay.RelayBatch(ctx)
			require.NoError(t, err)
			relayed += n
			return relayed == len(events)
		}, 30*time.Second, 10*time.Millisecond)
	}
	newEvent := func(i int) *message.Message {
		m := message.NewMessage(watermill.NewUUID(), []byte(fmt.Sprintf(`{"order":%d}`, i)))
		m.Metadata.Set(delivery.IdempotencyKey, fmt.Sprintf("order-%d:%s", i, m.UUID))
		m.Metadata.Set(delivery.PartitionKey, fmt.Sprintf("order-%d", i))
		return m
	}

	// The consumer: the inbox and the effect in one PostgreSQL
	// transaction.
	store, err := postgres.New(f.pool, schema)
	require.NoError(t, err)
	inbox, err := middleware.NewInbox(middleware.InboxConfig{TxStore: store, Consumer: consumer})
	require.NoError(t, err)
	effects := pgx.Identifier{f.schema, "effects"}.Sanitize()
	_, err = f.pool.Exec(ctx, `CREATE TABLE `+effects+` (key text PRIMARY KEY)`)
	require.NoError(t, err)
	count := func(query string, args ...any) (n int) {
		t.Helper()
		require.NoError(t, f.pool.QueryRow(ctx, query, args...).Scan(&n))
		return n
	}
	inboxTable := pgx.Identifier{f.schema, "inbox"}.Sanitize()
	startConsumer := func() (stop func()) {
		runCtx, cancel := context.WithCancel(ctx)
		router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
		require.NoError(t, err)
		router.AddMiddleware(inbox.Middleware)
		router.AddConsumerHandler(consumer, topic, ps.Subscriber, func(msg *message.Message) error {
			_, err := postgres.Tx(msg.Context()).Exec(msg.Context(), `INSERT INTO `+effects+` (key) VALUES ($1)`, middleware.IdempotencyKey(msg.Context()))
			return err
		})
		done := make(chan error, 1)
		go func() { done <- router.Run(runCtx) }()
		<-router.Running()
		return func() {
			cancel()
			require.NoError(t, <-done)
		}
	}

	const n = 5
	events := make([]*message.Message, n)
	for i := range events {
		events[i] = newEvent(i)
	}
	stop := startConsumer()
	write(events...)
	require.Eventually(t, func() bool {
		return count(`SELECT count(*) FROM `+inboxTable+` WHERE consumer = $1 AND status = 'done'`, consumer) == n
	}, 30*time.Second, 20*time.Millisecond)
	stop()
	require.Equal(t, n, count(`SELECT count(*) FROM `+effects))

	r = f.reconcile(t, consumer)
	require.Equal(t, exitOK, r.code, r.stdout+r.stderr)
	require.True(t, strings.HasPrefix(r.stdout, "0 missing"), r.stdout)
	require.Contains(t, r.stdout, fmt.Sprintf("of %d events", n))
	require.Empty(t, r.stderr)
	r = f.reconcile(t, consumer, "--strict")
	require.Equal(t, exitOK, r.code, r.stdout+r.stderr)
	require.True(t, strings.HasPrefix(r.stdout, "0 missing"), r.stdout)
	r = f.reconcile(t, "another-consumer")
	require.Equal(t, exitFailure, r.code, "another consumer applied none of them")
	require.Len(t, reconcileRows(r.stdout), n)

	// (a) A done inbox row is lost.
	gone := events[1]
	_, err = f.pool.Exec(ctx, `DELETE FROM `+inboxTable+` WHERE consumer = $1 AND key = $2`, consumer, gone.Metadata.Get(delivery.IdempotencyKey))
	require.NoError(t, err)
	r = f.reconcile(t, consumer)
	require.Equal(t, exitFailure, r.code, r.stdout+r.stderr)
	require.Equal(t, map[string]string{gone.UUID: "lost"}, reconcileRows(r.stdout))
	require.Contains(t, r.stdout, gone.Metadata.Get(delivery.IdempotencyKey))
	require.Contains(t, r.stdout, topic)
	require.Contains(t, r.stdout, "1 missing")
	require.Equal(t, "oncemill reconcile: 1 missing\n", r.stderr)

	// (b) A relayed message is purged from its queue before the consumer
	// runs: the broker lost it.
	queued := func(want int) {
		t.Helper()
		require.Eventually(t, func() bool {
			ch, err := rb.conn.Channel()
			require.NoError(t, err)
			defer ch.Close()
			q, err := ch.QueueDeclarePassive(queue, true, false, false, false, nil)
			require.NoError(t, err)
			return q.Consumers == 0 && q.Messages == want
		}, 30*time.Second, 20*time.Millisecond, "the queue holds %d messages and has no consumer", want)
	}
	queued(0)
	dropped := newEvent(n)
	write(dropped)
	queued(1)
	ch, err := rb.conn.Channel()
	require.NoError(t, err)
	purged, err := ch.QueuePurge(queue, false)
	require.NoError(t, err)
	require.Equal(t, 1, purged)
	// A stuck one: the consumer failed it and has not succeeded since
	// (its copy is taken off the queue, as a consumer parked on it would
	// hold it).
	stuck := newEvent(n + 1)
	write(stuck)
	queued(1)
	purged, err = ch.QueuePurge(queue, false)
	require.NoError(t, err)
	require.Equal(t, 1, purged)
	require.NoError(t, ch.Close())
	_, err = f.pool.Exec(ctx, `INSERT INTO `+inboxTable+` (consumer, key, status, expires_at) VALUES ($1, $2, 'failed', now() + interval '1 hour')`,
		consumer, stuck.Metadata.Get(delivery.IdempotencyKey))
	require.NoError(t, err)
	r = f.reconcile(t, consumer)
	require.Equal(t, exitFailure, r.code, r.stdout+r.stderr)
	require.Equal(t, map[string]string{gone.UUID: "lost", dropped.UUID: "lost", stuck.UUID: "stuck"}, reconcileRows(r.stdout))
	require.Contains(t, r.stdout, "failed")
	require.Contains(t, r.stdout, "3 missing (2 lost, 1 stuck)")
	// --limit lists the oldest and counts them all.
	r = f.reconcile(t, consumer, "--limit", "1")
	require.Equal(t, exitFailure, r.code, r.stdout+r.stderr)
	require.Equal(t, map[string]string{gone.UUID: "lost"}, reconcileRows(r.stdout))
	require.Contains(t, r.stdout, "(the oldest 1 of 3 listed: --limit)")
	require.Equal(t, "oncemill reconcile: 3 missing\n", r.stderr)
	// --topic checks the consumer's topics only: another topic's consumer
	// misses nothing here.
	r = f.reconcile(t, consumer, "--topic", topic)
	require.Equal(t, exitFailure, r.code, r.stdout+r.stderr)
	require.Len(t, reconcileRows(r.stdout), 3)
	r = f.reconcile(t, consumer, "--topic", "payments,refunds")
	require.Equal(t, exitOK, r.code, r.stdout+r.stderr)
	require.True(t, strings.HasPrefix(r.stdout, "0 missing (0 lost, 0 stuck) of 0 events"), r.stdout)

	// An event the consumer dead-lettered is not missing: it is what
	// 'oncemill dlq list' shows.
	deadLetter := dead(topic, consumer, "card declined")
	deadLetter.UUID = stuck.UUID
	deadLetter.Metadata.Set(delivery.DeadKey, stuck.Metadata.Get(delivery.IdempotencyKey))
	f.seed(t, deadLetter)
	list := f.dlq(t, "list", "--consumer", consumer, "--json")
	require.Equal(t, exitOK, list.code, list.stderr)
	require.Contains(t, list.stdout, stuck.UUID)
	r = f.reconcile(t, consumer)
	require.Equal(t, exitFailure, r.code, r.stdout+r.stderr)
	require.Equal(t, map[string]string{gone.UUID: "lost", dropped.UUID: "lost"}, reconcileRows(r.stdout))

	// (c) A key done in the inbox that no published event explains.
	_, err = f.pool.Exec(ctx, `INSERT INTO `+inboxTable+` (consumer, key, status, done_at, expires_at)
		VALUES ($1, 'forged-key', 'done', now() - interval '1 second', now() + interval '1 hour')`, consumer)
	require.NoError(t, err)
	r = f.reconcile(t, consumer)
	require.NotContains(t, r.stdout, "forged-key", "without --strict")
	r = f.reconcile(t, consumer, "--strict")
	require.Equal(t, exitFailure, r.code, r.stdout+r.stderr)
	require.Contains(t, r.stdout, "\nforged-key ")
	require.Equal(t, map[string]string{gone.UUID: "lost", dropped.UUID: "lost"}, reconcileRows(r.stdout))
	require.Equal(t, 1, strings.Count(r.stdout, "UNEXPLAINED KEY"))
	require.Equal(t, "oncemill reconcile: 2 missing, 1 unexplained\n", r.stderr)
	for _, e := range events {
		require.NotContains(t, r.stdout, "\n"+e.Metadata.Get(delivery.IdempotencyKey)+" ", "explained by its ledger row")
	}

	// The console's overview shows the same findings.
	const token = "reconcile-console-token"
	cr := startConsole(t, nil, "--addr", "127.0.0.1:0", "--database", pgtest.URL(), "--schema", f.schema, "--token", token,
		"--reconcile", consumer+"="+topic, "--reconcile-grace", "1ms", "--reconcile-since", "1h")
	code, body := get(t, cr.url, "", token)
	require.Equal(t, http.StatusOK, code, body)
	require.Contains(t, body, `id="overview-reconcile"`)
	for _, lost := range []*message.Message{gone, dropped} {
		require.Regexp(t, `lost</span></td><td class="mono">`+lost.UUID+`</td>`, body)
	}
	require.NotContains(t, body, stuck.UUID, "dead-lettered")
	require.Equal(t, exitOK, cr.stop(t), "stderr: %s", cr.stderr)

	// Outside --since, nothing is checked.
	r = oncemill(t, nil, "reconcile", "--database", pgtest.URL(), "--schema", f.schema, "--consumer", consumer, "--grace", "1h", "--since", "2h")
	require.Equal(t, exitOK, r.code, r.stdout+r.stderr)
	require.True(t, strings.HasPrefix(r.stdout, "0 missing (0 lost, 0 stuck) of 0 events"), r.stdout)
}

// TestReconcileErrors: flag mistakes exit 2 naming the flag, before
// anything connects; a check that cannot run exits 3, not 1.
func TestReconcileErrors(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--consumer", "c"}, "--database is required"},
		{[]string{"--database", "postgres://x/y"}, "--consumer is required"},
		{[]string{"--database", "postgres://x/y", "--consumer", "c", "--grace", "2h", "--since", "1h"}, "--since (1h0m0s) must be longer than --grace"},
		{[]string{"--database", "postgres://x/y", "--consumer", "c", "--since", "-1h"}, `flag -since: "-1h" is not a positive duration`},
		{[]string{"--database", "postgres://x/y", "--consumer", "c", "--schema", "Bad"}, "--schema"},
		{[]string{"--database", "mysql://root@127.0.0.1:3306/test?timeout=soon", "--consumer", "c"}, "--database"},
		{[]string{"--database", "postgres://x/y", "--consumer", "c", "--limit", "0"}, "--limit must be at least 1"},
		{[]string{"--database", "postgres://x/y", "--consumer", "c", "--topic", "a,,b"}, `"a,,b" holds an empty topic`},
		{[]string{"--database", "postgres://x/y", "--consumer", "c", "extra"}, `unexpected argument "extra"`},
	} {
		r := oncemill(t, nil, append([]string{"reconcile"}, tc.args...)...)
		require.Equal(t, exitUsage, r.code, "%v: %s", tc.args, r.stderr)
		requireOneLine(t, r.stderr)
		require.Contains(t, r.stderr, tc.want, tc.args)
	}

	f := setup(t)
	r := oncemill(t, nil, "reconcile", "--database", pgtest.URL(), "--schema", f.schema, "--ledger-table", "no_such_table", "--consumer", "c")
	require.Equal(t, exitCannotCheck, r.code, r.stderr)
	requireOneLine(t, r.stderr)
	require.Contains(t, r.stderr, "no_such_table")
	// On MySQL too: a database without the ledger table.
	r = oncemill(t, nil, "reconcile", "--database", "mysql://root@127.0.0.1:3306/test", "--schema", "no_such_database", "--consumer", "c")
	require.Equal(t, exitCannotCheck, r.code, r.stderr)
	requireOneLine(t, r.stderr)
	require.Contains(t, r.stderr, "no_such_database")
	r = oncemill(t, nil, "reconcile", "--database", "postgres://postgres@127.0.0.1:1/test?connect_timeout=2", "--consumer", "c")
	require.Equal(t, exitCannotCheck, r.code, r.stderr)
	require.Contains(t, r.stderr, "--database")
}
