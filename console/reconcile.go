package console

import (
	"context"
	"errors"
	"strings"

	"github.com/oncemill/oncemill/reconcile"
)

// overviewListed is the most missing events (and unexplained keys) the
// overview lists per check: a check's Limit defaults to it.
const overviewListed = 10

// reconcileCheck is c with the console's defaults: the console's database
// and Schema for a Ledger not given, and overviewListed for Limit.
func (c Config) reconcileCheck(rc reconcile.Config) reconcile.Config {
	if rc.Ledger.Pool == nil && rc.Ledger.DB == nil {
		rc.Ledger = reconcile.Tables{Pool: c.Pool, DB: c.DB, Dialect: c.Dialect, Schema: c.Schema}
	}
	if rc.Limit == 0 {
		rc.Limit = overviewListed
	}
	rc.Topics = append([]string(nil), rc.Topics...)
	return rc
}

// reconcileRow is one check's line of the overview.
type reconcileRow struct {
	Consumer string
	Topics   string
	Strict   bool
	Report   reconcile.Report
	// NoLedger is set when the ledger table does not exist: the relay
	// keeps none.
	NoLedger bool
	Err      string
}

// reconcileRows runs the overview's checks, one after the other.
func (c *Console) reconcileRows(ctx context.Context) []reconcileRow {
	rows := make([]reconcileRow, 0, len(c.cfg.Reconcile))
	for _, rc := range c.cfg.Reconcile {
		row := reconcileRow{Consumer: rc.Consumer, Topics: strings.Join(rc.Topics, ", "), Strict: rc.Strict}
		rep, err := reconcile.Check(ctx, rc)
		switch {
		case errors.Is(err, reconcile.ErrNoLedger):
			row.NoLedger = true
		case err != nil:
			if errors.Is(err, context.Canceled) {
				return rows
			}
			c.cfg.Logger.Error("Reconcile check failed", err, nil)
			row.Err = err.Error()
		default:
			row.Report = rep
		}
		rows = append(rows, row)
	}
	return rows
}
