package nats

import (
	"testing"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill/message"
	natsgo "github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/internal/testing/msgtest"
)

// received is a JetStream message as the subscriber reads it: only the
// methods unmarshal calls are given.
type received struct {
	jetstream.Msg
	header natsgo.Header
	data   []byte
	reply  string
}

func (r received) Headers() natsgo.Header { return r.header }
func (r received) Data() []byte           { return r.data }
func (r received) Reply() string          { return r.reply }

// FuzzMarshal holds the two promises of the NATS marshalling on any
// input. A message comes back from marshal and unmarshal with its UUID,
// payload and metadata, whether the metadata travels as headers or as one
// JSON header. And a received message with any headers is always decoded
// into a message, never a panic: one with a UUID and its facts, or one
// carrying delivery.DecodeErrorOf, so that it is dead-lettered.
func FuzzMarshal(f *testing.F) {
	f.Add("uuid-1", []byte("payload"), "a", "1", "b", "2", "", "", true)
	f.Add("", []byte(nil), "", "", "", "", MetadataHeader, "{", true)
	f.Add("u", []byte{0xff}, "a:b", "line 1\nline 2", UUIDHeader, "forged", MetadataHeader, `{"a":1}`, false)
	f.Add("u", []byte("x"), "Nats-Expected-Stream", "other", delivery.Topic, "t", MsgIDHeader, "id-1", true)
	f.Fuzz(func(t *testing.T, id string, payload []byte, k1, v1, k2, v2, rawName, rawValue string, withMeta bool) {
		meta := &jetstream.MsgMetadata{Stream: "ORDERS", NumDelivered: 1}
		meta.Sequence.Stream = 9
		msg := message.NewMessage(id, payload)
		msg.Metadata.Set(k1, v1)
		msg.Metadata.Set(k2, v2)
		m, err := marshal(msg, "orders", msgID(msg, "orders", false))
		if err != nil {
			t.Fatalf("marshal: %v", err)
		}
		back := unmarshal(received{header: m.Header, data: m.Data}, "orders", meta)
		if why := delivery.DecodeErrorOf(back); why != "" {
			t.Fatalf("a marshalled message does not decode: %s", why)
		}
		// JSON carries a byte that is not UTF-8 as U+FFFD.
		msgtest.RoundTrip(t, msg, back, func(k, v string) bool { return !utf8.ValidString(k) || !utf8.ValidString(v) })
		if back.Metadata.Get(delivery.StreamSequence) != "9" {
			t.Fatalf("delivery facts not set: %v", back.Metadata)
		}

		// Raw received message: any headers, repeated ones too.
		h := natsgo.Header{}
		if k1 != "" {
			h[k1] = []string{v1}
		}
		if k2 != "" {
			h[k2] = []string{v2, v1}
		}
		if rawName != "" {
			h[rawName] = append(h[rawName], rawValue)
		}
		var rawMeta *jetstream.MsgMetadata
		if withMeta {
			rawMeta = meta
		}
		got := unmarshal(received{header: h, data: payload, reply: rawValue}, "orders", rawMeta)
		if got == nil {
			t.Fatal("unmarshal returned no message")
		}
		if got.Metadata.Get(delivery.Topic) != "orders" {
			t.Fatalf("raw message lost its topic: %v", got.Metadata)
		}
		if delivery.DecodeErrorOf(got) == "" && got.UUID == "" {
			t.Fatal("a raw message decoded with an empty UUID")
		}
		if !withMeta && delivery.DecodeErrorOf(got) == "" {
			t.Fatal("a message without JetStream metadata decoded")
		}
		if string(got.Payload) != string(payload) {
			t.Fatalf("raw message payload %q, want %q", got.Payload, payload)
		}
	})
}
