package prom_test

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/internal/testing/msgtest"
	"github.com/oncemill/oncemill/internal/testing/pgtest"
	"github.com/oncemill/oncemill/observe/prom"
	"github.com/oncemill/oncemill/retry"
	"github.com/oncemill/oncemill/sqlschema"
)

// park parks a message of consumer on topic, of ordering key order (""
// for none), due at due; behind parks it behind the key's first.
func park(t *testing.T, s *retry.Store, consumer, topic, order string, due time.Time, behind bool) {
	t.Helper()
	m := retry.Message{Consumer: consumer, Topic: topic, UUID: watermill.NewUUID(), OrderKey: order, Behind: behind, DueAt: due,
		Attempts: 5, Error: "gateway 503"}
	wrote, err := s.Park(context.Background(), m)
	require.NoError(t, err)
	require.True(t, wrote)
}

// TestRetryCollector: a scrape reads what is parked, due and overdue per
// consumer and topic; a message behind another of its ordering key is
// parked but neither due nor overdue; a pair with nothing parked has no
// series.
func TestRetryCollector(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t, 4)
	store, err := retry.NewStore(pool, sqlschema.Config{Schema: pgtest.Schema(t, pool)})
	require.NoError(t, err)
	collector, err := prom.NewRetryCollector(store, prom.RetryCollectorConfig{})
	require.NoError(t, err)
	reg, _ := setup(t)
	require.NoError(t, reg.Register(collector))
	names := []string{"oncemill_retries_parked", "oncemill_retries_due", "oncemill_retries_overdue", "oncemill_retries_scrape_errors_total"}

	require.NoError(t, testutil.GatherAndCompare(reg, strings.NewReader(`
# HELP oncemill_retries_scrape_errors_total Scrapes whose read of the table of parked messages failed or timed out.
# TYPE oncemill_retries_scrape_errors_total counter
oncemill_retries_scrape_errors_total 0
`), names...), "an empty table has no series")

	now := time.Now()
	park(t, store, "charge", "orders", "acct-1", now.Add(-5*time.Minute), false) // overdue
	park(t, store, "charge", "orders", "acct-1", now, true)                      // behind it: waits
	park(t, store, "charge", "orders", "acct-2", now.Add(-5*time.Second), false) // due
	park(t, store, "charge", "orders", "", now.Add(time.Hour), false)            // waiting
	park(t, store, "ship", "orders", "", now.Add(-2*time.Minute), false)         // overdue
	require.NoError(t, testutil.GatherAndCompare(reg, strings.NewReader(`
# HELP oncemill_retries_due Parked messages that may go out now and wait for their retry subscriber, read at scrape time.
# TYPE oncemill_retries_due gauge
oncemill_retries_due{consumer="charge",topic="orders"} 2
oncemill_retries_due{consumer="ship",topic="orders"} 1
# HELP oncemill_retries_overdue Parked messages due more than 1m0s ago and not handed back: no retry subscriber runs for the consumer and topic, read at scrape time.
# TYPE oncemill_retries_overdue gauge
oncemill_retries_overdue{consumer="charge",topic="orders"} 1
oncemill_retries_overdue{consumer="ship",topic="orders"} 1
# HELP oncemill_retries_parked Messages parked for a delayed retry, read at scrape time.
# TYPE oncemill_retries_parked gauge
oncemill_retries_parked{consumer="charge",topic="orders"} 4
oncemill_retries_parked{consumer="ship",topic="orders"} 1
# HELP oncemill_retries_scrape_errors_total Scrapes whose read of the table of parked messages failed or timed out.
# TYPE oncemill_retries_scrape_errors_total counter
oncemill_retries_scrape_errors_total 0
`), names...))
	problems, err := testutil.CollectAndLint(collector)
	require.NoError(t, err)
	require.Empty(t, problems, "the metrics follow Prometheus' naming rules")

	// Through the HTTP handler, as Prometheus scrapes it.
	rec := httptest.NewRecorder()
	promhttp.HandlerFor(reg, promhttp.HandlerOpts{}).ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/metrics", nil))
	require.Equal(t, http.StatusOK, rec.Code, rec.Body.String())
	require.Contains(t, rec.Body.String(), `oncemill_retries_overdue{consumer="ship",topic="orders"} 1`)

	// A subscriber that runs hands ship's back: once acked, ship has no
	// series left.
	sub, err := store.Subscriber(retry.SubscriberConfig{Consumer: "ship", PollInterval: 10 * time.Millisecond})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	msgs, err := sub.Subscribe(ctx, "orders")
	require.NoError(t, err)
	msgtest.Receive(t, msgs, 30*time.Second).Ack()
	require.Eventually(t, func() bool { return testutil.CollectAndCount(collector, "oncemill_retries_parked") == 1 }, 30*time.Second, 10*time.Millisecond,
		"a pair with nothing parked has no series")
	cancel()
	require.NoError(t, sub.Close())

	// A threshold of its own.
	strict, err := prom.NewRetryCollector(store, prom.RetryCollectorConfig{Overdue: time.Nanosecond, Namespace: "shop"})
	require.NoError(t, err)
	reg = prometheus.NewPedanticRegistry()
	require.NoError(t, reg.Register(strict))
	require.Equal(t, 2.0, series(t, reg, "shop_retries_overdue", map[string]string{"consumer": "charge"}).GetGauge().GetValue(),
		"every due message of charge is overdue by a nanosecond")
}

// TestRetryCollectorFailure: a table that is not there costs the retries'
// series of that scrape, counted and logged, and nothing else; a scrape
// is bounded by the timeout.
func TestRetryCollectorFailure(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t, 2)
	store, err := retry.NewStore(pool, sqlschema.Config{Schema: pgtest.Name(t)}) // never migrated
	require.NoError(t, err)
	logger := watermill.NewCaptureLogger()
	collector, err := prom.NewRetryCollector(store, prom.RetryCollectorConfig{Logger: logger})
	require.NoError(t, err)
	reg := prometheus.NewPedanticRegistry()
	require.NoError(t, reg.Register(collector))
	require.NoError(t, testutil.GatherAndCompare(reg, strings.NewReader(`
# HELP oncemill_retries_scrape_errors_total Scrapes whose read of the table of parked messages failed or timed out.
# TYPE oncemill_retries_scrape_errors_total counter
oncemill_retries_scrape_errors_total 1
`)))
	logged := logger.Captured()[watermill.ErrorLogLevel]
	require.Len(t, logged, 1)
	require.Equal(t, "Cannot read the table of parked messages for metrics", logged[0].Msg)
	require.ErrorIs(t, logged[0].Err, retry.ErrNotMigrated)

	migrated, err := retry.NewStore(pool, sqlschema.Config{Schema: pgtest.Schema(t, pool)})
	require.NoError(t, err)
	slow, err := prom.NewRetryCollector(migrated, prom.RetryCollectorConfig{Timeout: time.Nanosecond, Logger: logger})
	require.NoError(t, err)
	require.Equal(t, 0, testutil.CollectAndCount(slow, "oncemill_retries_parked"))
	require.ErrorIs(t, logger.Captured()[watermill.ErrorLogLevel][1].Err, context.DeadlineExceeded)

	require.EqualError(t, prom.RetryCollectorConfig{Overdue: -time.Second}.Validate(), "prom: RetryCollectorConfig.Overdue must not be negative, got -1s")
	require.EqualError(t, prom.RetryCollectorConfig{Timeout: -time.Second}.Validate(), "prom: RetryCollectorConfig.Timeout must not be negative, got -1s")
	_, err = prom.NewRetryCollector(nil, prom.RetryCollectorConfig{})
	require.EqualError(t, err, "prom: NewRetryCollector: store is nil")
}
