// Package delivery names the message metadata that oncemill's broker
// adapters (Kafka, RabbitMQ, SQS, NATS JetStream) set on every delivery
// and that its middlewares read: where a message came from, how often the
// broker has delivered it, and whether it could be decoded at all.
//
// Adapters set these keys; they never import the middlewares, and the
// middlewares never import an adapter: this package is the one both know.
package delivery

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"strconv"
	"strings"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill/message"
)

const (
	// IdempotencyKey is the producer's stable key for a message's effect.
	IdempotencyKey = "idempotency_key"
	// PartitionKey orders messages: brokers that partition (Kafka) or group
	// (SQS FIFO) route equal keys to one partition or group. Publishers fall
	// back to IdempotencyKey when it is empty.
	PartitionKey = "partition_key"

	// Topic is the topic or queue the message was received from.
	Topic = "oncemill_topic"
	// Partition is the Kafka partition the message was received from.
	Partition = "oncemill_partition"
	// Offset is the Kafka offset of the message in its partition.
	Offset = "oncemill_offset"
	// Stream is the NATS JetStream stream the message was received from.
	Stream = "oncemill_stream"
	// StreamSequence is the message's sequence number in its JetStream
	// stream: the same on every delivery of the message.
	StreamSequence = "oncemill_stream_sequence"
	// Attempts is the broker's own count of deliveries of this message,
	// this one included, where the broker keeps one (SQS
	// ApproximateReceiveCount, RabbitMQ quorum x-delivery-count + 1,
	// JetStream NumDelivered). Kafka keeps none: its subscriber sets 1 on
	// an offset's first hand-out when it keeps a [HandOutMarks], and
	// nothing otherwise.
	Attempts = "oncemill_attempts"
	// Redelivered is "true" when the broker says it delivered the message
	// before (RabbitMQ's redelivered flag, JetStream NumDelivered > 1), or
	// the Kafka subscriber's [HandOutMarks] says the offset may have been
	// handed out before (by a process that died, or a member that owned
	// the partition), or the subscriber hands a nacked message out again.
	Redelivered = "oncemill_redelivered"
	// MaxDeliveries is how many times the broker delivers the message at
	// most, the first delivery included, before it drops it or moves it
	// aside (RabbitMQ quorum x-delivery-limit + 1, SQS maxReceiveCount,
	// JetStream MaxDeliver): a delivery whose Attempts reach it is the
	// last the broker makes ([LastDelivery]). Absent when the broker sets
	// no limit, or the adapter cannot tell.
	MaxDeliveries = "oncemill_max_deliveries"
	// DecodeError holds why the adapter could not decode the broker's
	// record into a message; the payload then holds the raw bytes. The
	// message must go to the dead-letter queue, not to the handler.
	DecodeError = "oncemill_decode_error"
	// Replay is set on a message republished from the dead-letter queue,
	// to the replay grant that the replay wrote on the dead key's record
	// (a random value, dedup.NewReplayGrant). It is a claim, not a right:
	// the inbox reopens the dead key only when the store holds the same
	// grant on the key's record, and treats any other copy that carries
	// it, forged, forwarded or already used, as a copy of the dead key.
	Replay = "oncemill_replay"
	// ReplayConsumer is set on a message republished from the dead-letter
	// queue to the consumer that dead-lettered it: a replay published to
	// its original topic reaches every consumer of the topic, and the
	// inbox of another consumer acks it without running the handler when
	// its store holds the message's Replay grant on the named consumer's
	// record of the key; otherwise it handles the message as any other.
	ReplayConsumer = "oncemill_replay_consumer"
)

// HandOutMarks keeps, for a subscriber whose broker counts no deliveries
// (Kafka), a durable mark per consumer group and partition: the highest
// offset it may have handed out. The subscriber writes the mark before it
// hands out any offset under it, one write for a batch of offsets
// received, and reads it when it is given the partition: an offset at or
// below the mark may have been handed out before, to a process that died
// in it, and goes out marked [Redelivered] (its attempts are counted one
// by one); an offset above it goes out as a first delivery, [Attempts]
// 1, whose attempt the inbox need not record, as on brokers that count.
// The inbox stores implement it (dedup/postgres, dedup/sqlstore,
// dedup/sqlite), on a table beside the inbox's.
type HandOutMarks interface {
	// InboxHandOutMark returns the mark of group's partition of topic,
	// -1 when there is none.
	InboxHandOutMark(ctx context.Context, group, topic string, partition int32) (int64, error)
	// InboxMarkHandOut raises the mark of group's partition of topic to
	// offset, durably, and never lowers it.
	InboxMarkHandOut(ctx context.Context, group, topic string, partition int32, offset int64) error
}

// IsAdapterFact reports whether metadata key k is one an adapter sets on
// each delivery from what the broker says of it: Topic, Partition, Offset,
// Stream, StreamSequence, Attempts, Redelivered, MaxDeliveries and
// DecodeError. It is the one list every adapter keeps to: its publisher
// leaves these keys out and its subscriber ignores a header of those
// names, since a message consumed from one broker and published to
// another (or the same) would otherwise carry facts of the delivery it
// was consumed from, which lie about the new one (a decode error would
// even have it dead-lettered unread). The replay marker and the dead-letter fields are not adapter
// facts: a replay or a dead-letter copy published to a broker must carry
// them (see [IsDeliveryFact]).
func IsAdapterFact(k string) bool {
	switch k {
	case Topic, Partition, Offset, Stream, StreamSequence, Attempts, Redelivered, MaxDeliveries, DecodeError:
		return true
	}
	return false
}

// IsDeliveryFact reports whether metadata key k is one an adapter sets on
// a delivery ([IsAdapterFact]), the replay marker of one (Replay,
// ReplayConsumer), one the poison middleware adds (the Dead* keys) or one
// a parked message is handed back with (the Retry* keys):
// facts about one delivery that must not travel into a dead-letter copy
// or a replay of it, which get their own.
func IsDeliveryFact(k string) bool {
	switch {
	case IsAdapterFact(k), k == Replay, k == ReplayConsumer:
		return true
	}
	return strings.HasPrefix(k, DeadPrefix) || strings.HasPrefix(k, RetryPrefix)
}

// AttemptsOf returns the broker's delivery count of msg, if it has one.
func AttemptsOf(msg *message.Message) (int, bool) {
	n, err := strconv.Atoi(msg.Metadata.Get(Attempts))
	if err != nil || n < 1 {
		return 0, false
	}
	return n, true
}

// LastDelivery reports whether msg is the last delivery its broker makes
// of it: its Attempts have reached its MaxDeliveries. The broker drops
// the message, or moves it aside, if this delivery is not acked; it
// returns the limit too.
func LastDelivery(msg *message.Message) (limit int, last bool) {
	limit, err := strconv.Atoi(msg.Metadata.Get(MaxDeliveries))
	if err != nil || limit < 1 {
		return 0, false
	}
	n, ok := AttemptsOf(msg)
	return limit, ok && n >= limit
}

// DecodeErrorOf returns why msg could not be decoded, or "" if it was.
func DecodeErrorOf(msg *message.Message) string {
	return msg.Metadata.Get(DecodeError)
}

// PartitionKeyOf returns the key that orders msg: metadata partition_key,
// else idempotency_key, else "".
func PartitionKeyOf(msg *message.Message) string {
	if k := msg.Metadata.Get(PartitionKey); k != "" {
		return k
	}
	return msg.Metadata.Get(IdempotencyKey)
}

// Metadata the poison middleware adds to a message it dead-letters. The
// original metadata (its key, its partition key) is kept as it was, so a
// replay of the copy is deduplicated like the original.
const (
	// DeadTopic is the topic the message was consumed from.
	DeadTopic = "oncemill_dlq_topic"
	// DeadConsumer is the consumer (handler) that gave up on it.
	DeadConsumer = "oncemill_dlq_consumer"
	// DeadKey is the idempotency key the consumer derived, when known.
	DeadKey = "oncemill_dlq_key"
	// DeadAttempts is how many attempts were made, the last included, as
	// the count that DeadAttemptsSource names has it.
	DeadAttempts = "oncemill_dlq_attempts"
	// DeadAttemptsSource names who counted DeadAttempts:
	// AttemptsFromInbox, AttemptsFromBroker or AttemptsFromProcess.
	DeadAttemptsSource = "oncemill_dlq_attempts_source"
	// DeadError is the text of the last error.
	DeadError = "oncemill_dlq_error"
	// DeadPermanent is "true" when the last error was permanent (never
	// retried), else "false".
	DeadPermanent = "oncemill_dlq_permanent"
	// DeadFirstFailedAt and DeadLastFailedAt are the times of the first and
	// the last failed attempt, RFC 3339 with nanoseconds, UTC.
	DeadFirstFailedAt = "oncemill_dlq_first_failed_at"
	// DeadLastFailedAt: see DeadFirstFailedAt.
	DeadLastFailedAt = "oncemill_dlq_last_failed_at"
	// DeadPartition and DeadOffset are the Kafka partition and offset of
	// the original, when known.
	DeadPartition = "oncemill_dlq_partition"
	// DeadOffset: see DeadPartition.
	DeadOffset = "oncemill_dlq_offset"
	// DeadStream and DeadStreamSequence are the NATS JetStream stream and
	// stream sequence of the original, when known.
	DeadStream = "oncemill_dlq_stream"
	// DeadStreamSequence: see DeadStream.
	DeadStreamSequence = "oncemill_dlq_stream_sequence"
)

// Values of DeadAttemptsSource.
const (
	// AttemptsFromInbox: the inbox store counted the failed handler
	// attempts of the key, durably and exactly.
	AttemptsFromInbox = "inbox"
	// AttemptsFromBroker: the broker's own count of deliveries of the
	// message (Attempts: RabbitMQ x-delivery-count, SQS
	// ApproximateReceiveCount, JetStream NumDelivered), which also grows
	// with deliveries that did not fail, returned on a consumer's
	// shutdown for instance.
	AttemptsFromBroker = "broker"
	// AttemptsFromProcess: a counter in the consumer's memory, which a
	// restart resets (a broker without a count, such as Kafka, and no
	// inbox).
	AttemptsFromProcess = "process"
)

// DeadPrefix starts every key of the dead-letter metadata above; a replay
// strips the keys with this prefix.
const DeadPrefix = "oncemill_dlq_"

// Metadata a parked message is handed back to its consumer with (package
// retry), for logs and handlers; the poison middleware reads the lease
// from the message's context, never from these.
const (
	// RetryPrefix starts every key of a parked message's metadata.
	RetryPrefix = "oncemill_retry_"
	// RetryID is the parked message's row in the retries table.
	RetryID = RetryPrefix + "id"
	// RetryAttempts is how many attempts of the message had failed
	// before this one.
	RetryAttempts = RetryPrefix + "attempts"
)

// DeadUUID is the message's UUID, set on a dead letter's metadata by the
// dead-letter table when the entry's uuid column holds another value: the
// [Bound] form of a UUID too long for the table's index, or a form made
// unique per outbox row for the relay's dead letters. A replay publishes
// the message with it.
const DeadUUID = DeadPrefix + "uuid"

// MaxBoundBytes is the most bytes [Bound] returns.
const MaxBoundBytes = 512

// Bound returns s when it is at most [MaxBoundBytes] long, else its first
// bytes, cut at a UTF-8 boundary, followed by "…sha256:" and the hex
// SHA-256 of the whole of s, MaxBoundBytes in all. It is the one form in
// which oncemill's tables index, and its logs print, an identifier that a
// producer chose and may have made of any length (a UUID, a key, a topic,
// a consumer name): a database index has a bound (PostgreSQL's B-tree
// takes about 2700 bytes a row) and a value past it fails the insert,
// which would keep the row that carries it, and every row behind it, from
// ever being written. Distinct values stay distinct (the digest is of the
// whole value), the same value always gives the same form, Bound of a
// bounded value is that value, and the readable prefix says what it was.
func Bound(s string) string {
	if len(s) <= MaxBoundBytes {
		return s
	}
	sum := sha256.Sum256([]byte(s))
	suffix := "…sha256:" + hex.EncodeToString(sum[:])
	// Cut before a rune that the cut would split (up to 3 bytes back).
	n := MaxBoundBytes - len(suffix)
	for back := 0; back < utf8.UTFMax-1 && n > 0 && !utf8.RuneStart(s[n]); back++ {
		n--
	}
	return s[:n] + suffix
}
