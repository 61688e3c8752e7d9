package main

import (
	"encoding/json"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"strings"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/oncemill/oncemill/delivery"
)

// demoCopies is how many times -produce publishes each order.
const demoCopies = 3

// produceDemo publishes n orders to topic, each demoCopies times with a
// new UUID (a producer retrying after a lost ack), in a shuffled order,
// and one malformed message, which ends in the dead-letter table. The
// order ids are new on every run, so a second run against the same
// database records its payments again.
func produceDemo(pub message.Publisher, topic string, n int) error {
	run := strings.ToLower(watermill.NewShortUUID())
	var msgs []*message.Message
	for i := 1; i <= n; i++ {
		p := Payment{OrderID: fmt.Sprintf("demo-%s-%d", run, i), AmountCents: int64(100 * i)}
		payload, err := json.Marshal(p)
		if err != nil {
			return err
		}
		for range demoCopies {
			m := message.NewMessage(watermill.NewUUID(), payload)
			m.Metadata.Set(delivery.PartitionKey, p.OrderID)
			msgs = append(msgs, m)
		}
	}
	msgs = append(msgs, message.NewMessage(watermill.NewUUID(), []byte("PAID demo-"+run)))
	rand.Shuffle(len(msgs), func(i, j int) { msgs[i], msgs[j] = msgs[j], msgs[i] })
	for _, m := range msgs {
		if err := pub.Publish(topic, m); err != nil {
			return fmt.Errorf("publish to %s: %w", topic, err)
		}
	}
	slog.Info("demo orders published", "orders", n, "copies", demoCopies, "malformed", 1, "messages", len(msgs), "topic", topic)
	return nil
}
