// Package amqp connects oncemill to RabbitMQ: it configures watermill-amqp
// (v3) for durable quorum queues with manual acknowledgement and publisher
// confirms, and replaces its marshaler with one that decodes any message a
// broker can deliver and sets the [delivery] metadata.
//
// # Topology
//
// Every topic is a durable fanout exchange named after the topic. A
// subscriber consumes from a durable quorum queue bound to it, named
// "<topic>", or "<topic>.<group>" when [Config.ConsumerGroup] is set. All
// instances with the same group share one queue and compete for its
// messages (a work queue); every group has its own queue and receives every
// message of the topic. Publishers only know the exchange, so adding a group
// needs no change on the publishing side.
//
// A fanout exchange drops what it cannot route: a message published before
// any queue is bound is lost, and a plain client still gets a confirm for
// it. This package's [Publisher] publishes with mandatory and fails such a
// publish with [ErrUnroutable] instead, so the outbox relay and dlq replays
// keep it; producers in other languages still lose it. Declare each group's
// queue before producers start, with [Declare] or `oncemill amqp declare`
// in the deploy pipeline.
//
// # Guarantees
//
// Delivery is at least once; oncemill's inbox turns it into exactly-once
// effects.
//
//   - A published message is persistent and routed to durable, replicated
//     quorum queues; Publish returns nil only after the broker confirmed
//     the message and routed it to at least one queue.
//   - A subscription hands out up to [Config.Prefetch] messages at once
//     (the broker keeps that many unacknowledged per subscription; the rest
//     stay in the queue for other consumers): messages of different
//     ordering keys (delivery.PartitionKeyOf: the partition_key header,
//     else the idempotency key) concurrently, a key's messages one at a
//     time in the queue's order, the next once the previous was acked or
//     nacked. Each message is acknowledged to the broker only after the
//     handler acks it.
//   - A nack requeues the message for redelivery, or, with
//     [Config.NoRequeueOnNack], dead-letters it (drops it without a
//     dead-letter exchange). Messages unacked when the subscriber closes,
//     its connection drops or the process dies are returned to the queue
//     and delivered again. Closing a subscriber drains: it hands out
//     nothing more and waits up to [Config.DrainTimeout], with the channel
//     open, for the messages its handlers hold to be acked or nacked;
//     the messages received and not handed out are returned at once, and
//     what handlers still hold when the drain ends is nacked, with
//     requeue, or without it under NoRequeueOnNack. A connection that drops is made again, and
//     consuming resumes; the acks of the messages handlers held then are
//     dropped, since the broker has returned those messages already.
//   - Queue order is FIFO, but competing consumers and redeliveries
//     reorder.
//
// # Poison messages
//
// A quorum queue counts deliveries: on a redelivery it sets the
// x-delivery-count header, and since RabbitMQ 4.3 also x-acquired-count.
// The [Marshaler] sets delivery.Attempts to 1 + the larger of the two ("1"
// on a first delivery), which the poison middleware compares with its limit
// before it dead-letters a message itself.
//
// As a broker-side backstop, [Config.DeliveryLimit] (x-delivery-limit) makes
// the broker dead-letter a message to [Config.DeadLetterExchange] once its
// delivery count exceeds the limit, or drop it when no dead-letter exchange
// is set. RabbitMQ 4.0 and later apply a default limit of 20 to every quorum
// queue; before 4.0 there is no default. Set a dead-letter exchange whenever
// a limit may apply, or a failing message is silently dropped. A
// dead-letter exchange may be another topic's exchange: that topic's
// subscribers then read the dead letters, with the broker's x-death table in
// their metadata as JSON.
//
// What counts as a delivery depends on the RabbitMQ version:
//
//   - Up to 4.2, every return increments x-delivery-count: nack or reject
//     with requeue, and a channel or connection closed with the message
//     unacked (observed on 3.10.8, where the header is also present, as 0, on
//     a first delivery).
//   - Since 4.3, x-delivery-count and the delivery limit count only failed
//     deliveries: basic.reject, and consumers lost with the message unacked,
//     but not basic.nack with requeue, which is what the subscriber sends
//     when a handler nacks. x-acquired-count counts every hand-out. On 4.3
//     delivery.Attempts therefore still grows with each nack (from
//     x-acquired-count), but the broker's delivery limit no longer stops a
//     handler that keeps nacking: only the poison middleware does.
//
// Attempts counts deliveries, not handler failures: every message a
// subscription has received and not acked when it closes, or when its
// connection drops, is returned and counted, whether a handler held it or
// it waited behind its key. Leave room for restarts when choosing attempt
// and delivery limits.
//
// # Metadata
//
// Every message a subscriber returns has delivery.Topic (the exchange, or
// the queue for a message sent through the default exchange),
// delivery.Redelivered ("true" or "false") and, where the broker keeps a
// count, delivery.Attempts. delivery.IdempotencyKey and other metadata
// travel as message headers. Headers of every AMQP type are accepted and
// converted to strings as [Marshaler] describes; a message whose headers
// cannot be decoded at all arrives with delivery.DecodeError set and its raw
// body as payload, instead of being nacked in a loop by the subscriber.
//
// # Credentials
//
// The password in [Config.URL] never appears in errors or logs; they show
// the URL with the password replaced by "xxxxx".
//
// # URL
//
// Importing the package registers amqp:// and amqps:// with adapters.Open,
// which links this broker, and only this one, into a program; the URL
// parameters are listed in docs/brokers.md.
package amqp
