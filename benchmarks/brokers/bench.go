package main

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	wnats "github.com/ThreeDotsLabs/watermill-nats/v2/pkg/nats"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	natsgo "github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/oncemill/oncemill/adapters"
	"github.com/oncemill/oncemill/adapters/amqp"
	_ "github.com/oncemill/oncemill/adapters/nats" // nats:// for adapters.Open
	"github.com/oncemill/oncemill/dedup/postgres"
	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/middleware"
	"github.com/oncemill/oncemill/sqlschema"
)

// The rows of each broker, in report order; these short names select them
// with -rows.
const (
	// rowStock is the broker's Watermill subscriber (watermill-amqp,
	// watermill-nats) under the inbox, a transaction per message.
	rowStock = "stock"
	// rowOurs is oncemill's subscriber, several messages in flight, under
	// the same inbox, a transaction per message.
	rowOurs = "oncemill"
	// rowBatch is oncemill's subscriber under the inbox's group commit,
	// the effects of a batch written by one multi-row INSERT through
	// middleware.BatchHandler.
	rowBatch = "oncemill-batch"
	// rowBare is oncemill's subscriber with no inbox: the handler's INSERT
	// alone, committed on its own; what the broker and the router cost.
	rowBare = "oncemill-no-inbox"
)

func rows() []string { return []string{rowStock, rowOurs, rowBatch, rowBare} }

// handlerName is the router handler's name, and the inbox's consumer.
const handlerName = "ledger"

// broker is what differs between the brokers: how to reach them with
// oncemill's subscriber and with the stock one, and how to set up and
// remove a run's topic.
type broker struct {
	name string
	// ours is the adapters.Open URL of oncemill's subscriber and of the
	// publisher, with inFlight messages in flight.
	ours func(inFlight int) string
	// stock returns the broker's Watermill subscriber of group.
	stock func(group string, inFlight int, logger watermill.LoggerAdapter) (message.Subscriber, error)
	// prepare creates what the run's topic and group need before anything
	// is published; the returned func removes them.
	prepare func(ctx context.Context, topic, group string, inFlight int) (func(context.Context) error, error)
}

func amqpBroker(url string) broker {
	cfg := func(group string, inFlight int) amqp.Config {
		return amqp.Config{URL: url, ConsumerGroup: group, Prefetch: inFlight}
	}
	return broker{
		name: "amqp",
		ours: func(inFlight int) string { return fmt.Sprintf("%s?prefetch=%d", url, inFlight) },
		stock: func(group string, inFlight int, logger watermill.LoggerAdapter) (message.Subscriber, error) {
			// The same topology and prefetch as oncemill's subscriber, on
			// watermill-amqp's, which hands out one message at a time.
			wcfg, err := cfg(group, inFlight).WatermillConfig()
			if err != nil {
				return nil, err
			}
			return wamqp.NewSubscriber(wcfg, logger)
		},
		prepare: func(ctx context.Context, topic, group string, inFlight int) (func(context.Context) error, error) {
			c := cfg(group, inFlight)
			if err := amqp.Declare(ctx, c, topic); err != nil {
				return nil, err
			}
			return func(context.Context) error {
				conn, err := amqp091.Dial(url)
				if err != nil {
					return err
				}
				defer conn.Close()
				ch, err := conn.Channel()
				if err != nil {
					return err
				}
				_, err = ch.QueueDelete(c.QueueName(topic), false, false, false)
				return errors.Join(err, ch.ExchangeDelete(c.ExchangeName(topic), false, false))
			}, nil
		},
	}
}

func natsBroker(url string) broker {
	return broker{
		name: "nats",
		ours: func(inFlight int) string { return fmt.Sprintf("%s?max_in_flight=%d", url, inFlight) },
		stock: func(group string, _ int, logger watermill.LoggerAdapter) (message.Subscriber, error) {
			// watermill-nats's production subscriber, as the NATS end-to-end
			// benchmark runs it: a durable push consumer in a queue group.
			return wnats.NewSubscriber(wnats.SubscriberConfig{
				URL:              url,
				QueueGroupPrefix: group,
				SubscribersCount: 1,
				AckWaitTimeout:   30 * time.Second,
				CloseTimeout:     10 * time.Second,
				Unmarshaler:      &wnats.NATSMarshaler{},
				JetStream: wnats.JetStreamConfig{
					SubscribeOptions: []natsgo.SubOpt{natsgo.DeliverAll(), natsgo.AckExplicit()},
					DurablePrefix:    group,
				},
			}, logger)
		},
		prepare: func(ctx context.Context, topic, _ string, _ int) (func(context.Context) error, error) {
			nc, err := natsgo.Connect(url, natsgo.Timeout(10*time.Second))
			if err != nil {
				return nil, err
			}
			js, err := jetstream.New(nc)
			if err != nil {
				nc.Close()
				return nil, err
			}
			if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: topic, Subjects: []string{topic}, Storage: jetstream.FileStorage}); err != nil {
				nc.Close()
				return nil, err
			}
			return func(ctx context.Context) error {
				defer nc.Close()
				return js.DeleteStream(ctx, topic)
			}, nil
		},
	}
}

// Sample is one run of one row.
type Sample struct {
	Broker, Row string
	Rep         int
	N           int
	Elapsed     time.Duration
	MsgsPerSec  float64
	// Doubled counts (account, version) pairs applied more than once,
	// Lost those never applied, OutOfOrder the accounts whose versions
	// were not applied in the order published.
	Doubled, Lost, OutOfOrder int
	// Calls is the handler's calls: a batch is one.
	Calls int64
}

func (s Sample) ok() bool { return s.Doubled == 0 && s.Lost == 0 && s.OutOfOrder == 0 }

// stream is the run's messages: versions 1..versions of each account,
// interleaved, each with the account as partition key and its own
// idempotency key.
func stream(accounts, versions int) []*message.Message {
	msgs := make([]*message.Message, 0, accounts*versions)
	for v := 1; v <= versions; v++ {
		for a := range accounts {
			account := fmt.Sprintf("acct-%05d", a)
			msg := message.NewMessage(watermill.NewUUID(), fmt.Appendf(nil, "%d", v))
			msg.Metadata.Set(delivery.PartitionKey, account)
			msg.Metadata.Set(delivery.IdempotencyKey, fmt.Sprintf("%s/v%d", account, v))
			msgs = append(msgs, msg)
		}
	}
	return msgs
}

// run measures one row once: a fresh schema and topic, the stream
// published beforehand, the router started, timed until every message's
// effect is in the table; then the table is checked.
func run(ctx context.Context, cfg Config, pool *pgxpool.Pool, b broker, row string, rep, seq int) (Sample, error) {
	s := Sample{Broker: b.name, Row: row, Rep: rep, N: cfg.Accounts * cfg.Versions}
	id := fmt.Sprintf("bench_brokers_%s_%03d", runID, seq)
	topic, group := id, id
	schema := id
	if err := sqlschema.Migrate(ctx, pool, sqlschema.Config{Schema: schema}); err != nil {
		return s, fmt.Errorf("migrate %s: %w", schema, err)
	}
	defer pool.Exec(context.WithoutCancel(ctx), `DROP SCHEMA `+pgx.Identifier{schema}.Sanitize()+` CASCADE`) //nolint:errcheck // best effort
	effects := pgx.Identifier{schema, "effects"}.Sanitize()
	if _, err := pool.Exec(ctx, `CREATE TABLE `+effects+` (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, account text NOT NULL, version int NOT NULL)`); err != nil {
		return s, err
	}
	inFlight := cfg.InFlight
	remove, err := b.prepare(ctx, topic, group, inFlight)
	if err != nil {
		return s, fmt.Errorf("%s: prepare %s: %w", b.name, topic, err)
	}
	defer remove(context.WithoutCancel(ctx)) //nolint:errcheck // best effort

	logger := watermill.NopLogger{}
	ps, err := adapters.Open(ctx, b.ours(inFlight), adapters.Options{ConsumerGroup: group, Logger: logger})
	if err != nil {
		return s, fmt.Errorf("%s: open: %w", b.name, err)
	}
	defer ps.Close()
	sub := ps.Subscriber
	if row == rowStock {
		if sub, err = b.stock(group, inFlight, logger); err != nil {
			return s, fmt.Errorf("%s: stock subscriber: %w", b.name, err)
		}
		defer sub.Close()
	}
	if err := ps.Publisher.Publish(topic, stream(cfg.Accounts, cfg.Versions)...); err != nil {
		return s, fmt.Errorf("%s: publish: %w", b.name, err)
	}

	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 30 * time.Second}, logger)
	if err != nil {
		return s, err
	}
	var calls atomic.Int64
	insert := `INSERT INTO ` + effects + ` (account, version) VALUES ($1, $2::int)`
	switch row {
	case rowBare:
		router.AddConsumerHandler(handlerName, topic, sub, func(msg *message.Message) error {
			calls.Add(1)
			_, err := pool.Exec(msg.Context(), insert, delivery.PartitionKeyOf(msg), string(msg.Payload))
			return err
		})
	default:
		store, err := postgres.New(pool, postgres.Config{Schema: schema})
		if err != nil {
			return s, err
		}
		icfg := middleware.InboxConfig{TxStore: store, Consumer: handlerName}
		var handler message.NoPublishHandlerFunc = func(msg *message.Message) error {
			calls.Add(1)
			ctx := msg.Context()
			_, err := postgres.Tx(ctx).Exec(ctx, insert, delivery.PartitionKeyOf(msg), string(msg.Payload))
			return err
		}
		if row == rowBatch {
			icfg.Tuning.Batch = middleware.BatchConfig{MaxMessages: cfg.BatchSize}
			bulk := `INSERT INTO ` + effects + ` (account, version) SELECT unnest($1::text[]), unnest($2::int[])`
			handler = middleware.BatchHandler(func(ctx context.Context, msgs []*message.Message) error {
				calls.Add(1)
				accounts := make([]string, len(msgs))
				versions := make([]string, len(msgs))
				for i, msg := range msgs {
					accounts[i], versions[i] = delivery.PartitionKeyOf(msg), string(msg.Payload)
				}
				_, err := postgres.Tx(ctx).Exec(ctx, bulk, accounts, versions)
				return err
			})
		}
		inbox, err := middleware.NewInbox(icfg)
		if err != nil {
			return s, err
		}
		router.AddMiddleware(inbox.Middleware)
		router.AddConsumerHandler(handlerName, topic, sub, handler)
	}

	count := func() (n int) {
		_ = pool.QueryRow(ctx, `SELECT count(*) FROM `+effects).Scan(&n)
		return n
	}
	runCtx, cancel := context.WithTimeout(ctx, cfg.RunTimeout)
	defer cancel()
	done := make(chan error, 1)
	start := time.Now()
	go func() { done <- router.Run(runCtx) }()
	<-router.Running()
	for count() < s.N {
		select {
		case <-runCtx.Done():
			_ = router.Close()
			return s, fmt.Errorf("%s %s: %d of %d applied in %s", b.name, row, count(), s.N, cfg.RunTimeout)
		case err := <-done:
			return s, fmt.Errorf("%s %s: router stopped: %w", b.name, row, err)
		case <-time.After(2 * time.Millisecond):
		}
	}
	s.Elapsed = time.Since(start)
	s.MsgsPerSec = float64(s.N) / s.Elapsed.Seconds()
	// Let what is in flight finish, so that a late double shows.
	time.Sleep(200 * time.Millisecond)
	if err := errors.Join(router.Close(), <-done); err != nil {
		return s, err
	}
	s.Calls = calls.Load()
	var applied int
	if err := pool.QueryRow(ctx, `SELECT count(*), count(DISTINCT (account, version)) FROM `+effects).Scan(&applied, &s.N); err != nil {
		return s, err
	}
	s.Doubled = applied - s.N
	s.Lost = cfg.Accounts*cfg.Versions - s.N
	s.N = cfg.Accounts * cfg.Versions
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM (SELECT array_agg(version ORDER BY id) AS vs FROM `+effects+` GROUP BY account) a
WHERE vs <> ARRAY(SELECT generate_series(1, $1))`, cfg.Versions).Scan(&s.OutOfOrder); err != nil {
		return s, err
	}
	return s, nil
}

// median is the median throughput of samples.
func median(samples []Sample) float64 {
	v := make([]float64, len(samples))
	for i, s := range samples {
		v[i] = s.MsgsPerSec
	}
	slices.Sort(v)
	if len(v) == 0 {
		return 0
	}
	if len(v)%2 == 1 {
		return v[len(v)/2]
	}
	return (v[len(v)/2-1] + v[len(v)/2]) / 2
}
