package adapters_test

import (
	"context"
	"errors"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	natsgo "github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/adapters"
	"github.com/oncemill/oncemill/adapters/amqp"
	"github.com/oncemill/oncemill/adapters/kafka"
	"github.com/oncemill/oncemill/adapters/kafka/embedded"
	"github.com/oncemill/oncemill/adapters/nats"
	natsembedded "github.com/oncemill/oncemill/adapters/nats/embedded"
	"github.com/oncemill/oncemill/adapters/sqs"
	"github.com/oncemill/oncemill/internal/testing/amqptest"
	"github.com/oncemill/oncemill/internal/testing/brokertest"
	"github.com/oncemill/oncemill/internal/testing/pgtest"
)

// brokers lists the conformance table: every broker this machine offers,
// Kafka in both of its subscriber modes.
func brokers(t *testing.T) []broker {
	kafkaBrokers := kafkaCluster(t)
	return []broker{
		goChannelBroker(t),
		kafkaRow(kafkaBrokers, "kafka", ""),
		// The one-at-a-time subscriber, watermill-kafka's.
		kafkaRow(kafkaBrokers, "kafka_max_in_flight_1", "max_in_flight=1"),
		amqpBroker(t),
		sqsBroker(t),
		natsBroker(t),
		natsEmbeddedBroker(t),
	}
}

// amqpBroker is RabbitMQ: a queue per topic and group; its backlog is the
// queue's ready messages (unacked ones return to ready when consumers close).
func amqpBroker(t *testing.T) broker {
	admin, err := amqp091.Dial(amqptest.URL())
	if err != nil {
		return broker{name: "amqp", open: func(t *testing.T, _ string) *adapters.PubSub {
			pgtest.Unavailable(t, "RabbitMQ", err)
			return nil
		}}
	}
	t.Cleanup(func() { require.NoError(t, admin.Close()) })
	withChannel := func(t *testing.T, fn func(ch *amqp091.Channel) error) {
		ch, err := admin.Channel()
		require.NoError(t, err)
		defer ch.Close()
		require.NoError(t, fn(ch))
	}
	return broker{
		name: "amqp",
		url:  amqptest.URL(),
		open: func(t *testing.T, group string) *adapters.PubSub {
			ps, err := adapters.Open(context.Background(), amqptest.URL(), adapters.Options{ConsumerGroup: group})
			require.NoError(t, err)
			return ps
		},
		// pending is the queue's ready messages: what a running consumer
		// holds unacked is left out (AMQP does not report it), so a test
		// reads it again once its consumers stopped, which returns
		// whatever they still held.
		pending: func(t *testing.T, topic, group string) int {
			return brokertest.AMQPReady(t, amqptest.URL(), topic, group)
		},
		cleanup: func(t *testing.T, topic string, groups ...string) {
			withChannel(t, func(ch *amqp091.Channel) error {
				for _, g := range groups {
					if _, err := ch.QueueDelete(amqp.Config{ConsumerGroup: g}.QueueName(topic), false, false, false); err != nil {
						return err
					}
				}
				return ch.ExchangeDelete(amqp.Config{}.ExchangeName(topic), false, false)
			})
		},
	}
}

// goChannelBroker shares one persistent GoChannel between every "process"
// of a test, as a broker is shared. GoChannel keeps no offsets: a new
// subscriber receives every message again, and sends the next one only
// after the previous is acked, so a group's backlog is the messages its
// newest subscription has not acked yet.
func goChannelBroker(t *testing.T) broker {
	ps, err := adapters.Open(context.Background(), "gochannel://?persistent=true", adapters.Options{})
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, ps.Close()) })

	var (
		mu        sync.Mutex
		published = map[string]int{}
		acked     = map[string]*atomic.Int64{} // topic/group → acks of the newest subscription
	)
	pub := countingPublisher{Publisher: ps.Publisher, published: func(topic string, n int) {
		mu.Lock()
		published[topic] += n
		mu.Unlock()
	}}
	return broker{
		name: "gochannel",
		open: func(t *testing.T, group string) *adapters.PubSub {
			counter := &atomic.Int64{}
			return &adapters.PubSub{
				Publisher: pub,
				Subscriber: ackCountingSubscriber{Subscriber: ps.Subscriber, onSubscribe: func(topic string) *atomic.Int64 {
					mu.Lock()
					defer mu.Unlock()
					acked[topic+"/"+group] = counter
					return counter
				}},
				Scheme: "gochannel",
			}
		},
		pending: func(t *testing.T, topic, group string) int {
			mu.Lock()
			defer mu.Unlock()
			c := acked[topic+"/"+group]
			if c == nil {
				return published[topic]
			}
			return published[topic] - int(c.Load())
		},
	}
}

// countingPublisher counts what it publishes; its Close leaves the shared
// GoChannel open.
type countingPublisher struct {
	message.Publisher
	published func(topic string, n int)
}

func (p countingPublisher) Publish(topic string, msgs ...*message.Message) error {
	if err := p.Publisher.Publish(topic, msgs...); err != nil {
		return err
	}
	p.published(topic, len(msgs))
	return nil
}

func (countingPublisher) Close() error { return nil }

// ackCountingSubscriber counts the acks of its subscriptions; its Close
// leaves the shared GoChannel open (a router closes its subscriber).
type ackCountingSubscriber struct {
	message.Subscriber
	onSubscribe func(topic string) *atomic.Int64
}

func (s ackCountingSubscriber) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	in, err := s.Subscriber.Subscribe(ctx, topic)
	if err != nil {
		return nil, err
	}
	counter := s.onSubscribe(topic)
	out := make(chan *message.Message)
	go func() {
		defer close(out)
		for m := range in {
			select {
			case out <- m:
			case <-ctx.Done():
				return
			}
			select {
			case <-m.Acked():
				counter.Add(1)
			case <-m.Nacked():
			case <-ctx.Done():
				return
			}
		}
	}()
	return out, nil
}

func (ackCountingSubscriber) Close() error { return nil }

// kafkaBroker is the embedded broker, or the cluster named by
// ONCEMILL_KAFKA_BROKERS, with the default (key-parallel) subscriber; its
// backlog is the group's lag.
func kafkaBroker(t *testing.T) broker {
	return kafkaRow(kafkaCluster(t), "kafka", "")
}

// kafkaCluster returns the seed brokers of the cluster named by
// ONCEMILL_KAFKA_BROKERS, else of an embedded one with 4 partitions a
// topic that t's cleanup closes.
func kafkaCluster(t *testing.T) []string {
	if brokers := kafka.BrokersFromEnv(); len(brokers) > 0 {
		return brokers
	}
	cluster, err := embedded.Start(embedded.Config{DefaultPartitions: 4})
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, cluster.Close()) })
	return cluster.Addrs()
}

// kafkaRow is a Kafka row named name on brokers, opened with the URL
// parameters params (such as "max_in_flight=1"; empty for the defaults);
// its backlog is the group's lag.
func kafkaRow(brokers []string, name, params string) broker {
	url := "kafka://" + strings.Join(brokers, ",")
	if params != "" {
		url += "?" + params
	}
	return broker{
		name: name,
		url:  url,
		open: func(t *testing.T, group string) *adapters.PubSub {
			ps, err := adapters.Open(context.Background(), url, adapters.Options{ConsumerGroup: group})
			require.NoError(t, err)
			return ps
		},
		pending: func(t *testing.T, topic, group string) int {
			return brokertest.KafkaLag(t, brokers, topic, group)
		},
	}
}

// sqsEndpoint is the SQS the tests use.
func sqsEndpoint() string {
	if e := os.Getenv("ONCEMILL_SQS_ENDPOINT"); e != "" {
		return e
	}
	return "http://127.0.0.1:4566"
}

// sqsBroker is SQS (the emulator unless ONCEMILL_SQS_ENDPOINT is set): a
// queue per topic, competing consumers; its backlog is the queue's visible
// and in-flight messages.
func sqsBroker(t *testing.T) broker {
	endpoint := sqsEndpoint()
	queues := brokertest.NewSQS(t, endpoint)
	url := "sqs://test:test@us-east-1?create=true&endpoint=" + endpoint
	return broker{
		name: "sqs",
		url:  url,
		open: func(t *testing.T, _ string) *adapters.PubSub {
			ps, err := adapters.Open(context.Background(), url, adapters.Options{})
			if err != nil {
				pgtest.Unavailable(t, "SQS at "+endpoint, err)
			}
			return ps
		},
		pending: func(t *testing.T, topic, _ string) int { return queues.Backlog(t, topic) },
		cleanup: func(t *testing.T, topic string, _ ...string) { queues.DeleteQueue(t, topic) },
	}
}

// sqsFIFOBroker is sqsBroker with FIFO queues: a test's topics end in
// ".fifo", and a message's partition key is its message group.
func sqsFIFOBroker(t *testing.T) broker {
	b := sqsBroker(t)
	b.name, b.topicSuffix = "sqs_fifo", sqs.FIFOSuffix
	return b
}

// natsURL is the NATS server with JetStream the tests use.
func natsURL() string {
	if u := os.Getenv("ONCEMILL_NATS_URL"); u != "" {
		return u
	}
	return "nats://127.0.0.1:4222"
}

// natsBroker is NATS JetStream at natsURL.
func natsBroker(t *testing.T) broker {
	return natsRow(t, "nats", natsURL())
}

// natsEmbeddedBroker is an embedded NATS server of the test's own, which
// its cleanup stops; child processes reach it too.
func natsEmbeddedBroker(t *testing.T) broker {
	srv, err := natsembedded.Start(natsembedded.Config{})
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, srv.Close()) })
	return natsRow(t, "nats_embedded", srv.URL())
}

// natsRow is a NATS row named name on the server at server: a stream per
// topic, created on first use, and a durable consumer per group; its
// backlog is the consumer's messages not yet delivered and those delivered
// and not acked (all of the stream's before the group's consumer exists).
// A short ack wait bounds what a consumer that dies holding a message
// costs the tests.
func natsRow(t *testing.T, name, server string) broker {
	nc, err := natsgo.Connect(server, natsgo.Timeout(5*time.Second))
	if err != nil {
		return broker{name: name, open: func(t *testing.T, _ string) *adapters.PubSub {
			pgtest.Unavailable(t, "NATS at "+server, err)
			return nil
		}}
	}
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	require.NoError(t, err)
	url := server + "?create=true&ack_wait=5s"
	return broker{
		name:         name,
		url:          url,
		dropsRetries: true,
		open: func(t *testing.T, group string) *adapters.PubSub {
			ps, err := adapters.Open(context.Background(), url, adapters.Options{ConsumerGroup: group})
			if err != nil {
				pgtest.Unavailable(t, "NATS with JetStream at "+server, err)
			}
			return ps
		},
		pending: func(t *testing.T, topic, group string) int { return brokertest.NATSPending(t, js, topic, group) },
		cleanup: func(t *testing.T, topic string, _ ...string) {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			// Deleting the stream deletes its consumers.
			if err := js.DeleteStream(ctx, nats.Config{}.StreamName(topic)); err != nil && !errors.Is(err, jetstream.ErrStreamNotFound) {
				require.NoError(t, err)
			}
		},
	}
}
