package kafka_test

import (
	"testing"

	"github.com/IBM/sarama"
	wkafka "github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/adapters/kafka"
	"github.com/oncemill/oncemill/delivery"
)

// consumed turns what Marshal produced into what a consumer reads.
func consumed(t *testing.T, rec *sarama.ProducerMessage, partition int32, offset int64) *sarama.ConsumerMessage {
	t.Helper()
	value, err := rec.Value.Encode()
	require.NoError(t, err)
	var key []byte
	if rec.Key != nil {
		key, err = rec.Key.Encode()
		require.NoError(t, err)
	}
	cm := &sarama.ConsumerMessage{Topic: rec.Topic, Partition: partition, Offset: offset, Key: key, Value: value}
	for i := range rec.Headers {
		cm.Headers = append(cm.Headers, &rec.Headers[i])
	}
	return cm
}

func header(k, v string) *sarama.RecordHeader {
	return &sarama.RecordHeader{Key: []byte(k), Value: []byte(v)}
}

func TestMarshalerRoundTrip(t *testing.T) {
	msg := message.NewMessage("uuid-1", []byte("payload"))
	msg.Metadata.Set("a", "1")
	msg.Metadata.Set(delivery.IdempotencyKey, "order-7")

	rec, err := kafka.Marshaler{}.Marshal("orders", msg)
	require.NoError(t, err)
	key, err := rec.Key.Encode()
	require.NoError(t, err)
	require.Equal(t, "order-7", string(key), "the idempotency key orders when there is no partition key")

	got, err := kafka.Marshaler{}.Unmarshal(consumed(t, rec, 3, 42))
	require.NoError(t, err)
	require.Equal(t, "uuid-1", got.UUID)
	require.Equal(t, []byte("payload"), []byte(got.Payload))
	require.Equal(t, message.Metadata{
		"a":                     "1",
		delivery.IdempotencyKey: "order-7",
		delivery.Topic:          "orders",
		delivery.Partition:      "3",
		delivery.Offset:         "42",
	}, got.Metadata)
}

func TestMarshalerKey(t *testing.T) {
	msg := message.NewMessage("u", nil)
	msg.Metadata.Set(delivery.IdempotencyKey, "idem")
	msg.Metadata.Set(delivery.PartitionKey, "part")
	rec, err := kafka.Marshaler{}.Marshal("t", msg)
	require.NoError(t, err)
	key, err := rec.Key.Encode()
	require.NoError(t, err)
	require.Equal(t, "part", string(key), "the partition key wins")

	rec, err = kafka.Marshaler{}.Marshal("t", message.NewMessage("u", nil))
	require.NoError(t, err)
	require.NotNil(t, rec.Key, "a keyless message gets the empty key, not a null one")
	key, err = rec.Key.Encode()
	require.NoError(t, err)
	require.NotNil(t, key)
	require.Empty(t, key)
}

// TestUnmarshalStockRecord: records of stock watermill-kafka decode
// normally.
func TestUnmarshalStockRecord(t *testing.T) {
	msg := message.NewMessage("stock-uuid", []byte("x"))
	msg.Metadata.Set("k", "v")
	rec, err := wkafka.DefaultMarshaler{}.Marshal("t", msg)
	require.NoError(t, err)
	got, err := kafka.Marshaler{}.Unmarshal(consumed(t, rec, 0, 9))
	require.NoError(t, err)
	require.Equal(t, "stock-uuid", got.UUID)
	require.Empty(t, delivery.DecodeErrorOf(got))
	require.Equal(t, "v", got.Metadata.Get("k"))
	require.Equal(t, "9", got.Metadata.Get(delivery.Offset))
}

func TestMarshalRejects(t *testing.T) {
	for name, msg := range map[string]*message.Message{
		"empty UUID":         message.NewMessage("", nil),
		"non-UTF-8 UUID":     message.NewMessage("\xff", nil),
		"reserved metadata":  withMetadata(kafka.UUIDHeader, "x"),
		"non-UTF-8 key":      withMetadata("\xfe", "x"),
		"non-UTF-8 metadata": withMetadata("k", "\xfe\xff"),
	} {
		t.Run(name, func(t *testing.T) {
			_, err := kafka.Marshaler{}.Marshal("t", msg)
			require.ErrorIs(t, err, kafka.ErrInvalidMessage)
		})
	}
}

func withMetadata(k, v string) *message.Message {
	msg := message.NewMessage("u", nil)
	msg.Metadata.Set(k, v)
	return msg
}

func TestUnmarshalUndecodable(t *testing.T) {
	for _, tc := range []struct {
		name      string
		value     []byte
		headers   []*sarama.RecordHeader
		wantUUID  string
		wantError string
		wantMeta  map[string]string
	}{{
		name:      "tombstone",
		wantUUID:  "t/2/7",
		wantError: "missing header _watermill_message_uuid (null value and no headers: a tombstone)",
	}, {
		name:      "no UUID header",
		value:     []byte(`{"from":"another producer"}`),
		headers:   []*sarama.RecordHeader{header("content-type", "application/json")},
		wantUUID:  "t/2/7",
		wantError: "missing header _watermill_message_uuid",
		wantMeta:  map[string]string{"content-type": "application/json"},
	}, {
		name:      "empty UUID",
		value:     []byte("x"),
		headers:   []*sarama.RecordHeader{header(kafka.UUIDHeader, "")},
		wantUUID:  "t/2/7",
		wantError: "header _watermill_message_uuid is empty",
	}, {
		name:      "two UUIDs",
		value:     []byte("x"),
		headers:   []*sarama.RecordHeader{header(kafka.UUIDHeader, "a"), header(kafka.UUIDHeader, "b")},
		wantUUID:  "t/2/7",
		wantError: "header _watermill_message_uuid appears 2 times",
	}, {
		name:      "non-UTF-8 UUID",
		value:     []byte("x"),
		headers:   []*sarama.RecordHeader{header(kafka.UUIDHeader, "\xff")},
		wantUUID:  "t/2/7",
		wantError: `header _watermill_message_uuid: value "\xff" is not valid UTF-8`,
	}, {
		name:      "non-UTF-8 header value",
		value:     []byte("x"),
		headers:   []*sarama.RecordHeader{header(kafka.UUIDHeader, "good-uuid"), header("k", "\xc3\x28"), header("ok", "1")},
		wantUUID:  "good-uuid",
		wantError: `header "k": value "\xc3(" is not valid UTF-8`,
		wantMeta:  map[string]string{"ok": "1"},
	}, {
		name:      "non-UTF-8 header key and no UUID",
		value:     []byte("x"),
		headers:   []*sarama.RecordHeader{header("\xff", "v")},
		wantUUID:  "t/2/7",
		wantError: `header 0: key "\xff" is not valid UTF-8; missing header _watermill_message_uuid`,
	}} {
		t.Run(tc.name, func(t *testing.T) {
			rec := &sarama.ConsumerMessage{Topic: "t", Partition: 2, Offset: 7, Value: tc.value, Headers: tc.headers}
			msg, err := kafka.Marshaler{}.Unmarshal(rec)
			require.NoError(t, err)
			require.Equal(t, tc.wantUUID, msg.UUID)
			require.Equal(t, tc.value, []byte(msg.Payload), "the raw value is the payload")
			want := message.Metadata{
				delivery.Topic:       "t",
				delivery.Partition:   "2",
				delivery.Offset:      "7",
				delivery.DecodeError: tc.wantError,
			}
			for k, v := range tc.wantMeta {
				want[k] = v
			}
			require.Equal(t, want, msg.Metadata)
		})
	}
}

// TestUnmarshalAdapterKeys: headers named like the keys an adapter sets
// (a republished message carries them) never override the record's own.
func TestUnmarshalAdapterKeys(t *testing.T) {
	rec := &sarama.ConsumerMessage{Topic: "now", Partition: 1, Offset: 5, Value: []byte("x"), Headers: []*sarama.RecordHeader{
		header(kafka.UUIDHeader, "u"),
		header(delivery.Topic, "before"),
		header(delivery.Partition, "9"),
		header(delivery.Offset, "99"),
		header(delivery.DecodeError, "old reason"),
		header(delivery.Attempts, "3"),
		header(delivery.Redelivered, "true"),
	}}
	msg, err := kafka.Marshaler{}.Unmarshal(rec)
	require.NoError(t, err)
	require.Equal(t, message.Metadata{
		delivery.Topic:     "now",
		delivery.Partition: "1",
		delivery.Offset:    "5",
	}, msg.Metadata)
}

func TestUnmarshalNilHeader(t *testing.T) {
	rec := &sarama.ConsumerMessage{Topic: "t", Value: []byte("x"), Headers: []*sarama.RecordHeader{nil, header(kafka.UUIDHeader, "u"), {Key: []byte("null-value")}}}
	msg, err := kafka.Marshaler{}.Unmarshal(rec)
	require.NoError(t, err)
	require.Equal(t, "u", msg.UUID)
	require.Empty(t, delivery.DecodeErrorOf(msg))
	require.Equal(t, "", msg.Metadata.Get("null-value"))
}
