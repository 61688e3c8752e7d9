package forwarder_test

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/forwarder"
	"github.com/oncemill/oncemill/internal/testing/pgtest"
)

// ledgerRow is one row of the ledger table.
type ledgerRow struct{ uuid, topic, partitionKey, key string }

func (b bundle) ledger(t *testing.T) map[string]ledgerRow {
	t.Helper()
	rows, err := b.pool.Query(context.Background(), `SELECT uuid, topic, partition_key, idempotency_key FROM "`+b.schema.Schema+`".outbox_ledger`)
	require.NoError(t, err)
	defer rows.Close()
	out := map[string]ledgerRow{}
	for rows.Next() {
		var r ledgerRow
		require.NoError(t, rows.Scan(&r.uuid, &r.topic, &r.partitionKey, &r.key))
		_, dup := out[r.uuid]
		require.False(t, dup, "one ledger row per published event: %s twice", r.uuid)
		out[r.uuid] = r
	}
	require.NoError(t, rows.Err())
	return out
}

// failBatch runs batches until one takes rows and fails, and returns its
// error: a batch may take nothing while the rows wait on transactions
// older than theirs elsewhere on the server.
func failBatch(t *testing.T, r *forwarder.Relay) error {
	t.Helper()
	var err error
	require.Eventually(t, func() bool {
		_, err = r.RelayBatch(context.Background())
		return err != nil
	}, 30*time.Second, 10*time.Millisecond)
	return err
}

// TestLedgerCommitsWithTheOutboxDelete: the ledger row of an event is
// written in the transaction that deletes it from the outbox. A batch
// whose publish fails after the broker took the messages, and a batch
// whose database session is killed before its commit, leave no ledger row
// and the events in the outbox; the batch that commits leaves one ledger
// row per event, with the inbox's default key.
func TestLedgerCommitsWithTheOutboxDelete(t *testing.T) {
	t.Parallel()
	b := setup(t, 4)
	ctx := context.Background()
	topic := pgtest.Name(t)
	s := &sink{}
	r := newRelay(t, b, s, func(c *forwarder.RelayConfig) { c.Ledger = true })

	keyed := event("k1", 1)
	keyed.Metadata.Set(delivery.IdempotencyKey, "order-1:paid")
	events := []*message.Message{keyed, event("k1", 2), event("k2", 3)}
	b.write(t, topic, events...)

	// The broker took the messages and the connection broke: the batch
	// rolls back, its delete and its ledger rows with it.
	s.fail = func(call int) (bool, bool) { return call == 1, true }
	require.ErrorContains(t, failBatch(t, r), "connection reset")
	require.Empty(t, b.ledger(t), "no ledger row for an event whose delete did not commit")
	require.Equal(t, len(events), b.count(t, "outbox"))

	// The relay's session dies between the publish and the commit. (The
	// server keeps the first kilobyte of a query's text: the take
	// statement is found by its start.)
	var (
		killed  int
		killErr error
	)
	s.fail = func(call int) (bool, bool) {
		if call == 2 {
			killErr = b.pool.QueryRow(ctx, `SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
				WHERE pid <> pg_backend_pid() AND state = 'idle in transaction'
				AND query LIKE '%pg_try_advisory_xact_lock%' AND query LIKE '%' || $1 || '%'`,
				`"`+b.schema.Schema+`".`).Scan(&killed)
		}
		return false, false
	}
	require.Error(t, failBatch(t, r))
	require.NoError(t, killErr)
	require.Equal(t, 1, killed, "the relay's session, in its batch")
	require.Empty(t, b.ledger(t), "no ledger row for an event whose delete did not commit")
	require.Equal(t, len(events), b.count(t, "outbox"))

	relayAll(t, r, len(events))
	require.Zero(t, b.count(t, "outbox"))
	got := b.ledger(t)
	require.Len(t, got, len(events))
	for _, e := range events {
		want := ledgerRow{uuid: e.UUID, topic: topic, partitionKey: e.Metadata.Get(delivery.PartitionKey), key: e.UUID}
		if k := e.Metadata.Get(delivery.IdempotencyKey); k != "" {
			want.key = k
		}
		require.Equal(t, want, got[e.UUID])
	}
}

// TestLedgerOffWritesNothing: without RelayConfig.Ledger the relay writes
// no ledger row and has no ledger to prune.
func TestLedgerOffWritesNothing(t *testing.T) {
	t.Parallel()
	b := setup(t, 2)
	r := newRelay(t, b, &sink{}, nil)
	b.write(t, pgtest.Name(t), event("k", 1))
	relayAll(t, r, 1)
	require.Zero(t, b.count(t, "outbox_ledger"))
	_, err := r.PruneLedger(context.Background())
	require.ErrorIs(t, err, forwarder.ErrNoLedger)
}

// TestLedgerRetention: a running relay deletes the ledger rows older than
// LedgerRetention, more than one statement's worth, and keeps the others.
func TestLedgerRetention(t *testing.T) {
	t.Parallel()
	b := setup(t, 4)
	ctx := context.Background()
	const old = 2500 // more than one delete's batch
	_, err := b.pool.Exec(ctx, `INSERT INTO "`+b.schema.Schema+`".outbox_ledger (uuid, topic, partition_key, idempotency_key, published_at)
		SELECT 'old-' || i, 't', 'k', 'old-' || i, now() - interval '2 hours' FROM generate_series(1, $1) AS i`, old)
	require.NoError(t, err)
	_, err = b.pool.Exec(ctx, `INSERT INTO "`+b.schema.Schema+`".outbox_ledger (uuid, topic, partition_key, idempotency_key, published_at)
		VALUES ('recent', 't', 'k', 'recent', now() - interval '30 minutes')`)
	require.NoError(t, err)

	r := newRelay(t, b, &sink{}, func(c *forwarder.RelayConfig) {
		c.Ledger = true
		c.LedgerRetention = time.Hour
	})
	run(t, r)
	b.write(t, pgtest.Name(t), event("k", 1))
	require.Eventually(t, func() bool {
		var n int
		require.NoError(t, b.pool.QueryRow(ctx, `SELECT count(*) FROM "`+b.schema.Schema+`".outbox_ledger WHERE uuid LIKE 'old-%'`).Scan(&n))
		return n == 0 && b.count(t, "outbox") == 0
	}, 30*time.Second, 20*time.Millisecond)
	got := b.ledger(t)
	require.Len(t, got, 2, "the recent row and the relayed event's")
	require.Contains(t, got, "recent")

	n, err := r.PruneLedger(ctx)
	require.NoError(t, err)
	require.Zero(t, n)
}

func TestLedgerConfigErrors(t *testing.T) {
	t.Parallel()
	b := setup(t, 2)
	_, err := forwarder.NewRelay(forwarder.RelayConfig{Pool: b.pool, Publisher: &sink{}, Schema: b.schema, Ledger: true, LedgerRetention: time.Second})
	require.ErrorContains(t, err, "RelayConfig.LedgerRetention")
	_, err = forwarder.NewRelay(forwarder.RelayConfig{Pool: b.pool, Publisher: &sink{}, Schema: b.schema, LedgerRetention: -time.Hour})
	require.ErrorContains(t, err, "RelayConfig.LedgerRetention")
}
