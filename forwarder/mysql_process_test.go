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
	"strconv"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/go-sql-driver/mysql"
	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/adapters/amqp"
	"github.com/oncemill/oncemill/dedup/sqlstore"
	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/forwarder"
	"github.com/oncemill/oncemill/internal/testing/mysqltest"
	"github.com/oncemill/oncemill/internal/testing/pgtest"
	"github.com/oncemill/oncemill/internal/testing/proctest"
	"github.com/oncemill/oncemill/middleware"
	"github.com/oncemill/oncemill/sqlschema"
)

// mysqlRelayEnv, when set, makes the test binary a relay process of
// TestMySQLRelaySIGKILL instead of running the tests (see init): its JSON
// value is a mysqlRelayProcess.
const mysqlRelayEnv = "ONCEMILL_TEST_MYSQL_RELAY"

const mysqlRelayReady = "MYSQL RELAY READY"

// mysqlRelayProcess is what a relay process runs: a Relay on the outbox of
// database Database of the MySQL server DSN, publishing to RabbitMQ.
type mysqlRelayProcess struct {
	DSN         string `json:"dsn"`
	Database    string `json:"database"`
	AMQP        string `json:"amqp"`
	LockOrdered bool   `json:"lock_ordered"`
}

func init() {
	if v := os.Getenv(mysqlRelayEnv); v != "" {
		os.Exit(runMySQLRelayProcess(v))
	}
}

func runMySQLRelayProcess(raw string) int {
	term := make(chan os.Signal, 1)
	signal.Notify(term, syscall.SIGTERM)
	if err := mysqlRelayProcessMain(raw, term); err != nil {
		fmt.Fprintln(os.Stderr, "mysql relay:", err)
		return 4
	}
	return 0
}

func mysqlRelayProcessMain(raw string, term <-chan os.Signal) error {
	var p mysqlRelayProcess
	if err := json.Unmarshal([]byte(raw), &p); err != nil {
		return err
	}
	cfg, err := mysql.ParseDSN(p.DSN)
	if err != nil {
		return err
	}
	cfg.DBName = p.Database
	connector, err := mysql.NewConnector(cfg)
	if err != nil {
		return err
	}
	db := sql.OpenDB(connector)
	defer db.Close()
	pub, err := amqp.NewPublisher(amqp.Config{URL: p.AMQP}, nil)
	if err != nil {
		return err
	}
	defer pub.Close()
	r, err := forwarder.NewRelay(forwarder.RelayConfig{
		DB: db, Dialect: sqlschema.MySQL, Publisher: pub, Schema: sqlschema.Config{Schema: p.Database},
		// Small batches of few lanes, so that a kill often lands
		// between a batch's publish and its commit.
		BatchSize: 20, LanesPerBatch: 4, LockOrderedWriters: p.LockOrdered,
		MinBackoff: 10 * time.Millisecond, MaxBackoff: 100 * time.Millisecond,
		Logger: watermill.NewStdLogger(false, false),
	})
	if err != nil {
		return err
	}
	done := make(chan error, 1)
	go func() { done <- r.Run(context.Background()) }()
	fmt.Println(mysqlRelayReady)
	select {
	case <-term:
		return errors.Join(r.Close(), <-done)
	case err := <-done:
		return fmt.Errorf("relay stopped by itself: %w", err)
	}
}

func amqpURL() string {
	if url := os.Getenv("ONCEMILL_AMQP_URL"); url != "" {
		return url
	}
	return "amqp://guest:guest@127.0.0.1:5672/"
}

// TestMySQLRelaySIGKILL: lock-ordered writers commit events on MariaDB
// while two relay processes publish them to RabbitMQ and are SIGKILLed,
// again and again, and restarted; a consumer with a MariaDB inbox applies
// each event as an effect row. Counted from outside, in the database the
// effects commit to: every committed event applied once (0 lost, 0
// doubled), each key's in its commit order (0 order violations); the
// copies a killed relay had published and not deleted reach the consumer
// again, and its inbox absorbs them.
func TestMySQLRelaySIGKILL(t *testing.T) {
	t.Parallel()
	for _, lockOrdered := range []bool{false, true} {
		t.Run(fmt.Sprintf("LockOrderedWriters=%t", lockOrdered), func(t *testing.T) {
			t.Parallel()
			testMySQLRelaySIGKILL(t, lockOrdered)
		})
	}
}

func testMySQLRelaySIGKILL(t *testing.T, lockOrdered bool) {
	const (
		writers, txPerWriter, keys, perTx = 4, 60, 8, 4
		relays, minKills                  = 2, 6
	)
	b := setupMySQL(t, 16)
	ctx := context.Background()
	for k := 0; k < keys; k++ {
		_, err := b.db.ExecContext(ctx, "INSERT INTO `"+b.name+"`.orders (id) VALUES (?)", fmt.Sprintf("key-%d", k))
		require.NoError(t, err)
	}
	_, err := b.db.ExecContext(ctx, "CREATE TABLE `"+b.name+"`.effects (n BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY, "+
		"uuid VARCHAR(64) NOT NULL, `key` VARCHAR(64) NOT NULL, seq INT NOT NULL) ENGINE = InnoDB")
	require.NoError(t, err)

	// The broker: a topic of its own, its queue declared before anything
	// is published.
	admin, err := amqp091.DialConfig(amqpURL(), amqp091.Config{Dial: amqp091.DefaultDial(3 * time.Second)})
	if err != nil {
		pgtest.Unavailable(t, "RabbitMQ", err)
	}
	var suffix [6]byte
	_, _ = rand.Read(suffix[:])
	topic := "oncemill-test-mysql-relay-kill-" + hex.EncodeToString(suffix[:])
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

	// The consumer: a router whose inbox is on MariaDB, beside the
	// outbox; each event's effect is a row written in the inbox's
	// transaction. Every delivery is counted before the inbox.
	store, err := sqlstore.New(b.db, sqlstore.Config{Dialect: sqlstore.MySQL, Schema: b.schema})
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
		_, err = sqlstore.Tx(msg.Context()).ExecContext(msg.Context(), "INSERT INTO `"+b.name+"`.effects (uuid, `key`, seq) VALUES (?, ?, ?)",
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

	// The relays: processes of their own, killed and restarted.
	env, err := json.Marshal(mysqlRelayProcess{DSN: mysqltest.DSN(), Database: b.name, AMQP: amqpURL(), LockOrdered: lockOrdered})
	require.NoError(t, err)
	start := func() *proctest.Process {
		p, err := proctest.Start([]string{mysqlRelayEnv + "=" + string(env)}, mysqlRelayReady, 30*time.Second)
		require.NoError(t, err)
		return p
	}
	var running []*proctest.Process
	for i := 0; i < relays; i++ {
		running = append(running, start())
	}
	t.Cleanup(func() {
		for _, p := range running {
			p.Kill()
		}
	})

	// The writers, while a relay is killed now and then.
	var (
		mu        sync.Mutex
		committed = map[string]bool{}
		wg        sync.WaitGroup
		errs      = make(chan error, writers)
		written   = make(chan struct{})
	)
	for w := 0; w < writers; w++ {
		wg.Add(1)
		go func(w int) {
			defer wg.Done()
			rng := mrand.New(mrand.NewPCG(uint64(w), 11))
			for i := 0; i < txPerWriter; i++ {
				commit := rng.IntN(6) != 0
				ids, err := b.writeOrdered(ctx, topic, fmt.Sprintf("key-%d", rng.IntN(keys)), 1+rng.IntN(perTx), commit)
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
			}
		}(w)
	}
	go func() {
		wg.Wait()
		close(written)
	}()
	kills := 0
	rng := mrand.New(mrand.NewPCG(1, 2))
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
		running[i].Kill()
		kills++
		running[i] = start()
	}
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}

	// The relays still running drain the outbox; the consumer applies
	// what they publish.
	effects := func() int {
		var n int
		require.NoError(t, b.db.QueryRow("SELECT COUNT(*) FROM `"+b.name+"`.effects").Scan(&n))
		return n
	}
	drained := func() bool { return b.count(t, "outbox") == 0 && effects() >= len(committed) }
	if !assertEventually(drained, 3*time.Minute) {
		deliveriesMu.Lock()
		n := len(deliveries)
		deliveriesMu.Unlock()
		for i, p := range running {
			t.Logf("relay %d output:\n%s", i, p.Out.String())
		}
		t.Fatalf("not drained: %d rows in the outbox, %d of %d events applied, %d delivered", b.count(t, "outbox"), effects(), len(committed), n)
	}

	rows, err := b.db.Query("SELECT uuid, `key`, seq FROM `" + b.name + "`.effects ORDER BY n")
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
	t.Logf("LockOrderedWriters=%t: %d relay kills; %d events committed, %d applied: %d lost, %d doubled, %d order violations, %d rolled back and applied; "+
		"%d copies republished after a kill, absorbed by the inbox", lockOrdered, kills, len(committed), applies, lost, doubled, outOfOrder, notCommitted, copies)
	require.Zero(t, lost, "lost")
	require.Zero(t, doubled, "doubled")
	require.Zero(t, outOfOrder, "order violations")
	require.Zero(t, notCommitted, "rolled-back events applied")
	var seqs int
	for k := 0; k < keys; k++ {
		var n int
		require.NoError(t, b.db.QueryRow("SELECT seq FROM `"+b.name+"`.orders WHERE id = ?", fmt.Sprintf("key-%d", k)).Scan(&n))
		require.Equal(t, n, last[fmt.Sprintf("key-%d", k)], "key-%d: every event up to its last", k)
		seqs += n
	}
	require.Equal(t, len(committed), seqs)
	require.GreaterOrEqual(t, kills, minKills)
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
