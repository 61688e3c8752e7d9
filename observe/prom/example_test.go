package prom_test

import (
	"bufio"
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/oncemill/oncemill/dedup/memory"
	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/dlq"
	"github.com/oncemill/oncemill/middleware"
	"github.com/oncemill/oncemill/observe"
	"github.com/oncemill/oncemill/observe/prom"
	"github.com/oncemill/oncemill/sqlschema"
)

// The metrics go on a registry, the hook in the inbox's config, and the
// registry behind promhttp. Three deliveries of one payment run the
// handler once; the scrape shows one applied and two duplicates. (The
// memory store is for examples and tests only.)
func Example() {
	reg := prometheus.NewRegistry()
	metrics, err := prom.New(prom.Config{Registerer: reg})
	if err != nil {
		panic(err)
	}
	inbox, err := middleware.NewInbox(middleware.InboxConfig{
		LeaseStore: memory.New(),
		Consumer:   "payments",
		Hooks:      []observe.Hook{metrics}, // and the same in PoisonConfig, BloomConfig, RelayConfig
	})
	if err != nil {
		panic(err)
	}
	handler := inbox.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		return nil, nil // charge the card
	})
	for range 3 {
		msg := message.NewMessage(watermill.NewUUID(), []byte(`{"orderId":"A-42"}`))
		msg.Metadata.Set(delivery.IdempotencyKey, "A-42")
		if _, err := handler(msg); err != nil {
			panic(err)
		}
	}

	// In a service: http.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{})).
	scrape := httptest.NewRecorder()
	promhttp.HandlerFor(reg, promhttp.HandlerOpts{}).ServeHTTP(scrape, httptest.NewRequest(http.MethodGet, "/metrics", nil))
	lines := bufio.NewScanner(scrape.Body)
	for lines.Scan() {
		if line := lines.Text(); strings.HasPrefix(line, "oncemill_inbox_messages_total{") && !strings.HasSuffix(line, " 0") {
			fmt.Println(line)
		}
	}
	// Output:
	// oncemill_inbox_messages_total{consumer="payments",outcome="applied",topic=""} 1
	// oncemill_inbox_messages_total{consumer="payments",outcome="duplicate",topic=""} 2
}

// The dead-letter table's size is read at scrape time, by a collector
// registered beside the hooks' metrics. The example needs PostgreSQL, so
// it is compiled, not run.
func ExampleNewDLQCollector() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		panic(err)
	}
	defer pool.Close()
	store, err := dlq.NewStore(pool, sqlschema.Config{})
	if err != nil {
		panic(err)
	}

	reg := prometheus.NewRegistry()
	metrics, err := prom.New(prom.Config{Registerer: reg})
	if err != nil {
		panic(err)
	}
	_ = metrics // in the Hooks of every component's config
	collector, err := prom.NewDLQCollector(store, prom.DLQCollectorConfig{Logger: watermill.NewStdLogger(false, false)})
	if err != nil {
		panic(err)
	}
	reg.MustRegister(collector)

	http.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	if err := http.ListenAndServe(":9090", nil); err != nil {
		panic(err)
	}
}
