package forwarder_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	mrand "math/rand/v2"
	"os"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/adapters/amqp"
	"github.com/oncemill/oncemill/dedup"
	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/forwarder"
	"github.com/oncemill/oncemill/internal/sqldb"
	"github.com/oncemill/oncemill/internal/testing/amqptest"
	"github.com/oncemill/oncemill/internal/testing/proctest"
	"github.com/oncemill/oncemill/middleware"
	"github.com/oncemill/oncemill/sqlschema"
)

// relayProcess is what a relay process of [testRelaySIGKILL] runs: a
// Relay on the outbox of the database DSN opens through database/sql,
// publishing to RabbitMQ in small batches, so that a kill often lands
// between a batch's publish and its commit.
type relayProcess struct {
	Driver        string            `json:"driver"`
	DSN           string            `json:"dsn"`
	Dialect       sqlschema.Dialect `json:"dialect"`
	Schema        string            `json:"schema"`
	LanesPerBatch int               `json:"lanes_per_batch"`
	LockOrdered   bool              `json:"lock_ordered"`
	AMQP          string            `json:"amqp"`
}

var relayRole = proctest.NewRole("relay", func(p relayProcess, term <-chan os.Signal) error {
	db, err := sql.Open(p.Driver, p.DSN)
	if err != nil {
		return proctest.Setup(err)
	}
	defer db.Close()
	pub, err := amqp.NewPublisher(amqp.Config{URL: p.AMQP}, nil)
	if err != nil {
		return proctest.Setup(err)
	}
	defer pub.Close()
	r, err := forwarder.NewRelay(forwarder.RelayConfig{
		DB: db, Dialect: p.Dialect, Publisher: pub, Schema: sqlschema.Config{Schema: p.Schema},
		BatchSize: 20, LanesPerBatch: p.LanesPerBatch, LockOrderedWriters: p.LockOrdered,
		MinBackoff: 10 * time.Millisecond, MaxBackoff: 100 * time.Millisecond,
		Logger: watermill.NewStdLogger(false, false),
	})
	if err != nil {
		return proctest.Setup(err)
	}
	done := make(chan error, 1)
	go func() { done <- r.Run(context.Background()) }()
	proctest.Ready("")
	select {
	case <-term:
		return errors.Join(r.Close(), <-done)
	case err := <-done:
		return fmt.Errorf("relay stopped by itself: %w", err)
	}
})

// relayKill is what [testRelaySIGKILL] needs of a database; the rest is
// the same on every one.
type relayKill struct {
	// db holds the outbox, the consumer's inbox and the tables of the
	// test: orders (id, seq), whose rows the writers lock, and effects
	// (n, uuid, key, seq), n their insert order.
	db     *sql.DB
	schema sqlschema.Config
	// tables are the statements that create what db does not have yet
	// of orders and effects.
	tables []string
	// inbox is the consumer's inbox store on db, and inboxTx its
	// transaction in a handler's context.
	inbox   dedup.TxStore
	inboxTx func(context.Context) *sql.Tx
	// relay is what each relay process runs (AMQP is filled in), relays
	// how many run at once.
	relay  relayProcess
	relays int
	// writerSeed and killSeed seed the writers' and the killer's random
	// choices; pause makes a writer wait 0 to 2 ms between transactions.
	writerSeed uint64
	killSeed   [2]uint64
	pause      bool
	// delay, when set, schedules every event delay after its write
	// (forwarder.Delay): the relays are killed while rows wait in the
	// scheduled table and while they move them into the outbox.
	delay time.Duration
}

// testRelaySIGKILL: writers commit (and roll back) events on k.db while
// k.relays relay processes publish them to RabbitMQ and are SIGKILLed,
// again and again, and restarted; a consumer with an inbox on k.db
// applies each event as an effect row. Counted from outside, in the
// database the effects commit to: every committed event applied once (0
// lost, 0 doubled), each key's in its commit order (0 order violations),
// no rolled-back one; the copies a killed relay had published and not
// deleted reach the consumer again, and its inbox absorbs them. With
// k.delay, no event reaches the consumer before its due time either, and
// some kills land while scheduled rows wait.
func testRelaySIGKILL(t *testing.T, k relayKill) {
	const (
		writers, txPerWriter, keys, perTx = 4, 60, 8, 4
		minKills                          = 6
	)
	d, err := sqldb.For(k.relay.Dialect)
	require.NoError(t, err)
	db := sqldb.SQL(k.db, d)
	orders, effects := qualified(d, k.schema, "orders"), qualified(d, k.schema, "effects")
	ctx := context.Background()
	for _, stmt := range k.tables {
		_, err := db.Exec(ctx, stmt)
		require.NoError(t, err)
	}
	for i := 0; i < keys; i++ {
		_, err := db.Exec(ctx, d.Rebind(`INSERT INTO `+orders+` (id) VALUES (?)`), fmt.Sprintf("key-%d", i))
		require.NoError(t, err)
	}

	// The broker: a topic of its own, its queue declared before anything
	// is published.
	topic, acfg, _ := amqptest.Topic(t, "oncemill-test-"+d.String()+"-relay-kill-", "shipping")

	// The consumer: a router whose inbox is beside the outbox; each
	// event's effect is a row written in the inbox's transaction. Every
	// delivery is counted before the inbox.
	inboxMW, err := middleware.NewInbox(middleware.InboxConfig{TxStore: k.inbox, Consumer: "shipping"})
	require.NoError(t, err)
	var (
		deliveriesMu sync.Mutex
		deliveries   = map[string]int{}
		early        int // deliveries before their due time
	)
	insertEffect := d.Rebind(`INSERT INTO ` + effects + ` (uuid, ` + d.Quote("key") + `, seq) VALUES (?, ?, ?)`)
	handler := inboxMW.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		seq, err := strconv.Atoi(msg.Metadata.Get("seq"))
		if err != nil {
			return nil, middleware.Permanent(err)
		}
		_, err = k.inboxTx(msg.Context()).ExecContext(msg.Context(), insertEffect,
			msg.UUID, msg.Metadata.Get(delivery.PartitionKey), seq)
		return nil, err
	})
	sub, err := amqp.NewSubscriber(acfg, nil)
	require.NoError(t, err)
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
	require.NoError(t, err)
	router.AddConsumerHandler("shipping", topic, sub, func(msg *message.Message) error {
		now := time.Now()
		deliveriesMu.Lock()
		deliveries[msg.UUID]++
		if due, err := time.Parse(time.RFC3339Nano, msg.Metadata.Get(forwarder.DueAtKey)); err == nil && now.Before(due) {
			early++
		}
		deliveriesMu.Unlock()
		_, err := handler(msg)
		return err
	})
	routerDone := make(chan error, 1)
	go func() { routerDone <- router.Run(context.Background()) }()
	t.Cleanup(func() {
		require.NoError(t, router.Close())
		require.NoError(t, <-routerDone)
	})
	<-router.Running()

	// The relays: processes of their own, killed and restarted (and
	// killed when the test ends, their output logged).
	process := k.relay
	process.AMQP = amqptest.URL()
	running := make([]*proctest.Process, k.relays)
	for i := range running {
		running[i] = relayRole.Start(t, process)
	}

	// The writers, while a relay is killed now and then.
	var (
		mu        sync.Mutex
		committed = map[string]bool{}
		wg        sync.WaitGroup
		errs      = make(chan error, writers)
		written   = make(chan struct{})
		late      atomic.Int64 // events written after their due time
	)
	for w := 0; w < writers; w++ {
		wg.Add(1)
		go func(w int) {
			defer wg.Done()
			rng := mrand.New(mrand.NewPCG(uint64(w), k.writerSeed))
			for i := 0; i < txPerWriter; i++ {
				commit := rng.IntN(6) != 0
				ids, err := writeOrdered(ctx, k.db, d, k.schema, topic, fmt.Sprintf("key-%d", rng.IntN(keys)), 1+rng.IntN(perTx), commit, k.delay, &late)
				if err != nil {
					errs <- fmt.Errorf("writer %d: %w", w, err)
					return
				}
				if commit {
					mu.Lock()
					for _, id := range ids {
						committed[id] = true
					}
					mu.Unlock()
				}
				if k.pause {
					time.Sleep(time.Duration(rng.IntN(3)) * time.Millisecond)
				}
			}
		}(w)
	}
	go func() {
		wg.Wait()
		close(written)
	}()
	count := func(table string) int {
		var n int
		require.NoError(t, db.QueryRow(ctx, `SELECT COUNT(*) FROM `+table).Scan(&n))
		return n
	}
	names := d.Names(k.schema)
	kills, killsScheduled := 0, 0 // killsScheduled: with scheduled rows waiting
	rng := mrand.New(mrand.NewPCG(k.killSeed[0], k.killSeed[1]))
	for stop := false; !stop || kills < minKills; {
		select {
		case <-written:
			stop, written = true, nil
		case <-time.After(time.Duration(50+rng.IntN(150)) * time.Millisecond):
		}
		if stop && kills >= minKills {
			break
		}
		i := rng.IntN(len(running))
		if k.delay > 0 && count(names.Scheduled) > 0 {
			killsScheduled++
		}
		running[i].Kill()
		kills++
		running[i] = relayRole.Start(t, process)
	}
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}

	// The relays still running drain the outbox (and the scheduled
	// table); the consumer applies what they publish.
	drained := func() bool {
		return count(names.Outbox) == 0 && count(names.Scheduled) == 0 && count(effects) >= len(committed)
	}
	if !assertEventually(drained, 3*time.Minute) {
		deliveriesMu.Lock()
		n := len(deliveries)
		deliveriesMu.Unlock()
		t.Fatalf("not drained: %d rows in the outbox, %d scheduled, %d of %d events applied, %d delivered",
			count(names.Outbox), count(names.Scheduled), count(effects), len(committed), n)
	}

	rows, err := db.Query(ctx, `SELECT uuid, `+d.Quote("key")+`, seq FROM `+effects+` ORDER BY n`)
	require.NoError(t, err)
	defer rows.Close()
	var (
		applied               = map[string]int{}
		last                  = map[string]int{}
		doubled, outOfOrder   int
		notCommitted, applies int
	)
	for rows.Next() {
		var (
			uuid, key string
			seq       int
		)
		require.NoError(t, rows.Scan(&uuid, &key, &seq))
		applies++
		applied[uuid]++
		if applied[uuid] > 1 {
			doubled++
		}
		if !committed[uuid] {
			notCommitted++
		}
		if seq != last[key]+1 {
			outOfOrder++
		}
		last[key] = seq
	}
	require.NoError(t, rows.Err())
	lost := 0
	for id := range committed {
		if applied[id] == 0 {
			lost++
		}
	}
	deliveriesMu.Lock()
	copies := 0
	for _, n := range deliveries {
		copies += n - 1
	}
	earlyDeliveries := early
	deliveriesMu.Unlock()
	t.Logf("%d relay kills (%d with scheduled rows waiting); %d events committed, %d applied: %d lost, %d doubled, %d order violations, %d rolled back and applied, %d delivered before their due time; "+
		"%d copies republished after a kill, absorbed by the inbox; %d events written after their due time", kills, killsScheduled, len(committed), applies, lost, doubled, outOfOrder, notCommitted, earlyDeliveries, copies, late.Load())
	require.Zero(t, lost, "lost")
	require.Zero(t, earlyDeliveries, "delivered before the due time")
	if k.delay > 0 {
		require.Positive(t, killsScheduled, "kills while scheduled rows waited")
	}
	require.Zero(t, doubled, "doubled")
	require.Zero(t, outOfOrder, "order violations")
	require.Zero(t, notCommitted, "rolled-back events applied")
	var seqs int
	for i := 0; i < keys; i++ {
		key := fmt.Sprintf("key-%d", i)
		var n int
		require.NoError(t, db.QueryRow(ctx, d.Rebind(`SELECT seq FROM `+orders+` WHERE id = ?`), key).Scan(&n))
		require.Equal(t, n, last[key], "%s: every event up to its last", key)
		seqs += n
	}
	require.Equal(t, len(committed), seqs)
	require.GreaterOrEqual(t, kills, minKills)
}

// writeOrdered is a lock-ordered writer on db: it locks key's row of the
// table orders (id, seq) beside the outbox of schema, writes n events to
// topic with the key's next sequence numbers (half in one insert, the
// rest one insert each), each due delay after its write when delay is
// set, advances the sequence and commits, or rolls back. It returns the
// events' UUIDs. With late, it counts the events whose due time had
// passed when the writer began to publish them (a writer held up past
// its delay: they go behind the key's rows that are due and wait).
func writeOrdered(ctx context.Context, db *sql.DB, d *sqldb.Dialect, schema sqlschema.Config, topic, key string, n int, commit bool, delay time.Duration, late *atomic.Int64) ([]string, error) {
	orders := qualified(d, schema, "orders")
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		return nil, err
	}
	defer tx.Rollback() //nolint:errcheck // a no-op after Commit
	var seq int
	if err := tx.QueryRowContext(ctx, d.Rebind(`SELECT seq FROM `+orders+` WHERE id = ?`+d.LockRow(false)), key).Scan(&seq); err != nil {
		return nil, err
	}
	pub, err := forwarder.NewSQLTxPublisher(ctx, tx, d.Name, schema)
	if err != nil {
		return nil, err
	}
	events := make([]*message.Message, n)
	ids := make([]string, n)
	for i := range events {
		events[i] = event(key, seq+1+i)
		ids[i] = events[i].UUID
		if delay > 0 {
			forwarder.Delay(events[i], delay)
		}
	}
	publish := func(events ...*message.Message) error {
		if late != nil {
			now := time.Now()
			for _, e := range events {
				if due, err := time.Parse(time.RFC3339Nano, e.Metadata.Get(forwarder.DueAtKey)); err == nil && !due.After(now) {
					late.Add(1)
				}
			}
		}
		return pub.Publish(topic, events...)
	}
	half := n / 2
	if err := publish(events[:half]...); err != nil {
		return nil, err
	}
	for _, e := range events[half:] {
		if err := publish(e); err != nil {
			return nil, err
		}
	}
	if _, err := tx.ExecContext(ctx, d.Rebind(`UPDATE `+orders+` SET seq = seq + ? WHERE id = ?`), n, key); err != nil {
		return nil, err
	}
	if !commit {
		return ids, tx.Rollback()
	}
	return ids, tx.Commit()
}

// qualified is table, quoted, in the schema (or MySQL database) of
// schema; on SQLite, which has none, just quoted.
func qualified(d *sqldb.Dialect, schema sqlschema.Config, table string) string {
	if s := d.Names(schema).Schema; s != "" {
		return s + "." + d.Quote(table)
	}
	return d.Quote(table)
}

// assertEventually reports whether cond holds within bound, looking every
// 50ms.
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
