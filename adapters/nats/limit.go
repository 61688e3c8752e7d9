package nats

import (
	"context"
	"fmt"

	"github.com/oncemill/oncemill/delivery"
)

// DeliveryLimit reads the MaxDeliver of the group's durable consumer of
// topic, making sure it exists with the subscriber's settings as
// Subscribe does: JetStream stops delivering a message past it, and the
// poison middleware ends the message at its last delivery and refuses to
// start below what its policy needs (middleware.Poison.Subscriber). It
// implements delivery.Limiter; a Limit of 0 deliveries is no limit.
func (s *Subscriber) DeliveryLimit(ctx context.Context, topic string) (delivery.Limit, error) {
	cons, err := s.consumer(ctx, topic)
	if err != nil {
		return delivery.Limit{}, fmt.Errorf("nats: delivery limit of %q: %w", topic, err)
	}
	info := cons.CachedInfo()
	return consumerLimit(info.Stream, info.Name, info.Config.MaxDeliver), nil
}

// consumerLimit is the Limit of a consumer with maxDeliver.
func consumerLimit(stream, consumer string, maxDeliver int) delivery.Limit {
	if maxDeliver <= 0 {
		return delivery.Limit{}
	}
	return delivery.Limit{
		Deliveries: maxDeliver,
		Where:      fmt.Sprintf("JetStream consumer %q of stream %q (MaxDeliver %d)", consumer, stream, maxDeliver),
		Raise: fmt.Sprintf("raise max_deliver in the URL (SubscriberConfig.MaxDeliver; -1 for no limit) and on the consumer "+
			"(nats consumer edit %s %s --max-deliver=-1)", stream, consumer),
	}
}
