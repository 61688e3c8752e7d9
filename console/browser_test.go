package console_test

import (
	"bytes"
	"cmp"
	"context"
	"errors"
	"fmt"
	"image/png"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/chromedp/cdproto/page"
	"github.com/chromedp/cdproto/runtime"
	"github.com/chromedp/chromedp"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/console"
	"github.com/oncemill/oncemill/dedup/postgres"
	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/dlq"
	"github.com/oncemill/oncemill/forwarder"
	"github.com/oncemill/oncemill/internal/testing/pgtest"
	"github.com/oncemill/oncemill/middleware"
	"github.com/oncemill/oncemill/sqlschema"
)

// The browser test drives the console as an operator would, in a headless
// Chromium: log in, read the overview, find a group of failures on the
// dead letters' page, replay it to its consumer and confirm; then it
// checks in PostgreSQL that the consumer, a Watermill router with the
// inbox and dlq.WithReplays, applied each replayed message once.
//
// With ONCEMILL_WRITE_SCREENSHOTS=1 it writes the screenshots of the
// overview and of the dead letters' page into docs/; otherwise they go to
// a temporary directory, so that a test run changes nothing in the tree.

const (
	browserWidth   = 1366
	browserHeight  = 900
	browserTimeout = 90 * time.Second
	browserToken   = "browser-test-console-token-0123456789"
)

// chromiumPath returns the Chromium binary: "chromium" on PATH, else
// /usr/bin/chromium. Without one the test fails under CI=true and is
// skipped elsewhere.
func chromiumPath(t *testing.T) string {
	t.Helper()
	if p, err := exec.LookPath("chromium"); err == nil {
		return p
	}
	const fallback = "/usr/bin/chromium"
	if _, err := os.Stat(fallback); err != nil {
		pgtest.Unavailable(t, "Chromium (Debian's chromium package)", fmt.Errorf("no chromium on PATH and %s: %w", fallback, err))
	}
	return fallback
}

// demoLetter is one failure to seed.
type demoLetter struct {
	consumer, topic, key, err string
	attempts                  int
	permanent                 bool
	ago                       time.Duration // dead this long ago
	payload                   string
}

// demoEntry is a dead letter as written.
type demoEntry struct {
	demoLetter
	id   int64
	uuid string
}

// seedDemoDeadLetters writes the entries through dlq.Publisher, as the poison
// middleware does, and their keys as dead in the inbox.
func seedDemoDeadLetters(t *testing.T, pool *pgxpool.Pool, cfg sqlschema.Config, entries []demoLetter) []demoEntry {
	t.Helper()
	ctx := context.Background()
	pub, err := dlq.NewPublisher(pool, cfg)
	require.NoError(t, err)
	names := sqlschema.NamesFor(sqlschema.Postgres, cfg.WithDefaults())
	out := make([]demoEntry, 0, len(entries))
	for _, d := range entries {
		m := message.NewMessage(watermill.NewUUID(), []byte(d.payload))
		first := time.Now().Add(-d.ago - time.Duration(d.attempts)*time.Minute).UTC()
		last := time.Now().Add(-d.ago).UTC()
		m.Metadata.Set(delivery.IdempotencyKey, d.key)
		m.Metadata.Set(delivery.PartitionKey, "customer-"+d.key[len(d.key)-2:])
		m.Metadata.Set("trace_id", strings.ReplaceAll(watermill.NewUUID(), "-", ""))
		m.Metadata.Set(delivery.DeadTopic, d.topic)
		m.Metadata.Set(delivery.DeadConsumer, d.consumer)
		m.Metadata.Set(delivery.DeadKey, d.key)
		m.Metadata.Set(delivery.DeadAttempts, strconv.Itoa(d.attempts))
		m.Metadata.Set(delivery.DeadAttemptsSource, delivery.AttemptsFromInbox) // the inbox row below counted them
		m.Metadata.Set(delivery.DeadError, d.err)
		m.Metadata.Set(delivery.DeadPermanent, strconv.FormatBool(d.permanent))
		m.Metadata.Set(delivery.DeadFirstFailedAt, first.Format(time.RFC3339Nano))
		m.Metadata.Set(delivery.DeadLastFailedAt, last.Format(time.RFC3339Nano))
		require.NoError(t, pub.Publish(d.topic+".dlq", m))
		var id int64
		require.NoError(t, pool.QueryRow(ctx, `UPDATE `+names.DLQ+` SET dead_at = now() - $2::interval
WHERE uuid = $1 RETURNING id`, m.UUID, d.ago.String()).Scan(&id))
		_, err := pool.Exec(ctx, `INSERT INTO `+names.Inbox+` (consumer, key, status, expires_at)
VALUES ($1, $2, 'dead', now() + interval '72 hours')`, d.consumer, d.key)
		require.NoError(t, err)
		_, err = pool.Exec(ctx, `INSERT INTO `+names.InboxFailures+` (consumer, key, attempts, first_error, last_error,
	first_failed_at, last_failed_at, dead_at, dead_copies, created_at, updated_at)
VALUES ($1, $2, $3, $4, $4, $5, $6, $6, $7, $5, $6)`,
			d.consumer, d.key, d.attempts, d.err, first, last, int(d.ago/time.Hour)%3)
		require.NoError(t, err)
		out = append(out, demoEntry{demoLetter: d, id: id, uuid: m.UUID})
	}
	return out
}

// seedDemoInbox writes the records of keys the consumers applied, failed on
// or hold: done ones spread over the last day, a few failing and in
// flight.
func seedDemoInbox(t *testing.T, pool *pgxpool.Pool, names sqlschema.Names) {
	inbox, failures := names.Inbox, names.InboxFailures
	t.Helper()
	ctx := context.Background()
	for _, c := range []struct {
		consumer      string
		done          int
		every         time.Duration
		failing, held int
		lastError     string
	}{
		{"billing", 2400, 33 * time.Second, 2, 1, "ledger: connection reset by peer"},
		{"inventory", 960, 85 * time.Second, 0, 0, ""},
		{"notifications", 3100, 26 * time.Second, 1, 0, "smtp: 421 too many connections"},
		{"shipping", 1350, 61 * time.Second, 1, 2, "carrier API: 503 service unavailable"},
	} {
		_, err := pool.Exec(ctx, `INSERT INTO `+inbox+` (consumer, key, status, done_at, expires_at)
SELECT $1, $1 || '-' || g, 'done', now() - g * $3::interval, now() + interval '72 hours'
FROM generate_series(1, $2) g`, c.consumer, c.done, c.every.String())
		require.NoError(t, err)
		_, err = pool.Exec(ctx, `INSERT INTO `+failures+` (consumer, key, attempts, created_at, updated_at)
SELECT $1, $1 || '-' || g, 2, now() - g * $3::interval, now() - g * $3::interval
FROM generate_series(1, $2) g WHERE g % 17 = 0`, c.consumer, c.done, c.every.String())
		require.NoError(t, err)
		_, err = pool.Exec(ctx, `INSERT INTO `+inbox+` (consumer, key, status, expires_at)
SELECT $1, $1 || '-failing-' || g, 'failed', now() + interval '72 hours'
FROM generate_series(1, $2) g`, c.consumer, c.failing)
		require.NoError(t, err)
		_, err = pool.Exec(ctx, `INSERT INTO `+failures+` (consumer, key, attempts, first_error, last_error,
	first_failed_at, last_failed_at)
SELECT $1, $1 || '-failing-' || g, 1 + g, $3, $3, now() - interval '4 minutes', now() - g * interval '20 seconds'
FROM generate_series(1, $2) g`, c.consumer, c.failing, c.lastError)
		require.NoError(t, err)
		_, err = pool.Exec(ctx, `INSERT INTO `+inbox+` (consumer, key, status, token, lease_until, expires_at)
SELECT $1, $1 || '-held-' || g, 'processing', g, now() + interval '25 seconds', now() + interval '72 hours'
FROM generate_series(1, $2) g`, c.consumer, c.held)
		require.NoError(t, err)
		_, err = pool.Exec(ctx, `INSERT INTO `+failures+` (consumer, key, attempts)
SELECT $1, $1 || '-held-' || g, 1 FROM generate_series(1, $2) g`, c.consumer, c.held)
		require.NoError(t, err)
	}
}

// seedDemoOutbox writes events into the outbox, as a service's business
// transaction does, and leaves them pending: no relay runs.
func seedDemoOutbox(t *testing.T, pool *pgxpool.Pool, cfg sqlschema.Config, outbox string) {
	t.Helper()
	ctx := context.Background()
	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx) //nolint:errcheck // a no-op after Commit
	pub, err := forwarder.NewTxPublisher(ctx, tx, cfg)
	require.NoError(t, err)
	for i, topic := range []string{"invoices.issued", "invoices.issued", "invoices.issued", "shipments.requested", "shipments.requested", "stock.reserved"} {
		m := message.NewMessage(watermill.NewUUID(), []byte(fmt.Sprintf(`{"order":%d}`, 7310+i)))
		m.Metadata.Set(delivery.PartitionKey, fmt.Sprintf("customer-%d", 40+i))
		require.NoError(t, pub.Publish(topic, m))
	}
	require.NoError(t, tx.Commit(ctx))
	_, err = pool.Exec(ctx, `UPDATE `+outbox+` SET created_at = now() - (id % 5 + 1) * interval '17 seconds'`)
	require.NoError(t, err)
}

// runBillingConsumer runs the consumer "billing" of topic "payments": a router
// whose handler writes one row per message into effects, in the inbox's
// transaction, over a subscriber that also delivers the consumer's
// requested replays from the dead-letter table.
func runBillingConsumer(t *testing.T, pool *pgxpool.Pool, cfg sqlschema.Config, effects string) {
	t.Helper()
	logger := watermill.NopLogger{}
	store, err := postgres.New(pool, postgres.Config{Schema: cfg.Schema})
	require.NoError(t, err)
	inbox, err := middleware.NewInbox(middleware.InboxConfig{TxStore: store, Consumer: "billing"})
	require.NoError(t, err)
	replays, err := dlq.NewReplaySubscriber(pool, cfg, dlq.ReplaySubscriberConfig{Consumer: "billing", PollInterval: 50 * time.Millisecond})
	require.NoError(t, err)
	live := gochannel.NewGoChannel(gochannel.Config{}, logger)

	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, logger)
	require.NoError(t, err)
	router.AddMiddleware(inbox.Middleware)
	router.AddConsumerHandler("billing", "payments", dlq.WithReplays(live, replays), func(msg *message.Message) error {
		ctx := msg.Context()
		_, err := postgres.Tx(ctx).Exec(ctx, `INSERT INTO `+effects+` (uuid, key) VALUES ($1, $2)`,
			msg.UUID, middleware.IdempotencyKey(ctx))
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
}

// browserProcesses returns the pids of the processes whose command line
// names dir: Chromium passes its profile (--user-data-dir) to every child.
func browserProcesses(dir string) []int {
	want := []byte(dir)
	entries, _ := os.ReadDir("/proc")
	var pids []int
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		cmdline, err := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		if err != nil {
			continue
		}
		if bytes.Contains(cmdline, want) {
			pids = append(pids, pid)
		}
	}
	return pids
}

// headless is a headless Chromium on a fresh profile and one tab.
type headless struct {
	ctx context.Context // the tab's

	mu         sync.Mutex
	dialogs    []string // JavaScript dialogs that opened
	exceptions []string // uncaught JavaScript exceptions
}

// startBrowser starts Chromium, stopped when the test ends; a process of
// it that outlives the stop fails the test. Everything it writes stays in
// the test's temporary directory: the profile, and, with HOME there, the
// caches and settings it keeps beside it.
func startBrowser(t *testing.T) *headless {
	t.Helper()
	bin := chromiumPath(t)
	root := t.TempDir()
	profile, home := filepath.Join(root, "profile"), filepath.Join(root, "home")
	ctx, cancel := context.WithTimeout(context.Background(), browserTimeout)
	opts := append(chromedp.DefaultExecAllocatorOptions[:],
		chromedp.ExecPath(bin),
		chromedp.UserDataDir(profile),
		chromedp.Env("HOME="+home, "XDG_CONFIG_HOME="+filepath.Join(home, ".config"), "XDG_CACHE_HOME="+filepath.Join(home, ".cache")),
		chromedp.NoSandbox, // the tests may run as root
		chromedp.WindowSize(browserWidth, browserHeight),
		chromedp.Flag("hide-scrollbars", true),
		chromedp.Flag("lang", "en-US"),
	)
	allocCtx, cancelAlloc := chromedp.NewExecAllocator(ctx, opts...)
	b := &headless{}
	var handlers sync.WaitGroup
	tabCtx, cancelTab := chromedp.NewContext(allocCtx, chromedp.WithListener(func(ev any) {
		switch ev := ev.(type) {
		case *page.EventJavascriptDialogOpening:
			b.mu.Lock()
			b.dialogs = append(b.dialogs, string(ev.Type)+": "+ev.Message)
			b.mu.Unlock()
			// A dialog stops the page until it is answered; the test
			// fails on it, after dismissing it.
			handlers.Add(1)
			go func() {
				defer handlers.Done()
				_, _ = chromedp.Call(b.ctx, page.HandleJavaScriptDialog, page.HandleJavaScriptDialogParams{Accept: false})
			}()
		case *runtime.EventExceptionThrown:
			b.mu.Lock()
			b.exceptions = append(b.exceptions, ev.ExceptionDetails.Text)
			b.mu.Unlock()
		}
	}))
	b.ctx = tabCtx
	// The first action starts the browser.
	if err := chromedp.Do(tabCtx, chromedp.EmulateViewport(browserWidth, browserHeight)); err != nil {
		cancelTab()
		cancelAlloc()
		cancel()
		t.Fatalf("start Chromium (%s): %v", bin, err)
	}
	t.Cleanup(func() {
		if err := chromedp.Cancel(tabCtx); err != nil && !errors.Is(err, context.Canceled) {
			t.Errorf("close Chromium: %v", err)
		}
		cancelTab()
		cancelAlloc() // waits for the browser process
		cancel()
		handlers.Wait()
		deadline := time.Now().Add(5 * time.Second)
		for {
			left := browserProcesses(root)
			if len(left) == 0 {
				return
			}
			if time.Now().After(deadline) {
				for _, pid := range left {
					_ = syscall.Kill(pid, syscall.SIGKILL)
				}
				t.Errorf("Chromium processes %v outlived the browser's stop: killed", left)
				return
			}
			time.Sleep(50 * time.Millisecond)
		}
	})
	if len(browserProcesses(root)) == 0 {
		t.Fatalf("no process runs with the profile %s: the check for leftovers would see nothing", profile)
	}
	return b
}

// do runs steps in the tab.
func (b *headless) do(t *testing.T, what string, steps ...chromedp.Action[chromedp.Void]) {
	t.Helper()
	if err := chromedp.Do(b.ctx, steps...); err != nil {
		t.Fatalf("%s: %v", what, err)
	}
}

// navigate runs trigger, which leads to another page, and returns that
// page's HTTP status.
func (b *headless) navigate(t *testing.T, what string, trigger chromedp.Action[chromedp.Void]) int64 {
	t.Helper()
	resp, err := chromedp.RunResponse(b.ctx, trigger)
	if err != nil {
		t.Fatalf("%s: %v", what, err)
	}
	return resp.Status
}

// text returns the text of the element sel finds.
func (b *headless) text(t *testing.T, sel chromedp.CSS) string {
	t.Helper()
	s, err := chromedp.Run(b.ctx, chromedp.Text(sel))
	if err != nil {
		t.Fatalf("text of %s: %v", sel, err)
	}
	return s
}

// eval evaluates a JavaScript expression in the page.
func evalIn[T any](t *testing.T, b *headless, expr string) T {
	t.Helper()
	v, err := chromedp.Run(b.ctx, chromedp.Evaluate[T](expr))
	if err != nil {
		t.Fatalf("evaluate %s: %v", expr, err)
	}
	return v
}

// screenshot saves the whole page as name, in docs/ with
// ONCEMILL_WRITE_SCREENSHOTS=1, else in a temporary directory, and checks
// that it is a PNG as wide as the browser.
func (b *headless) screenshot(t *testing.T, dir, name string) {
	t.Helper()
	buf, err := chromedp.Run(b.ctx, chromedp.FullScreenshot(100))
	if err != nil {
		t.Fatalf("screenshot %s: %v", name, err)
	}
	cfg, err := png.DecodeConfig(bytes.NewReader(buf))
	require.NoError(t, err, "the screenshot is a PNG")
	require.Equal(t, browserWidth, cfg.Width, "screenshot width")
	require.GreaterOrEqual(t, cfg.Height, browserHeight/2, "screenshot height")
	require.NoError(t, os.WriteFile(filepath.Join(dir, name), buf, 0o644))
	t.Logf("screenshot %s: %dx%d", filepath.Join(dir, name), cfg.Width, cfg.Height)
}

func (b *headless) requireNoScripts(t *testing.T) {
	t.Helper()
	b.mu.Lock()
	defer b.mu.Unlock()
	require.Empty(t, b.dialogs, "no JavaScript dialog opened: every error text is escaped")
	require.Empty(t, b.exceptions, "no uncaught JavaScript exception")
}

func TestBrowser(t *testing.T) {
	t.Parallel()
	started := time.Now()
	writeShots := os.Getenv("ONCEMILL_WRITE_SCREENSHOTS") == "1"
	shots := t.TempDir()
	if writeShots {
		shots = filepath.Join("..", "docs")
		require.NoError(t, os.MkdirAll(shots, 0o755))
	}
	b := startBrowser(t) // first: skipped without Chromium before anything is written

	pool := pgtest.Pool(t, 8)
	schema := demoSchema(t, pool, writeShots)
	cfg := sqlschema.Config{Schema: schema}.WithDefaults()
	names := sqlschema.NamesFor(sqlschema.Postgres, cfg)
	ctx := context.Background()
	effects := pgx.Identifier{schema, "charges"}.Sanitize()
	_, err := pool.Exec(ctx, `CREATE TABLE `+effects+` (uuid text PRIMARY KEY, key text NOT NULL, applied_at timestamptz NOT NULL DEFAULT now())`)
	require.NoError(t, err)

	// Five card declines (one group once the order numbers are
	// normalised), three ledger timeouts of the same consumer and topic,
	// other consumers' failures, and one error that is markup.
	const xss = `template "receipt": <script>alert("xss")</script><img src=x onerror=alert(1)> is not allowed`
	var letters []demoLetter
	for i, order := range []int{1234, 4471, 5208, 6630, 9015} {
		letters = append(letters, demoLetter{consumer: "billing", topic: "payments", key: fmt.Sprintf("pay-%d", order),
			err: fmt.Sprintf("card declined for order %d", order), attempts: 5, ago: time.Duration(37-i*7) * time.Minute,
			payload: fmt.Sprintf(`{"order":%d,"amount_cents":%d,"currency":"EUR"}`, order, 1999+i*250)})
	}
	for i, order := range []int{3320, 3341, 3398} {
		letters = append(letters, demoLetter{consumer: "billing", topic: "payments", key: fmt.Sprintf("pay-%d", order),
			err: "timeout after 30s calling ledger", attempts: 5, ago: time.Duration(4-i)*time.Hour + 12*time.Minute,
			payload: fmt.Sprintf(`{"order":%d,"amount_cents":4500,"currency":"EUR"}`, order)})
	}
	letters = append(letters,
		demoLetter{consumer: "shipping", topic: "orders.placed", key: "ord-5521", attempts: 4, ago: 5 * time.Hour,
			err: `carrier API: address rejected for order 5521: postcode "75001" unknown`, payload: `{"order":5521,"country":"FR"}`},
		demoLetter{consumer: "shipping", topic: "orders.placed", key: "ord-5587", attempts: 4, ago: 3*time.Hour + 40*time.Minute,
			err: `carrier API: address rejected for order 5587: postcode "69002" unknown`, payload: `{"order":5587,"country":"FR"}`},
		demoLetter{consumer: "inventory", topic: "stock.reserve", key: "res-88", attempts: 1, permanent: true, ago: 26 * time.Hour,
			err: "permanent: sku 8812-XL does not exist", payload: `{"sku":"8812-XL","quantity":3}`},
		demoLetter{consumer: "notifications", topic: "customer-emails", key: "mail-77", attempts: 3, ago: 47 * time.Minute,
			err: xss, payload: `{"to":"ada@example.com","template":"receipt"}`},
	)
	// Ids as a table that has been in use for a while has them.
	_, err = pool.Exec(ctx, `SELECT setval(pg_get_serial_sequence($1, 'id'), 48210)`, names.DLQ)
	require.NoError(t, err)
	// Oldest first, as they died: ids grow with the time of death.
	slices.SortStableFunc(letters, func(a, b demoLetter) int { return cmp.Compare(b.ago, a.ago) })
	entries := seedDemoDeadLetters(t, pool, cfg, letters)
	var declined, rest []demoEntry
	for _, e := range entries {
		if strings.HasPrefix(e.err, "card declined") {
			declined = append(declined, e)
		} else {
			rest = append(rest, e)
		}
	}
	require.Len(t, declined, 5)
	seedDemoInbox(t, pool, names)
	seedDemoOutbox(t, pool, cfg, names.Outbox)
	runBillingConsumer(t, pool, cfg, effects)

	handler, err := console.New(console.Config{Pool: pool, Schema: cfg, Token: browserToken})
	require.NoError(t, err)
	srv := httptest.NewServer(handler)
	t.Cleanup(srv.Close)

	// Log in: a wrong token is refused, the right one leads to the
	// overview.
	b.do(t, "open the login page", chromedp.Navigate(srv.URL+"/login"), chromedp.WaitVisible(chromedp.ID("login-form")))
	b.do(t, "type a wrong token", chromedp.SendKeys(chromedp.CSS(`#login-form input[name="token"]`), "not-the-token"))
	require.Equal(t, int64(http.StatusUnauthorized), b.navigate(t, "log in with a wrong token", chromedp.Click(chromedp.CSS(`#login-form button[type="submit"]`))))
	require.Contains(t, b.text(t, "#login-error"), "not the console's token")
	b.do(t, "type the token", chromedp.SendKeys(chromedp.CSS(`#login-form input[name="token"]`), browserToken))
	require.Equal(t, int64(http.StatusOK), b.navigate(t, "log in", chromedp.Click(chromedp.CSS(`#login-form button[type="submit"]`))))
	loc, err := chromedp.Run(b.ctx, chromedp.Location())
	require.NoError(t, err)
	require.Equal(t, srv.URL+"/", loc, "the login leads to the overview")

	// The overview: every section, with the demoEntry numbers.
	b.do(t, "see the overview", chromedp.WaitVisible(chromedp.ID("overview-inbox")),
		chromedp.WaitVisible(chromedp.ID("overview-dlq")), chromedp.WaitVisible(chromedp.ID("overview-outbox")))
	inboxText := b.text(t, "#overview-inbox")
	for _, c := range []string{"billing", "inventory", "notifications", "shipping"} {
		require.Contains(t, inboxText, c)
	}
	dlqText := b.text(t, "#overview-dlq")
	require.Contains(t, dlqText, "card declined for order <n>")
	require.Contains(t, dlqText, "timeout after <n>s calling ledger")
	// The inbox's dead keys and the dead letters count different things,
	// and the page says what each counts.
	require.Contains(t, b.text(t, "#dlq-counts-caption"), "They are not the inbox's dead keys above")
	require.Contains(t, evalIn[string](t, b, `document.querySelector('#overview-inbox th[title^="keys the inbox"]').title`),
		"a purged dead letter leaves its key dead here")
	require.Zero(t, evalIn[int](t, b, `document.querySelectorAll('#dead-counts-differ').length`),
		"every demo dead letter has its dead inbox row: the counts agree, nothing to explain")
	require.Equal(t, "6", b.text(t, "#outbox-pending"))
	b.screenshot(t, shots, "console-overview.png")

	// The dead letters, then the card declines' group.
	require.Equal(t, int64(http.StatusOK), b.navigate(t, "open the dead letters",
		chromedp.Click(chromedp.CSS(`header nav a[href$="dlq"]`))))
	require.Equal(t, strconv.Itoa(len(entries)), b.text(t, "#dlq-total"))
	require.Equal(t, int64(http.StatusOK), b.navigate(t, "open the card declines' group",
		chromedp.Click(chromedp.Search(`//table[@id="dlq-groups"]//a[contains(@class, "group-link")][starts-with(normalize-space(.), "card declined")]`))))
	require.Equal(t, "5", b.text(t, "#dlq-total"))
	require.Contains(t, b.text(t, "#active-group"), "card declined for order <n>")
	require.Equal(t, "Failed attempts: 5, counted by the inbox",
		evalIn[string](t, b, `document.querySelector('#dlq-table tbody tr[data-id] td.num.nowrap').title`), "the attempts say who counted them")
	rows := evalIn[[]string](t, b, `Array.from(document.querySelectorAll('#dlq-table tbody tr[data-id]'), tr => tr.dataset.id)`)
	want := make([]string, len(declined))
	for i, e := range declined {
		want[len(declined)-1-i] = strconv.FormatInt(e.id, 10) // newest first
	}
	require.Equal(t, want, rows, "the group's entries, newest first")

	// Select them all and ask for their replay to the consumer.
	b.do(t, "select all", chromedp.Click(chromedp.ID("select-all")))
	require.Equal(t, "5", b.text(t, "#selected-count"))
	require.Equal(t, 5, evalIn[int](t, b, `document.querySelectorAll('#dlq-table input[name="id"]:checked').length`))
	b.screenshot(t, shots, "console-dead-letters.png")
	require.Equal(t, int64(http.StatusOK), b.navigate(t, "replay to the consumer",
		chromedp.Click(chromedp.CSS(`#dlq-select-form button[name="action"][value="replay-consumer"]`))))

	// The confirm page names exactly what the button does.
	b.do(t, "see the confirm page", chromedp.WaitVisible(chromedp.ID("confirm-form")))
	summary := b.text(t, "#confirm-summary")
	require.Contains(t, summary, "Replay 5 entries to consumer billing (topic payments)")
	require.Contains(t, b.text(t, "#confirm-button"), "5 entries")
	n, err := countWhere(ctx, pool, names.DLQ, "replay_requested_at IS NOT NULL")
	require.NoError(t, err)
	require.Zero(t, n, "nothing is requested before the confirmation")
	require.Equal(t, int64(http.StatusOK), b.navigate(t, "confirm", chromedp.Click(chromedp.ID("confirm-button"))))
	b.do(t, "see the outcome", chromedp.WaitVisible(chromedp.ID("flash")))
	require.Contains(t, b.text(t, "#flash"), "Requested a replay of 5 entries to their consumer")

	// The consumer's replay subscriber delivers each entry once, through
	// the inbox, and deletes it.
	declinedIDs := make([]int64, len(declined))
	for i, e := range declined {
		declinedIDs[i] = e.id
	}
	require.Eventually(t, func() bool {
		n, err := countWhere(ctx, pool, names.DLQ, "id = ANY($1)", declinedIDs)
		return err == nil && n == 0
	}, 20*time.Second, 50*time.Millisecond, "the replayed entries leave the dead-letter table")
	var applied []string
	rowsQ, err := pool.Query(ctx, `SELECT uuid FROM `+effects+` ORDER BY uuid`)
	require.NoError(t, err)
	applied, err = pgx.CollectRows(rowsQ, pgx.RowTo[string])
	require.NoError(t, err)
	wantUUIDs := make([]string, len(declined))
	for i, e := range declined {
		wantUUIDs[i] = e.uuid
	}
	slices.Sort(wantUUIDs)
	require.Equal(t, wantUUIDs, applied, "each replayed message applied once, with its original UUID")
	for _, e := range declined {
		var status string
		require.NoError(t, pool.QueryRow(ctx, `SELECT status FROM `+names.Inbox+` WHERE consumer = $1 AND key = $2`, e.consumer, e.key).Scan(&status))
		require.Equal(t, "done", status, "the replay reopened the dead key %s and applied it", e.key)
	}
	var left []int64
	rowsQ, err = pool.Query(ctx, `SELECT id FROM `+names.DLQ+` ORDER BY id`)
	require.NoError(t, err)
	left, err = pgx.CollectRows(rowsQ, pgx.RowTo[int64])
	require.NoError(t, err)
	wantLeft := make([]int64, len(rest))
	for i, e := range rest {
		wantLeft[i] = e.id
	}
	require.Equal(t, wantLeft, left, "the timeouts, the other consumers' entries and the markup stay")
	b.do(t, "reload the dead letters", chromedp.Navigate(srv.URL+"/dlq"))
	require.Equal(t, strconv.Itoa(len(rest)), b.text(t, "#dlq-total"), "the page shows the entries left")

	// The markup in an error is text on every page, even with the page's
	// Content-Security-Policy out of the way.
	i := slices.IndexFunc(rest, func(e demoEntry) bool { return e.err == xss })
	require.GreaterOrEqual(t, i, 0)
	markup := rest[i]
	_, err = chromedp.Call(b.ctx, page.SetBypassCSP, page.SetBypassCSPParams{Enabled: true})
	require.NoError(t, err)
	for _, path := range []string{"/", "/dlq", "/dlq?consumer=notifications", "/dlq/" + strconv.FormatInt(markup.id, 10)} {
		b.do(t, "open "+path, chromedp.Navigate(srv.URL+path), chromedp.WaitReady(chromedp.CSS("main")))
		require.Zero(t, evalIn[int](t, b, `document.querySelectorAll('main script, main img').length`), "%s: no element from the error text", path)
		require.Contains(t, evalIn[string](t, b, `document.querySelector('main').textContent`), `<script>alert(`, "%s: the error is shown as text", path)
	}
	b.requireNoScripts(t)
	t.Logf("browser scenario took %s", time.Since(started).Round(time.Millisecond))
}

// demoSchema returns a fresh migrated schema, dropped when the test ends:
// pgtest's, or, for the screenshots, one named "shop" as a service's
// would be, which must not exist yet.
func demoSchema(t *testing.T, pool *pgxpool.Pool, screenshots bool) string {
	t.Helper()
	if !screenshots {
		return pgtest.Schema(t, pool)
	}
	const schema = "shop"
	ctx := context.Background()
	if _, err := pool.Exec(ctx, `CREATE SCHEMA `+schema); err != nil {
		t.Fatalf("screenshots: create schema %s (it must not exist; the test drops it at the end): %v", schema, err)
	}
	t.Cleanup(func() {
		if _, err := pool.Exec(context.Background(), `DROP SCHEMA `+schema+` CASCADE`); err != nil {
			t.Errorf("drop schema %s: %v", schema, err)
		}
	})
	require.NoError(t, sqlschema.Migrate(ctx, pool, sqlschema.Config{Schema: schema}))
	return schema
}

// countWhere counts the rows of table that match where.
func countWhere(ctx context.Context, pool *pgxpool.Pool, table, where string, args ...any) (int, error) {
	var n int
	err := pool.QueryRow(ctx, `SELECT count(*) FROM `+table+` WHERE `+where, args...).Scan(&n)
	return n, err
}
