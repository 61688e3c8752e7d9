package delivery

import "context"

// Limit is how many times a broker delivers a message of a topic before it
// drops it or moves it aside: RabbitMQ's quorum queues after their
// x-delivery-limit (20 by default since RabbitMQ 4.0), SQS after a redrive
// policy's maxReceiveCount, JetStream after a consumer's MaxDeliver.
type Limit struct {
	// Deliveries is the most deliveries of a message, the first one
	// included; 0 when the broker sets no limit.
	Deliveries int
	// Where names what holds the limit, for errors and logs: the queue or
	// consumer and the setting, e.g. `queue "orders.billing"
	// (x-delivery-limit 3)`.
	Where string
	// Raise says how to raise the limit, for errors and logs.
	Raise string
}

// Limiter is a subscriber that can tell its broker's [Limit] for the
// messages of a topic, reading it from the queue or consumer (and, where
// the subscriber declares them, setting it first). The poison middleware
// asks before it subscribes (middleware.Poison.Subscriber) and refuses a
// limit below what its policy needs; a subscriber that wraps another one
// forwards the question.
type Limiter interface {
	DeliveryLimit(ctx context.Context, topic string) (Limit, error)
}
