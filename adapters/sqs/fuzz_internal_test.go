package sqs

import (
	"errors"
	"testing"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/sqs/types"

	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/internal/testing/msgtest"
)

// FuzzMarshal holds the two promises of the SQS marshalling on any
// input. A message marshal accepts comes back from unmarshal with its
// UUID, payload and metadata, whether the metadata travels as attributes
// or as one JSON attribute and the body as text or base64; one it refuses
// is refused with ErrInvalidMessage. And a received message with any
// body and attributes is always decoded into a message, never a panic:
// one with a UUID and its topic, or one carrying delivery.DecodeErrorOf,
// so that it is dead-lettered.
func FuzzMarshal(f *testing.F) {
	f.Add("uuid-1", []byte("payload"), "a", "1", "b", "2", "", "")
	f.Add("", []byte(nil), "", "", "", "", BodyEncodingAttribute, BodyEncodingBase64)
	f.Add("u", []byte{0xff, 0x00}, "k k", "\x00", MetadataAttribute, "{", MetadataAttribute, `{"a":1}`)
	f.Add("u", []byte("x"), delivery.Topic, "t", "emoji 🚀", "🚀", BodyEncodingAttribute, "rot13")
	f.Add("u", []byte("!!"), UUIDAttribute, "", BodyEncodingAttribute, BodyEncodingEmpty, UUIDAttribute, "forged")
	f.Fuzz(func(t *testing.T, id string, payload []byte, k1, v1, k2, v2, rawName, rawValue string) {
		msg := message.NewMessage(id, payload)
		msg.Metadata.Set(k1, v1)
		msg.Metadata.Set(k2, v2)
		body, attrs, err := marshal(msg)
		if err != nil {
			if !errors.Is(err, ErrInvalidMessage) {
				t.Fatalf("marshal error %v does not wrap ErrInvalidMessage", err)
			}
		} else {
			back := unmarshal(received(attrs, body), "orders")
			if why := delivery.DecodeErrorOf(back); why != "" {
				t.Fatalf("a message marshal accepted does not decode: %s", why)
			}
			// JSON carries a byte that is not UTF-8 as U+FFFD.
			msgtest.RoundTrip(t, msg, back, func(k, v string) bool { return !utf8.ValidString(k) || !utf8.ValidString(v) })
			if back.Metadata.Get(delivery.Topic) != "orders" {
				t.Fatalf("topic fact not set: %v", back.Metadata)
			}
		}

		// Raw received message: any body and attributes, the
		// publisher's own among them.
		raw := map[string]types.MessageAttributeValue{}
		if k1 != "" {
			raw[k1] = stringAttribute(v1)
		}
		if k2 != "" {
			raw[k2] = types.MessageAttributeValue{DataType: aws.String("Binary"), BinaryValue: []byte(v2)}
		}
		if rawName != "" {
			raw[rawName] = stringAttribute(rawValue)
		}
		got := unmarshal(received(raw, string(payload)), "orders")
		if got == nil || got.UUID == "" {
			t.Fatalf("a raw message decoded with no UUID: %v", got)
		}
		if got.Metadata.Get(delivery.Topic) != "orders" {
			t.Fatalf("raw message lost its topic: %v", got.Metadata)
		}
		if delivery.DecodeErrorOf(got) != "" && string(got.Payload) != string(payload) {
			t.Fatalf("an undecodable message does not keep its raw body: %q, want %q", got.Payload, payload)
		}
	})
}
