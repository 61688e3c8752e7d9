package prom_test

// The code of "Consumer backlog" in docs/operations.md; internal/docsnippets
// checks that the page shows it as it is here. It needs brokers, so it is
// compiled, not run.

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/oncemill/oncemill/adapters"
	"github.com/oncemill/oncemill/observe/prom"
)

// registerBacklog exports what two consumers' brokers still hold for them.
func registerBacklog(reg *prometheus.Registry, ps *adapters.PubSub, auditSub adapters.Backlogger) error {
	// snippet:backlog
	collector, err := prom.NewBacklogCollector(prom.BacklogCollectorConfig{},
		prom.BacklogSource{Consumer: "charge", Topic: "orders", Backlogger: ps},
		prom.BacklogSource{Consumer: "audit", Topic: "orders", Backlogger: auditSub},
	)
	if err != nil {
		return err
	}
	reg.MustRegister(collector)
	// endsnippet
	return nil
}

var _ = registerBacklog
