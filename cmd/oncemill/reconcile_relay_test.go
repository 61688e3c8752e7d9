package main

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/oncemill/oncemill/internal/testing/proctest"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/forwarder"
	"github.com/oncemill/oncemill/internal/testing/pgtest"
	"github.com/oncemill/oncemill/sqlschema"
)

// TestRelayLedgerFlag: "oncemill relay --ledger" keeps the ledger that
// reconcile reads: every row it relays has its ledger row, and reconcile
// of a consumer that applied none lists them all. Without the ledger
// table the relay refuses to start, naming it. (On MySQL:
// TestMySQLRelayLedgerFlag.)
func TestRelayLedgerFlag(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := setup(t)
	topic := pgtest.Name(t)
	broker := pgBroker(t, f.pool, topic)

	const n = 3
	tx, err := f.pool.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx) //nolint:errcheck // no-op after commit
	pub, err := forwarder.NewTxPublisher(ctx, tx, sqlschema.Config{Schema: f.schema})
	require.NoError(t, err)
	for i := range n {
		m := message.NewMessage(watermill.NewUUID(), []byte(fmt.Sprint(i)))
		m.Metadata.Set(delivery.IdempotencyKey, fmt.Sprintf("order-%d", i))
		require.NoError(t, pub.Publish(topic, m))
	}
	require.NoError(t, tx.Commit(ctx))

	runCtx, stop := context.WithCancel(ctx)
	var out, errOut proctest.Buffer
	done := make(chan int, 1)
	go func() {
		done <- run(runCtx, []string{"relay", "--database", pgtest.URL(), "--schema", f.schema, "--broker", broker,
			"--listen", "", "--ledger", "--ledger-retention", "48h"}, func(string) string { return "" }, &out, &errOut)
	}()
	ledger := pgx.Identifier{f.schema, "outbox_ledger"}.Sanitize()
	count := func(table string) (c int) {
		require.NoError(t, f.pool.QueryRow(ctx, `SELECT count(*) FROM `+table).Scan(&c))
		return c
	}
	require.Eventually(t, func() bool {
		return count(ledger) == n
	}, 30*time.Second, 20*time.Millisecond, errOut.String())
	stop()
	require.Equal(t, exitOK, <-done, errOut.String())
	require.Zero(t, count(pgx.Identifier{f.schema, "outbox"}.Sanitize()))

	r := f.reconcile(t, "nobody")
	require.Equal(t, exitFailure, r.code, r.stdout+r.stderr)
	require.Len(t, reconcileRows(r.stdout), n)

	_, err = f.pool.Exec(ctx, `DROP TABLE `+ledger)
	require.NoError(t, err)
	r = oncemill(t, nil, "relay", "--database", pgtest.URL(), "--schema", f.schema, "--broker", broker, "--listen", "", "--ledger")
	require.Equal(t, exitFailure, r.code, r.stderr)
	requireOneLine(t, r.stderr)
	require.Contains(t, r.stderr, `"`+f.schema+`"."outbox_ledger" does not exist`)
	require.Contains(t, r.stderr, "--ledger")

	r = oncemill(t, nil, "relay", "--database", pgtest.URL(), "--broker", broker, "--ledger", "--ledger-retention", "30s")
	require.Equal(t, exitUsage, r.code, r.stderr)
	require.Contains(t, r.stderr, "--ledger-retention must be at least 1m")
}
