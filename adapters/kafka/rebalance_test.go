package kafka_test

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/dedup/postgres"
	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/dlq"
	"github.com/oncemill/oncemill/internal/testing/brokertest"
	"github.com/oncemill/oncemill/internal/testing/pgtest"
	"github.com/oncemill/oncemill/middleware"
	"github.com/oncemill/oncemill/sqlschema"
)

// The workload of TestRebalanceExactlyOnce: rebalanceKeys record keys,
// each published with sequence numbers 1..rebalanceSeqs, one round of
// every key per sequence number.
const (
	rebalancePartitions = 6
	rebalanceKeys       = 200
	rebalanceSeqs       = 15
	// rebalanceRoundGap spaces the producer's rounds: the stream lasts
	// about rebalanceSeqs of them.
	rebalanceRoundGap = 500 * time.Millisecond
	// The third member joins after this round is published, the first
	// leaves after that one.
	rebalanceJoinAfter  = 4
	rebalanceLeaveAfter = 9
	// rebalanceMaxAttempts is the poison middleware's MaxAttempts; the
	// transient keys fail transientFailures times, fewer.
	rebalanceMaxAttempts = 5
	transientFailures    = 2
	// rebalanceConsumer is the inbox's consumer name, the same on every
	// member: they are one service.
	rebalanceConsumer = "ledger"
)

// rebalanceKey is the record key of key number k.
func rebalanceKey(k int) string { return fmt.Sprintf("acct-%03d", k) }

// rebalanceIdem is the idempotency key of key k's message seq.
func rebalanceIdem(k, seq int) string { return fmt.Sprintf("%s/%d", rebalanceKey(k), seq) }

// slowFor is how long the handler of key k's message seq works after
// writing its effect: 50–300 ms for one key in eight, nothing otherwise.
func slowFor(k, seq int) time.Duration {
	if k%8 != 1 {
		return 0
	}
	return time.Duration(50+(k*7+seq*31)%251) * time.Millisecond
}

// isTransient reports whether key k's message seq fails
// transientFailures times before it succeeds.
func isTransient(k, seq int) bool { return k%10 == 4 && seq%3 == 0 }

// isStubborn reports whether the handler of key k's message seq ignores
// cancellation: it works stubbornWork, longer than the drain timeout, so
// that a revocation or a close abandons it while it holds the key's
// claim. Published in the rounds just before the third member joins and
// the first leaves, so that they are in flight then.
func isStubborn(k, seq int) bool {
	return k%50 == 21 && (seq == rebalanceJoinAfter || seq == rebalanceLeaveAfter)
}

// stubbornWork is longer than the subscribers' drain timeout (half the
// rebalance timeout of fastGroups).
const stubbornWork = 2500 * time.Millisecond

// isPoison reports whether key k's message seq fails on every attempt:
// nine messages over the stream, on both sides of the rebalances.
func isPoison(k, seq int) bool {
	switch {
	case k%40 == 13:
		return seq == 3+k/40*2 // keys 13, 53, 93, 133, 173 at seq 3, 5, 7, 9, 11
	case k == 7 || k == 107:
		return seq == 6 || seq == 12
	}
	return false
}

// isDuplicated reports whether key k's message seq is published a second
// time, with the same idempotency key, one round later: a few messages of
// every seventeenth key, and every poison message.
func isDuplicated(k, seq int) bool {
	return (k%17 == 0 && seq%4 == 2) || isPoison(k, seq)
}

// poisonDelay is how long a poison message's handler works before it
// fails, so that poison messages are in flight when partitions move.
const poisonDelay = 60 * time.Millisecond

// rebalanceRun is the state the members of TestRebalanceExactlyOnce share:
// the database, the transient failures so far, and who handled which
// partition last.
type rebalanceRun struct {
	brokers []string
	topic   string
	group   string
	schema  string // unquoted
	q       string // quoted

	mu       sync.Mutex
	failures map[string]int    // idempotency key → transient failures so far
	owner    map[string]string // partition → member that last handled it
	moves    int               // partition handovers seen by the handlers

	// lateFinishes counts stubborn handlers that finished after their
	// context was cancelled.
	lateFinishes atomic.Int64
}

// rebalanceMember is one consumer of the group: its own Kafka subscriber,
// PostgreSQL pool, inbox, poison middleware and router.
type rebalanceMember struct {
	name   string
	router *message.Router
	sub    message.Subscriber
	inbox  *middleware.Inbox
	poison *middleware.Poison
	done   chan error // Run's result

	deliveries atomic.Int64 // messages the router handed to the chain
	closeTook  time.Duration
}

// TestRebalanceExactlyOnce: six partitions, a steady producer of 200 keys
// with per-key sequence numbers (3,000 messages and some duplicates of
// the same idempotency key), and a group whose members each run the
// PostgreSQL inbox behind the poison middleware, with the dead-letter
// queue in PostgreSQL and the effect, an INSERT of key, seq and member, in
// the inbox's transaction. Two members start; a third joins mid-stream,
// and later the first leaves (its router closed). Some handlers are slow
// (50–300 ms, honouring the context), some messages fail twice and then
// succeed, a few always fail, and a few handlers, in flight when the
// partitions move, ignore cancellation for longer than the drain timeout:
// the old owner abandons them while they hold the key's claim, and the
// new owner's delivery of the same record waits for that claim.
//
// From PostgreSQL: each key's effects, in the order they were applied,
// have increasing sequence numbers; no message has two effects; every
// message that does not always fail has one; each one that always fails
// is dead-lettered exactly once and has none (so no record is both
// applied by one member and dead-lettered by another, as an old owner
// that went on retrying a revoked record would do); the transient ones
// are not dead-lettered. The group's committed offsets reach the end of
// every partition.
func TestRebalanceExactlyOnce(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	brokers := Brokers(t)
	pool := pgtest.Pool(t, 3)
	schema := pgtest.Schema(t, pool)
	run := &rebalanceRun{
		brokers:  brokers,
		topic:    uniqueName("rebalance"),
		group:    uniqueName("ledger"),
		schema:   schema,
		q:        pgx.Identifier{schema}.Sanitize(),
		failures: map[string]int{},
		owner:    map[string]string{},
	}
	_, err := pool.Exec(ctx, `CREATE TABLE `+run.q+`.effects (
	id     bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
	key    text    NOT NULL,
	seq    integer NOT NULL,
	idem   text    NOT NULL,
	member text    NOT NULL
)`)
	require.NoError(t, err)
	createTopic(t, brokers, run.topic, rebalancePartitions)
	pub := newPublisher(t, brokers)

	watch := watchGroup(t, brokers, run.group)
	began := time.Now()
	first := run.start(t, "a")
	second := run.start(t, "b")
	var third *rebalanceMember
	leaving := make(chan error, 1)

	// The producer: one round per sequence number, every key in it, and
	// the duplicates of the previous round.
	published, duplicates := 0, 0
	for seq := 1; seq <= rebalanceSeqs+1; seq++ {
		var batch []*message.Message
		for k := range rebalanceKeys {
			if seq <= rebalanceSeqs {
				batch = append(batch, rebalanceMessage(k, seq))
				published++
			}
			if seq > 1 && isDuplicated(k, seq-1) {
				batch = append(batch, rebalanceMessage(k, seq-1))
				duplicates++
			}
		}
		require.NoError(t, pub.Publish(run.topic, batch...))
		switch seq {
		case rebalanceJoinAfter:
			third = run.start(t, "c")
		case rebalanceLeaveAfter:
			go func() { leaving <- first.close() }()
		}
		time.Sleep(rebalanceRoundGap)
	}
	require.NoError(t, <-leaving, "the leaving member's router closes cleanly")

	var poisoned []string
	want := map[string]bool{} // idempotency keys that must be applied
	for k := range rebalanceKeys {
		for seq := 1; seq <= rebalanceSeqs; seq++ {
			if isPoison(k, seq) {
				poisoned = append(poisoned, rebalanceIdem(k, seq))
			} else {
				want[rebalanceIdem(k, seq)] = true
			}
		}
	}
	require.Eventually(t, func() bool {
		effects, err := run.tryCount(pool, `SELECT count(DISTINCT idem) FROM {S}.effects`)
		if err != nil || effects < len(want) {
			return false
		}
		dead, err := run.tryCount(pool, `SELECT count(DISTINCT key) FROM {S}.dlq`)
		return err == nil && dead >= len(poisoned)
	}, 90*time.Second, 50*time.Millisecond, "every message applied or dead-lettered")
	require.Eventually(t, func() bool { return brokertest.KafkaLag(t, brokers, run.topic, run.group) == 0 },
		30*time.Second, 50*time.Millisecond, "the group's committed offsets reach the end of every partition")
	consumed := time.Since(began)
	require.NoError(t, second.close())
	require.NoError(t, third.close())
	rebalances := watch()

	// Per-key order: the identity column is the order of application.
	require.Zero(t, run.count(t, pool, `SELECT count(*) FROM (
	SELECT seq, lag(seq) OVER (PARTITION BY key ORDER BY id) AS prev FROM {S}.effects) s
WHERE prev >= seq`), "a key's effects applied out of sequence order")
	// Doubled and lost.
	require.Zero(t, run.count(t, pool, `SELECT count(*) FROM (
	SELECT idem FROM {S}.effects GROUP BY idem HAVING count(*) > 1) d`), "messages applied twice")
	rows, err := pool.Query(ctx, `SELECT DISTINCT idem FROM `+run.q+`.effects`)
	require.NoError(t, err)
	applied, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	got := map[string]bool{}
	for _, idem := range applied {
		got[idem] = true
		require.True(t, want[idem], "%s applied, but it always fails", idem)
	}
	for idem := range want {
		require.True(t, got[idem], "%s never applied", idem)
	}
	// Dead letters: the poison messages exactly once each, nothing else,
	// none of them applied.
	dead := map[string]int{}
	rows, err = pool.Query(ctx, `SELECT key, count(*) FROM `+run.q+`.dlq GROUP BY key`)
	require.NoError(t, err)
	for rows.Next() {
		var (
			key string
			n   int
		)
		require.NoError(t, rows.Scan(&key, &n))
		dead[key] = n
	}
	require.NoError(t, rows.Err())
	for _, idem := range poisoned {
		require.Equal(t, 1, dead[idem], "%s dead-lettered %d times, want exactly once", idem, dead[idem])
	}
	require.Len(t, dead, len(poisoned), "only the poison messages are dead-lettered: %v", dead)
	require.Zero(t, run.count(t, pool, `SELECT count(*) FROM {S}.effects e JOIN {S}.dlq d ON d.key = e.idem`),
		"a message both applied and dead-lettered")
	require.Equal(t, len(poisoned), run.count(t, pool, `SELECT count(*) FROM {S}.inbox WHERE consumer = $1 AND status = 'dead'`, rebalanceConsumer))
	require.Equal(t, len(want), run.count(t, pool, `SELECT count(*) FROM {S}.inbox WHERE consumer = $1 AND status = 'done'`, rebalanceConsumer))
	require.Equal(t, 0, brokertest.KafkaLag(t, brokers, run.topic, run.group), "nothing left unconsumed")

	// The summary.
	members := []*rebalanceMember{first, second, third}
	perMember := map[string]int{}
	rows, err = pool.Query(ctx, `SELECT member, count(*) FROM `+run.q+`.effects GROUP BY member`)
	require.NoError(t, err)
	for rows.Next() {
		var (
			name string
			n    int
		)
		require.NoError(t, rows.Scan(&name, &n))
		perMember[name] = n
	}
	require.NoError(t, rows.Err())
	var (
		lines                                   []string
		deliveries                              int64
		inboxDups, deadCopies, failed, abandons int64
		deadLettered, meanwhile                 int64
	)
	for _, m := range members {
		in, ps := m.inbox.Stats(), m.poison.Stats()
		deliveries += m.deliveries.Load()
		inboxDups += in.Duplicates
		deadCopies += in.DeadCopies
		failed += in.Failed
		abandons += in.Abandoned
		deadLettered += ps.DeadLettered
		meanwhile += ps.AppliedMeanwhile
		lines = append(lines, fmt.Sprintf("%s: %d effects, %d deliveries, %d duplicates absorbed, %d failed attempts, %d cut short by revocation or close, %d dead-lettered, %d dead copies; router closed in %s",
			m.name, perMember[m.name], m.deliveries.Load(), in.Duplicates, in.Failed, in.Abandoned, ps.DeadLettered, in.DeadCopies, m.closeTook.Round(time.Millisecond)))
	}
	require.Equal(t, int64(len(poisoned)), deadLettered, "the poison middlewares dead-lettered each poison message once")
	run.mu.Lock()
	moves := run.moves
	run.mu.Unlock()
	reasons := run.deadReasons(t, pool)
	t.Logf("%d messages + %d published duplicates on %d partitions, consumed in %s; %d effects (%d keys), 0 doubled, 0 lost, 0 out of order; %d dead-lettered once each (%s), 0 applied and dead; %d deliveries, %d duplicates absorbed by the inbox (%d published, %d redeliveries), %d dead copies acked, %d failed attempts, %d attempts cut short (not counted), %d applied meanwhile; %d rebalances seen by the coordinator, %d partition handovers seen by the handlers; %d handlers that ignore cancellation finished after it",
		published, duplicates, rebalancePartitions, consumed.Round(time.Millisecond), len(applied), rebalanceKeys,
		len(poisoned), reasons, deliveries, inboxDups, duplicates, inboxDups+deadCopies-int64(duplicates), deadCopies, failed, abandons, meanwhile, rebalances, moves, run.lateFinishes.Load())
	for _, l := range lines {
		t.Log(l)
	}
}

// rebalanceMessage is key k's message seq.
func rebalanceMessage(k, seq int) *message.Message {
	msg := message.NewMessage(watermill.NewUUID(), []byte(rebalanceIdem(k, seq)))
	msg.Metadata.Set(delivery.PartitionKey, rebalanceKey(k))
	msg.Metadata.Set(delivery.IdempotencyKey, rebalanceIdem(k, seq))
	msg.Metadata.Set("acct", strconv.Itoa(k))
	msg.Metadata.Set("seq", strconv.Itoa(seq))
	return msg
}

// count runs a count query, {S} standing for the quoted schema.
func (run *rebalanceRun) count(t *testing.T, pool *pgxpool.Pool, query string, args ...any) int {
	t.Helper()
	n, err := run.tryCount(pool, query, args...)
	require.NoError(t, err)
	return n
}

// tryCount is count for the conditions of require.Eventually, which run
// in a goroutine of their own and must not fail the test.
func (run *rebalanceRun) tryCount(pool *pgxpool.Pool, query string, args ...any) (int, error) {
	var n int
	err := pool.QueryRow(context.Background(), strings.ReplaceAll(query, "{S}", run.q), args...).Scan(&n)
	return n, err
}

// watchGroup polls the coordinator's description of group until the
// function it returns is called, which returns how many times the group
// was seen to leave the Stable state: the rebalances seen (a rebalance
// shorter than the polling interval may go unseen).
func watchGroup(t *testing.T, brokers []string, group string) func() int {
	t.Helper()
	sc := sarama.NewConfig()
	sc.Version = sarama.V2_3_0_0
	admin, err := sarama.NewClusterAdmin(brokers, sc)
	require.NoError(t, err)
	stop, done := make(chan struct{}), make(chan int)
	go func() {
		rebalances, stable := 0, false
		tick := time.NewTicker(20 * time.Millisecond)
		defer tick.Stop()
		for {
			if groups, err := admin.DescribeConsumerGroups([]string{group}); err == nil && len(groups) == 1 {
				switch state := groups[0].State; {
				case state == "Stable":
					stable = true
				case stable && (state == "PreparingRebalance" || state == "CompletingRebalance"):
					stable = false
					rebalances++
				}
			}
			select {
			case <-tick.C:
			case <-stop:
				done <- rebalances
				return
			}
		}
	}()
	var once sync.Once
	result := 0
	finish := func() int {
		once.Do(func() {
			close(stop)
			result = <-done
			assert.NoError(t, admin.Close())
		})
		return result
	}
	t.Cleanup(func() { finish() })
	return finish
}

// deadReasons sums up why the dead letters were dead-lettered.
func (run *rebalanceRun) deadReasons(t *testing.T, pool *pgxpool.Pool) string {
	t.Helper()
	rows, err := pool.Query(context.Background(), `SELECT CASE WHEN error LIKE $1 THEN 'crash loop' ELSE 'handler error' END AS reason,
	attempts, count(*) FROM `+run.q+`.dlq GROUP BY 1, 2 ORDER BY 1, 2`, "%"+middleware.ErrCrashLoop.Error()+"%")
	require.NoError(t, err)
	var parts []string
	for rows.Next() {
		var (
			reason      string
			attempts, n int
		)
		require.NoError(t, rows.Scan(&reason, &attempts, &n))
		parts = append(parts, fmt.Sprintf("%d after %d attempts (%s)", n, attempts, reason))
	}
	require.NoError(t, rows.Err())
	sort.Strings(parts)
	return strings.Join(parts, ", ")
}

// handover notes that member handled a message of partition.
func (run *rebalanceRun) handover(partition, member string) {
	run.mu.Lock()
	defer run.mu.Unlock()
	if last, ok := run.owner[partition]; ok && last != member {
		run.moves++
	}
	run.owner[partition] = member
}

// transientFailure reports whether idem's attempt is to fail, counting
// the failure: the first transientFailures attempts do.
func (run *rebalanceRun) transientFailure(idem string) bool {
	run.mu.Lock()
	defer run.mu.Unlock()
	if run.failures[idem] >= transientFailures {
		return false
	}
	run.failures[idem]++
	return true
}

// errTransient and errPoison are the handler's failures.
var (
	errTransient = errors.New("transient failure")
	errPoison    = errors.New("this message always fails")
)

// start starts member name, and returns once its router runs.
func (run *rebalanceRun) start(t *testing.T, name string) *rebalanceMember {
	t.Helper()
	// Each in-flight message holds a connection for its transaction; a
	// handler waiting for one waits on its context, so that a small pool
	// slows the member down but cannot deadlock it.
	pool := pgtest.Pool(t, 8)
	store, err := postgres.New(pool, postgres.Config{Schema: run.schema})
	require.NoError(t, err)
	dlqPub, err := dlq.NewPublisher(pool, sqlschema.Config{Schema: run.schema})
	require.NoError(t, err)
	poison, err := middleware.NewPoison(middleware.PoisonConfig{
		Publisher: dlqPub, Topic: "dlq_" + run.topic, MaxAttempts: rebalanceMaxAttempts,
		InitialBackoff: 20 * time.Millisecond, MaxBackoff: 50 * time.Millisecond,
	})
	require.NoError(t, err)
	inbox, err := middleware.NewInbox(middleware.InboxConfig{TxStore: store, Consumer: rebalanceConsumer})
	require.NoError(t, err)
	sub := newSubscriber(t, run.brokers, run.group)
	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 20 * time.Second}, testLogger())
	require.NoError(t, err)
	m := &rebalanceMember{name: name, router: r, sub: sub, inbox: inbox, poison: poison, done: make(chan error, 1)}

	counting := func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			m.deliveries.Add(1)
			run.handover(msg.Metadata.Get(delivery.Partition), name)
			return h(msg)
		}
	}
	r.AddMiddleware(counting, poison.Middleware, inbox.Middleware)
	r.AddNoPublisherHandler(rebalanceConsumer, run.topic, sub, func(msg *message.Message) error {
		return run.handle(msg, name)
	})
	go func() { m.done <- r.Run(context.Background()) }()
	select {
	case <-r.Running():
	case err := <-m.done:
		t.Fatalf("member %s: router stopped before it ran: %v", name, err)
	}
	t.Cleanup(func() {
		if !r.IsClosed() {
			assert.NoError(t, m.close(), "member %s at the end of the test", name)
		}
	})
	return m
}

// handle is the members' handler: the effect, in the inbox's
// transaction, then the message's work or failure.
func (run *rebalanceRun) handle(msg *message.Message, member string) error {
	ctx := msg.Context()
	k, err := strconv.Atoi(msg.Metadata.Get("acct"))
	if err != nil {
		return middleware.Permanent(err)
	}
	seq, err := strconv.Atoi(msg.Metadata.Get("seq"))
	if err != nil {
		return middleware.Permanent(err)
	}
	idem := middleware.IdempotencyKey(ctx)
	if _, err := postgres.Tx(ctx).Exec(ctx, `INSERT INTO `+run.q+`.effects (key, seq, idem, member) VALUES ($1, $2, $3, $4)`,
		rebalanceKey(k), seq, idem, member); err != nil {
		return err
	}
	work := slowFor(k, seq)
	if isPoison(k, seq) {
		work = poisonDelay
	}
	if isStubborn(k, seq) {
		time.Sleep(stubbornWork)
		if ctx.Err() != nil {
			run.lateFinishes.Add(1)
		}
		return nil
	}
	if work > 0 {
		timer := time.NewTimer(work)
		defer timer.Stop()
		select {
		case <-timer.C:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	switch {
	case isPoison(k, seq):
		return errPoison
	case isTransient(k, seq) && run.transientFailure(idem):
		return errTransient
	}
	return nil
}

// close closes the member's router, which closes its subscriber, and
// waits for Run to return.
func (m *rebalanceMember) close() error {
	start := time.Now()
	err := m.router.Close()
	select {
	case runErr := <-m.done:
		err = errors.Join(err, runErr)
	case <-time.After(30 * time.Second):
		err = errors.Join(err, fmt.Errorf("member %s: Run did not return 30s after Close", m.name))
	}
	err = errors.Join(err, m.sub.Close())
	m.closeTook = time.Since(start)
	return err
}
