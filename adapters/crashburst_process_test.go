package adapters_test

import (
	"context"
	"fmt"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/adapters/kafka"
	"github.com/oncemill/oncemill/dedup/postgres"
	"github.com/oncemill/oncemill/internal/testing/brokertest"
	"github.com/oncemill/oncemill/internal/testing/pgtest"
	"github.com/oncemill/oncemill/internal/testing/proctest"
	"github.com/oncemill/oncemill/middleware"
)

const (
	// burstHandlerTime is how long the handler works on each message,
	// inside the inbox's transaction, so that every kill finds messages
	// in flight.
	burstHandlerTime = 800 * time.Millisecond
	// burstPublishEvery is the producer's pace: 5 messages a second.
	burstPublishEvery = 200 * time.Millisecond
	// burstInFlight bounds the messages in flight in a consumer, and is
	// its database pool's size: 20 messages a second, which catches up
	// with the backlog of the burst within seconds.
	burstInFlight = 16
)

// burstRole is a consumer process of the crash-burst test: the standard
// stack on the Kafka adapter, around a handler that works for
// burstHandlerTime and then inserts one effect row per key, with its
// process id, in the inbox's transaction.
var burstRole = proctest.NewRole("burst", func(cfg proctest.Stack, term <-chan os.Signal) error {
	c := &proctest.Consumer{
		Stack: cfg, MaxConns: burstInFlight, Verbose: true, StrictClose: true,
		// A key in flight at several kills is not poison here: the
		// attempts allowed outnumber the kills.
		Poison: &middleware.PoisonConfig{Topic: "dlq", MaxAttempts: 100,
			InitialBackoff: 20 * time.Millisecond, MaxBackoff: 200 * time.Millisecond},
	}
	effects := cfg.Table("effects")
	pid := os.Getpid()
	return c.Run(term, func(msg *message.Message) error {
		ctx := msg.Context()
		select {
		case <-time.After(burstHandlerTime):
		case <-ctx.Done():
			return ctx.Err()
		}
		_, err := postgres.Tx(ctx).Exec(ctx, `INSERT INTO `+effects+` (key, pid) VALUES ($1, $2)`, middleware.IdempotencyKey(ctx), pid)
		return err
	})
})

// TestKafkaCrashBurstProcesses: the embedded Kafka broker in its own
// process (or the cluster named by ONCEMILL_KAFKA_BROKERS), a topic of 4
// partitions fed 5 messages a second, and one dynamic consumer process
// (no instance_id; the kafka:// URL's defaults but for max_in_flight_total,
// with an 0.8 s handler) SIGKILLed 12 times, 4–12 s apart, restarted at
// once each time, as a supervisor restarts a crash loop, and then left
// running. The kills pile up: a consumer is often killed before the
// session of the one killed before it has expired, and while its own
// JoinGroup waits for that expiry.
//
// The liveness bound: the survivor applies its first message within
// twice the session timeout of the last kill, its start included; a
// crash must not cost the group more than the dead member's session,
// however many came before it. The figure is logged. In the end every
// published key is applied exactly once, nothing is dead-lettered and
// the group's lag is 0.
func TestKafkaCrashBurstProcesses(t *testing.T) {
	t.Parallel()
	brokers := proctest.KafkaCluster(t)
	id := pgtest.Name(t)
	topic, group := "payments_"+id, "ledger_"+id
	db := proctest.NewDB(t, `CREATE TABLE {S}.effects (key text NOT NULL, pid integer NOT NULL, at timestamptz NOT NULL DEFAULT clock_timestamp());
CREATE TABLE {S}.published (key text PRIMARY KEY)`)
	brokertest.CreateKafkaTopic(t, brokers, topic, proctest.KafkaPartitions)
	session := kafka.DefaultSessionTimeout
	bound := 2 * session

	cfg := db.Stack("kafka://"+strings.Join(brokers, ",")+"?group="+group+fmt.Sprintf("&max_in_flight_total=%d", burstInFlight), group, topic, "ledger")
	groups := brokertest.NewKafkaGroups(t, brokers)

	// The producer: one message a tick, each its own key, recorded once
	// the broker has it.
	stopProducer := db.Stream(t, "kafka://"+strings.Join(brokers, ","), topic, burstPublishEvery)

	// The group's states, as its coordinator describes them, for the log.
	var (
		watchMu sync.Mutex
		states  []string
		prev    string
	)
	began := time.Now()
	note := func(what string) {
		watchMu.Lock()
		defer watchMu.Unlock()
		states = append(states, fmt.Sprintf("+%5.1fs %s", time.Since(began).Seconds(), what))
	}
	stopWatching := groups.Watch(t, group, topic, 100*time.Millisecond, func(g brokertest.KafkaGroup, err error) {
		what := fmt.Sprintf("%s, %d members", g.State, len(g.Members))
		if err != nil {
			what = err.Error()
		}
		if what != prev {
			note(what)
			prev = what
		}
	})
	defer func() {
		stopWatching()
		watchMu.Lock()
		defer watchMu.Unlock()
		t.Logf("the group's states:\n  %s", strings.Join(states, "\n  "))
	}()

	// Steady: the first consumer applies messages.
	c := burstRole.Start(t, cfg)
	started := db.Now(t)
	require.Eventually(t, func() bool { return db.Count(t, `SELECT count(*) FROM {S}.effects WHERE at > $1`, started) > 0 },
		time.Minute, 50*time.Millisecond, "the first consumer applies messages")

	// The burst: 12 kills, 4–12 s apart, each followed by a restart.
	s := time.Second
	gaps := []time.Duration{4 * s, 5 * s, 4 * s, 9 * s, 4 * s, 6 * s, 12 * s, 4 * s, 5 * s, 7 * s, 4 * s, 6 * s}
	var lastKill time.Time
	last := time.Now()
	for i, gap := range gaps {
		time.Sleep(time.Until(last.Add(gap)))
		last = time.Now()
		lastKill = db.Now(t)
		c.Kill()
		note(fmt.Sprintf("kill %d", i+1))
		c = burstRole.Start(t, cfg)
	}
	survivor := c.Cmd.Process.Pid

	// The survivor's first effect, at the database's clock.
	var (
		first time.Time
		stall time.Duration
	)
	deadline := time.Now().Add(bound + 10*time.Second)
	for {
		var at *time.Time
		require.NoError(t, db.Pool.QueryRow(context.Background(), db.Q(`SELECT min(at) FROM {S}.effects WHERE pid = $1`), survivor).Scan(&at))
		if at != nil {
			first = *at
			stall = first.Sub(lastKill)
			note("the survivor's first effect")
			break
		}
		if time.Now().After(deadline) {
			stall = db.Now(t).Sub(lastKill)
			g, err := groups.Group(group, topic)
			require.FailNowf(t, "the survivor stalled",
				"no effect of the survivor %s after the last of %d kills (session timeout %s, bound %s); the group: %+v (%v)",
				stall.Round(10*time.Millisecond), len(gaps), session, bound, g, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
	t.Logf("after %d kills 4–12 s apart, the survivor applied its first message %.2fs after the last kill (session timeout %s, bound %s)",
		len(gaps), stall.Seconds(), session, bound)
	require.LessOrEqual(t, stall, bound, "the survivor consumes within twice the session timeout of the last kill")

	// Everything published is applied once, and the group is caught up.
	time.Sleep(2 * time.Second)
	published := stopAndCatchUp(t, db, stopProducer, brokers, topic, group)
	c.Stop(t, restartShutdownBound)

	require.Equal(t, published, db.Count(t, `SELECT count(*) FROM {S}.effects`), "exactly one effect per published message")
	require.Equal(t, published, db.Count(t, `SELECT count(DISTINCT key) FROM {S}.effects`))
	require.Zero(t, db.Count(t, `SELECT count(*) FROM {S}.dlq`), "nothing dead-lettered")
	t.Logf("%d messages published, each applied once, by %d consumer processes", published, db.Count(t, `SELECT count(DISTINCT pid) FROM {S}.effects`))
}
