package forwarder_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/adapters/amqp"
	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/dlq"
	"github.com/oncemill/oncemill/forwarder"
	"github.com/oncemill/oncemill/internal/testing/pgtest"
	"github.com/oncemill/oncemill/sqlschema"
)

// outboxUnderTest is an outbox on one database, for the tests that run on
// every database the relay runs on (see [outboxBackends]).
type outboxUnderTest struct {
	// insert commits rows (topic, uuid, partition_key, payload, metadata)
	// into the outbox by plain SQL, in one transaction.
	insert func(t *testing.T, rows [][]any)
	count  func(t *testing.T, table string) int
	relay  func(t *testing.T, pub message.Publisher, mod func(*forwarder.RelayConfig)) *forwarder.Relay
	dead   func(t *testing.T) []dlq.Entry
	// ledgerKeys lists the ledger's idempotency keys.
	ledgerKeys func(t *testing.T) []string
	// write writes events to topic through the outbox's publisher, in one
	// transaction, and commits it or rolls it back.
	write func(ctx context.Context, topic string, commit bool, events ...*message.Message) error
	// lag is OutboxLag's or SQLOutboxLag's reading.
	lag func(t *testing.T) forwarder.Lag
}

func pgOutboxUnderTest(t *testing.T) outboxUnderTest { return pgOutboxUnderTestOn(t, setup(t, 8)) }

func pgOutboxUnderTestOn(t *testing.T, b bundle) outboxUnderTest {
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
		write: func(ctx context.Context, topic string, commit bool, events ...*message.Message) error {
			tx, err := b.pool.Begin(ctx)
			if err != nil {
				return err
			}
			defer tx.Rollback(ctx) //nolint:errcheck // no-op after commit
			pub, err := forwarder.NewTxPublisher(ctx, tx, b.schema)
			if err == nil {
				err = pub.Publish(topic, events...)
			}
			if err != nil || !commit {
				return err
			}
			return tx.Commit(ctx)
		},
		lag: func(t *testing.T) forwarder.Lag {
			lag, err := forwarder.OutboxLag(ctx, b.pool, b.schema)
			require.NoError(t, err)
			return lag
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
		write: sqlWrite(b.db, sqlschema.MySQL, b.schema),
		lag:   sqlLag(b.db, sqlschema.MySQL, b.schema),
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

// TestRelayRefusedRowsCostOnlyThemselves, on every backend,
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
	for _, db := range outboxBackends {
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

// TestRelayRefusesTopicsRabbitMQRefuses, on every backend: rows whose topic RabbitMQ would refuse (300 bytes, longer than
// an AMQP name; on MySQL and SQLite, whose outbox holds bytes, also
// invalid UTF-8)
// sit between good rows of their lane. They are dead-lettered with the
// publisher's reason before any publish, and each good row reaches the
// queue once. Issue 31, case 8: before, the 300-byte topic made the broker
// close the channel and the relay retried the batch in a loop (0 rows
// left the outbox), and on MySQL the invalid UTF-8 topic republished the
// good row before it on every try.
func TestRelayRefusesTopicsRabbitMQRefuses(t *testing.T) {
	t.Parallel()
	url := os.Getenv("ONCEMILL_AMQP_URL")
	if url == "" {
		url = "amqp://guest:guest@127.0.0.1:5672/"
	}
	for _, db := range []struct {
		name string
		open func(*testing.T) outboxUnderTest
		bad  []string
	}{
		{"PostgreSQL", pgOutboxUnderTest, []string{strings.Repeat("t", 300)}},
		{"MySQL", mysqlOutboxUnderTest, []string{strings.Repeat("t", 300), "orders-\xff\xfe"}},
		{"PostgreSQL/database-sql", pgSQLOutboxUnderTest, []string{strings.Repeat("t", 300)}},
		{"SQLite", sqliteOutboxUnderTest, []string{strings.Repeat("t", 300), "orders-\xff\xfe"}},
	} {
		t.Run(db.name, func(t *testing.T) {
			t.Parallel()
			topic := "oncemill-test-refused-topic-" + noise(12)
			cfg := amqp.Config{URL: url}
			if err := amqp.Declare(context.Background(), cfg, topic); err != nil {
				pgtest.Unavailable(t, "RabbitMQ", err)
			}
			t.Cleanup(func() { deleteAMQPTopic(t, url, cfg, topic) })
			o := db.open(t)
			var rows [][]any
			want := map[string]bool{}
			for i := range 6 {
				uuid := fmt.Sprintf("good-%d", i)
				want[uuid] = true
				rows = append(rows, []any{topic, uuid, "one-key", []byte(uuid), `{}`})
				if i < len(db.bad) {
					rows = append(rows, []any{db.bad[i], fmt.Sprintf("bad-%d", i), "one-key", []byte("bad"), `{}`})
				}
			}
			o.insert(t, rows)

			pub, err := amqp.NewPublisher(cfg, nil)
			require.NoError(t, err)
			t.Cleanup(func() { require.NoError(t, pub.Close()) })
			run(t, o.relay(t, pub, func(c *forwarder.RelayConfig) { c.LockOrderedWriters = true }))
			require.Eventually(t, func() bool { return o.count(t, "outbox") == 0 }, 15*time.Second, 10*time.Millisecond,
				"the relay empties the outbox")

			sub, err := amqp.NewSubscriber(cfg, nil)
			require.NoError(t, err)
			t.Cleanup(func() { require.NoError(t, sub.Close()) })
			ctx, cancel := context.WithCancel(context.Background())
			t.Cleanup(cancel)
			msgs, err := sub.Subscribe(ctx, topic)
			require.NoError(t, err)
			got := map[string]int{}
			// Every good row, then whatever else comes within a second:
			// a copy published twice would be in the queue by now.
			for deadline := time.After(30 * time.Second); ; {
				var quiet <-chan time.Time
				if len(got) == len(want) {
					quiet = time.After(time.Second)
				}
				select {
				case m := <-msgs:
					got[m.UUID]++
					m.Ack()
					continue
				case <-quiet:
				case <-deadline:
					t.Fatalf("received %v of %d rows", got, len(want))
				}
				break
			}
			for uuid, n := range got {
				require.True(t, want[uuid], "only good rows reach the broker, got %s", uuid)
				require.Equal(t, 1, n, "row %s reaches the broker once", uuid)
			}
			require.Equal(t, len(want), len(got))

			dead := o.dead(t)
			require.Equal(t, len(db.bad), len(dead), "every refused row is one dead letter")
			for _, e := range dead {
				require.Contains(t, e.Error, "the publisher refuses the topic")
				require.Contains(t, e.Error, "amqp: invalid topic")
			}
		})
	}
}

func deleteAMQPTopic(t *testing.T, url string, cfg amqp.Config, topic string) {
	admin, err := amqp091.DialConfig(url, amqp091.Config{Dial: amqp091.DefaultDial(3 * time.Second)})
	require.NoError(t, err)
	defer admin.Close()
	ch, err := admin.Channel()
	require.NoError(t, err)
	_, err = ch.QueueDelete(cfg.QueueName(topic), false, false, false)
	require.NoError(t, err)
	require.NoError(t, ch.ExchangeDelete(cfg.ExchangeName(topic), false, false))
	require.NoError(t, ch.Close())
}
