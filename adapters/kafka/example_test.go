package kafka_test

import (
	"context"
	"log"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/oncemill/oncemill/adapters/kafka"
	"github.com/oncemill/oncemill/adapters/kafka/embedded"
	"github.com/oncemill/oncemill/delivery"
)

// Example runs a router that consumes orders from Kafka, here an embedded
// broker, with manual acks and commits after them.
func Example() {
	ctx := context.Background()
	logger := watermill.NewStdLogger(false, false)

	brokers := kafka.BrokersFromEnv()
	if len(brokers) == 0 {
		cluster, err := embedded.Start(embedded.Config{})
		if err != nil {
			log.Fatal(err)
		}
		defer cluster.Close()
		if err := cluster.CreateTopic(ctx, "orders", 4); err != nil {
			log.Fatal(err)
		}
		brokers = cluster.Addrs()
	}

	pub, err := kafka.NewPublisher(kafka.PublisherConfig{Brokers: brokers}, logger)
	if err != nil {
		log.Fatal(err)
	}
	defer pub.Close()
	sub, err := kafka.NewSubscriber(kafka.SubscriberConfig{Brokers: brokers, ConsumerGroup: "billing"}, logger)
	if err != nil {
		log.Fatal(err)
	}

	router, err := message.NewRouter(message.RouterConfig{}, logger)
	if err != nil {
		log.Fatal(err)
	}
	router.AddConsumerHandler("charge", "orders", sub, func(msg *message.Message) error {
		if reason := delivery.DecodeErrorOf(msg); reason != "" {
			// In oncemill the poison middleware dead-letters these.
			log.Printf("undecodable record %s: %s", msg.UUID, reason)
			return nil
		}
		log.Printf("order %s from partition %s offset %s", msg.Metadata.Get(delivery.IdempotencyKey),
			msg.Metadata.Get(delivery.Partition), msg.Metadata.Get(delivery.Offset))
		return nil
	})

	order := message.NewMessage(watermill.NewUUID(), []byte(`{"amount":42}`))
	order.Metadata.Set(delivery.IdempotencyKey, "order-1") // also the partition key
	if err := pub.Publish("orders", order); err != nil {
		log.Fatal(err)
	}

	if err := router.Run(ctx); err != nil {
		log.Fatal(err)
	}
}
