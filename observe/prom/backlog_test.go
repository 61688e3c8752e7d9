package prom_test

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	natsgo "github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/adapters"
	"github.com/oncemill/oncemill/adapters/kafka"
	"github.com/oncemill/oncemill/adapters/kafka/embedded"
	"github.com/oncemill/oncemill/adapters/nats"
	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/internal/testing/msgtest"
	"github.com/oncemill/oncemill/internal/testing/pgtest"
	"github.com/oncemill/oncemill/observe/prom"
)

// natsURL is the NATS server with JetStream the tests use.
func natsURL() string {
	if u := os.Getenv("ONCEMILL_NATS_URL"); u != "" {
		return u
	}
	return "nats://127.0.0.1:4222"
}

// TestBacklogCollector: one registry, three sources. A NATS group that
// has acked 2 of 7 messages and holds a third: its backlog gauge is 5. A
// Kafka group that has consumed nothing of 6 records over 2 partitions:
// its gauge is 6 and each partition's lag is that partition's high
// watermark, as Sarama reads it. A GoChannel, which cannot tell: no gauge,
// an error counted at each scrape, logged once. Both scrapes go through
// the HTTP handler Prometheus scrapes. With OmitPartitions the Kafka
// total stays and the partition series go.
func TestBacklogCollector(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	id := pgtest.Name(t)

	// NATS.
	ncfg := nats.Config{URL: natsURL(), CreateStreams: true}
	npub, err := nats.NewPublisher(ctx, nats.PublisherConfig{Config: ncfg})
	require.NoError(t, err, "NATS with JetStream at %s (scripts/services.sh nats)", ncfg.URL)
	defer func() { require.NoError(t, npub.Close()) }()
	orders := "orders_" + id
	defer deleteStream(t, ncfg, orders) // once the subscriber has closed
	nsub, err := nats.NewSubscriber(ctx, nats.SubscriberConfig{Config: ncfg, ConsumerGroup: "billing"})
	require.NoError(t, err)
	defer func() { require.NoError(t, nsub.Close()) }()
	for i := range 7 {
		require.NoError(t, npub.Publish(orders, message.NewMessage(watermill.NewUUID(), []byte(fmt.Sprint(i)))))
	}
	msgs, err := nsub.Subscribe(ctx, orders)
	require.NoError(t, err)
	for range 2 {
		require.True(t, msgtest.Receive(t, msgs, 10*time.Second).Ack())
	}
	held := msgtest.Receive(t, msgs, 10*time.Second)
	defer held.Ack()

	// Kafka.
	cluster, err := embedded.Start(embedded.Config{DefaultPartitions: 2})
	require.NoError(t, err)
	defer func() { require.NoError(t, cluster.Close()) }()
	kpub, err := kafka.NewPublisher(kafka.PublisherConfig{Brokers: cluster.Addrs()}, nil)
	require.NoError(t, err)
	defer func() { require.NoError(t, kpub.Close()) }()
	for i := range 6 {
		msg := message.NewMessage(watermill.NewUUID(), nil)
		msg.Metadata.Set(delivery.PartitionKey, fmt.Sprint("key-", i))
		require.NoError(t, kpub.Publish("payments", msg))
	}
	ksub, err := kafka.NewSubscriber(kafka.SubscriberConfig{Brokers: cluster.Addrs(), ConsumerGroup: "audit"}, nil)
	require.NoError(t, err)
	defer func() { require.NoError(t, ksub.Close()) }()

	// GoChannel.
	gc, err := adapters.Open(ctx, "gochannel://", adapters.Options{})
	require.NoError(t, err)
	defer func() { require.NoError(t, gc.Close()) }()

	logger := watermill.NewCaptureLogger()
	collector, err := prom.NewBacklogCollector(prom.BacklogCollectorConfig{Logger: logger},
		prom.BacklogSource{Consumer: "billing", Topic: orders, Backlogger: nsub},
		prom.BacklogSource{Consumer: "audit", Topic: "payments", Backlogger: ksub.(adapters.Backlogger)},
		prom.BacklogSource{Consumer: "local", Topic: "events", Backlogger: gc},
	)
	require.NoError(t, err)
	reg := prometheus.NewPedanticRegistry()
	require.NoError(t, reg.Register(collector))

	// The second ack reaches JetStream after Ack returns.
	msgtest.WaitFor(t, "the NATS backlog at 5", func() bool {
		return series(t, reg, "oncemill_consumer_backlog_messages", map[string]string{"consumer": "billing"}).GetGauge().GetValue() == 5
	})
	high := kafkaHighWatermarks(t, cluster.Addrs(), "payments", 2)
	for scrape := 1; scrape <= 2; scrape++ {
		rec := httptest.NewRecorder()
		promhttp.HandlerFor(reg, promhttp.HandlerOpts{}).ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/metrics", nil))
		require.Equal(t, http.StatusOK, rec.Code, rec.Body.String())
		body := rec.Body.String()
		require.Contains(t, body, `oncemill_consumer_backlog_messages{consumer="billing",topic="`+orders+`"} 5`)
		require.Contains(t, body, `oncemill_consumer_backlog_messages{consumer="audit",topic="payments"} 6`)
		for p, h := range high {
			require.Contains(t, body, fmt.Sprintf(`oncemill_consumer_partition_lag{consumer="audit",partition="%d",topic="payments"} %d`, p, h))
		}
		require.NotContains(t, body, `oncemill_consumer_partition_lag{consumer="billing"`, "NATS has no partitions")
		require.NotContains(t, body, `oncemill_consumer_backlog_messages{consumer="local"`)
		// The WaitFor's scrapes counted too: at least this one.
		errs := series(t, reg, "oncemill_consumer_backlog_scrape_errors_total", map[string]string{"consumer": "local"}).GetCounter().GetValue()
		require.GreaterOrEqual(t, errs, float64(scrape))
		require.Contains(t, body, `oncemill_consumer_backlog_scrape_errors_total{consumer="audit",topic="payments"} 0`)
		require.Contains(t, body, `oncemill_consumer_backlog_scrape_errors_total{consumer="billing",topic="`+orders+`"} 0`)
	}
	var noBacklog int
	for _, m := range logger.Captured()[watermill.ErrorLogLevel] {
		require.ErrorIs(t, m.Err, adapters.ErrNoBacklog, "only GoChannel fails")
		noBacklog++
	}
	require.Equal(t, 1, noBacklog, "a source that cannot tell is logged once")

	// OmitPartitions: the totals, no partition series.
	omitting, err := prom.NewBacklogCollector(prom.BacklogCollectorConfig{OmitPartitions: true},
		prom.BacklogSource{Consumer: "audit", Topic: "payments", Backlogger: ksub.(adapters.Backlogger)})
	require.NoError(t, err)
	reg = prometheus.NewPedanticRegistry()
	require.NoError(t, reg.Register(omitting))
	require.Equal(t, float64(6), series(t, reg, "oncemill_consumer_backlog_messages", map[string]string{"consumer": "audit"}).GetGauge().GetValue())
	families, err := reg.Gather()
	require.NoError(t, err)
	for _, f := range families {
		require.NotEqual(t, "oncemill_consumer_partition_lag", f.GetName())
	}
}

// TestBacklogCollectorConfig: each missing or repeated source is refused,
// naming it.
func TestBacklogCollectorConfig(t *testing.T) {
	t.Parallel()
	gc, err := adapters.Open(context.Background(), "gochannel://", adapters.Options{})
	require.NoError(t, err)
	defer func() { require.NoError(t, gc.Close()) }()
	ok := prom.BacklogSource{Consumer: "c", Topic: "t", Backlogger: gc}
	for want, sources := range map[string][]prom.BacklogSource{
		"no source given":                               nil,
		"sources[0].Consumer is empty":                  {{Topic: "t", Backlogger: gc}},
		"sources[1].Topic is empty":                     {ok, {Consumer: "c", Backlogger: gc}},
		"sources[0].Backlogger is nil":                  {{Consumer: "c", Topic: "t"}},
		`sources[1] repeats consumer "c" and topic "t"`: {ok, ok},
	} {
		_, err := prom.NewBacklogCollector(prom.BacklogCollectorConfig{}, sources...)
		require.ErrorContains(t, err, want)
	}
	_, err = prom.NewBacklogCollector(prom.BacklogCollectorConfig{Timeout: -time.Second}, ok)
	require.ErrorContains(t, err, "BacklogCollectorConfig.Timeout must not be negative")
}

// kafkaHighWatermarks reads each partition's high watermark with
// Sarama's own GetOffset.
func kafkaHighWatermarks(t *testing.T, brokers []string, topic string, partitions int32) map[int32]int64 {
	t.Helper()
	sc := sarama.NewConfig()
	sc.Version = sarama.V2_3_0_0
	client, err := sarama.NewClient(brokers, sc)
	require.NoError(t, err)
	defer func() { require.NoError(t, client.Close()) }()
	high := map[int32]int64{}
	for p := range partitions {
		high[p], err = client.GetOffset(topic, p, sarama.OffsetNewest)
		require.NoError(t, err)
		require.Positive(t, high[p], "the keys reach partition %d", p)
	}
	return high
}

// deleteStream deletes topic's stream.
func deleteStream(t *testing.T, cfg nats.Config, topic string) {
	t.Helper()
	nc, err := natsgo.Connect(cfg.URL)
	require.NoError(t, err)
	defer nc.Close()
	js, err := jetstream.New(nc)
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	require.NoError(t, js.DeleteStream(ctx, cfg.StreamName(topic)))
}
