//go:build chaos

package chaos_test

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/internal/testing/amqptest"
	"github.com/oncemill/oncemill/internal/testing/brokertest"
	"github.com/oncemill/oncemill/internal/testing/pgtest"
	"github.com/oncemill/oncemill/internal/testing/proctest"
)

// TestChaosBatchHandler is the chaos suite with the inbox's group commit
// and a middleware.BatchHandler that writes each batch's effects with one
// multi-row INSERT, on Kafka (the key-parallel subscriber) and RabbitMQ
// (eight subscriptions of the queue, so that deliveries wait together):
// two consumer processes per broker on a private PostgreSQL, the stream
// of TestChaos with its copies, poison and flaky keys, consumers
// SIGKILLed at random, PostgreSQL restarted and RabbitMQ's application
// restarted. A poison or flaky key fails alone through a BatchErrors, its
// mates commit without it; a kill takes the open batch's transaction with
// it.
func TestChaosBatchHandler(t *testing.T) {
	seed, random := seeded(t)
	pg := pgtest.StartServer(t)
	rabbit := amqptest.StartServer(t)
	kafkaAddrs := proctest.StartKafka(t)
	pool := chaosDB(t, pg.URL())

	run := strconv.FormatInt(time.Now().UnixNano()%1e9, 36)
	kl := newLane("kafka_batch", "kafka://"+strings.Join(kafkaAddrs, ",")+"?session_timeout=3s&rebalance_timeout=10s", run)
	al := newLane("amqp_batch", rabbit.URL()+"?prefetch=4", run)
	{
		topic, group := kl.topic, kl.group
		kl.pending = func(t *testing.T) int { return brokertest.KafkaLag(t, kafkaAddrs, topic, group) }
		kl.ordered = true
	}
	{
		topic, group := al.topic, al.group
		al.pending = func(t *testing.T) int { return brokertest.AMQPReady(t, rabbit.URL(), topic, group) }
	}
	lanes := []*lane{kl, al}
	for _, l := range lanes {
		l.addSlots(pg.URL(), "", "postgres", "postgres")
		for _, s := range l.slots {
			s.cfg.Batch = true
			s.cfg.Subscriptions = 1
			if l == al {
				s.cfg.Subscriptions = 8
			}
		}
	}
	// Nine SIGKILLs of a random consumer of each lane in turn, and one
	// outage of each service, spaced so that each fault's window shows
	// its own stall; shorter than TestChaos's.
	schedule := []step{
		{3 * time.Second, faultKill}, {6 * time.Second, faultKill}, {9 * time.Second, faultKill}, {12 * time.Second, faultKill},
		{15 * time.Second, faultPostgres},
		{23 * time.Second, faultKill}, {26 * time.Second, faultKill}, {29 * time.Second, faultKill},
		{32 * time.Second, faultRabbit},
		{40 * time.Second, faultKill}, {43 * time.Second, faultKill},
	}
	runChaos(t, chaosRun{
		seed: seed, random: random, pool: pool, lanes: lanes,
		schedule: schedule,
		outages: []outage{
			{name: faultPostgres, do: downFor(3*time.Second, pg.Stop, pg.Start)},
			{name: faultRabbit, lanes: []string{al.name}, do: downFor(3*time.Second, rabbit.StopApp, rabbit.StartApp)},
		},
		// Past the last fault's window.
		produceFor: 48 * time.Second,
		minKills:   7,
		summary: func(kills int) string {
			return fmt.Sprintf("batch handler: %d SIGKILLs, PostgreSQL restarted once (3 s down), RabbitMQ's app restarted once (3 s down)", kills)
		},
	})

	// The effects were written in bulk: on each broker, transactions that
	// committed more than one.
	for _, l := range lanes {
		var shared, largest int
		require.NoError(t, pool.QueryRow(context.Background(), `SELECT count(*) FILTER (WHERE n > 1), coalesce(max(n), 0)
FROM (SELECT count(*) AS n FROM `+schema+`.effects WHERE broker = $1 GROUP BY tx) AS per_tx`, l.name).Scan(&shared, &largest))
		t.Logf("%s: %d transactions committed more than one effect, the largest %d", l.name, shared, largest)
		require.Positive(t, shared, "%s: effects committed together", l.name)
	}
}
