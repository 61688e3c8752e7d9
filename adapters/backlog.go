package adapters

import (
	"context"
	"errors"
	"fmt"
)

// ErrNoBacklog is wrapped by the error of a Backlog call that cannot tell
// what the broker holds for the consumer: [PubSub.Backlog] of a
// subscriber that keeps no position on a broker (gochannel://,
// postgres://), or a [Backlogger] of another package that cannot tell.
var ErrNoBacklog = errors.New("adapters: the subscriber cannot tell its backlog")

// Backlog is what a broker still holds for one consumer (a consumer
// group, a queue, a durable consumer) of one topic: the messages the
// consumer has still to acknowledge.
type Backlog struct {
	// Messages is the number of messages the broker holds for the
	// consumer, not yet acknowledged. What each broker counts:
	//
	//   - Kafka: the sum of Partitions' Lag, the records from the group's
	//     committed offsets to the high watermarks, which includes the
	//     records delivered and not yet committed;
	//   - RabbitMQ: the queue's ready messages; those delivered to a
	//     consumer and not yet acknowledged (up to the prefetch count of
	//     each) are not counted, for AMQP does not report them;
	//   - NATS JetStream: the durable consumer's messages not yet
	//     delivered (NumPending) and those delivered and not yet
	//     acknowledged (NumAckPending);
	//   - SQS: the queue's visible, in-flight and delayed messages
	//     (ApproximateNumberOfMessages, …NotVisible, …Delayed), which SQS
	//     approximates.
	Messages int64
	// Partitions is the group's position in each partition of the topic,
	// in partition order, for Kafka; nil for the other brokers.
	Partitions []PartitionBacklog
}

// PartitionBacklog is a Kafka consumer group's position in one partition.
type PartitionBacklog struct {
	// Partition is the partition's number.
	Partition int32
	// Committed is the group's committed offset, the next record it
	// reads, or -1 when it has committed none in this partition.
	Committed int64
	// HighWatermark is the offset that the next record published to the
	// partition gets (the last stable offset for a group that reads
	// committed records only).
	HighWatermark int64
	// Lag is the number of records the group has still to commit:
	// HighWatermark minus Committed, or, with no commit, the records the
	// group reads once it starts (all the partition holds when it starts
	// from the oldest record, none when it starts from the newest).
	Lag int64
}

// Backlogger is implemented by the subscribers that can ask their broker
// what it holds for them. The subscribers of adapters/kafka (those with a
// consumer group), adapters/amqp, adapters/nats and adapters/sqs do: they
// ask on their own connection, or a client of their own that their Close
// closes.
type Backlogger interface {
	// Backlog asks the broker, within ctx, what it holds for the
	// subscriber's consumer of topic. It may be called whether or not the
	// subscriber has subscribed to topic, concurrently, and as often as
	// metrics are scraped.
	Backlog(ctx context.Context, topic string) (Backlog, error)
}

// Backlog asks the broker what it holds for p's consumer of topic (see
// [Backlogger]); p is itself a Backlogger. Every broker scheme but
// gochannel:// and postgres:// tells; for those the error wraps
// [ErrNoBacklog].
func (p *PubSub) Backlog(ctx context.Context, topic string) (Backlog, error) {
	b, ok := p.Subscriber.(Backlogger)
	if !ok {
		return Backlog{}, fmt.Errorf("%w: the %s:// subscriber (%T) keeps no position on a broker to compare",
			ErrNoBacklog, p.Scheme, p.Subscriber)
	}
	return b.Backlog(ctx, topic)
}
