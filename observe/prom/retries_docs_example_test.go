package prom_test

// The code of "Parked messages" in docs/operations.md; internal/docsnippets
// checks that the page shows it as it is here. It needs PostgreSQL, so it
// is compiled, not run.

import (
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/oncemill/oncemill/observe/prom"
	"github.com/oncemill/oncemill/retry"
	"github.com/oncemill/oncemill/sqlschema"
)

// registerRetries exports what waits in the table of parked messages.
func registerRetries(reg *prometheus.Registry, pool *pgxpool.Pool) error {
	// snippet:retries
	retries, err := retry.NewStore(pool, sqlschema.Config{})
	if err != nil {
		return err
	}
	parked, err := prom.NewRetryCollector(retries, prom.RetryCollectorConfig{}) // read at scrape time
	if err != nil {
		return err
	}
	reg.MustRegister(parked)
	// endsnippet
	return nil
}

var _ = registerRetries
