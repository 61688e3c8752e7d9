package kafka_test

import (
	"strconv"
	"testing"

	"github.com/IBM/sarama"
	wkafka "github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/adapters/kafka"
	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/middleware"
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

// recordUUID is the documented UUID of a record without a UUID header,
// computed from the documented namespace, not by the package.
func recordUUID(t *testing.T, name string) string {
	t.Helper()
	ns, err := uuid.Parse(kafka.RecordNamespace)
	require.NoError(t, err)
	return uuid.NewSHA1(ns, []byte(name)).String()
}

// TestRecordNamespace: the namespace is what its documentation derives it
// from, and RecordUUID follows the documented formula.
func TestRecordNamespace(t *testing.T) {
	require.Equal(t, uuid.NewSHA1(uuid.NameSpaceURL, []byte("https://github.com/oncemill/oncemill/adapters/kafka#record")).String(), kafka.RecordNamespace)
	require.Equal(t, "dca63d81-fda7-55dd-8e26-632bf4381bd6", kafka.RecordUUID("orders", 2, 7), "a record's UUID never changes")
	require.Equal(t, recordUUID(t, "orders/2/7"), kafka.RecordUUID("orders", 2, 7))
}

// TestUnmarshalForeignRecord: a record from a producer that is not
// Watermill (no UUID header) is decoded, with the UUIDv5 of its topic,
// partition and offset as UUID, the same on every delivery.
func TestUnmarshalForeignRecord(t *testing.T) {
	foreign := func(topic string, partition int32, offset int64) *sarama.ConsumerMessage {
		return &sarama.ConsumerMessage{
			Topic: topic, Partition: partition, Offset: offset,
			Key:   []byte("customer-7"),
			Value: []byte(`{"orderId":"A-42","amount":1999}`),
			Headers: []*sarama.RecordHeader{
				header("content-type", "application/json"),
				header(delivery.IdempotencyKey, "order-A-42"),
			},
		}
	}
	msg, err := kafka.Marshaler{}.Unmarshal(foreign("orders", 2, 7))
	require.NoError(t, err)
	require.Empty(t, delivery.DecodeErrorOf(msg), "decoded, not dead-lettered")
	require.Equal(t, "dca63d81-fda7-55dd-8e26-632bf4381bd6", msg.UUID)
	parsed, err := uuid.Parse(msg.UUID)
	require.NoError(t, err)
	require.Equal(t, uuid.Version(5), parsed.Version())
	require.Equal(t, uuid.RFC4122, parsed.Variant())
	require.Equal(t, parsed.String(), msg.UUID, "canonical lower-case form")
	require.Equal(t, []byte(`{"orderId":"A-42","amount":1999}`), []byte(msg.Payload))
	require.Equal(t, message.Metadata{
		"content-type":          "application/json",
		delivery.IdempotencyKey: "order-A-42",
		delivery.PartitionKey:   "customer-7",
		delivery.Topic:          "orders",
		delivery.Partition:      "2",
		delivery.Offset:         "7",
	}, msg.Metadata)
	key, err := middleware.DefaultKey(msg)
	require.NoError(t, err)
	require.Equal(t, "order-A-42", key, "the inbox's key is the header's")

	again, err := kafka.Marshaler{}.Unmarshal(foreign("orders", 2, 7))
	require.NoError(t, err)
	require.Equal(t, msg.UUID, again.UUID, "a redelivery of the record has its UUID")

	seen := map[string]string{msg.UUID: "orders/2/7"}
	for _, other := range []struct {
		topic     string
		partition int32
		offset    int64
	}{{"orders", 2, 8}, {"orders", 3, 7}, {"orders", 0, 27}, {"orders2", 2, 7}, {"payments", 2, 7}} {
		m, err := kafka.Marshaler{}.Unmarshal(foreign(other.topic, other.partition, other.offset))
		require.NoError(t, err)
		name := other.topic + "/" + strconv.Itoa(int(other.partition)) + "/" + strconv.FormatInt(other.offset, 10)
		require.Equal(t, recordUUID(t, name), m.UUID)
		require.NotContains(t, seen, m.UUID, "%s has the UUID of %s", name, seen[m.UUID])
		seen[m.UUID] = name
	}
}

// TestUnmarshalForeignIdempotencyKey: on a record without a UUID header,
// the key is header idempotency_key, else header Idempotency-Key, else
// the inbox falls back to the record's UUID.
func TestUnmarshalForeignIdempotencyKey(t *testing.T) {
	for _, tc := range []struct {
		name    string
		headers []*sarama.RecordHeader
		wantKey string // "" for the record's UUID
	}{
		{"idempotency_key", []*sarama.RecordHeader{header("idempotency_key", "order-1")}, "order-1"},
		{"Idempotency-Key", []*sarama.RecordHeader{header("Idempotency-Key", "order-2")}, "order-2"},
		{"both: idempotency_key wins", []*sarama.RecordHeader{header("Idempotency-Key", "http"), header("idempotency_key", "exact")}, "exact"},
		{"other spellings are not read", []*sarama.RecordHeader{header("idempotency-key", "a"), header("IDEMPOTENCY_KEY", "b")}, ""},
		{"neither", []*sarama.RecordHeader{header("content-type", "application/json")}, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			msg, err := kafka.Marshaler{}.Unmarshal(&sarama.ConsumerMessage{Topic: "t", Partition: 1, Offset: 4, Value: []byte("{}"), Headers: tc.headers})
			require.NoError(t, err)
			require.Empty(t, delivery.DecodeErrorOf(msg))
			for _, h := range tc.headers {
				require.Equal(t, string(h.Value), msg.Metadata.Get(string(h.Key)), "every header is kept as metadata")
			}
			key, err := middleware.DefaultKey(msg)
			require.NoError(t, err)
			if tc.wantKey == "" {
				require.Equal(t, recordUUID(t, "t/1/4"), key, "the record's UUID")
				return
			}
			require.Equal(t, tc.wantKey, key)
		})
	}

	t.Run("empty Idempotency-Key", func(t *testing.T) {
		msg, err := kafka.Marshaler{}.Unmarshal(&sarama.ConsumerMessage{Topic: "t", Value: []byte("{}"), Headers: []*sarama.RecordHeader{header("Idempotency-Key", "")}})
		require.NoError(t, err)
		_, err = middleware.DefaultKey(msg)
		require.ErrorIs(t, err, middleware.ErrEmptyKey, "a key that is present but empty is an error, not the UUID")
	})

	t.Run("Watermill records are not rewritten", func(t *testing.T) {
		msg, err := kafka.Marshaler{}.Unmarshal(&sarama.ConsumerMessage{Topic: "t", Key: []byte("k"), Value: []byte("{}"), Headers: []*sarama.RecordHeader{
			header(kafka.UUIDHeader, "u"), header("Idempotency-Key", "http"),
		}})
		require.NoError(t, err)
		require.Equal(t, "u", msg.UUID)
		require.NotContains(t, msg.Metadata, delivery.IdempotencyKey)
		require.NotContains(t, msg.Metadata, delivery.PartitionKey)
	})
}

// TestUnmarshalForeignPartitionKey: the record key of a record without a
// UUID header becomes the partition key, so that the message published
// again is keyed as the record was.
func TestUnmarshalForeignPartitionKey(t *testing.T) {
	for _, tc := range []struct {
		name    string
		key     []byte
		headers []*sarama.RecordHeader
		want    string // "" for no partition_key metadata
	}{
		{"record key", []byte("customer-7"), nil, "customer-7"},
		{"partition_key header wins", []byte("customer-7"), []*sarama.RecordHeader{header(delivery.PartitionKey, "region-eu")}, "region-eu"},
		{"empty record key", []byte{}, nil, ""},
		{"null record key", nil, nil, ""},
		{"record key not UTF-8", []byte{0xff, 0x00, 0x01}, nil, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rec := &sarama.ConsumerMessage{Topic: "t", Partition: 0, Offset: 3, Key: tc.key, Value: []byte(`{"n":1}`), Headers: tc.headers}
			msg, err := kafka.Marshaler{}.Unmarshal(rec)
			require.NoError(t, err)
			require.Empty(t, delivery.DecodeErrorOf(msg))
			if tc.want == "" {
				require.NotContains(t, msg.Metadata, delivery.PartitionKey)
				return
			}
			require.Equal(t, tc.want, msg.Metadata.Get(delivery.PartitionKey))

			// Published again (to a dead-letter topic, say), it keeps its key.
			republished := message.NewMessage(msg.UUID, msg.Payload)
			for k, v := range msg.Metadata {
				if !delivery.IsDeliveryFact(k) {
					republished.Metadata.Set(k, v)
				}
			}
			out, err := kafka.Marshaler{}.Marshal("t.dlq", republished)
			require.NoError(t, err)
			key, err := out.Key.Encode()
			require.NoError(t, err)
			require.Equal(t, tc.want, string(key))
		})
	}
}

// TestUnmarshalForeignNullValue: a record without a UUID header and with
// a null value is decoded when it has headers; only a null value without
// headers is a tombstone.
func TestUnmarshalForeignNullValue(t *testing.T) {
	msg, err := kafka.Marshaler{}.Unmarshal(&sarama.ConsumerMessage{Topic: "t", Partition: 2, Offset: 7, Headers: []*sarama.RecordHeader{header(delivery.IdempotencyKey, "order-9")}})
	require.NoError(t, err)
	require.Empty(t, delivery.DecodeErrorOf(msg))
	require.Equal(t, recordUUID(t, "t/2/7"), msg.UUID)
	require.Nil(t, []byte(msg.Payload))
	require.Equal(t, "order-9", msg.Metadata.Get(delivery.IdempotencyKey))

	tomb, err := kafka.Marshaler{}.Unmarshal(&sarama.ConsumerMessage{Topic: "t", Partition: 2, Offset: 7, Key: []byte("customer-7")})
	require.NoError(t, err)
	require.Equal(t, "missing header _watermill_message_uuid (null value and no headers: a tombstone)", delivery.DecodeErrorOf(tomb))
	require.Equal(t, "t/2/7", tomb.UUID)
	require.NotContains(t, tomb.Metadata, delivery.PartitionKey, "an undecodable record gets no partition key")
}
