package nats_test

import (
	"context"
	"fmt"
	"log"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/oncemill/oncemill/adapters/nats"
	"github.com/oncemill/oncemill/adapters/nats/embedded"
	"github.com/oncemill/oncemill/delivery"
)

// A billing service consumes the "orders" topic. The example runs on an
// embedded server; against a real one, set URL to its address
// ("nats://127.0.0.1:4222") and create the streams beforehand, or keep
// CreateStreams. A second publish of the same order, a producer's retry,
// is dropped by JetStream (its Nats-Msg-Id is the idempotency key), and
// the handler's ack is confirmed by JetStream before the message counts
// as done.
func Example() {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	srv, err := embedded.Start(embedded.Config{})
	if err != nil {
		log.Fatal(err)
	}
	defer srv.Close()

	cfg := nats.Config{URL: srv.URL(), CreateStreams: true}
	pub, err := nats.NewPublisher(ctx, nats.PublisherConfig{Config: cfg})
	if err != nil {
		log.Fatal(err)
	}
	defer pub.Close()
	sub, err := nats.NewSubscriber(ctx, nats.SubscriberConfig{
		Config:        cfg,
		ConsumerGroup: "billing",
		AckWait:       10 * time.Second, // a heartbeat every 3.3s while a handler runs
	})
	if err != nil {
		log.Fatal(err)
	}
	defer sub.Close() // the router closes it too; this waits for its drain before the server stops

	for range 2 { // the second publish is a retry: same key, new UUID
		order := message.NewMessage(watermill.NewUUID(), []byte(`{"id":42,"amount":1999}`))
		order.Metadata.Set(delivery.IdempotencyKey, "order-42")
		if err := pub.Publish("orders", order); err != nil {
			log.Fatal(err)
		}
	}

	router, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	if err != nil {
		log.Fatal(err)
	}
	billed := make(chan struct{})
	router.AddConsumerHandler("bill", "orders", sub, func(msg *message.Message) error {
		attempt, _ := delivery.AttemptsOf(msg)
		fmt.Printf("billing %s, attempt %d, stream %s sequence %s\n", msg.Metadata.Get(delivery.IdempotencyKey), attempt,
			msg.Metadata.Get(delivery.Stream), msg.Metadata.Get(delivery.StreamSequence))
		close(billed)
		return nil // the router acks; the subscriber waits for JetStream to confirm it
	})
	go func() {
		<-billed
		_ = router.Close() // closes the subscriber, which drains
	}()
	if err := router.Run(ctx); err != nil {
		log.Fatal(err)
	}
	// Output:
	// billing order-42, attempt 1, stream orders sequence 1
}
