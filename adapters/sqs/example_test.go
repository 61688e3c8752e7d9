package sqs_test

import (
	"context"
	"log"
	"os/signal"
	"syscall"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/aws/aws-sdk-go-v2/credentials"

	"github.com/oncemill/oncemill/adapters/sqs"
	"github.com/oncemill/oncemill/delivery"
)

// A billing service consumes the "orders" topic from a local SQS emulator
// (fauxqs or LocalStack). Against AWS, leave Endpoint and Credentials
// empty. This example needs a running emulator, so it is compiled but not
// run.
func Example() {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	logger := watermill.NewStdLogger(false, false)

	cfg := sqs.Config{
		Region:               "us-east-1",
		Endpoint:             "http://127.0.0.1:4566",
		Credentials:          credentials.NewStaticCredentialsProvider("test", "test", ""),
		CreateQueueIfMissing: true,
		Logger:               logger,
	}
	sub, err := sqs.NewSubscriber(sqs.SubscriberConfig{
		Config:            cfg,
		VisibilityTimeout: time.Minute,
	})
	if err != nil {
		log.Fatal(err)
	}
	defer sub.Close()

	pub, err := sqs.NewPublisher(sqs.PublisherConfig{Config: cfg})
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
		return nil // the router acks; the subscriber then deletes the message
	})
	if err := router.Run(ctx); err != nil {
		log.Fatal(err)
	}
}
