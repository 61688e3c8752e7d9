// Command payments charges each confirmed payment exactly once while the
// broker redelivers: the producer publishes some events twice (a retry after
// a lost ack) and the first consumer crashes after committing a charge and
// before acknowledging it. A second consumer in the same group takes over.
// A few events are malformed (not JSON): the poison middleware puts them in
// the PostgreSQL dead-letter table at their first attempt, with the reason,
// and the partition goes on.
//
// The broker comes from BROKER_URL (default: an embedded Kafka), the inbox
// and the charges live in PostgreSQL (DATABASE_URL, default the local test
// database). It prints what was delivered, charged and dead-lettered and
// exits non-zero if any order was charged twice or not at all, or a
// malformed event is not in the dead-letter table.
//
//	go run ./examples/payments
//	BROKER_URL=amqp://guest:guest@127.0.0.1:5672/ go run ./examples/payments
//	BROKER_URL='sqs://us-east-1?endpoint=http://127.0.0.1:4566&create=true' go run ./examples/payments
//	BROKER_URL='nats://127.0.0.1:4222?create=true' go run ./examples/payments
//
// nats:// with no host runs the example on one embedded NATS server that
// every connection of this program shares, as kafka:// with no host (or
// no BROKER_URL) does with an embedded Kafka.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"net/url"
	"os"
	"regexp"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/oncemill/oncemill/adapters"
	_ "github.com/oncemill/oncemill/adapters/amqp"
	_ "github.com/oncemill/oncemill/adapters/kafka"
	"github.com/oncemill/oncemill/adapters/kafka/embedded"
	_ "github.com/oncemill/oncemill/adapters/nats"
	natsembedded "github.com/oncemill/oncemill/adapters/nats/embedded"
	_ "github.com/oncemill/oncemill/adapters/sqs"
	"github.com/oncemill/oncemill/dedup/postgres"
	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/dlq"
	"github.com/oncemill/oncemill/middleware"
	"github.com/oncemill/oncemill/sqlschema"
)

// PaymentConfirmed is the event: the customer must be charged once per order.
type PaymentConfirmed struct {
	OrderID string `json:"orderId"`
	Amount  int64  `json:"amountCents"`
}

func main() {
	orders := flag.Int("orders", 200, "number of orders")
	crashAfter := flag.Int("crash-after", 60, "charges the first consumer commits before it crashes")
	flag.Parse()
	if err := start(*orders, *crashAfter); err != nil {
		fmt.Fprintln(os.Stderr, "payments:", err)
		os.Exit(1)
	}
}

func start(orders, crashAfter int) error {
	db := envOr("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/test?sslmode=disable")
	broker := os.Getenv("BROKER_URL")
	if broker == "" {
		// An in-process Kafka that every connection of this program
		// shares, as consumers share a real cluster.
		cluster, err := embedded.Start(embedded.Config{DefaultPartitions: 4})
		if err != nil {
			return fmt.Errorf("embedded kafka: %w", err)
		}
		defer cluster.Close()
		broker = "kafka://" + strings.Join(cluster.Addrs(), ",")
	}
	if u, err := url.Parse(broker); err == nil && u.Scheme == "nats" && u.Host == "" {
		// adapters.Open would give each connection an embedded server
		// of its own: start one that they all share instead.
		srv, err := natsembedded.Start(natsembedded.Config{})
		if err != nil {
			return fmt.Errorf("embedded nats: %w", err)
		}
		defer srv.Close()
		su, err := url.Parse(srv.URL())
		if err != nil {
			return err
		}
		u.Host = su.Host
		if q := u.Query(); !q.Has("create") {
			q.Set("create", "true")
			u.RawQuery = q.Encode()
		}
		broker = u.String()
	}
	return run(context.Background(), broker, db, orders, crashAfter)
}

func envOr(name, def string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return def
}

func run(ctx context.Context, brokerURL, dbURL string, orders, crashAfter int) error {
	if orders < 1 || crashAfter < 1 {
		return errors.New("-orders and -crash-after must be at least 1")
	}
	pool, err := pgxpool.New(ctx, dbURL)
	if err != nil {
		return fmt.Errorf("DATABASE_URL: %w", err)
	}
	defer pool.Close()
	if err := sqlschema.Migrate(ctx, pool, sqlschema.Config{}); err != nil {
		return err
	}
	if _, err := pool.Exec(ctx, `CREATE TABLE IF NOT EXISTS oncemill.example_charges (
		run text NOT NULL, order_id text NOT NULL, amount_cents bigint NOT NULL)`); err != nil {
		return err
	}
	store, err := postgres.New(pool, postgres.Config{})
	if err != nil {
		return err
	}

	// Each run has its own topic, group and keys, so runs never see each
	// other's events or charges.
	runID := strings.ToLower(watermill.NewShortUUID())
	topic := "payments_confirmed_" + runID
	opts := adapters.Options{ConsumerGroup: "charge_" + runID}
	if u, err := url.Parse(brokerURL); err == nil && u.Query().Get("group") != "" {
		opts.ConsumerGroup = "" // the URL names the group; giving another would be a conflict
	}

	inbox, err := middleware.NewInbox(middleware.InboxConfig{
		TxStore:  store,
		Consumer: "charge-customer",
		Key:      middleware.KeyFromJSON("orderId"),
	})
	if err != nil {
		return err
	}
	// Messages that can never be processed go to the dead-letter table,
	// where operators list and replay them (go run ./cmd/oncemill dlq).
	deadLetters, err := dlq.NewPublisher(pool, sqlschema.Config{})
	if err != nil {
		return err
	}
	// Dead letters are filed under the inbox's consumer and key.
	poison, err := middleware.NewPoison(middleware.PoisonConfig{Inbox: inbox, Publisher: deadLetters, Topic: "payments.dlq", MaxAttempts: 5})
	if err != nil {
		return err
	}
	// The handler: plain business code. The charge is a row written in the
	// inbox's transaction, so it commits together with the key's claim.
	charge := func(msg *message.Message) error {
		var ev PaymentConfirmed
		if err := json.Unmarshal(msg.Payload, &ev); err != nil {
			return middleware.Permanent(err)
		}
		_, err := postgres.Tx(msg.Context()).Exec(msg.Context(),
			`INSERT INTO oncemill.example_charges (run, order_id, amount_cents) VALUES ($1, $2, $3)`,
			runID, ev.OrderID, ev.Amount)
		return err
	}

	producer, err := adapters.Open(ctx, brokerURL, opts)
	if err != nil {
		return err
	}
	defer producer.Close()
	if producer.Scheme == "gochannel" {
		return errors.New("BROKER_URL: gochannel:// lives inside one connection; this example needs a broker that consumers reconnect to")
	}
	var deliveries atomic.Int64
	chain := []message.HandlerMiddleware{poison.Middleware, inbox.Middleware}
	first, err := startConsumer(ctx, brokerURL, opts, topic, charge, chain, &deliveries, crashAfter)
	if err != nil {
		return err
	}

	published, malformed := 0, 0
	for i := 1; i <= orders; i++ {
		ev := PaymentConfirmed{OrderID: fmt.Sprintf("order-%s-%d", runID, i), Amount: int64(1000 + i)}
		payload, err := json.Marshal(ev)
		if err != nil {
			return err
		}
		copies := 1
		if i%5 == 0 {
			copies = 2 // the producer retried after a lost ack
		}
		for c := 0; c < copies; c++ {
			msg := message.NewMessage(watermill.NewUUID(), payload)
			msg.Metadata.Set(delivery.PartitionKey, ev.OrderID)
			if err := producer.Publisher.Publish(topic, msg); err != nil {
				return fmt.Errorf("publish: %w", err)
			}
			published++
		}
		if orders >= 3 && i%(orders/3) == 0 {
			// A malformed event in the same stream: no orderId to key on.
			msg := message.NewMessage(watermill.NewUUID(), []byte("PAYMENT OK "+ev.OrderID))
			msg.Metadata.Set(delivery.PartitionKey, ev.OrderID)
			if err := producer.Publisher.Publish(topic, msg); err != nil {
				return fmt.Errorf("publish: %w", err)
			}
			published++
			malformed++
		}
	}

	select {
	case <-first.crashed:
	case <-time.After(2 * time.Minute):
		return errors.New("the first consumer never reached its crash point")
	}
	if err := first.close(); err != nil {
		return fmt.Errorf("crash the first consumer: %w", err)
	}
	second, err := startConsumer(ctx, brokerURL, opts, topic, charge, chain, &deliveries, 0)
	if err != nil {
		return err
	}

	// Wait until every order is charged and deliveries have stopped
	// arriving (the redelivered duplicates are drained).
	charged := func() (rows, distinct int, err error) {
		err = pool.QueryRow(ctx, `SELECT count(*), count(DISTINCT order_id) FROM oncemill.example_charges WHERE run = $1`, runID).Scan(&rows, &distinct)
		return rows, distinct, err
	}
	deadline := time.Now().Add(3 * time.Minute)
	last, quietSince := deliveries.Load(), time.Now()
	for {
		_, distinct, err := charged()
		if err != nil {
			return err
		}
		if n := deliveries.Load(); n != last {
			last, quietSince = n, time.Now()
		}
		if distinct == orders && poison.Stats().DeadLettered >= int64(malformed) && time.Since(quietSince) > 2*time.Second {
			break
		}
		if time.Now().After(deadline) {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	if err := second.close(); err != nil {
		return err
	}

	var twice, never int
	err = pool.QueryRow(ctx, `SELECT
		(SELECT count(*) FROM (SELECT order_id FROM oncemill.example_charges WHERE run = $1 GROUP BY order_id HAVING count(*) > 1) d),
		$2::int - (SELECT count(DISTINCT order_id) FROM oncemill.example_charges WHERE run = $1)`, runID, orders).Scan(&twice, &never)
	if err != nil {
		return err
	}
	rows, _, err := charged()
	if err != nil {
		return err
	}
	entries, err := dlq.NewStore(pool, sqlschema.Config{})
	if err != nil {
		return err
	}
	dead, err := entries.Count(ctx, dlq.Filter{Topic: topic})
	if err != nil {
		return err
	}
	fmt.Printf("broker=%s orders=%d events_published=%d deliveries=%d charges=%d charged_twice=%d not_charged=%d duplicates_dropped=%d malformed=%d dead_lettered=%d\n",
		producer.Scheme, orders, published, deliveries.Load(), rows, twice, never, inbox.Stats().Duplicates, malformed, dead)
	if twice != 0 || never != 0 {
		return fmt.Errorf("NOT charged once: %d orders charged twice, %d not charged", twice, never)
	}
	if dead != malformed {
		return fmt.Errorf("%d malformed events, %d in the dead-letter table", malformed, dead)
	}
	fmt.Println("every order charged once; the malformed events are in the dead-letter table:")
	hint := "go run ./cmd/oncemill dlq list --topic " + topic
	if os.Getenv("DATABASE_URL") == "" {
		hint = "DATABASE_URL='" + dbURL + "' " + hint // the default, local URL: no secret in it
	}
	fmt.Println("  " + hint)
	fmt.Println("  see them in the console: DATABASE_URL='" + scrubPassword(dbURL) + "' go run ./cmd/oncemill console")
	return nil
}

// scrubPassword returns the database URL or keyword/value string dbURL
// with its password, if any, replaced by xxxxx, for printing.
func scrubPassword(dbURL string) string {
	if u, err := url.Parse(dbURL); err == nil && (u.Scheme == "postgres" || u.Scheme == "postgresql") {
		if q := u.Query(); q.Has("password") {
			q.Set("password", "xxxxx")
			u.RawQuery = q.Encode()
		}
		return u.Redacted()
	}
	return dsnPassword.ReplaceAllString(dbURL, "${1}xxxxx")
}

// dsnPassword is the password of a keyword/value connection string:
// password=secret or password='a secret'.
var dsnPassword = regexp.MustCompile(`(\bpassword\s*=\s*)('(?:[^'\\]|\\.)*'|\S+)`)

// consumer is one process's worth of consuming: a connection and a router.
type consumer struct {
	ps      *adapters.PubSub
	stop    context.CancelFunc
	done    chan error
	crashed chan struct{}
}

func (c *consumer) close() error {
	c.stop()
	return errors.Join(<-c.done, c.ps.Close())
}

// startConsumer starts a router on a new connection. With crashAfter > 0
// the consumer "crashes" after that many charges: the last one is committed
// but never acknowledged, and nothing more is handled until it is closed.
func startConsumer(ctx context.Context, brokerURL string, opts adapters.Options, topic string,
	charge message.NoPublishHandlerFunc, chain []message.HandlerMiddleware, deliveries *atomic.Int64, crashAfter int) (*consumer, error) {
	ps, err := adapters.Open(ctx, brokerURL, opts)
	if err != nil {
		return nil, err
	}
	c := &consumer{ps: ps, done: make(chan error, 1), crashed: make(chan struct{})}
	var (
		charges atomic.Int64
		once    sync.Once
	)
	crashPoint := func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			select {
			case <-c.crashed:
				return nil, errors.New("consumer is dead")
			default:
			}
			deliveries.Add(1)
			out, err := h(msg)
			if err == nil && crashAfter > 0 && charges.Add(1) == int64(crashAfter) {
				once.Do(func() { close(c.crashed) })
				return nil, errors.New("crash after commit, before ack")
			}
			return out, err
		}
	}
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
	if err != nil {
		return nil, errors.Join(err, ps.Close())
	}
	// The crash point is outside the chain: a crash is the process dying,
	// not an error the poison middleware should count.
	router.AddMiddleware(crashPoint)
	router.AddMiddleware(chain...)
	router.AddConsumerHandler("charge-customer", topic, ps.Subscriber, charge)

	runCtx, cancel := context.WithCancel(ctx)
	c.stop = cancel
	go func() { c.done <- router.Run(runCtx) }()
	select {
	case <-router.Running():
	case err := <-c.done:
		cancel()
		return nil, errors.Join(err, ps.Close())
	}
	return c, nil
}
