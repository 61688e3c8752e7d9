package forwarder_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/dlq"
	"github.com/oncemill/oncemill/forwarder"
	"github.com/oncemill/oncemill/sqlschema"
)

// outboxUnderTest is an outbox on one database, for the tests that run on
// PostgreSQL and MySQL alike.
type outboxUnderTest struct {
	// insert commits rows (topic, uuid, partition_key, payload, metadata)
	// into the outbox by plain SQL, in one transaction.
	insert func(t *testing.T, rows [][]any)
	count  func(t *testing.T, table string) int
	relay  func(t *testing.T, pub message.Publisher, mod func(*forwarder.RelayConfig)) *forwarder.Relay
	dead   func(t *testing.T) []dlq.Entry
	// ledgerKeys lists the ledger's idempotency keys.
	ledgerKeys func(t *testing.T) []string
}

func pgOutboxUnderTest(t *testing.T) outboxUnderTest {
	b := setup(t, 8)
	ctx := context.Background()
	outbox := `"` + b.schema.Schema + `".`
	return outboxUnderTest{
		insert: func(t *testing.T, rows [][]any) {
			tx, err := b.pool.Begin(ctx)
			require.NoError(t, err)
			for _, r := range rows {
				_, err := tx.Exec(ctx, `INSERT INTO `+outbox+`outbox (topic, uuid, partition_key, payload, metadata) VALUES ($1, $2, $3, $4, $5::jsonb)`, r...)
				require.NoError(t, err)
			}
			require.NoError(t, tx.Commit(ctx))
		},
		count: b.count,
		relay: func(t *testing.T, pub message.Publisher, mod func(*forwarder.RelayConfig)) *forwarder.Relay {
			return newRelay(t, b, pub, mod)
		},
		dead: func(t *testing.T) []dlq.Entry {
			s, err := dlq.NewStore(b.pool, b.schema)
			require.NoError(t, err)
			es, err := s.List(ctx, dlq.Filter{})
			require.NoError(t, err)
			return es
		},
		ledgerKeys: func(t *testing.T) []string {
			rs, err := b.pool.Query(ctx, `SELECT idempotency_key FROM `+outbox+`outbox_ledger`)
			require.NoError(t, err)
			var keys []string
			for rs.Next() {
				var k string
				require.NoError(t, rs.Scan(&k))
				keys = append(keys, k)
			}
			require.NoError(t, rs.Err())
			return keys
		},
	}
}

func mysqlOutboxUnderTest(t *testing.T) outboxUnderTest {
	b := setupMySQL(t, 8)
	ctx := context.Background()
	return outboxUnderTest{
		insert: func(t *testing.T, rows [][]any) {
			tx, err := b.db.BeginTx(ctx, nil)
			require.NoError(t, err)
			for _, r := range rows {
				_, err := tx.ExecContext(ctx, "INSERT INTO `"+b.name+"`.outbox (topic, uuid, partition_key, payload, metadata, created_at) VALUES (?, ?, ?, ?, ?, UTC_TIMESTAMP(6))", r...)
				require.NoError(t, err)
			}
			require.NoError(t, tx.Commit())
		},
		count: b.count,
		relay: func(t *testing.T, pub message.Publisher, mod func(*forwarder.RelayConfig)) *forwarder.Relay {
			return b.relay(t, pub, mod)
		},
		dead: func(t *testing.T) []dlq.Entry {
			s, err := dlq.NewSQLStore(b.db, sqlschema.MySQL, b.schema)
			require.NoError(t, err)
			es, err := s.List(ctx, dlq.Filter{})
			require.NoError(t, err)
			return es
		},
		ledgerKeys: func(t *testing.T) []string {
			rs, err := b.db.QueryContext(ctx, "SELECT idempotency_key FROM `"+b.name+"`.outbox_ledger")
			require.NoError(t, err)
			var keys []string
			for rs.Next() {
				var k []byte
				require.NoError(t, rs.Scan(&k))
				keys = append(keys, string(k))
			}
			require.NoError(t, rs.Err())
			return keys
		},
	}
}

// TestRelayRefusedRowsCostOnlyThemselves, on PostgreSQL and on MariaDB,
// with and without the ledger: 29 good rows share their lanes with rows the
// relay refuses (an empty topic), one of them with a 4 KB uuid and a 4 KB
// idempotency key, two of them with one uuid, and one good row has a 4 KB
// uuid and key of its own. Every good row is published once within
// seconds, every refused row is one dead letter with its reason (the two
// of one uuid are two), and the outbox is left empty. A uuid or key longer
// than an index takes is stored bounded, the whole UUID kept for a
// replay. Issue 31, case 8: before, on PostgreSQL, the 4 KB uuid's dead
// letter failed its insert (dlq_uuid_idx) and no row went out for good
// (0 of 29 in 10 s); with the ledger, the 4 KB key's record failed
// (outbox_ledger_key_idx) likewise; the two refused rows of one uuid were
// one dead letter, the other lost.
func TestRelayRefusedRowsCostOnlyThemselves(t *testing.T) {
	t.Parallel()
	for _, db := range []struct {
		name string
		open func(*testing.T) outboxUnderTest
	}{{"PostgreSQL", pgOutboxUnderTest}, {"MySQL", mysqlOutboxUnderTest}} {
		for _, ledger := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/ledger=%t", db.name, ledger), func(t *testing.T) {
				t.Parallel()
				o := db.open(t)
				// Random text: PostgreSQL compresses a repetitive one
				// into an index row.
				long, longKey, goodLong := noise(4096), noise(4096), noise(4096)
				var rows [][]any
				// The refused rows come first in the lanes of the good rows
				// behind them (same partition keys).
				rows = append(rows,
					[]any{"", long, "key-0", []byte("no topic, long uuid"), `{"idempotency_key":"` + longKey + `"}`},
					[]any{"", "same-uuid", "key-1", []byte("no topic, one"), `{}`},
					[]any{"", "same-uuid", "key-2", []byte("no topic, two"), `{}`},
				)
				want := map[string]bool{}
				for i := range 28 {
					uuid := fmt.Sprintf("good-%02d", i)
					want[uuid] = true
					rows = append(rows, []any{"orders", uuid, fmt.Sprintf("key-%d", i%3), []byte(uuid), `{"idempotency_key":"k-` + uuid + `"}`})
				}
				want[goodLong] = true
				rows = append(rows, []any{"orders", goodLong, "key-0", []byte("long"), `{"idempotency_key":"` + longKey + `x"}`})
				o.insert(t, rows)

				sink := &sink{}
				r := o.relay(t, sink, func(c *forwarder.RelayConfig) { c.LockOrderedWriters, c.Ledger = true, ledger })
				began := time.Now()
				run(t, r)
				require.Eventually(t, func() bool { return o.count(t, "outbox") == 0 }, 10*time.Second, 5*time.Millisecond,
					"the relay empties the outbox within 10 s; published %d", len(sink.snapshot()))
				t.Logf("%d rows published, outbox empty in %s", len(sink.snapshot()), time.Since(began).Round(time.Millisecond))

				got := map[string]int{}
				for _, m := range sink.snapshot() {
					got[m.UUID]++
				}
				require.Equal(t, len(want), len(got), "every good row is published")
				for uuid, n := range got {
					require.True(t, want[uuid], "only good rows are published")
					require.Equal(t, 1, n, "each good row is published once")
				}

				dead := o.dead(t)
				require.Equal(t, 3, len(dead), "every refused row is one dead letter")
				uuids := map[string]int{}
				for _, e := range dead {
					require.Contains(t, e.Error, "topic is empty")
					require.True(t, e.Permanent)
					require.LessOrEqual(t, len(e.UUID), delivery.MaxBoundBytes, "the uuid column is bounded")
					uuids[e.Message("").UUID]++
				}
				require.True(t, uuids[long] == 1 && uuids["same-uuid"] == 2 && len(uuids) == 2, "a replay gets each row's whole UUID back")
				require.Contains(t, []string{dead[0].UUID, dead[1].UUID, dead[2].UUID}, delivery.Bound(long))

				if ledger {
					keys := o.ledgerKeys(t)
					require.Equal(t, len(want), len(keys), "the ledger records the published rows only")
					require.Contains(t, keys, delivery.Bound(longKey+"x"), "a long key is recorded bounded")
				}
			})
		}
	}
}

// noise returns n bytes of random hex.
func noise(n int) string {
	b := make([]byte, (n+1)/2)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)[:n]
}
