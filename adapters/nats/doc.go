// Package nats connects oncemill to NATS JetStream with nats.go's jetstream
// package: a Watermill [Publisher] and [Subscriber] that acknowledge to
// JetStream only when the handler acks, never let JetStream deliver a
// message again while its handler still works on it, and set the
// [delivery] metadata that oncemill's middlewares read. Core NATS, which
// has no acknowledgements, is not supported.
//
// # Why not watermill-nats
//
// watermill-nats (github.com/ThreeDotsLabs/watermill-nats) loses the
// guarantees this package keeps:
//
//   - It starts its AckWait clock when the handler starts, while JetStream
//     started it when the message was prefetched into the client's buffer,
//     so a message that waited there is delivered again while its handler
//     runs (ThreeDotsLabs/watermill#609).
//   - It never tells JetStream that a handler is still in progress, so a
//     handler longer than AckWait is raced by a redelivery.
//   - A durable consumer it recreates replays the messages that were
//     acked already (#671, #531).
//   - It does not expose NumDelivered, which the poison middleware counts
//     attempts with.
//
// # Topology
//
// A topic is a subject. By default every topic has a stream of its own,
// named by [Config.StreamName] (the topic with '.' and the other
// characters a stream name cannot have replaced by '_'), whose only
// subject is the topic. With [Config.Stream] set (stream=NAME in a URL),
// every topic is a subject of that one existing stream, such as a stream
// ORDERS with subjects "orders.>" for topics "orders.created" and
// "orders.paid".
//
// Streams are the operator's: a missing one fails Publish, Subscribe and
// SubscribeInitialize with [ErrStreamNotFound], naming the stream and how
// to create it, unless [Config.CreateStreams] is set (create=true), which
// creates a topic's own stream with file storage, limits retention and
// [Config.DuplicateWindow]. A shared stream is never created.
//
// Each consumer group has one durable pull consumer per topic, named by
// [SubscriberConfig.ConsumerName] (the group; in a shared stream, the
// group and the topic), filtered on the topic, which every subscriber of
// the group, in any process, pulls from: they compete for its messages,
// and every group receives each message. The subscriber owns the
// consumer's settings: it creates the consumer with DeliverAll (a new
// group starts at the stream's first message), AckExplicit and the
// [SubscriberConfig] fields AckWait, MaxDeliver, BackOff and
// MaxAckPending, and a consumer that exists with any other value of
// those, a push consumer, or one with an InactiveThreshold (after which
// JetStream would delete it, and the next Subscribe would make it again
// and replay the stream) fails Subscribe with [ErrConsumerMismatch],
// naming each field, instead of running with them. A subscription never
// makes its consumer again: one deleted while subscribed makes it log
// errors until the consumer exists again (a later Subscribe makes it, as
// for a new group, from the stream's start).
//
// # Guarantees
//
// Delivery is at least once; oncemill's inbox turns it into exactly-once
// effects.
//
//   - Publish returns once JetStream has stored every message, each
//     published expecting its topic's stream. A connection that drops, or
//     a server that restarts, within [PublisherConfig.PublishTimeout]
//     does not fail it: the publish waits for the next connection, and a
//     message whose ack was lost with the connection is published again,
//     the stream dropping the copy by its Nats-Msg-Id.
//   - A connection that drops ends the subscriptions' pull requests,
//     which the server lost with it, and they pull again as soon as the
//     client has reconnected; acks, nacks and heartbeats whose answer was
//     lost are sent again on the next connection.
//   - Each published message's Nats-Msg-Id is its idempotency key (see
//     Deduplication below), so that JetStream drops a producer's retry.
//   - A subscription holds at most [SubscriberConfig.MaxInFlight] messages
//     (1 by default) and asks JetStream for more only when it holds fewer:
//     no message waits in a client buffer while its ack wait runs out. It
//     hands them to the router concurrently, per ordering key: messages
//     of different keys are in flight at once, up to MaxInFlight (so
//     group commit and middleware.BatchHandler fill their batches), a
//     key's messages one at a time, the next once the previous is acked
//     or nacked. The key is [delivery.PartitionKeyOf] the message (the
//     partition_key header, else idempotency_key); a message without one
//     is its own key.
//   - From the moment a message arrives until it is acked or nacked, the
//     subscription tells JetStream every third of its ack wait that it is
//     in progress (+WPI), and JetStream confirms each, so a handler of any
//     length is not raced by a redelivery. When two heartbeats in a row go
//     unconfirmed, which leaves too little of the ack wait for a third,
//     the message's context is cancelled with cause [ErrHeartbeat] before
//     the ack wait runs out: JetStream will deliver the message again, and
//     the inbox rolls the handler's transaction back.
//   - An ack waits for JetStream's confirmation. One answered "no
//     responders", as while a server shutting down has stopped JetStream
//     and not yet closed the connections, is sent again after a short
//     pause, or at once on the next connection, for up to 10s. When no
//     confirmation comes, JetStream delivers the message again after its
//     ack wait, and the inbox absorbs the duplicate.
//   - A nack asks JetStream to deliver the message again after
//     [SubscriberConfig.NackBackoff] of its attempt (NakWithDelay; by
//     default 1s, doubling per attempt, at most 5 minutes). A message the
//     poison middleware dead-lettered is acked by the router once the
//     dead-letter copy is written, like any handled message; the
//     subscriber never terminates (Term) a message itself.
//   - Close, or the cancellation of Subscribe's context, drains: nothing
//     more is fetched or handed out, messages fetched but not handed out
//     are nacked without delay, and the acks and nacks of the messages
//     handlers hold are waited for up to [SubscriberConfig.DrainTimeout],
//     their heartbeats going on. A message still held then has its context
//     cancelled and is delivered again after its ack wait. A pull request
//     that a closing subscription cancels may cross a message JetStream
//     was sending it: that message too is delivered again after its ack
//     wait.
//   - Order: within a subscription, a key's messages are handled in the
//     order JetStream delivers them, whatever MaxInFlight. A nacked
//     message comes back after its delay, behind the key's later
//     messages, which the subscription hands out meanwhile: JetStream
//     redelivers a nacked message out of its original order, to whichever
//     subscriber asks, so holding them back would stop the key for an
//     unknown time without restoring the order. Across subscriptions and
//     processes the order of a key holds only with
//     [SubscriberConfig.MaxAckPending] 1 (one message of the consumer
//     unacked at a time); otherwise competing subscribers run a key's
//     messages at once.
//
// [SubscriberConfig.MaxDeliver] is unlimited by default. A message that
// reaches a limit is neither acked nor delivered again: it stays in the
// stream, applied by nobody and in no dead-letter queue. Leave the limit
// to the poison middleware's MaxAttempts, or keep MaxDeliver well above
// it as a backstop.
//
// # Deduplication
//
// The publisher sets each message's Nats-Msg-Id to its idempotency key
// (metadata delivery.IdempotencyKey), else its UUID, and JetStream drops a
// message whose ID the stream stored within its duplicate window (the
// stream's Duplicates: 2 minutes by default, [Config.DuplicateWindow] for
// the streams this package creates). The window is short and held in the
// server's memory and stream: it catches a producer's or the outbox
// relay's quick retries, before they cost a delivery. The inbox's window
// (72 hours by default) is the one that holds the guarantee: it absorbs
// what JetStream delivers again (a lost ack, a consumer that died, a
// retry after the duplicate window) and a copy published with a new key
// by mistake, so keep it longer than any redelivery. A replay from the
// dead-letter queue (delivery.Replay) and a dead-lettered copy (the
// delivery.Dead* fields) get an ID of their own, derived from the key and
// those fields, so that JetStream does not drop them as copies of the
// original. In a shared stream the ID starts with the topic, as the
// window spans every topic of the stream.
//
// # Metadata
//
// Each subscribed message has delivery.Topic (the topic subscribed to),
// delivery.Stream, delivery.StreamSequence, delivery.Attempts (JetStream's
// NumDelivered: 1 on the first delivery, counting nacks, redeliveries
// after an ack wait and subscribers that closed holding the message) and
// delivery.Redelivered ("true" from the second delivery on).
//
// The publisher sends the payload as the message data and the UUID in the
// [UUIDHeader] header, the one watermill-nats uses. The metadata travels
// as one header per key when every key is a valid header name (printable
// ASCII without the characters nats.go rejects, and not starting with
// "Nats-", which the protocol reserves) and every value travels unchanged
// (valid UTF-8 without control characters other than tab, and without
// leading or trailing blanks, which header parsing trims); otherwise all
// of it travels as one JSON object in the [MetadataHeader] header. The
// delivery facts are never sent: each delivery sets its own.
//
// The subscriber accepts any message, including those of other producers:
// their headers become metadata (a header given several times, its values
// joined by ", "), except the protocol's Nats-* headers, and a message
// without [UUIDHeader] gets its Nats-Msg-Id, else "<stream>:<stream
// sequence>", as UUID, the same on every delivery. A message whose
// [MetadataHeader] cannot be decoded is still delivered, with
// delivery.DecodeError set and its data as payload, for the handler chain
// to dead-letter; it is never dropped and never nacked in a loop by the
// subscriber.
//
// # Credentials
//
// The user info of [Config.URL] (user and password, or a token) never
// appears in errors or logs.
//
// # URL
//
// Importing the package registers nats:// with adapters.Open, which links
// this broker, and only this one, into a program; the URL parameters are
// listed in docs/brokers.md. nats:// with no host starts the embedded server
// of package embedded, which the program links by importing
// github.com/oncemill/oncemill/adapters/nats/embedded.
package nats
