package kafka_test

import (
	"errors"
	"strconv"
	"testing"
	"unicode/utf8"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/oncemill/oncemill/adapters/kafka"
	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/internal/testing/msgtest"
)

// FuzzMarshaler holds the two promises of the Kafka marshaler on any
// input. A message Marshal accepts comes back from Unmarshal with its
// UUID, payload and metadata; one it refuses is refused with
// ErrInvalidMessage. And a record built from arbitrary header bytes is
// always decoded into a message, never a panic or an error: a message
// with a UUID and its facts, or one carrying delivery.DecodeErrorOf, so
// that it is dead-lettered rather than read forever.
func FuzzMarshaler(f *testing.F) {
	f.Add("uuid-1", []byte("payload"), "a", "1", "b", "2", []byte(nil), []byte(nil), false)
	f.Add("", []byte(nil), "", "", "", "", []byte(nil), []byte(nil), true)
	f.Add("uuid-2", []byte{0xff, 0x00}, kafka.UUIDHeader, "forged", "\xff", "x", []byte("k"), []byte("\xfe"), false)
	f.Add("u", []byte("{}"), delivery.Topic, "other", delivery.DecodeError, "forged", []byte(kafka.UUIDHeader), []byte(""), true)
	f.Add("u", []byte("v"), kafka.HTTPIdempotencyKeyHeader, "order-1", delivery.PartitionKey, "p", []byte(kafka.UUIDHeader), []byte("x"), false)
	f.Fuzz(func(t *testing.T, id string, payload []byte, k1, v1, k2, v2 string, hk, hv []byte, nullValue bool) {
		// Round trip.
		msg := message.NewMessage(id, payload)
		msg.Metadata.Set(k1, v1)
		msg.Metadata.Set(k2, v2)
		rec, err := kafka.Marshaler{}.Marshal("orders", msg)
		if err != nil {
			if !errors.Is(err, kafka.ErrInvalidMessage) {
				t.Fatalf("Marshal error %v does not wrap ErrInvalidMessage", err)
			}
		} else {
			back, err := kafka.Marshaler{}.Unmarshal(consumedRecord(t, rec, 3, 42))
			if err != nil {
				t.Fatalf("Unmarshal: %v", err)
			}
			if why := delivery.DecodeErrorOf(back); why != "" {
				t.Fatalf("a message Marshal accepted does not decode: %s", why)
			}
			if back.UUID != id {
				t.Fatalf("UUID %q came back as %q", id, back.UUID)
			}
			msgtest.RoundTrip(t, msg, back, nil)
			if back.Metadata.Get(delivery.Offset) != "42" || back.Metadata.Get(delivery.Partition) != "3" {
				t.Fatalf("delivery facts not set: %v", back.Metadata)
			}
		}

		// Raw record: headers from the fuzzer, in every combination.
		raw := &sarama.ConsumerMessage{Topic: "orders", Partition: 1, Offset: 7, Key: hk, Value: payload}
		if nullValue {
			raw.Value = nil
		}
		if len(hk) > 0 || len(hv) > 0 {
			raw.Headers = append(raw.Headers, &sarama.RecordHeader{Key: hk, Value: hv}, nil)
		}
		if k1 != "" {
			raw.Headers = append(raw.Headers, &sarama.RecordHeader{Key: []byte(k1), Value: []byte(v1)})
		}
		if k2 != "" {
			raw.Headers = append(raw.Headers, &sarama.RecordHeader{Key: []byte(k2), Value: []byte(v2)})
		}
		got, err := kafka.Marshaler{}.Unmarshal(raw)
		if err != nil || got == nil {
			t.Fatalf("Unmarshal of a raw record: %v, %v", got, err)
		}
		if got.UUID == "" {
			t.Fatal("a raw record decoded with an empty UUID")
		}
		if got.Metadata.Get(delivery.Offset) != strconv.Itoa(7) {
			t.Fatalf("raw record lost its offset: %v", got.Metadata)
		}
		if delivery.DecodeErrorOf(got) == "" {
			for k, v := range got.Metadata {
				if !utf8.ValidString(k) || !utf8.ValidString(v) {
					t.Fatalf("decoded record has metadata that is not UTF-8: %q=%q", k, v)
				}
			}
		}
	})
}

// consumedRecord turns what Marshal produced into what a consumer reads.
func consumedRecord(t *testing.T, rec *sarama.ProducerMessage, partition int32, offset int64) *sarama.ConsumerMessage {
	t.Helper()
	value, err := rec.Value.Encode()
	if err != nil {
		t.Fatal(err)
	}
	var key []byte
	if rec.Key != nil {
		if key, err = rec.Key.Encode(); err != nil {
			t.Fatal(err)
		}
	}
	cm := &sarama.ConsumerMessage{Topic: rec.Topic, Partition: partition, Offset: offset, Key: key, Value: value}
	for i := range rec.Headers {
		cm.Headers = append(cm.Headers, &rec.Headers[i])
	}
	return cm
}
