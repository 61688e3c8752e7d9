package forwarder_test

import (
	"context"
	"fmt"
	"hash/crc32"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/dlq"
	"github.com/oncemill/oncemill/forwarder"
	"github.com/oncemill/oncemill/internal/sqldb"
	"github.com/oncemill/oncemill/internal/testing/sqltest"
	"github.com/oncemill/oncemill/sqlschema"
)

// outboxUnderTest is the outbox of one of [sqltest.Backends], for the
// tests that run on every database the relay runs on. Its rows are
// written and read by plain SQL through the SQL layer, each statement
// written once; its events are written through the outbox's publisher,
// and its relay, lag and dead letters are the public API's for the way to
// the database (a pgx pool, or a *sql.DB and its dialect).
type outboxUnderTest struct {
	sqltest.Database
	sql   sqldb.DB
	d     *sqldb.Dialect
	names sqlschema.Names
}

// openOutbox opens a fresh outbox on backend.
func openOutbox(t *testing.T, backend sqltest.Backend) outboxUnderTest {
	db := backend.Open(t, 8)
	s := db.SQL()
	return outboxUnderTest{Database: db, sql: s, d: s.Dialect(), names: s.Dialect().Names(db.Schema)}
}

// outboxRow is a row written into the outbox by plain SQL.
type outboxRow struct {
	topic, uuid, key string
	payload          []byte
	metadata         string
}

// insert commits rows into the outbox by plain SQL, in one transaction
// and in their order, as a writer other than the outbox's publisher
// would: every string byte for byte, the lane written where the writer
// hashes it.
func (o outboxUnderTest) insert(t *testing.T, rows []outboxRow) {
	t.Helper()
	cols, vals := "", ""
	if o.d.WriterHashes() {
		cols, vals = ", lane", ", ?"
	}
	q := o.d.Rebind(`INSERT INTO ` + o.names.Outbox + ` (topic, uuid, partition_key, payload, metadata, created_at` + cols + `)
		VALUES (?, ?, ?, ?, ` + o.d.JSON("?") + `, ` + o.d.FromMicros("?") + vals + `)`)
	ctx := context.Background()
	require.NoError(t, sqldb.InTx(ctx, o.sql, sqldb.TxOptions{}, func(tx sqldb.Tx) error {
		for _, r := range rows {
			args := []any{o.d.Text(r.topic), o.d.Text(r.uuid), o.d.Text(r.key), r.payload, r.metadata, time.Now().UnixMicro()}
			if o.d.WriterHashes() {
				args = append(args, crc32.ChecksumIEEE([]byte(r.key))&63)
			}
			if _, err := tx.Exec(ctx, q, args...); err != nil {
				return err
			}
		}
		return nil
	}))
}

// pending counts the outbox's rows.
func (o outboxUnderTest) pending(t *testing.T) int {
	t.Helper()
	var n int
	require.NoError(t, o.sql.QueryRow(context.Background(), `SELECT COUNT(*) FROM `+o.names.Outbox).Scan(&n))
	return n
}

// ledgerKeys lists the ledger's idempotency keys.
func (o outboxUnderTest) ledgerKeys(t *testing.T) []string {
	t.Helper()
	rows, err := o.sql.Query(context.Background(), `SELECT idempotency_key FROM `+o.names.Ledger)
	keys, err := sqldb.Collect(rows, err, sqldb.Value[string])
	require.NoError(t, err)
	return keys
}

// relay is a relay on the outbox, publishing to pub, with short backoffs
// and what mod sets.
func (o outboxUnderTest) relay(t *testing.T, pub message.Publisher, mod func(*forwarder.RelayConfig)) *forwarder.Relay {
	t.Helper()
	cfg := forwarder.RelayConfig{Pool: o.Pool, DB: o.DB, Dialect: o.Dialect, Schema: o.Schema, Publisher: pub,
		MinBackoff: 10 * time.Millisecond, MaxBackoff: 50 * time.Millisecond}
	if mod != nil {
		mod(&cfg)
	}
	r, err := forwarder.NewRelay(cfg)
	require.NoError(t, err)
	return r
}

// dead lists the dead letters, as the dead-letter store reads them.
func (o outboxUnderTest) dead(t *testing.T) []dlq.Entry {
	t.Helper()
	var (
		s   *dlq.Store
		err error
	)
	if o.Pool != nil {
		s, err = dlq.NewStore(o.Pool, o.Schema)
	} else {
		s, err = dlq.NewSQLStore(o.DB, o.Dialect, o.Schema)
	}
	require.NoError(t, err)
	es, err := s.List(context.Background(), dlq.Filter{})
	require.NoError(t, err)
	return es
}

// lag is OutboxLag's reading, or SQLOutboxLag's.
func (o outboxUnderTest) lag(t *testing.T) forwarder.Lag {
	t.Helper()
	var (
		lag forwarder.Lag
		err error
	)
	if o.Pool != nil {
		lag, err = forwarder.OutboxLag(context.Background(), o.Pool, o.Schema)
	} else {
		lag, err = forwarder.SQLOutboxLag(context.Background(), o.DB, o.Dialect, o.Schema)
	}
	require.NoError(t, err)
	return lag
}

// write writes events to topic through the outbox's publisher
// (NewTxPublisher or NewSQLTxPublisher), in one transaction, and commits
// it or rolls it back.
func (o outboxUnderTest) write(ctx context.Context, topic string, commit bool, events ...*message.Message) error {
	return o.writeWith(ctx, commit, func(pub *forwarder.TxPublisher) error { return pub.Publish(topic, events...) })
}

// writeWith runs f with the outbox's publisher (NewTxPublisher or
// NewSQLTxPublisher) on a transaction of its own, and then commits the
// transaction, or rolls it back.
func (o outboxUnderTest) writeWith(ctx context.Context, commit bool, f func(*forwarder.TxPublisher) error) error {
	if o.Pool != nil {
		tx, err := o.Pool.Begin(ctx)
		if err != nil {
			return err
		}
		defer tx.Rollback(ctx) //nolint:errcheck // a no-op after Commit
		pub, err := forwarder.NewTxPublisher(ctx, tx, o.Schema)
		return publishIn(pub, err, f, commit, func() error { return tx.Commit(ctx) })
	}
	tx, err := o.DB.BeginTx(ctx, nil)
	if err != nil {
		return err
	}
	defer tx.Rollback() //nolint:errcheck // a no-op after Commit
	pub, err := forwarder.NewSQLTxPublisher(ctx, tx, o.Dialect, o.Schema)
	return publishIn(pub, err, f, commit, tx.Commit)
}

// publishIn runs f with pub, unless opening it failed with err, and then
// commits the transaction if commit is set.
func publishIn(pub *forwarder.TxPublisher, err error, f func(*forwarder.TxPublisher) error, commit bool, commitTx func() error) error {
	if err == nil {
		err = f(pub)
	}
	if err != nil || !commit {
		return err
	}
	return commitTx()
}

// TestRelayPromisesOnEveryBackend: on PostgreSQL through pgx and through
// database/sql, on MariaDB and on SQLite, writers of four keys commit
// (and roll back) events while a relay with the ledger runs, after a
// backlog and a row the relay must refuse (no topic). Every committed
// event is published once and deleted, each key's in its commit order,
// no rolled-back one; the refused row is one dead letter and never
// published; the ledger records exactly the published events; the lag
// counts the backlog, and nothing once it is drained.
func TestRelayPromisesOnEveryBackend(t *testing.T) {
	t.Parallel()
	for _, backend := range sqltest.Backends {
		t.Run(backend.Name, func(t *testing.T) {
			t.Parallel()
			const keys, backlogTx, liveTx = 4, 2, 8
			o := openOutbox(t, backend)
			ctx := context.Background()
			var (
				mu        sync.Mutex
				committed = map[string]bool{}
				seq       = map[string]int{}
			)
			// write is one transaction of the key's next 1 to 3 events.
			write := func(key string, i int, commit bool) error {
				n := 1 + i%3
				events := make([]*message.Message, n)
				mu.Lock()
				for j := range events {
					events[j] = event(key, seq[key]+1+j)
				}
				mu.Unlock()
				if err := o.write(ctx, "orders", commit, events...); err != nil {
					return fmt.Errorf("%s: %w", key, err)
				}
				if commit {
					mu.Lock()
					seq[key] += n
					for _, e := range events {
						committed[e.UUID] = true
					}
					mu.Unlock()
				}
				return nil
			}
			for k := range keys {
				for i := range backlogTx {
					require.NoError(t, write(fmt.Sprintf("key-%d", k), i, true))
				}
			}
			o.insert(t, []outboxRow{{"", "refused-1", "key-0", []byte("no topic"), `{}`}})

			lag := o.lag(t)
			require.Equal(t, len(committed)+1, lag.Pending, "the backlog: every row, the refused one too")
			require.Positive(t, lag.OldestAge)

			s := &sink{}
			r := o.relay(t, s, func(c *forwarder.RelayConfig) { c.Ledger, c.BatchSize = true, 5 })
			relayLag, err := r.Lag(ctx)
			require.NoError(t, err)
			require.Equal(t, lag.Pending, relayLag.Pending, "the relay's lag reads the same backlog")
			run(t, r)

			var wg sync.WaitGroup
			errs := make(chan error, keys)
			for k := range keys {
				wg.Add(1)
				go func(key string) {
					defer wg.Done()
					for i := range liveTx {
						if err := write(key, i, i%4 != 3); err != nil {
							errs <- err
							return
						}
					}
				}(fmt.Sprintf("key-%d", k))
			}
			wg.Wait()
			close(errs)
			for err := range errs {
				require.NoError(t, err)
			}
			require.Eventually(t, func() bool { return o.pending(t) == 0 && len(s.snapshot()) >= len(committed) },
				60*time.Second, 10*time.Millisecond, "the relay drains the outbox")

			published := map[string]int{}
			last := map[string]int{}
			for _, m := range s.snapshot() {
				published[m.UUID]++
				require.True(t, committed[m.UUID], "only committed events are published, not %s", m.UUID)
				key := m.Metadata.Get(delivery.PartitionKey)
				n, err := strconv.Atoi(m.Metadata.Get("seq"))
				require.NoError(t, err)
				require.Equal(t, last[key]+1, n, "%s: the events go out in their commit order", key)
				last[key] = n
			}
			require.Len(t, published, len(committed), "every committed event is published")
			for uuid, n := range published {
				require.Equal(t, 1, n, "%s is published once", uuid)
			}
			for k := range keys {
				key := fmt.Sprintf("key-%d", k)
				require.Equal(t, seq[key], last[key], "%s: every event up to its last", key)
			}

			dead := o.dead(t)
			require.Len(t, dead, 1, "the refused row is one dead letter")
			require.Equal(t, "refused-1", dead[0].Message("").UUID)
			require.Contains(t, dead[0].Error, "topic is empty")
			require.True(t, strings.HasPrefix(dead[0].Consumer, "relay:") && strings.HasSuffix(dead[0].Consumer, ".outbox"),
				"the relay's consumer, relay:<schema>.outbox: %s", dead[0].Consumer)
			require.True(t, dead[0].Permanent)

			ledger := o.ledgerKeys(t)
			require.Len(t, ledger, len(published), "the ledger records each published event once")
			for _, k := range ledger {
				require.Equal(t, 1, published[k], "the ledger records published events only, not %s", k)
			}

			lag = o.lag(t)
			require.Zero(t, lag.Pending, "drained")
			require.Zero(t, lag.OldestAge)
			require.Zero(t, lag.Waiting)
			require.Nil(t, lag.HeldBy)
		})
	}
}
