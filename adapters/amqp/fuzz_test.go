package amqp_test

import (
	"math"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/oncemill/oncemill/adapters/amqp"
	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/internal/testing/msgtest"
)

// FuzzMarshaler holds the two promises of the AMQP marshaler on any
// input. A message comes back from Marshal and Unmarshal with its UUID,
// payload and metadata (but the delivery facts and the broker's own
// headers, which are never published). And a delivery whose headers hold
// any mix of AMQP field types, nested or not, is always decoded into a
// message, never a panic or an error: one with a UUID and its facts, or
// one carrying delivery.DecodeErrorOf, so that it is dead-lettered.
func FuzzMarshaler(f *testing.F) {
	f.Add("uuid-1", []byte("payload"), "a", "1", "b", "2", []byte{0, 1, 2, 3}, int64(5), "")
	f.Add("", []byte(nil), "", "", "", "", []byte(nil), int64(0), "")
	f.Add("u", []byte{0xff}, amqp.UUIDHeader, "forged", amqp.HeaderDeliveryCount, "3", []byte{9, 9, 9}, int64(-1), "mid")
	f.Add("u", []byte("x"), delivery.Topic, "t", "x-death", "[]", []byte{6, 7, 8, 10, 11}, int64(math.MaxInt64), "m")
	f.Fuzz(func(t *testing.T, id string, payload []byte, k1, v1, k2, v2 string, shape []byte, n int64, messageID string) {
		var m amqp.Marshaler
		msg := message.NewMessage(id, payload)
		msg.Metadata.Set(k1, v1)
		msg.Metadata.Set(k2, v2)
		p, err := m.Marshal(msg)
		if err != nil {
			t.Fatalf("Marshal: %v", err)
		}
		back, err := m.Unmarshal(amqp091.Delivery{
			Headers: p.Headers, MessageId: p.MessageId, Body: p.Body, Exchange: "orders",
		})
		if err != nil || back == nil {
			t.Fatalf("Unmarshal: %v, %v", back, err)
		}
		if why := delivery.DecodeErrorOf(back); why != "" {
			t.Fatalf("a marshalled message does not decode: %s", why)
		}
		msgtest.RoundTrip(t, msg, back, func(k, _ string) bool { return k == amqp.UUIDHeader || isBroker(k) })
		if back.Metadata.Get(delivery.Topic) != "orders" {
			t.Fatalf("topic fact not set: %v", back.Metadata)
		}

		// Raw delivery: headers of every AMQP field type, as shape says.
		headers := amqp091.Table{}
		if k1 != "" {
			headers[k1] = fieldValue(shape, n, v1, 0)
		}
		if k2 != "" {
			headers[k2] = fieldValue(shape, n, v2, 1)
		}
		for i := range min(len(shape), 8) {
			headers[string(rune('a'+i))] = fieldValue(shape[i:], n, v1, 0)
		}
		d := amqp091.Delivery{Headers: headers, MessageId: messageID, Body: payload, RoutingKey: "orders", Redelivered: n%2 == 0}
		got, err := m.Unmarshal(d)
		if err != nil || got == nil {
			t.Fatalf("Unmarshal of a raw delivery: %v, %v", got, err)
		}
		if got.UUID == "" {
			t.Fatal("a raw delivery decoded with an empty UUID")
		}
		if got.Metadata.Get(delivery.Topic) != "orders" {
			t.Fatalf("raw delivery lost its topic: %v", got.Metadata)
		}
		again, _ := m.Unmarshal(d)
		if again.UUID != got.UUID {
			t.Fatalf("one delivery decoded twice has UUIDs %q and %q", got.UUID, again.UUID)
		}
	})
}

func isBroker(k string) bool {
	switch k {
	case amqp.HeaderDeliveryCount, amqp.HeaderAcquiredCount, amqp.HeaderDeath,
		"x-first-death-exchange", "x-first-death-queue", "x-first-death-reason",
		"x-last-death-exchange", "x-last-death-queue", "x-last-death-reason":
		return true
	}
	return false
}

// fieldValue returns an AMQP header value whose type shape[i] picks, with
// nested tables and arrays to a small depth; one type in the list (a
// complex number) is none AMQP has.
func fieldValue(shape []byte, n int64, s string, depth int) any {
	if len(shape) == 0 {
		return s
	}
	switch shape[0] % 17 {
	case 0:
		return s
	case 1:
		return []byte(s)
	case 2:
		return n%2 == 0
	case 3:
		return int8(n)
	case 4:
		return int16(n)
	case 5:
		return int32(n)
	case 6:
		return n
	case 7:
		return float32(n) / 3
	case 8:
		return math.Float64frombits(uint64(n))
	case 9:
		return amqp091.Decimal{Scale: uint8(n), Value: int32(n >> 8)}
	case 10:
		return time.Unix(n%(1<<40), 0)
	case 11:
		return nil
	case 12:
		if depth > 3 {
			return s
		}
		return amqp091.Table{s: fieldValue(shape[1:], n, s, depth+1), "n": fieldValue(shape[min(2, len(shape)):], n, s, depth+1)}
	case 13:
		if depth > 3 {
			return s
		}
		return []any{fieldValue(shape[1:], n, s, depth+1), fieldValue(shape[min(2, len(shape)):], n, s, depth+1)}
	case 14:
		return uint8(n)
	case 15:
		return uint64(n)
	default:
		return complex(float64(n), 1)
	}
}
