package sqlite_test

import (
	"bufio"
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	mrand "math/rand/v2"
	"os"
	"os/signal"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/adapters/amqp"
	"github.com/oncemill/oncemill/dedup/sqlite"
	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/dlq"
	"github.com/oncemill/oncemill/forwarder"
	"github.com/oncemill/oncemill/internal/testing/amqptest"
	"github.com/oncemill/oncemill/internal/testing/proctest"
	"github.com/oncemill/oncemill/internal/testing/sqltest"
	"github.com/oncemill/oncemill/middleware"
	"github.com/oncemill/oncemill/sqlschema"
)

// sqliteConsumerEnv, when set, makes the test binary a consumer process of
// TestSQLiteConsumerSIGKILL instead of running the tests (see init): its
// JSON value is a sqliteConsumerProcess.
const sqliteConsumerEnv = "ONCEMILL_TEST_SQLITE_CONSUMER"

// The lines a consumer process prints: once it consumes, when a delivery
// reaches the stack, and when the stack is done with it (whether the
// handler ran, and the error the router got).
const (
	sqliteConsumerReady = "SQLITE CONSUMER READY"
	deliveryLine        = "DELIVERY "
	doneLine            = "DONE "
	statsLine           = "STATS "
)

// sqliteConsumerProcess is what a consumer process runs: the standard
// stack on the SQLite database file Path, consuming Topic of the RabbitMQ
// broker at AMQP in the consumer group Group.
type sqliteConsumerProcess struct {
	Path       string `json:"path"`
	AMQP       string `json:"amqp"`
	Topic      string `json:"topic"`
	Group      string `json:"group"`
	EventTopic string `json:"event_topic"`
}

func init() {
	if v := os.Getenv(sqliteConsumerEnv); v != "" {
		term := make(chan os.Signal, 1)
		signal.Notify(term, syscall.SIGTERM)
		if err := sqliteConsumerMain(v, term); err != nil {
			fmt.Fprintln(os.Stderr, "sqlite consumer:", err)
			os.Exit(4)
		}
		os.Exit(0)
	}
}

// ranKey carries, in a delivery's context, the flag its handler run sets.
type ranKey struct{}

// sqliteConsumerMain is a consumer process's life: on a Watermill router,
// the poison middleware with the SQLite dead-letter table, the inbox with
// the SQLite store and the consumer outbox, around a handler that works a
// little inside the inbox's transaction, then writes the order's effect
// row and, for every other order, an event. It runs until SIGTERM, or
// until it is SIGKILLed.
func sqliteConsumerMain(raw string, term <-chan os.Signal) error {
	var p sqliteConsumerProcess
	if err := json.Unmarshal([]byte(raw), &p); err != nil {
		return err
	}
	ctx := context.Background()
	db, err := sql.Open("sqlite", sqltest.DSN(p.Path))
	if err != nil {
		return err
	}
	defer db.Close()
	store, err := sqlite.New(ctx, db, sqlite.Config{})
	if err != nil {
		return err
	}
	dead, err := dlq.NewSQLPublisher(db, sqlschema.SQLite, sqlschema.Config{})
	if err != nil {
		return err
	}
	inbox, err := middleware.NewInbox(middleware.InboxConfig{
		TxStore: store, Consumer: p.Group,
		Outbox: forwarder.SQLInboxOutbox(p.EventTopic, sqlschema.SQLite, sqlschema.Config{}),
	})
	if err != nil {
		return err
	}
	poison, err := middleware.NewPoison(middleware.PoisonConfig{
		Inbox: inbox, Publisher: dead,
		// An order in flight at several kills is not poison here: the
		// attempts allowed outnumber the kills.
		MaxAttempts:    100,
		InitialBackoff: 10 * time.Millisecond, MaxBackoff: 100 * time.Millisecond,
	})
	if err != nil {
		return err
	}
	pid := os.Getpid()
	handler := func(msg *message.Message) ([]*message.Message, error) {
		ctx := msg.Context()
		*ctx.Value(ranKey{}).(*bool) = true
		amount, err := strconv.Atoi(string(msg.Payload))
		if err != nil {
			return nil, middleware.Permanent(fmt.Errorf("order %s: amount %q: %w", msg.UUID, msg.Payload, err))
		}
		// The work, inside the inbox's transaction: a kill finds it in
		// flight most of the time.
		select {
		case <-time.After(time.Duration(5+mrand.IntN(15)) * time.Millisecond):
		case <-ctx.Done():
			return nil, ctx.Err()
		}
		if _, err := sqlite.Tx(ctx).ExecContext(ctx, `INSERT INTO effects (uuid, amount, pid) VALUES (?, ?, ?)`, msg.UUID, amount, pid); err != nil {
			return nil, err
		}
		if amount%2 != 0 {
			return nil, nil
		}
		ev := message.NewMessage("billed-"+msg.UUID, msg.Payload)
		ev.Metadata.Set(delivery.PartitionKey, msg.UUID)
		return []*message.Message{ev}, nil
	}
	stack := poison.Middleware(inbox.Middleware(handler))

	sub, err := amqp.NewSubscriber(amqp.Config{URL: p.AMQP, ConsumerGroup: p.Group}, nil)
	if err != nil {
		return err
	}
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
	if err != nil {
		return errors.Join(err, sub.Close())
	}
	router.AddConsumerHandler(p.Group, p.Topic, sub, func(msg *message.Message) error {
		fmt.Println(deliveryLine + msg.UUID)
		ran := false
		msg.SetContext(context.WithValue(msg.Context(), ranKey{}, &ran))
		_, err := stack(msg)
		outcome := "-"
		if err != nil {
			outcome = strconv.Quote(err.Error())
		}
		fmt.Printf("%s%s %t %s\n", doneLine, msg.UUID, ran, outcome)
		return err
	})
	done := make(chan error, 1)
	go func() { done <- router.Run(ctx) }()
	select {
	case <-router.Running():
	case err := <-done:
		return errors.Join(fmt.Errorf("router stopped at start: %w", err), sub.Close())
	}
	fmt.Println(sqliteConsumerReady)
	select {
	case <-term:
		err = errors.Join(router.Close(), <-done)
	case err = <-done:
		err = fmt.Errorf("router stopped by itself: %w", err)
	}
	stats, merr := json.Marshal(struct {
		Inbox  middleware.InboxStats
		Poison middleware.PoisonStats
	}{inbox.Stats(), poison.Stats()})
	fmt.Println(statsLine + string(stats))
	return errors.Join(err, merr, sub.Close())
}

// consumerLog is what a consumer process printed about its deliveries.
type consumerLog struct {
	deliveries []string
	// done holds, per finished delivery, whether the handler ran and the
	// error the router got ("-" for none).
	done []doneDelivery
}

type doneDelivery struct {
	uuid, err string
	ran       bool
}

func parseConsumerLog(out string) (consumerLog, error) {
	var l consumerLog
	sc := bufio.NewScanner(strings.NewReader(out))
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if uuid, ok := strings.CutPrefix(line, deliveryLine); ok {
			l.deliveries = append(l.deliveries, uuid)
			continue
		}
		rest, ok := strings.CutPrefix(line, doneLine)
		if !ok {
			continue
		}
		fields := strings.SplitN(rest, " ", 3)
		if len(fields) != 3 {
			return l, fmt.Errorf("malformed line %q", line)
		}
		ran, err := strconv.ParseBool(fields[1])
		if err != nil {
			return l, fmt.Errorf("line %q: %w", line, err)
		}
		l.done = append(l.done, doneDelivery{uuid: fields[0], ran: ran, err: fields[2]})
	}
	return l, sc.Err()
}

// TestSQLiteConsumerSIGKILL: a consumer process with the standard stack on
// SQLite (poison middleware with the dead-letter table, inbox, consumer
// outbox, all in one database file) consumes orders from a durable
// RabbitMQ queue and is SIGKILLed at random moments, again and again, while
// its handler is at work inside the inbox's transaction, and restarted
// (one process at a time: SQLite has one writer). Some orders were
// published twice, as a producer's retry does, and two are malformed, which
// the handler refuses as permanent failures. Counted from outside, in the
// file: every valid order applied exactly once (0 lost, 0 doubled), each
// even one's event in the outbox exactly once; each malformed order exactly
// one dead letter and no effect; and once the last consumer left, nothing
// is left unacked in the queue.
func TestSQLiteConsumerSIGKILL(t *testing.T) {
	t.Parallel()
	const (
		orders     = 300
		duplicated = 30 // orders published twice
		kills      = 8
	)
	path := filepath.Join(t.TempDir(), "billing.db")
	db, err := sql.Open("sqlite", sqltest.DSN(path))
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, db.Close()) })
	ctx := context.Background()
	require.NoError(t, sqlschema.MigrateSQL(ctx, db, sqlschema.SQLite, sqlschema.Config{}))
	_, err = db.ExecContext(ctx, `CREATE TABLE effects (n INTEGER PRIMARY KEY AUTOINCREMENT, uuid TEXT NOT NULL, amount INTEGER NOT NULL, pid INTEGER NOT NULL)`)
	require.NoError(t, err)

	// The broker: a topic of its own, its queue declared before anything
	// is published, both deleted at the end.
	const prefix = "oncemill-test-sqlite-consumer-kill-"
	topic, acfg, admin := amqptest.Topic(t, prefix, "billing")
	id := strings.TrimPrefix(topic, prefix)
	queue := acfg.QueueName(topic)
	inspect := func() amqp091.Queue {
		ch, err := admin.Channel()
		require.NoError(t, err)
		defer ch.Close()
		q, err := ch.QueueDeclarePassive(queue, true, false, false, false, nil)
		require.NoError(t, err)
		return q
	}

	// The orders: order-NNN with an amount of NNN+1, some of them twice,
	// two malformed (one of those twice as well), in a shuffled order.
	rng := mrand.New(mrand.NewPCG(7, 11))
	var (
		valid     = map[string]int{} // uuid → amount
		malformed = map[string]bool{}
		msgs      []*message.Message
	)
	order := func(uuid, payload string) *message.Message {
		m := message.NewMessage(uuid, []byte(payload))
		m.Metadata.Set(delivery.PartitionKey, uuid)
		return m
	}
	for i := range orders {
		uuid := fmt.Sprintf("order-%03d-%s", i, id)
		valid[uuid] = i + 1
		msgs = append(msgs, order(uuid, strconv.Itoa(i+1)))
	}
	for _, i := range rng.Perm(orders)[:duplicated] {
		msgs = append(msgs, msgs[i].Copy())
	}
	for i := range 2 {
		uuid := fmt.Sprintf("bad-%d-%s", i, id)
		malformed[uuid] = true
		msgs = append(msgs, order(uuid, "twelve"))
	}
	msgs = append(msgs, msgs[len(msgs)-1].Copy())
	rng.Shuffle(len(msgs), func(i, j int) { msgs[i], msgs[j] = msgs[j], msgs[i] })
	pub, err := amqp.NewPublisher(acfg, nil)
	require.NoError(t, err)
	require.NoError(t, pub.Publish(topic, msgs...))
	require.NoError(t, pub.Close())

	// The consumer: one process at a time, SIGKILLed a while after it
	// began to consume, and restarted at once.
	env, err := json.Marshal(sqliteConsumerProcess{Path: path, AMQP: amqptest.URL(), Topic: topic, Group: "billing", EventTopic: "billed-" + id})
	require.NoError(t, err)
	start := func() *proctest.Process {
		p, err := proctest.Start([]string{sqliteConsumerEnv + "=" + string(env)}, sqliteConsumerReady, 30*time.Second)
		require.NoError(t, err)
		return p
	}
	var logs []consumerLog
	read := func(p *proctest.Process) consumerLog {
		l, err := parseConsumerLog(p.Out.String())
		require.NoError(t, err)
		return l
	}
	began := time.Now()
	c := start()
	t.Cleanup(func() { c.Kill() })
	inFlightAtKill := 0
	for range kills {
		require.Eventually(t, func() bool { return len(read(c).deliveries) > 0 }, 20*time.Second, 5*time.Millisecond,
			"the consumer receives orders")
		time.Sleep(time.Duration(100+rng.IntN(500)) * time.Millisecond)
		c.Kill()
		l := read(c)
		logs = append(logs, l)
		inFlightAtKill += len(l.deliveries) - len(l.done)
		c = start()
	}

	// The last consumer drains the queue: every order settled, nothing
	// ready in the queue and the consumer idle for a while; then it is
	// stopped cleanly, and the queue must hold nothing, acked or not.
	count := func(q string, args ...any) int {
		var n int
		require.NoError(t, db.QueryRowContext(ctx, q, args...).Scan(&n))
		return n
	}
	var idleSince time.Time
	lastSeen := -1
	drained := func() bool {
		l := read(c)
		if len(l.done) != lastSeen || len(l.deliveries) != len(l.done) {
			lastSeen, idleSince = len(l.done), time.Now()
			return false
		}
		return time.Since(idleSince) > time.Second &&
			count(`SELECT count(DISTINCT uuid) FROM effects`) >= len(valid) &&
			count(`SELECT count(*) FROM dlq`) >= len(malformed) &&
			inspect().Messages == 0
	}
	if !assertEventually(drained, 40*time.Second) {
		t.Logf("consumer output:\n%s", c.Out.String())
		t.Fatalf("not drained: %d of %d orders applied, %d of %d dead-lettered, %d messages ready in the queue",
			count(`SELECT count(DISTINCT uuid) FROM effects`), len(valid), count(`SELECT count(*) FROM dlq`), len(malformed), inspect().Messages)
	}
	require.NoError(t, c.Terminate(20*time.Second))
	require.Zero(t, c.Code(), "the last consumer exits cleanly; output:\n%s", c.Out.String())
	last := read(c)
	logs = append(logs, last)
	stats, _ := c.Out.Line(statsLine)
	took := time.Since(began)

	// The queue: every message acked, none left for the next consumer.
	q := inspect()
	require.Zero(t, q.Messages, "messages left in the queue once the last consumer left")

	// The effects: one per valid order, none for a malformed one.
	applied := map[string]int{}
	rows, err := db.QueryContext(ctx, `SELECT uuid, amount FROM effects`)
	require.NoError(t, err)
	for rows.Next() {
		var (
			uuid   string
			amount int
		)
		require.NoError(t, rows.Scan(&uuid, &amount))
		applied[uuid]++
		require.Equal(t, valid[uuid], amount, "effect of %s", uuid)
	}
	require.NoError(t, rows.Err())
	var lost, doubled []string
	for uuid := range valid {
		switch n := applied[uuid]; {
		case n == 0:
			lost = append(lost, uuid)
		case n > 1:
			doubled = append(doubled, fmt.Sprintf("%s×%d", uuid, n))
		}
	}
	for uuid := range applied {
		_, ok := valid[uuid]
		require.True(t, ok, "an effect for %s, which is not a valid order", uuid)
	}
	sort.Strings(lost)
	sort.Strings(doubled)

	// The outbox: one event per even order applied, nothing else.
	events := map[string]int{}
	rows, err = db.QueryContext(ctx, `SELECT uuid, topic, partition_key FROM outbox`)
	require.NoError(t, err)
	for rows.Next() {
		var uuid, evTopic, key string
		require.NoError(t, rows.Scan(&uuid, &evTopic, &key))
		require.Equal(t, "billed-"+id, evTopic)
		require.Equal(t, "billed-"+key, uuid, "the event's partition key is its order")
		events[key]++
	}
	require.NoError(t, rows.Err())
	var eventsLost, eventsDoubled, eventsUnwanted int
	for uuid, amount := range valid {
		switch n := events[uuid]; {
		case amount%2 != 0 && n > 0:
			eventsUnwanted++
		case amount%2 == 0 && n == 0:
			eventsLost++
		case n > 1:
			eventsDoubled++
		}
	}
	for uuid := range events {
		_, ok := valid[uuid]
		require.True(t, ok, "an event for %s, which is not a valid order", uuid)
	}

	// The dead letters: one per malformed order, read as the console and
	// the command read them.
	dlqStore, err := dlq.NewSQLStore(db, sqlschema.SQLite, sqlschema.Config{})
	require.NoError(t, err)
	entries, err := dlqStore.List(ctx, dlq.Filter{})
	require.NoError(t, err)
	deadLettered := map[string]int{}
	for _, e := range entries {
		deadLettered[e.UUID]++
		require.Equal(t, topic, e.Topic, "entry %d: the original topic", e.ID)
		require.Equal(t, "billing", e.Consumer, "entry %d: the consumer", e.ID)
		require.Equal(t, e.UUID, e.Key, "entry %d: the inbox's key", e.ID)
		require.Contains(t, e.Error, "twelve", "entry %d: the handler's error", e.ID)
	}

	// The figures, from every process's lines.
	var deliveries, runs, absorbed, deadCopies, failed int
	for _, l := range logs {
		deliveries += len(l.deliveries)
		for _, d := range l.done {
			switch {
			case d.ran:
				runs++
			case d.err == "-" && malformed[d.uuid]:
				deadCopies++ // acked by the inbox: the key is dead-lettered
			case d.err == "-":
				absorbed++ // acked by the inbox: the order is applied
			}
			if d.err != "-" {
				failed++
			}
		}
	}
	t.Logf("%d messages published (%d orders, %d of them twice, %d malformed, one of those twice) in %s; %d SIGKILLs, %d deliveries in flight at them; "+
		"%d deliveries, %d handler runs, %d failed; duplicates absorbed by the inbox: %d copies of applied orders, %d of dead-lettered ones; %d effects: %d lost, %d doubled; %d events: %d lost, %d doubled, %d unwanted; "+
		"%d dead letters; last consumer's %s",
		len(msgs), orders, duplicated, len(malformed), took.Round(100*time.Millisecond), kills, inFlightAtKill,
		deliveries, runs, failed, absorbed, deadCopies, len(applied), len(lost), len(doubled), len(events), eventsLost, eventsDoubled, eventsUnwanted,
		len(entries), stats)

	require.Empty(t, lost, "orders lost")
	require.Empty(t, doubled, "orders applied more than once")
	require.Zero(t, eventsLost, "events lost")
	require.Zero(t, eventsDoubled, "events written more than once")
	require.Zero(t, eventsUnwanted, "events of odd orders")
	require.Len(t, entries, len(malformed), "one dead letter per malformed order")
	for uuid := range malformed {
		require.Equal(t, 1, deadLettered[uuid], "dead letters of %s", uuid)
		require.Zero(t, applied[uuid], "effects of %s", uuid)
	}
	require.Positive(t, inFlightAtKill, "the kills found deliveries in flight")
}

// assertEventually polls cond until it holds or bound passes.
func assertEventually(cond func() bool, bound time.Duration) bool {
	deadline := time.Now().Add(bound)
	for !cond() {
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(50 * time.Millisecond)
	}
	return true
}
