// Package sqs connects oncemill to Amazon SQS with the AWS SDK for Go v2: a
// Watermill [Publisher] and [Subscriber] that acknowledge to SQS only when
// the handler acks, and set the [delivery] metadata that oncemill's
// middlewares read.
//
// # Topology
//
// Every topic is one SQS queue, named by [Config.QueueNameFromTopic]
// ([DefaultQueueName]: the topic with the characters SQS rejects replaced
// by '-'). All subscribers of a topic, in any process, compete for its
// messages: there are no consumer groups (fan-out to several queues is
// SNS's job). A queue is looked up once per topic and cached; it is created,
// with [Config.QueueAttributes], by SubscribeInitialize, and by Publish and
// Subscribe when [Config.CreateQueueIfMissing] is set.
//
// # Guarantees
//
// Delivery is at least once; oncemill's inbox turns it into exactly-once
// effects.
//
//   - Publish returns once SQS has stored every message (several are sent
//     with SendMessageBatch, 10 at most per request).
//   - A subscription holds up to [SubscriberConfig.MaxInFlight] messages
//     (MaxNumberOfMessages, 10, by default) and hands them to the router
//     concurrently, per ordering key (see Concurrency and order below),
//     so that group commit and middleware.BatchHandler fill their
//     batches. It deletes a
//     message only after the handler acks it, retrying the deletion a few
//     times. When the deletion still fails, SQS delivers the message again
//     after its visibility timeout, and the inbox absorbs the duplicate.
//   - While the subscription holds a message (the handler runs, or the
//     message waits behind another of its key), a heartbeat extends its
//     visibility timeout every [SubscriberConfig.VisibilityTimeout]/3, so a
//     slow handler is not raced by a redelivery to another consumer.
//   - A nack makes the message visible again after
//     [SubscriberConfig.NackBackoff] (by default 1s, doubling per attempt,
//     at most 5 minutes).
//   - Close, or the cancellation of Subscribe's context, neither deletes
//     nor nacks the message a handler holds: SQS delivers it again after its
//     visibility timeout. Messages received but not yet handed out are made
//     visible at once. A long poll in flight is cancelled; messages SQS had
//     already picked for it stay hidden until their visibility timeout.
//   - Order: standard queues are best-effort ordered; FIFO queues keep the
//     order within a message group (see below).
//
// # Concurrency and order
//
// The ordering key of a message is its message group on a FIFO queue, and
// on a standard queue [delivery.PartitionKeyOf] the message (the
// partition_key attribute, else idempotency_key); a message without one
// is its own key. Messages of different keys are in flight at once, up to
// MaxInFlight; a key's messages one at a time, in the order
// received, the next once the previous is acked or nacked. Within a
// process a FIFO group stays in order, across nacks too (below); on a
// standard queue a nacked message comes back after its backoff, behind
// the key's later messages, as SQS keeps no order to restore. Across
// processes a FIFO group stays in order (SQS hands a group's messages to
// one receiver at a time), a standard queue keeps none.
//
// With a RedrivePolicy queue attribute ([RedrivePolicy]) SQS itself moves a
// message received too many times to a dead-letter queue; keep its
// maxReceiveCount above the poison middleware's attempt limit so that it
// is only a backstop.
//
// # Metadata
//
// Each subscribed message has delivery.Topic (the topic subscribed to) and
// delivery.Attempts, SQS's ApproximateReceiveCount: 1 on the first
// delivery, incremented by every receive, so by nacks, by redeliveries after
// a visibility timeout and by subscribers that closed while holding the
// message.
//
// The publisher sends the payload as the body when it is text that every
// SQS implementation accepts: UTF-8 of characters in the Basic Multilingual
// Plane, without control characters other than tab, CR and LF. (AWS also
// accepts characters above U+FFFF, such as emoji, but emulators such as
// fauxqs reject them.) Other payloads are sent in base64 and empty payloads
// as a placeholder, marked by the [BodyEncodingAttribute] attribute. The message UUID travels in the
// [UUIDAttribute] attribute. The metadata travels as one String attribute
// per key when it fits: SQS allows 10 attributes per message, names of
// letters, digits, '_', '-' and '.', no empty values, and values made of the
// same characters as a text body. Otherwise all of
// it travels as one JSON object in the [MetadataAttribute] attribute, which
// keeps every key and value (invalid UTF-8 becomes U+FFFD). The delivery
// facts (delivery.Topic, delivery.Attempts, delivery.DecodeError and the
// other brokers' ones) are never sent: each delivery sets its own.
//
// The subscriber accepts any message, including those sent by other
// producers: their attributes become metadata (Binary values as raw
// bytes), and a message without [UUIDAttribute] gets its SQS MessageId as
// UUID, which stays the same across redeliveries. A message whose body or
// metadata cannot be decoded (a body that is not the base64 its attribute
// claims, a corrupt [MetadataAttribute]) is still delivered, with
// delivery.DecodeError set and the raw body as payload, for the handler
// chain to dead-letter; it is never dropped and never nacked in a loop by
// the subscriber.
//
// # FIFO queues
//
// A queue whose name ends in ".fifo" is a FIFO queue (topics ending in
// ".fifo" keep the suffix). The publisher sets each message's
// MessageGroupId to [delivery.PartitionKeyOf] the message (the partition
// key, else the idempotency key), else its UUID, and its
// MessageDeduplicationId to its idempotency key, else its UUID; an ID that
// SQS would reject (over 128 characters, or characters other than ASCII
// letters, digits and punctuation) is replaced by its SHA-256 in hex. A
// replay of a dead letter (delivery.Replay, its replay grant, fresh for
// every replay) and a dead-lettered copy (delivery.DeadConsumer,
// delivery.DeadLastFailedAt) get an ID of their
// own, a hash of the key and those fields, so that SQS does not drop them
// as retries of the original. SQS then drops a message published again
// with the same idempotency key within 5 minutes, and delivers the messages of a group in order, one
// group member in flight at a time. The subscriber keeps that order: it
// hands out a group's messages one at a time, and after a nack, the
// messages of the same group that it holds are made visible again rather
// than handed out, so they follow the nacked one once its backoff has
// passed; meanwhile the group waits.
//
// # URL
//
// Importing the package registers sqs:// with adapters.Open, which links
// this broker, and only this one, into a program; the URL parameters are
// listed in docs/brokers.md.
package sqs
