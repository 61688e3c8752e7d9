package kafka

import (
	"fmt"
	"strconv"
	"strings"
	"unicode/utf8"

	"github.com/IBM/sarama"
	wkafka "github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"

	"github.com/oncemill/oncemill/delivery"
)

// UUIDHeader is the record header that carries the message UUID, the same
// as watermill-kafka's, so that both read each other's records.
const UUIDHeader = wkafka.UUIDHeaderKey

// HTTPIdempotencyKeyHeader is the HTTP spelling of the idempotency key
// header, which many services outside Go set on the records they produce.
// [Marshaler.Unmarshal] reads it, on a record without a [UUIDHeader]
// header only, when the record has no [delivery.IdempotencyKey] header.
// Kafka header names are case-sensitive, and so is this one: no other
// spelling is read.
const HTTPIdempotencyKeyHeader = "Idempotency-Key"

// RecordNamespace is the namespace of the name-based UUIDs (UUIDv5, RFC
// 9562) that [Marshaler.Unmarshal] gives the records without a
// [UUIDHeader] header; see [RecordUUID]. It is itself the UUIDv5 of
// "https://github.com/oncemill/oncemill/adapters/kafka#record" in the URL
// namespace, and never changes: a new value would give every record
// already consumed a new UUID, and so a new default idempotency key.
const RecordNamespace = "59d0a5e5-42a6-5728-b0f4-20c7e6e32e49"

var recordNamespace = uuid.MustParse(RecordNamespace)

// RecordUUID returns the UUID of the record at offset of partition of
// topic when it has no [UUIDHeader] header: the UUIDv5, in
// [RecordNamespace], of "topic/partition/offset" with partition and
// offset in decimal (a topic name cannot contain "/"). Every delivery of
// one record has the same UUID, and no other record of the topic has it;
// a producer that sends an event twice writes two records, with two
// UUIDs. The name holds no cluster and no topic ID: a topic deleted and
// created again under its name numbers its records from offset 0 again,
// and so does a topic of the same name on another cluster, so their
// records get the UUIDs of the old topic's. A consumer whose inbox keys
// such records by UUID would take them for duplicates within its window.
func RecordUUID(topic string, partition int32, offset int64) string {
	return uuid.NewSHA1(recordNamespace, []byte(recordName(topic, partition, offset))).String()
}

// recordName is "topic/partition/offset", partition and offset in
// decimal.
func recordName(topic string, partition int32, offset int64) string {
	return topic + "/" + strconv.FormatInt(int64(partition), 10) + "/" + strconv.FormatInt(offset, 10)
}

// Marshaler converts between Watermill messages and Kafka records in
// watermill-kafka's format: the UUID in the [UUIDHeader] header, each
// metadata entry in a header of its own, the payload as the value. It
// implements watermill-kafka's MarshalerUnmarshaler, so it can also be
// given to watermill-kafka's own configs.
//
// Marshal sets the record key to [delivery.PartitionKeyOf] the message:
// the partitioner sends equal keys to one partition, which keeps their
// order. A message with neither a partition key nor an idempotency key
// gets the empty key, not a null one, so keyless messages share one
// partition and keep their order too.
//
// Unmarshal never fails. A record without a [UUIDHeader] header, from a
// producer that is not Watermill, is decoded all the same, with
// [RecordUUID] as its UUID. A record it cannot decode becomes a message
// with metadata [delivery.DecodeError] set to the reason and the raw
// record value as payload; see [Marshaler.Unmarshal].
type Marshaler struct{}

var _ wkafka.MarshalerUnmarshaler = Marshaler{}

// Marshal converts msg to a record for topic. It rejects, with an error
// wrapping [ErrInvalidMessage], a message that Unmarshal would not decode:
// an empty or non-UTF-8 UUID, non-UTF-8 metadata, or metadata named
// [UUIDHeader].
func (Marshaler) Marshal(topic string, msg *message.Message) (*sarama.ProducerMessage, error) {
	if msg.UUID == "" {
		return nil, fmt.Errorf("%w: empty UUID", ErrInvalidMessage)
	}
	if !utf8.ValidString(msg.UUID) {
		return nil, fmt.Errorf("%w: UUID %s is not valid UTF-8", ErrInvalidMessage, quote(msg.UUID))
	}
	for k, v := range msg.Metadata {
		if k == UUIDHeader {
			return nil, fmt.Errorf("%w: metadata %s is reserved for the message UUID", ErrInvalidMessage, UUIDHeader)
		}
		if !utf8.ValidString(k) {
			return nil, fmt.Errorf("%w: metadata key %s is not valid UTF-8", ErrInvalidMessage, quote(k))
		}
		if !utf8.ValidString(v) {
			return nil, fmt.Errorf("%w: metadata %s value %s is not valid UTF-8", ErrInvalidMessage, quote(k), quote(v))
		}
	}
	rec, err := wkafka.DefaultMarshaler{}.Marshal(topic, msg)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrInvalidMessage, err)
	}
	// Never nil: a nil key would make the partitioner pick a partition
	// at random.
	rec.Key = sarama.ByteEncoder(append([]byte{}, delivery.PartitionKeyOf(msg)...))
	return rec, nil
}

// Unmarshal converts a record to a message; it never returns an error, so
// that one bad record cannot stop its partition (watermill-kafka ends the
// claim on an Unmarshal error and reads the same record again, forever).
//
// A record is decoded when every header key and value is valid UTF-8 and
// it either has exactly one [UUIDHeader] header, non-empty, as
// watermill-kafka decodes it, or has none and is not a tombstone (a null
// value and no headers). Its headers become the metadata and its value the
// payload.
//
// A record without a [UUIDHeader] header comes from a producer that is
// not Watermill (a Java, Node or Python service, say). Its UUID is
// [RecordUUID] of its topic, partition and offset, the same on every
// delivery of the record. When it has no [delivery.IdempotencyKey]
// header, a [HTTPIdempotencyKeyHeader] header is also copied to metadata
// [delivery.IdempotencyKey] (an empty one too, which the inbox rejects as
// an empty key); with neither, the inbox's default key is the UUID, which
// deduplicates the deliveries of one record, not two records of one
// event. When it has no [delivery.PartitionKey] header, a non-empty
// record key that is valid UTF-8 is copied to metadata
// [delivery.PartitionKey], so that the message published again (to a
// dead-letter topic, say) gets the same record key from Marshal. Records
// with a [UUIDHeader] header get neither copy: their metadata is the
// publisher's, as it was.
//
// Otherwise (several [UUIDHeader] headers or an empty one, a header that
// is not UTF-8, a tombstone) the message has [delivery.DecodeError] set to
// the reason, the raw record value as payload (nil for a null value), the
// headers that are valid UTF-8 as metadata, and as UUID the UUID header
// if it is usable, else "topic/partition/offset".
//
// Every message gets [delivery.Topic], [delivery.Partition] and
// [delivery.Offset] (decimal) from the record; headers of those names,
// and of the other keys an adapter sets, are ignored. The record key,
// timestamp, partition and offset are also in the message context, see
// watermill-kafka's MessageKeyFromCtx and friends.
func (Marshaler) Unmarshal(rec *sarama.ConsumerMessage) (*message.Message, error) {
	var (
		id       string
		uuids    int
		problems []string
	)
	metadata := make(message.Metadata, len(rec.Headers)+6)
	for i, h := range rec.Headers {
		if h == nil {
			continue
		}
		k, v := string(h.Key), string(h.Value)
		switch {
		case k == UUIDHeader:
			uuids++
			id = v
		case !utf8.ValidString(k):
			problems = append(problems, fmt.Sprintf("header %d: key %s is not valid UTF-8", i, quote(k)))
		case !utf8.ValidString(v):
			problems = append(problems, fmt.Sprintf("header %s: value %s is not valid UTF-8", quote(k), quote(v)))
		case !delivery.IsAdapterFact(k):
			metadata[k] = v
		}
	}

	foreign := false
	switch {
	case uuids == 0 && rec.Value == nil && len(rec.Headers) == 0:
		problems = append(problems, "missing header "+UUIDHeader+" (null value and no headers: a tombstone)")
	case uuids == 0 && len(problems) > 0:
		// Undecodable anyway; say why the UUID is not the record's.
		problems = append(problems, "missing header "+UUIDHeader)
	case uuids == 0:
		foreign = true
	case uuids > 1:
		problems = append(problems, fmt.Sprintf("header %s appears %d times", UUIDHeader, uuids))
	case id == "":
		problems = append(problems, "header "+UUIDHeader+" is empty")
	case !utf8.ValidString(id):
		problems = append(problems, fmt.Sprintf("header %s: value %s is not valid UTF-8", UUIDHeader, quote(id)))
	}
	switch {
	case foreign:
		id = RecordUUID(rec.Topic, rec.Partition, rec.Offset)
		if _, ok := metadata[delivery.IdempotencyKey]; !ok {
			if k, ok := metadata[HTTPIdempotencyKeyHeader]; ok {
				metadata[delivery.IdempotencyKey] = k
			}
		}
		if _, ok := metadata[delivery.PartitionKey]; !ok && len(rec.Key) > 0 && utf8.Valid(rec.Key) {
			metadata[delivery.PartitionKey] = string(rec.Key)
		}
	case uuids != 1 || id == "" || !utf8.ValidString(id):
		id = recordName(rec.Topic, rec.Partition, rec.Offset)
	}

	msg := message.NewMessage(id, rec.Value)
	msg.Metadata = metadata
	msg.Metadata[delivery.Topic] = rec.Topic
	msg.Metadata[delivery.Partition] = strconv.FormatInt(int64(rec.Partition), 10)
	msg.Metadata[delivery.Offset] = strconv.FormatInt(rec.Offset, 10)
	if len(problems) > 0 {
		msg.Metadata[delivery.DecodeError] = strings.Join(problems, "; ")
	}
	return msg, nil
}

// quote quotes s for an error message, cut to 64 bytes.
func quote(s string) string {
	const limit = 64
	if len(s) > limit {
		return strconv.Quote(s[:limit]) + "..."
	}
	return strconv.Quote(s)
}
