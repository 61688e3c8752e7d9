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

	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/adapters/amqp"
	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/forwarder"
	"github.com/oncemill/oncemill/internal/sqldb"
	"github.com/oncemill/oncemill/internal/testing/pgtest"
	"github.com/oncemill/oncemill/internal/testing/sqltest"
)

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
	for _, backend := range sqltest.Backends {
		for _, ledger := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/ledger=%t", backend.Name, ledger), func(t *testing.T) {
				t.Parallel()
				o := openOutbox(t, backend)
				// Random text: PostgreSQL compresses a repetitive one
				// into an index row.
				long, longKey, goodLong := noise(4096), noise(4096), noise(4096)
				var rows []outboxRow
				// The refused rows come first in the lanes of the good rows
				// behind them (same partition keys).
				rows = append(rows,
					outboxRow{"", long, "key-0", []byte("no topic, long uuid"), `{"idempotency_key":"` + longKey + `"}`},
					outboxRow{"", "same-uuid", "key-1", []byte("no topic, one"), `{}`},
					outboxRow{"", "same-uuid", "key-2", []byte("no topic, two"), `{}`},
				)
				want := map[string]bool{}
				for i := range 28 {
					uuid := fmt.Sprintf("good-%02d", i)
					want[uuid] = true
					rows = append(rows, outboxRow{"orders", uuid, fmt.Sprintf("key-%d", i%3), []byte(uuid), `{"idempotency_key":"k-` + uuid + `"}`})
				}
				want[goodLong] = true
				rows = append(rows, outboxRow{"orders", goodLong, "key-0", []byte("long"), `{"idempotency_key":"` + longKey + `x"}`})
				o.insert(t, rows)

				sink := &sink{}
				r := o.relay(t, sink, func(c *forwarder.RelayConfig) { c.LockOrderedWriters, c.Ledger = true, ledger })
				began := time.Now()
				run(t, r)
				require.Eventually(t, func() bool { return o.pending(t) == 0 }, 10*time.Second, 5*time.Millisecond,
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
	for _, backend := range sqltest.Backends {
		t.Run(backend.Name, func(t *testing.T) {
			t.Parallel()
			topic := "oncemill-test-refused-topic-" + noise(12)
			cfg := amqp.Config{URL: url}
			if err := amqp.Declare(context.Background(), cfg, topic); err != nil {
				pgtest.Unavailable(t, "RabbitMQ", err)
			}
			t.Cleanup(func() { deleteAMQPTopic(t, url, cfg, topic) })
			o := openOutbox(t, backend)
			bad := []string{strings.Repeat("t", 300)}
			if o.d != sqldb.Postgres {
				// PostgreSQL's text refuses invalid UTF-8 on insert;
				// MySQL's BLOBs and SQLite's TEXT keep any bytes.
				bad = append(bad, "orders-\xff\xfe")
			}
			var rows []outboxRow
			want := map[string]bool{}
			for i := range 6 {
				uuid := fmt.Sprintf("good-%d", i)
				want[uuid] = true
				rows = append(rows, outboxRow{topic, uuid, "one-key", []byte(uuid), `{}`})
				if i < len(bad) {
					rows = append(rows, outboxRow{bad[i], fmt.Sprintf("bad-%d", i), "one-key", []byte("bad"), `{}`})
				}
			}
			o.insert(t, rows)

			pub, err := amqp.NewPublisher(cfg, nil)
			require.NoError(t, err)
			t.Cleanup(func() { require.NoError(t, pub.Close()) })
			run(t, o.relay(t, pub, func(c *forwarder.RelayConfig) { c.LockOrderedWriters = true }))
			require.Eventually(t, func() bool { return o.pending(t) == 0 }, 15*time.Second, 10*time.Millisecond,
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
			require.Equal(t, len(bad), len(dead), "every refused row is one dead letter")
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
