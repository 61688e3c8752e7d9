package console_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/chromedp/chromedp"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/adapters"
	"github.com/oncemill/oncemill/adapters/amqp"
	"github.com/oncemill/oncemill/console"
	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/internal/testing/brokertest"
	"github.com/oncemill/oncemill/internal/testing/msgtest"
	"github.com/oncemill/oncemill/internal/testing/pgtest"
	"github.com/oncemill/oncemill/sqlschema"
)

// The broker browser test drives a replay to the original topic through a
// real RabbitMQ: the console publishes with the amqp adapter, as `oncemill
// console --broker amqp://…` does, and the test reads what reached the
// consumer group's queue with a subscriber of the same adapter.

// rabbitURL returns the RabbitMQ the test uses (ONCEMILL_AMQP_URL, else the
// local broker), or skips the test (fails it under CI) when it is
// unreachable. The connection it checks with stays open until the test
// ends, for inspection and cleanup.
func rabbitURL(t *testing.T) (string, *amqp091.Connection) {
	t.Helper()
	u := os.Getenv("ONCEMILL_AMQP_URL")
	if u == "" {
		u = "amqp://guest:guest@127.0.0.1:5672/"
	}
	conn, err := amqp091.DialConfig(u, amqp091.Config{Dial: amqp091.DefaultDial(3 * time.Second)})
	if err != nil {
		pgtest.Unavailable(t, "RabbitMQ", err)
	}
	t.Cleanup(func() {
		if err := conn.Close(); err != nil && !errors.Is(err, amqp091.ErrClosed) {
			t.Errorf("close the RabbitMQ admin connection: %v", err)
		}
	})
	return u, conn
}

// deleteTopology deletes queue and exchange when the test ends, after
// everything registered later (the publisher and the subscriber) closed.
func deleteTopology(t *testing.T, admin *amqp091.Connection, queue, exchange string) {
	t.Helper()
	t.Cleanup(func() {
		ch, err := admin.Channel()
		if err != nil {
			t.Errorf("cleanup: open channel: %v", err)
			return
		}
		defer ch.Close()
		if _, err := ch.QueueDelete(queue, false, false, false); err != nil {
			t.Errorf("cleanup: delete queue %q: %v", queue, err)
			return
		}
		if err := ch.ExchangeDelete(exchange, false, false); err != nil {
			t.Errorf("cleanup: delete exchange %q: %v", exchange, err)
		}
	})
}

// dlqRows returns every row of the dead-letter table as JSON, by id, to
// compare what an action must leave untouched.
func dlqRows(t *testing.T, pool *pgxpool.Pool, table string) map[int64]string {
	t.Helper()
	rows, err := pool.Query(context.Background(), `SELECT id, to_jsonb(d)::text FROM `+table+` d ORDER BY id`)
	require.NoError(t, err)
	out := map[int64]string{}
	for rows.Next() {
		var (
			id  int64
			row string
		)
		require.NoError(t, rows.Scan(&id, &row))
		out[id] = row
	}
	require.NoError(t, rows.Err())
	return out
}

// login signs in at the login form with the right token and lands on the
// overview.
func (b *headless) login(t *testing.T, base string) {
	t.Helper()
	b.do(t, "open the login page", chromedp.Navigate(base+"/login"), chromedp.WaitVisible(chromedp.ID("login-form")))
	b.do(t, "type the token", chromedp.SendKeys(chromedp.CSS(`#login-form input[name="token"]`), browserToken))
	require.Equal(t, int64(http.StatusOK), b.navigate(t, "log in", chromedp.Click(chromedp.CSS(`#login-form button[type="submit"]`))))
	loc, err := chromedp.Run(b.ctx, chromedp.Location())
	require.NoError(t, err)
	require.Equal(t, base+"/", loc, "the login leads to the overview")
}

// TestBrowserReplayToTopic: an operator filters the dead letters to a
// topic, opens one error group, replays it to the topic and confirms; the
// consumer group's RabbitMQ queue then holds exactly the group's messages,
// their entries are gone from the table, and every other entry is as it
// was.
func TestBrowserReplayToTopic(t *testing.T) {
	t.Parallel()
	b := startBrowser(t) // first: skipped without Chromium before anything is written
	rabbit, admin := rabbitURL(t)

	ctx := context.Background()
	pool := pgtest.Pool(t, 8)
	cfg := sqlschema.Config{Schema: pgtest.Schema(t, pool)}.WithDefaults()
	names := sqlschema.NamesFor(sqlschema.Postgres, cfg)

	var suffix [6]byte
	_, _ = rand.Read(suffix[:])
	topic := "oncemill-test-console-payments-" + hex.EncodeToString(suffix[:])
	const group = "billing"
	// The consumer group's queue, bound before anything is published:
	// a fanout exchange drops what no queue is bound to.
	consumerCfg := amqp.Config{URL: rabbit, ConsumerGroup: group}
	deleteTopology(t, admin, consumerCfg.QueueName(topic), consumerCfg.ExchangeName(topic))
	require.NoError(t, amqp.Declare(ctx, consumerCfg, topic))
	require.Zero(t, brokertest.AMQPReady(t, rabbit, topic, group), "the queue starts empty")

	// Three card declines and two ledger timeouts of the topic, and a
	// card decline of another topic, which no queue is bound to: it is in
	// the same error group, so only the topic filter keeps it out.
	var letters []demoLetter
	for i, order := range []int{1234, 4471, 5208} {
		letters = append(letters, demoLetter{consumer: group, topic: topic, key: fmt.Sprintf("pay-%d", order),
			err: fmt.Sprintf("card declined for order %d", order), attempts: 5, ago: time.Duration(40-i*10) * time.Minute,
			payload: fmt.Sprintf(`{"order":%d,"amount_cents":%d,"currency":"EUR"}`, order, 1999+i*250)})
	}
	for i, order := range []int{3320, 3341} {
		letters = append(letters, demoLetter{consumer: group, topic: topic, key: fmt.Sprintf("pay-%d", order),
			err: "timeout after 30s calling ledger", attempts: 5, ago: time.Duration(3-i) * time.Hour,
			payload: fmt.Sprintf(`{"order":%d,"amount_cents":4500,"currency":"EUR"}`, order)})
	}
	letters = append(letters, demoLetter{consumer: "refunds", topic: "refunds.requested", key: "ref-7781", attempts: 5, ago: 2 * time.Hour,
		err: "card declined for order 7781", payload: `{"order":7781,"amount_cents":990,"currency":"EUR"}`})
	entries := seedDemoDeadLetters(t, pool, cfg, letters)
	declined := entries[:3]
	before := dlqRows(t, pool, names.DLQ)
	require.Len(t, before, len(letters))

	// The console publishes through the adapters, as the command does.
	broker, err := adapters.Open(ctx, rabbit, adapters.Options{ConsumerGroup: "oncemill-console"})
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, broker.Close()) })
	handler, err := console.New(console.Config{Pool: pool, Schema: cfg, Token: browserToken, Publisher: broker.Publisher})
	require.NoError(t, err)
	srv := httptest.NewServer(handler)
	t.Cleanup(srv.Close)

	b.login(t, srv.URL)
	require.Equal(t, int64(http.StatusOK), b.navigate(t, "open the dead letters",
		chromedp.Click(chromedp.CSS(`header nav a[href$="dlq"]`))))
	require.Equal(t, strconv.Itoa(len(entries)), b.text(t, "#dlq-total"))

	// Filter to the topic, then open the card declines' group.
	b.do(t, "type the topic", chromedp.SendKeys(chromedp.CSS(`#dlq-filter input[name="topic"]`), topic))
	require.Equal(t, int64(http.StatusOK), b.navigate(t, "filter",
		chromedp.Click(chromedp.CSS(`#dlq-filter button[type="submit"]`))))
	require.Equal(t, "5", b.text(t, "#dlq-total"), "the topic's entries")
	require.Equal(t, int64(http.StatusOK), b.navigate(t, "open the card declines' group",
		chromedp.Click(chromedp.Search(`//table[@id="dlq-groups"]//a[contains(@class, "group-link")][starts-with(normalize-space(.), "card declined")]`))))
	loc, err := chromedp.Run(b.ctx, chromedp.Location())
	require.NoError(t, err)
	u, err := url.Parse(loc)
	require.NoError(t, err)
	require.Equal(t, topic, u.Query().Get("topic"), "the group keeps the filter")
	require.Equal(t, "card declined for order <n>", u.Query().Get("group"))
	require.Equal(t, "3", b.text(t, "#dlq-total"))
	require.Contains(t, b.text(t, "#active-group"), "card declined for order <n>")
	rows := evalIn[[]string](t, b, `Array.from(document.querySelectorAll('#dlq-table tbody tr[data-id]'), tr => tr.dataset.id)`)
	want := make([]string, len(declined))
	for i, e := range declined {
		want[len(declined)-1-i] = strconv.FormatInt(e.id, 10) // newest first
	}
	require.Equal(t, want, rows, "the group's entries of the topic, newest first")

	// Replay the whole group to the topic.
	require.Contains(t, b.text(t, "#dlq-bulk-form"), "All 3 in this group")
	require.Equal(t, int64(http.StatusOK), b.navigate(t, "replay the group to the topic",
		chromedp.Click(chromedp.CSS(`#dlq-bulk-form button[name="action"][value="replay-topic"]`))))

	// The confirm page says how many and where; nothing is published yet.
	b.do(t, "see the confirm page", chromedp.WaitVisible(chromedp.ID("confirm-form")))
	require.Equal(t, "Replay 3 entries to topic "+topic+": every consumer group of it receives them.", b.text(t, "#confirm-summary"))
	dests := evalIn[[]string](t, b, `Array.from(document.querySelectorAll('#confirm-destinations tbody tr'), tr => tr.innerText.replace(/\s+/g, ' ').trim())`)
	require.Equal(t, []string{topic + " 3"}, dests, "one destination: the topic, with the count")
	require.Contains(t, b.text(t, "#confirm-button"), "Replay 3 entries")
	require.Zero(t, brokertest.AMQPReady(t, rabbit, topic, group), "nothing published before the confirmation")
	require.Equal(t, before, dlqRows(t, pool, names.DLQ), "nothing changed before the confirmation")

	require.Equal(t, int64(http.StatusOK), b.navigate(t, "confirm", chromedp.Click(chromedp.ID("confirm-button"))))
	b.do(t, "see the outcome", chromedp.WaitVisible(chromedp.ID("flash")))
	require.Equal(t, "Replayed 3 entries to their topic.", b.text(t, "#flash"))
	require.Equal(t, "0", b.text(t, "#dlq-total"), "back on the group's list, now empty")

	// The table: the group's entries are gone, every other one is as it
	// was.
	after := dlqRows(t, pool, names.DLQ)
	wantAfter := map[int64]string{}
	for _, e := range entries[3:] {
		wantAfter[e.id] = before[e.id]
	}
	require.Equal(t, wantAfter, after, "the timeouts and the other topic's card decline are untouched")

	// The broker: the consumer group's queue holds exactly the group's
	// messages, with their UUIDs, payloads and the entries' ids.
	require.Equal(t, len(declined), brokertest.AMQPReady(t, rabbit, topic, group), "the queue holds the replayed messages")
	sub, err := amqp.NewSubscriber(consumerCfg, nil)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, sub.Close()) })
	subCtx, cancel := context.WithCancel(ctx)
	t.Cleanup(cancel)
	msgs, err := sub.Subscribe(subCtx, topic)
	require.NoError(t, err)
	byUUID := map[string]demoEntry{}
	for _, e := range declined {
		byUUID[e.uuid] = e
	}
	var got, wantUUIDs []string
	for range declined {
		m := msgtest.Receive(t, msgs, 20*time.Second)
		got = append(got, m.UUID)
		e, ok := byUUID[m.UUID]
		require.True(t, ok, "message %s is one of the group's", m.UUID)
		require.Equal(t, e.payload, string(m.Payload), "message %s keeps its payload", m.UUID)
		require.Len(t, m.Metadata.Get(delivery.Replay), 32, "message %s carries a fresh replay grant", m.UUID)
		require.Equal(t, e.key, m.Metadata.Get(delivery.IdempotencyKey), "message %s keeps its key", m.UUID)
		m.Ack()
	}
	for _, e := range declined {
		wantUUIDs = append(wantUUIDs, e.uuid)
	}
	slices.Sort(got)
	slices.Sort(wantUUIDs)
	require.Equal(t, wantUUIDs, got, "each of the group's messages once")
	b.requireNoScripts(t)
}
