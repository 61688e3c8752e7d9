package console_test

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strconv"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/chromedp/chromedp"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/console"
	"github.com/oncemill/oncemill/dedup/postgres"
	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/dlq"
	"github.com/oncemill/oncemill/internal/testing/pgtest"
	"github.com/oncemill/oncemill/middleware"
	"github.com/oncemill/oncemill/sqlschema"
)

// TestBrowserStrandedReplayAndReopen: with no replay subscriber of its
// consumer running, an entry's page and the confirm step of a replay to
// the consumer say so, and the overview shows the request nobody picks
// up. The operator reopens another entry's dead key from its page; the
// producer's corrected copy, a new message with a new payload, then runs
// once (a row in PostgreSQL) and a copy after it is a duplicate. Once the
// consumer runs with its replay subscriber, the waiting replay is
// delivered too.
func TestBrowserStrandedReplayAndReopen(t *testing.T) {
	t.Parallel()
	b := startBrowser(t) // first: skipped without Chromium before anything is written

	ctx := context.Background()
	pool := pgtest.Pool(t, 8)
	cfg := sqlschema.Config{Schema: pgtest.Schema(t, pool)}.WithDefaults()
	names := sqlschema.NamesFor(sqlschema.Postgres, cfg)
	entries := seedDemoDeadLetters(t, pool, cfg, []demoLetter{
		{consumer: "billing", topic: "payments", key: "pay-1", err: "order has no amount", attempts: 1, permanent: true,
			ago: time.Hour, payload: `{"order":1}`},
		{consumer: "billing", topic: "payments", key: "pay-2", err: "timeout after 30s calling ledger", attempts: 5,
			ago: 30 * time.Minute, payload: `{"order":2,"amount_cents":4500}`},
	})
	bad, waiting := entries[0], entries[1]

	handler, err := console.New(console.Config{Pool: pool, Schema: cfg, Token: browserToken})
	require.NoError(t, err)
	srv := httptest.NewServer(handler)
	t.Cleanup(srv.Close)
	b.login(t, srv.URL)

	// The entry's page warns before anything is asked.
	entryURL := func(e demoEntry) string { return srv.URL + "/dlq/" + strconv.FormatInt(e.id, 10) }
	require.Equal(t, int64(http.StatusOK), b.navigate(t, "open the timeout", chromedp.Navigate(entryURL(waiting))))
	const stranded = "No replay subscriber seen for consumer billing ever; the request waits in the table until one runs"
	require.Contains(t, b.text(t, "#no-replayer"), stranded)
	require.Equal(t, int64(http.StatusOK), b.navigate(t, "replay it to its consumer",
		chromedp.Click(chromedp.CSS(`#entry-actions button[value="replay-consumer"]`))))
	b.do(t, "see the confirm page", chromedp.WaitVisible(chromedp.ID("confirm-form")))
	require.Contains(t, b.text(t, ".confirm"), stranded, "the confirm step says it too")
	require.Equal(t, int64(http.StatusOK), b.navigate(t, "confirm", chromedp.Click(chromedp.ID("confirm-button"))))
	b.do(t, "see the outcome", chromedp.WaitVisible(chromedp.ID("flash")))

	// The overview shows the request that nobody picks up.
	require.Equal(t, int64(http.StatusOK), b.navigate(t, "open the overview", chromedp.Navigate(srv.URL+"/")))
	row := b.text(t, "#overview-pending-replays tbody tr")
	require.Contains(t, row, "billing")
	require.Contains(t, row, "payments")
	require.Contains(t, row, stranded)

	// The permanent failure: its page says a replay cannot succeed, and
	// offers the reopen, behind the confirm step.
	require.Equal(t, int64(http.StatusOK), b.navigate(t, "open the bad order", chromedp.Navigate(entryURL(bad))))
	require.Contains(t, b.text(t, "#hopeless"), "its error is permanent")
	require.Equal(t, int64(http.StatusOK), b.navigate(t, "reopen its key",
		chromedp.Click(chromedp.CSS(`#entry-actions button[value="reopen"]`))))
	b.do(t, "see the confirm page", chromedp.WaitVisible(chromedp.ID("confirm-form")))
	require.Contains(t, b.text(t, "#confirm-summary"), "Reopen the dead key of consumer billing for its next copy, whatever its payload")
	var status string
	inboxStatus := func(key string) string {
		require.NoError(t, pool.QueryRow(ctx, `SELECT status FROM `+names.Inbox+` WHERE consumer = 'billing' AND key = $1`, key).Scan(&status))
		return status
	}
	require.Equal(t, "dead", inboxStatus("pay-1"), "nothing changed before the confirmation")
	require.Equal(t, int64(http.StatusOK), b.navigate(t, "confirm", chromedp.Click(chromedp.ID("confirm-button"))))
	b.do(t, "see the outcome", chromedp.WaitVisible(chromedp.ID("flash")))
	require.Equal(t, "Reopened 1 entry (consumer billing, key pay-1): the next copy of the key runs once, whatever its payload.", b.text(t, "#flash"))
	require.Equal(t, "failed", inboxStatus("pay-1"))
	n, err := countWhere(ctx, pool, names.DLQ, "id = $1", bad.id)
	require.NoError(t, err)
	require.Zero(t, n, "the reopened entry is gone")

	// The consumer runs, with its replay subscriber; the producer sends
	// the corrected order, then a copy.
	effects := pgx.Identifier{cfg.Schema, "effects"}.Sanitize()
	_, err = pool.Exec(ctx, `CREATE TABLE `+effects+` (key text NOT NULL, payload text NOT NULL)`)
	require.NoError(t, err)
	live := runPaymentsConsumer(t, pool, cfg, effects)
	corrected := message.NewMessage(watermill.NewUUID(), []byte(`{"order":1,"amount_cents":1250}`))
	corrected.Metadata.Set(delivery.IdempotencyKey, "pay-1")
	require.NoError(t, live.Publish("payments", corrected))
	applied := func(key string) int {
		n, err := countWhere(ctx, pool, effects, "key = $1", key)
		require.NoError(t, err)
		return n
	}
	require.Eventually(t, func() bool { return applied("pay-1") == 1 && applied("pay-2") == 1 }, 30*time.Second, 20*time.Millisecond,
		"the corrected order runs, and the waiting replay is delivered")
	again := message.NewMessage(watermill.NewUUID(), []byte(`{"order":1,"amount_cents":9900}`))
	again.Metadata.Set(delivery.IdempotencyKey, "pay-1")
	require.NoError(t, live.Publish("payments", again))
	time.Sleep(300 * time.Millisecond)
	var payload string
	require.NoError(t, pool.QueryRow(ctx, `SELECT payload FROM `+effects+` WHERE key = 'pay-1'`).Scan(&payload))
	require.Equal(t, `{"order":1,"amount_cents":1250}`, payload, "the corrected copy ran, once; the copy after it is a duplicate")
	require.Equal(t, 1, applied("pay-1"))
	require.Equal(t, "done", inboxStatus("pay-1"))

	require.Equal(t, int64(http.StatusOK), b.navigate(t, "open the overview", chromedp.Navigate(srv.URL+"/")))
	left, err := chromedp.Run(b.ctx, chromedp.Evaluate[int](`document.querySelectorAll('#overview-pending-replays').length`))
	require.NoError(t, err)
	require.Zero(t, left, "no replay waits any more")
	b.requireNoScripts(t)
}

// runPaymentsConsumer runs the consumer "billing" of topic "payments" on
// the returned GoChannel, its requested replays merged in: a router with
// the inbox whose handler writes each message's key and payload into
// effects, in the inbox's transaction.
func runPaymentsConsumer(t *testing.T, pool *pgxpool.Pool, cfg sqlschema.Config, effects string) *gochannel.GoChannel {
	t.Helper()
	logger := watermill.NopLogger{}
	store, err := postgres.New(pool, postgres.Config{Schema: cfg.Schema})
	require.NoError(t, err)
	inbox, err := middleware.NewInbox(middleware.InboxConfig{TxStore: store, Consumer: "billing"})
	require.NoError(t, err)
	replays, err := dlq.NewReplaySubscriber(pool, cfg, dlq.ReplaySubscriberConfig{Consumer: "billing", PollInterval: 50 * time.Millisecond})
	require.NoError(t, err)
	live := gochannel.NewGoChannel(gochannel.Config{Persistent: true}, logger)
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, logger)
	require.NoError(t, err)
	router.AddMiddleware(inbox.Middleware)
	router.AddConsumerHandler("billing", "payments", dlq.WithReplays(live, replays), func(msg *message.Message) error {
		ctx := msg.Context()
		_, err := postgres.Tx(ctx).Exec(ctx, `INSERT INTO `+effects+` (key, payload) VALUES ($1, $2)`,
			middleware.IdempotencyKey(ctx), string(msg.Payload))
		return err
	})
	done := make(chan error, 1)
	go func() { done <- router.Run(context.Background()) }()
	select {
	case <-router.Running():
	case err := <-done:
		t.Fatalf("router stopped at start: %v", err)
	}
	t.Cleanup(func() {
		require.NoError(t, router.Close())
		require.NoError(t, <-done)
	})
	return live
}
