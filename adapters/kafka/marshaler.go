package kafka

import (
	"fmt"
	"strconv"
	"strings"
	"unicode/utf8"

	"github.com/IBM/sarama"
	wkafka "github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/oncemill/oncemill/delivery"
)

// UUIDHeader is the record header that carries the message UUID, the same
// as watermill-kafka's, so that both read each other's records.
const UUIDHeader = wkafka.UUIDHeaderKey

// isAdapterKey reports whether k is a metadata key that the subscriber
// sets from the record itself, never from a header: a republished
// message carries these as headers, and they would lie about the new
// record.
func isAdapterKey(k string) bool {
	switch k {
	case delivery.Topic, delivery.Partition, delivery.Offset,
		delivery.Attempts, delivery.Redelivered, delivery.DecodeError:
		return true
	}
	return false
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
// Unmarshal never fails. A record it cannot decode becomes a message with
// metadata [delivery.DecodeError] set to the reason and the raw record
// value as payload; see [Marshaler.Unmarshal].
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
// A record is decoded, as watermill-kafka decodes it, when it has exactly
// one [UUIDHeader] header, non-empty, and every header key and value is
// valid UTF-8. Otherwise the message has [delivery.DecodeError] set to
// the reason, the raw record value as payload (nil for a null value), the
// headers that are valid UTF-8 as metadata, and as UUID the UUID header if
// it is usable, else "topic/partition/offset".
//
// Every message gets [delivery.Topic], [delivery.Partition] and
// [delivery.Offset] (decimal) from the record; headers of those names,
// and of the other keys an adapter sets, are ignored. The record key,
// timestamp, partition and offset are also in the message context, see
// watermill-kafka's MessageKeyFromCtx and friends.
func (Marshaler) Unmarshal(rec *sarama.ConsumerMessage) (*message.Message, error) {
	var (
		uuid     string
		uuids    int
		problems []string
	)
	metadata := make(message.Metadata, len(rec.Headers)+4)
	for i, h := range rec.Headers {
		if h == nil {
			continue
		}
		k, v := string(h.Key), string(h.Value)
		switch {
		case k == UUIDHeader:
			uuids++
			uuid = v
		case !utf8.ValidString(k):
			problems = append(problems, fmt.Sprintf("header %d: key %s is not valid UTF-8", i, quote(k)))
		case !utf8.ValidString(v):
			problems = append(problems, fmt.Sprintf("header %s: value %s is not valid UTF-8", quote(k), quote(v)))
		case !isAdapterKey(k):
			metadata[k] = v
		}
	}

	switch {
	case uuids == 0 && rec.Value == nil && len(rec.Headers) == 0:
		problems = append(problems, "missing header "+UUIDHeader+" (null value and no headers: a tombstone)")
	case uuids == 0:
		problems = append(problems, "missing header "+UUIDHeader)
	case uuids > 1:
		problems = append(problems, fmt.Sprintf("header %s appears %d times", UUIDHeader, uuids))
	case uuid == "":
		problems = append(problems, "header "+UUIDHeader+" is empty")
	case !utf8.ValidString(uuid):
		problems = append(problems, fmt.Sprintf("header %s: value %s is not valid UTF-8", UUIDHeader, quote(uuid)))
	}
	if uuids != 1 || uuid == "" || !utf8.ValidString(uuid) {
		uuid = rec.Topic + "/" + strconv.FormatInt(int64(rec.Partition), 10) + "/" + strconv.FormatInt(rec.Offset, 10)
	}

	msg := message.NewMessage(uuid, rec.Value)
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
