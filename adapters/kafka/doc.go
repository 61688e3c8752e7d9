// Package kafka is oncemill's Kafka adapter: a Watermill publisher on
// Sarama and a subscriber on Sarama consumer groups (its own key-parallel
// one by default, watermill-kafka v3's one message per partition at a
// time), configured for exactly-once effects on Kafka's at-least-once
// delivery, which the inbox middleware completes by deduplicating by
// idempotency key.
//
// # Guarantees
//
// Commit after ack. The subscriber commits a record's offset to its
// consumer group only after the handler acked the message (and, in the
// key-parallel mode below, every message before it): watermill-kafka
// marks the offset on ack and never before, and Sarama commits marked
// offsets only, every [SubscriberConfig.CommitInterval], when the
// subscriber closes and before the group rebalances, or after every ack
// with [SubscriberConfig.SyncCommit]. With
// [SubscriberConfig.MaxInFlightPerPartition] 1, a partition delivers its
// next message only once the previous one is acked, and a nacked message
// is delivered again after [SubscriberConfig.NackResendSleep] while its
// partition waits; the key-parallel mode below orders by key instead, and
// there only the nacked message's key waits. After a crash
// or a lost ack, the group resumes at its committed offset, so a message
// may be delivered again, never skipped. (An ack in the same instant as
// Close may lose the race and leave its message to be delivered again.)
//
// Key-parallel consumption. With a ConsumerGroup and
// [SubscriberConfig.MaxInFlightPerPartition] above 1 (the default is 64),
// the subscriber runs its own Sarama consumer group instead of
// watermill-kafka's. Within a partition, messages with different record
// keys are handed to the router concurrently, up to
// MaxInFlightPerPartition at once, and [SubscriberConfig.MaxInFlight], when
// set, bounds them across all partitions; messages
// with the same key (the record key, which the [Marshaler] sets to
// [delivery.PartitionKeyOf] the message) stay strictly in offset order: a
// key's next message is handed out only once the previous one is acked,
// and a nacked one is delivered again, after NackResendSleep, before any
// later message of its key, while other keys go on. The partition
// commits the highest offset below which every message is acked, never
// past one that is in flight or nacked; acked messages above it are
// delivered again after a crash or a rebalance. When a partition is
// revoked, nothing more of it is handed out or marked once its session
// has ended, and the claim waits up to [SubscriberConfig.RevokeTimeout]
// for the handlers of its messages in flight, whose contexts it leaves
// alone until then, before it cancels them and lets the partition go. A
// handler still running then is abandoned: its message is delivered again
// to the partition's next owner, so handlers should honour their context
// (with the inbox, the next owner's delivery waits for the abandoned
// handler's claim). Close drains every partition the same way for up to
// [SubscriberConfig.DrainTimeout], long enough by default for the inbox's
// own drain, but marks and commits what the handlers ack while it waits,
// before the member leaves the group, and returns once every goroutine
// the subscriber started has stopped. Messages are decoded by the same
// [Marshaler], with the same metadata; watermill-kafka's context
// accessors (MessageKeyFromCtx and friends) find nothing in this mode:
// read [delivery.Partition] and [delivery.Offset] from the metadata.
// Message contexts derive from the Subscribe context.
//
// Oldest offset. A group with no committed offset for a partition starts
// at the partition's oldest record, so nothing published before the group
// first subscribed is missed; [SubscriberConfig.InitialOffset] changes
// that.
//
// Idempotent producer. The publisher's Sarama producer is idempotent
// (Producer.Idempotent, RequiredAcks WaitForAll, Net.MaxOpenRequests 1,
// retries): a retried send is never written twice, and retries do not
// reorder a partition. Publish returns once the partition's in-sync
// replicas have the records; the messages of one Publish call go out as
// one batch (watermill-kafka's publisher sends them one round trip each),
// which is what lets the outbox relay drain a backlog fast.
//
// Per-key order. The [Marshaler] keys every record by
// [delivery.PartitionKeyOf] (metadata partition_key, else
// idempotency_key), and the [NewKeyPartitioner] partitioner maps equal
// keys to one partition, as the Java client and franz-go do, so messages
// of one key are consumed in publish order. Keyless messages share the
// empty key's partition and keep their order too.
//
// Undecodable records surface. A record that cannot be decoded (several
// UUID headers or an empty one, headers that are not UTF-8, a tombstone:
// a null value and no headers) is delivered, not retried forever, as a
// message with [delivery.DecodeError] set to the reason and the raw
// record value as payload, for the poison middleware to dead-letter; its
// UUID is the UUID header if usable, else "topic/partition/offset".
// Every message carries [delivery.Topic], [delivery.Partition] and
// [delivery.Offset]. Records of stock watermill-kafka read normally, and
// stock watermill-kafka reads ours.
//
// Records from other producers. A record without Watermill's UUID header
// ([UUIDHeader]), as Java, Node or Python services write them, is decoded
// like any other: its headers become metadata, its value the payload, and
// its UUID is [RecordUUID], the UUIDv5 in [RecordNamespace] of
// "topic/partition/offset", the same on every delivery of the record. Its
// idempotency key is header idempotency_key or, when that is absent,
// header Idempotency-Key ([HTTPIdempotencyKeyHeader]); no other spelling
// is read. With neither, the inbox's default key is the UUID: the
// redeliveries of the record are deduplicated, but an event that the
// producer sends twice is two records, with two UUIDs, and is applied
// twice; such producers should set a key header. (A topic deleted and
// created again under its name numbers its records from 0 again, so they
// repeat the old records' UUIDs; see [RecordUUID].) A non-empty record key
// that is valid UTF-8 becomes metadata partition_key
// ([delivery.PartitionKey]) unless a partition_key header is present, so
// that the message published again (to a dead-letter topic, say) keeps
// its key.
//
// Hand-out marks. Kafka counts no deliveries, so by default the inbox
// records every attempt before the handler's transaction, to count one
// whose process dies. [SubscriberConfig.HandOutMarks] (the inbox's store;
// adapters.Options.HandOutMarks) spares a first delivery that record: the
// key-parallel subscriber writes, before it hands out an offset above it,
// a durable mark of the highest offset received, one write for a batch,
// and reads the mark when it is given a partition. Offsets above the mark
// it read go out with [delivery.Attempts] 1; those at or below it, and a
// nacked message handed out again, with [delivery.Redelivered], and the
// inbox counts their attempts one by one, so a message that kills its
// process is still dead-lettered at the poison middleware's MaxAttempts.
//
// Restarts and static membership. A subscriber that closes (the router
// closing on SIGTERM) leaves its consumer group before Close returns, in
// both modes: Sarama sends LeaveGroup, and the other members take its
// partitions at their next heartbeat, not a session timeout later. A
// member that dies without closing (SIGKILL, an OOM kill) keeps its
// partitions until its [SubscriberConfig.SessionTimeout] (6s by default)
// expires, and a replacement that joins meanwhile starts a rebalance that
// stops every member until that expiry: each crash of a crash loop
// stalls the whole group for most of a session timeout.
// [SubscriberConfig.ReadTimeout] outlasts the rebalance timeout, so a
// member waiting for the rebalance never abandons its JoinGroup to start
// over. A Close that comes while the member waits in a JoinGroup returns
// once the JoinGroup does, as Sarama cannot cancel it.
// [SubscriberConfig.InstanceID] (URL parameter instance_id) makes the
// subscriber a static member (KIP-345): restarted within the session
// timeout, it gets its partitions back without a rebalance and the rest
// of the group never stops, but it sends no LeaveGroup when it closes, so
// after a SIGTERM that no restart follows, its partitions wait out the
// session timeout. The embedded broker implements static membership,
// and drops a member killed while its JoinGroup waits one session timeout
// after the rebalance completes, as Kafka does, so that after a burst of
// crashes the last replacement consumes about one session timeout after
// the last crash, however many came before it.
//
// # Brokers
//
// Kafka 2.3 or later, or the in-process broker of package embedded, which
// tests use unless [BrokersEnv] names a real cluster (see
// [BrokersFromEnv]). The Sarama configs set Version 2.3.0.0, and Sarama
// sends each request at the newest version that Version allows (among
// them JoinGroup v5 and OffsetCommit v7, new in Kafka 2.3) without asking
// the broker which versions it supports, so an older broker refuses them. [SubscriberConfig.InstanceID] needs 2.3 in any case
// (static membership, KIP-345, is JoinGroup v5). For an older broker
// without InstanceID, a Sarama hook may lower Version to the broker's,
// down to 0.11.0.0 (record headers, the idempotent producer). Newer
// brokers accept these versions, Kafka 4 too: it drops only versions
// older than Kafka 2.1's (KIP-896).
//
// Tests that check for goroutine leaks must ignore
// github.com/rcrowley/go-metrics.(*meterArbiter).tick, a process-wide
// goroutine that Sarama's metrics start and nothing stops.
//
// watermill-kafka reconnects at once, in a loop, while a consumer group
// keeps failing with an error from the broker (an authorization error,
// say); [SubscriberConfig.ReconnectRetrySleep] spaces only the attempts
// that cannot connect at all. Its logs show the error.
//
// # URL
//
// Importing the package registers kafka:// with adapters.Open, which links
// this broker, and only this one, into a program; the URL parameters are
// listed in docs/brokers.md. kafka:// with no host starts the embedded
// broker of package embedded, which the program links by importing
// github.com/oncemill/oncemill/adapters/kafka/embedded.
package kafka
