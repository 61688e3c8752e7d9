package amqp_test

import (
	"context"
	"log"
	"os/signal"
	"syscall"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/oncemill/oncemill/adapters/amqp"
	"github.com/oncemill/oncemill/delivery"
)

// A billing service consumes the "orders" topic as consumer group
// "billing". Messages a handler keeps failing are dead-lettered by the
// broker, after ten deliveries, to the "orders.dead" topic. This example
// needs a running RabbitMQ, so it is compiled but not run.
func Example() {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	logger := watermill.NewStdLogger(false, false)

	cfg := amqp.Config{
		URL:                "amqp://guest:guest@127.0.0.1:5672/",
		ConsumerGroup:      "billing",
		DeliveryLimit:      10,
		DeadLetterExchange: "orders.dead",
	}
	sub, err := amqp.NewSubscriber(cfg, logger)
	if err != nil {
		log.Fatal(err)
	}
	defer sub.Close()
	// Declare the queue "orders.billing" before anything is published: the
	// fanout exchange drops messages while no queue is bound to it (the
	// publisher reports them as amqp.ErrUnroutable; other producers lose
	// them). amqp.Declare, or "oncemill amqp declare", does the same from a
	// deploy pipeline.
	if err := sub.SubscribeInitialize("orders"); err != nil {
		log.Fatal(err)
	}

	// The dead letters go to a topic of their own, whose queue must exist
	// too; RabbitMQ drops what it dead-letters to an exchange that does not.
	deadCfg := amqp.Config{URL: cfg.URL, ConsumerGroup: "billing"}
	deadSub, err := amqp.NewSubscriber(deadCfg, logger)
	if err != nil {
		log.Fatal(err)
	}
	defer deadSub.Close()
	if err := deadSub.SubscribeInitialize("orders.dead"); err != nil {
		log.Fatal(err)
	}

	pub, err := amqp.NewPublisher(cfg, logger)
	if err != nil {
		log.Fatal(err)
	}
	defer pub.Close()
	order := message.NewMessage(watermill.NewUUID(), []byte(`{"id":42,"amount":1999}`))
	order.Metadata.Set(delivery.IdempotencyKey, "order-42")
	if err := pub.Publish("orders", order); err != nil {
		log.Fatal(err)
	}

	router, err := message.NewRouter(message.RouterConfig{}, logger)
	if err != nil {
		log.Fatal(err)
	}
	router.AddConsumerHandler("bill", "orders", sub, func(msg *message.Message) error {
		attempt, _ := delivery.AttemptsOf(msg)
		log.Printf("billing %s (attempt %d)", msg.Metadata.Get(delivery.IdempotencyKey), attempt)
		return nil // the router acks; the subscriber then acks to RabbitMQ
	})
	if err := router.Run(ctx); err != nil {
		log.Fatal(err)
	}
}
