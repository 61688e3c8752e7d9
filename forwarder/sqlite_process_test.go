package forwarder_test

import (
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	mrand "math/rand/v2"
	"os"
	"os/signal"
	"path/filepath"
	"strconv"
	"sync"
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
	"github.com/oncemill/oncemill/forwarder"
	"github.com/oncemill/oncemill/internal/testing/pgtest"
	"github.com/oncemill/oncemill/internal/testing/proctest"
	"github.com/oncemill/oncemill/internal/testing/sqltest"
	"github.com/oncemill/oncemill/middleware"
	"github.com/oncemill/oncemill/sqlschema"
)

// sqliteRelayEnv, when set, makes the test binary a relay process of
// TestSQLiteRelaySIGKILL instead of running the tests (see init): its JSON
// value is a sqliteRelayProcess.
const sqliteRelayEnv = "ONCEMILL_TEST_SQLITE_RELAY"

const sqliteRelayReady = "SQLITE RELAY READY"

// sqliteRelayProcess is what a relay process runs: a Relay on the outbox of
// the SQLite database file Path, publishing to RabbitMQ.
type sqliteRelayProcess struct {
	Path string `json:"path"`
	AMQP string `json:"amqp"`
}

func init() {
	if v := os.Getenv(sqliteRelayEnv); v != "" {
		term := make(chan os.Signal, 1)
		signal.Notify(term, syscall.SIGTERM)
		if err := sqliteRelayProcessMain(v, term); err != nil {
			fmt.Fprintln(os.Stderr, "sqlite relay:", err)
			os.Exit(4)
		}
		os.Exit(0)
	}
}

func sqliteDSN(path string) string {
	return "file:" + path + "?_pragma=busy_timeout(10000)&_pragma=journal_mode(WAL)&_pragma=foreign_keys(1)&_txlock=immediate"
}

func sqliteRelayProcessMain(raw string, term <-chan os.Signal) error {
	var p sqliteRelayProcess
	if err := json.Unmarshal([]byte(raw), &p); err != nil {
		return err
	}
	db, err := sql.Open("sqlite", sqliteDSN(p.Path))
	if err != nil {
		return err
	}
	defer db.Close()
	pub, err := amqp.NewPublisher(amqp.Config{URL: p.AMQP}, nil)
	if err != nil {
		return err
	}
	defer pub.Close()
	r, err := forwarder.NewRelay(forwarder.RelayConfig{
		DB: db, Dialect: sqlschema.SQLite, Publisher: pub,
		// Small batches, so that a kill often lands between a batch's
		// publish and its delete.
		BatchSize:  20,
		MinBackoff: 10 * time.Millisecond, MaxBackoff: 100 * time.Millisecond,
		Logger: watermill.NewStdLogger(false, false),
	})
	if err != nil {
		return err
	}
	done := make(chan error, 1)
	go func() { done <- r.Run(context.Background()) }()
	fmt.Println(sqliteRelayReady)
	select {
	case <-term:
		return errors.Join(r.Close(), <-done)
	case err := <-done:
		return fmt.Errorf("relay stopped by itself: %w", err)
	}
}

// TestSQLiteRelaySIGKILL: writers commit (and roll back) events in a
// SQLite file while a relay process publishes them to RabbitMQ and is
// SIGKILLed, again and again, and restarted (one relay per file at a
// time); a consumer with a SQLite inbox in the same file applies each
// event as an effect row. Counted from outside, in the file the effects
// commit to: every committed event applied once (0 lost, 0 doubled), each
// key's in its commit order (0 order violations), no rolled-back one; the
// copies a killed relay had published and not deleted reach the consumer
// again, and its inbox absorbs them.
func TestSQLiteRelaySIGKILL(t *testing.T) {
	t.Parallel()
	const (
		writers, txPerWriter, keys, perTx = 4, 60, 8, 4
		minKills                          = 6
	)
	path := filepath.Join(t.TempDir(), "shop.db")
	db := sqltest.OpenSQLite(t, path)
	ctx := context.Background()
	require.NoError(t, sqlschema.MigrateSQLite(ctx, db, sqlschema.Config{}))
	for _, stmt := range []string{
		`CREATE TABLE orders (id TEXT PRIMARY KEY, seq INTEGER NOT NULL DEFAULT 0)`,
		`CREATE TABLE effects (n INTEGER PRIMARY KEY AUTOINCREMENT, uuid TEXT NOT NULL, key TEXT NOT NULL, seq INTEGER NOT NULL)`,
	} {
		_, err := db.ExecContext(ctx, stmt)
		require.NoError(t, err)
	}
	for k := 0; k < keys; k++ {
		_, err := db.ExecContext(ctx, `INSERT INTO orders (id) VALUES (?)`, fmt.Sprintf("key-%d", k))
		require.NoError(t, err)
	}

	// The broker: a topic of its own, its queue declared before anything
	// is published.
	admin, err := amqp091.DialConfig(amqpURL(), amqp091.Config{Dial: amqp091.DefaultDial(3 * time.Second)})
	if err != nil {
		pgtest.Unavailable(t, "RabbitMQ", err)
	}
	var suffix [6]byte
	_, _ = rand.Read(suffix[:])
	topic := "oncemill-test-sqlite-relay-kill-" + hex.EncodeToString(suffix[:])
	acfg := amqp.Config{URL: amqpURL(), ConsumerGroup: "shipping"}
	t.Cleanup(func() {
		ch, err := admin.Channel()
		require.NoError(t, err)
		_, err = ch.QueueDelete(acfg.QueueName(topic), false, false, false)
		require.NoError(t, err)
		require.NoError(t, ch.ExchangeDelete(acfg.ExchangeName(topic), false, false))
		require.NoError(t, ch.Close())
		require.NoError(t, admin.Close())
	})
	require.NoError(t, amqp.Declare(ctx, acfg, topic))

	// The consumer: a router whose inbox is in the same file; each
	// event's effect is a row written in the inbox's transaction. Every
	// delivery is counted before the inbox.
	store, err := sqlite.New(ctx, db, sqlite.Config{})
	require.NoError(t, err)
	inboxMW, err := middleware.NewInbox(middleware.InboxConfig{TxStore: store, Consumer: "shipping"})
	require.NoError(t, err)
	var (
		deliveriesMu sync.Mutex
		deliveries   = map[string]int{}
	)
	handler := inboxMW.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		seq, err := strconv.Atoi(msg.Metadata.Get("seq"))
		if err != nil {
			return nil, middleware.Permanent(err)
		}
		_, err = sqlite.Tx(msg.Context()).ExecContext(msg.Context(), `INSERT INTO effects (uuid, key, seq) VALUES (?, ?, ?)`,
			msg.UUID, msg.Metadata.Get(delivery.PartitionKey), seq)
		return nil, err
	})
	sub, err := amqp.NewSubscriber(acfg, nil)
	require.NoError(t, err)
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
	require.NoError(t, err)
	router.AddConsumerHandler("shipping", topic, sub, func(msg *message.Message) error {
		deliveriesMu.Lock()
		deliveries[msg.UUID]++
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

	// The relay: a process of its own, killed and restarted.
	env, err := json.Marshal(sqliteRelayProcess{Path: path, AMQP: amqpURL()})
	require.NoError(t, err)
	start := func() *proctest.Process {
		p, err := proctest.Start([]string{sqliteRelayEnv + "=" + string(env)}, sqliteRelayReady, 30*time.Second)
		require.NoError(t, err)
		return p
	}
	relay := start()
	t.Cleanup(func() { relay.Kill() })

	// The writers, while the relay is killed now and then: each locks
	// the file (BEGIN IMMEDIATE), reads its key's sequence, writes the
	// next events and advances it, and commits or rolls back.
	var (
		mu        sync.Mutex
		committed = map[string]bool{}
		wg        sync.WaitGroup
		errs      = make(chan error, writers)
		written   = make(chan struct{})
	)
	writeTx := func(key string, n int, commit bool) ([]string, error) {
		tx, err := db.BeginTx(ctx, nil)
		if err != nil {
			return nil, err
		}
		defer tx.Rollback() //nolint:errcheck // a no-op after Commit
		var seq int
		if err := tx.QueryRowContext(ctx, `SELECT seq FROM orders WHERE id = ?`, key).Scan(&seq); err != nil {
			return nil, err
		}
		pub, err := forwarder.NewSQLTxPublisher(ctx, tx, sqlschema.SQLite, sqlschema.Config{})
		if err != nil {
			return nil, err
		}
		ids := make([]string, n)
		for i := range ids {
			e := event(key, seq+1+i)
			ids[i] = e.UUID
			if err := pub.Publish(topic, e); err != nil {
				return nil, err
			}
		}
		if _, err := tx.ExecContext(ctx, `UPDATE orders SET seq = seq + ? WHERE id = ?`, n, key); err != nil {
			return nil, err
		}
		if !commit {
			return ids, tx.Rollback()
		}
		return ids, tx.Commit()
	}
	for w := 0; w < writers; w++ {
		wg.Add(1)
		go func(w int) {
			defer wg.Done()
			rng := mrand.New(mrand.NewPCG(uint64(w), 17))
			for i := 0; i < txPerWriter; i++ {
				commit := rng.IntN(6) != 0
				ids, err := writeTx(fmt.Sprintf("key-%d", rng.IntN(keys)), 1+rng.IntN(perTx), commit)
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
				time.Sleep(time.Duration(rng.IntN(3)) * time.Millisecond)
			}
		}(w)
	}
	go func() {
		wg.Wait()
		close(written)
	}()
	kills := 0
	rng := mrand.New(mrand.NewPCG(3, 4))
	for stop := false; !stop || kills < minKills; {
		select {
		case <-written:
			stop, written = true, nil
		case <-time.After(time.Duration(50+rng.IntN(150)) * time.Millisecond):
		}
		if stop && kills >= minKills {
			break
		}
		relay.Kill()
		kills++
		relay = start()
	}
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}

	// The relay drains the outbox; the consumer applies what it publishes.
	count := func(table string) int {
		var n int
		require.NoError(t, db.QueryRow(`SELECT COUNT(*) FROM `+table).Scan(&n))
		return n
	}
	drained := func() bool { return count("outbox") == 0 && count("effects") >= len(committed) }
	if !assertEventually(drained, 3*time.Minute) {
		deliveriesMu.Lock()
		n := len(deliveries)
		deliveriesMu.Unlock()
		t.Logf("relay output:\n%s", relay.Out.String())
		t.Fatalf("not drained: %d rows in the outbox, %d of %d events applied, %d delivered", count("outbox"), count("effects"), len(committed), n)
	}

	rows, err := db.Query(`SELECT uuid, key, seq FROM effects ORDER BY n`)
	require.NoError(t, err)
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
	deliveriesMu.Unlock()
	t.Logf("%d relay kills; %d events committed, %d applied: %d lost, %d doubled, %d order violations, %d rolled back and applied; "+
		"%d copies republished after a kill, absorbed by the inbox", kills, len(committed), applies, lost, doubled, outOfOrder, notCommitted, copies)
	require.Zero(t, lost, "lost")
	require.Zero(t, doubled, "doubled")
	require.Zero(t, outOfOrder, "order violations")
	require.Zero(t, notCommitted, "rolled-back events applied")
	var seqs int
	for k := 0; k < keys; k++ {
		var n int
		require.NoError(t, db.QueryRow(`SELECT seq FROM orders WHERE id = ?`, fmt.Sprintf("key-%d", k)).Scan(&n))
		require.Equal(t, n, last[fmt.Sprintf("key-%d", k)], "key-%d: every event up to its last", k)
		seqs += n
	}
	require.Equal(t, len(committed), seqs)
	require.GreaterOrEqual(t, kills, minKills)
}
