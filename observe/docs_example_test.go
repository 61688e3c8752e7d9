package observe_test

// The code of "Metrics and traces" in docs/operations.md; internal/docsnippets
// checks that the page shows it as it is here. It needs PostgreSQL and a
// broker, so it is compiled, not run.

// snippet:hooks
import (
	"net/http"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/oncemill/oncemill/dedup/postgres"
	"github.com/oncemill/oncemill/dlq"
	"github.com/oncemill/oncemill/forwarder"
	"github.com/oncemill/oncemill/middleware"
	"github.com/oncemill/oncemill/observe"
	"github.com/oncemill/oncemill/observe/prom"
	"github.com/oncemill/oncemill/observe/tracing"
	"github.com/oncemill/oncemill/sqlschema"
)

// instrument gives the same hooks to every component.
func instrument(router *message.Router, pool *pgxpool.Pool, store *postgres.Store, broker message.Publisher) error {
	reg := prometheus.NewRegistry()
	metrics, err := prom.New(prom.Config{Registerer: reg})
	if err != nil {
		return err
	}
	tracer, err := tracing.New(tracing.Config{}) // OpenTelemetry's global provider and propagator
	if err != nil {
		return err
	}
	hooks := []observe.Hook{metrics, tracer}

	deadLetters, err := dlq.NewPublisher(pool, sqlschema.Config{})
	if err != nil {
		return err
	}
	inbox, err := middleware.NewInbox(middleware.InboxConfig{TxStore: store, Hooks: hooks})
	if err != nil {
		return err
	}
	poison, err := middleware.NewPoison(middleware.PoisonConfig{Inbox: inbox, Publisher: deadLetters, Topic: "orders.dlq", Hooks: hooks})
	if err != nil {
		return err
	}
	relay, err := forwarder.NewRelay(forwarder.RelayConfig{Pool: pool, Publisher: broker, Hooks: hooks})
	if err != nil {
		return err
	}
	router.AddMiddleware(poison.Middleware, inbox.Middleware)
	router.AddPlugin(relay.Plugin)

	dlqStore, err := dlq.NewStore(pool, sqlschema.Config{})
	if err != nil {
		return err
	}
	dlqSize, err := prom.NewDLQCollector(dlqStore, prom.DLQCollectorConfig{}) // read at scrape time
	if err != nil {
		return err
	}
	reg.MustRegister(dlqSize)
	http.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	return nil
}

// endsnippet
