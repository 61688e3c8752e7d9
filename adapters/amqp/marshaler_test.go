package amqp_test

import (
	"math"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/adapters/amqp"
	"github.com/oncemill/oncemill/delivery"
)

func TestMarshalRoundTrip(t *testing.T) {
	var m amqp.Marshaler
	msg := message.NewMessage("uuid-1", []byte("payload"))
	msg.Metadata.Set(delivery.IdempotencyKey, "key-1")
	msg.Metadata.Set("custom", "value")
	// Facts of an earlier delivery, on this broker or another, and broker
	// headers stringified by an earlier Unmarshal, are not published
	// again; the replay marker and the dead-letter fields are.
	msg.Metadata.Set(delivery.Topic, "old-topic")
	msg.Metadata.Set(delivery.Attempts, "5")
	msg.Metadata.Set(delivery.Redelivered, "true")
	msg.Metadata.Set(delivery.DecodeError, "a fact of an earlier delivery")
	msg.Metadata.Set(delivery.Partition, "3")
	msg.Metadata.Set(delivery.Offset, "1234")
	msg.Metadata.Set(delivery.Stream, "orders")
	msg.Metadata.Set(delivery.StreamSequence, "77")
	msg.Metadata.Set(amqp.HeaderDeath, `[{"count":1}]`)
	msg.Metadata.Set(amqp.HeaderDeliveryCount, "4")
	msg.Metadata.Set(delivery.Replay, "grant-1")
	msg.Metadata.Set(delivery.DeadConsumer, "billing")

	p, err := m.Marshal(msg)
	require.NoError(t, err)
	require.Equal(t, amqp091.Persistent, p.DeliveryMode)
	require.Equal(t, "uuid-1", p.MessageId)
	require.Equal(t, amqp091.Table{
		amqp.UUIDHeader:         "uuid-1",
		delivery.IdempotencyKey: "key-1",
		"custom":                "value",
		delivery.Replay:         "grant-1",
		delivery.DeadConsumer:   "billing",
	}, p.Headers)

	got, err := m.Unmarshal(amqp091.Delivery{
		Headers: p.Headers, MessageId: p.MessageId, Body: p.Body,
		Exchange: "orders", RoutingKey: "",
	})
	require.NoError(t, err)
	require.Equal(t, "uuid-1", got.UUID)
	require.Equal(t, "payload", string(got.Payload))
	require.Equal(t, message.Metadata{
		delivery.IdempotencyKey: "key-1",
		"custom":                "value",
		delivery.Replay:         "grant-1",
		delivery.DeadConsumer:   "billing",
		delivery.Topic:          "orders",
		delivery.Redelivered:    "false",
		delivery.Attempts:       "1",
	}, got.Metadata)
}

func TestUnmarshalHeaderValues(t *testing.T) {
	ts := time.Date(2024, 1, 2, 3, 4, 5, 0, time.FixedZone("x", 3600))
	for name, tc := range map[string]struct {
		v    any
		want string
	}{
		"string":        {"s", "s"},
		"int8":          {int8(-8), "-8"},
		"uint8":         {uint8(200), "200"},
		"int16":         {int16(-16), "-16"},
		"uint16":        {uint16(16), "16"},
		"int32":         {int32(-32), "-32"},
		"uint32":        {uint32(32), "32"},
		"int64":         {int64(math.MinInt64), "-9223372036854775808"},
		"float32":       {float32(0.25), "0.25"},
		"float64":       {2.5e-7, "2.5e-07"},
		"decimal":       {amqp091.Decimal{Scale: 3, Value: -12345}, "-12.345"},
		"decimal0":      {amqp091.Decimal{Scale: 0, Value: 7}, "7"},
		"bool":          {false, "false"},
		"time":          {ts, "2024-01-02T02:04:05Z"},
		"void":          {nil, ""},
		"utf8 bytes":    {[]byte("héllo"), "héllo"},
		"binary bytes":  {[]byte{0xff, 0x00, 0xfe}, "/wD+"},
		"table":         {amqp091.Table{"b": int32(1), "a": []any{"<&>", nil}}, `{"a":["<&>",null],"b":1}`},
		"array":         {[]any{amqp091.Decimal{Scale: 1, Value: 5}, ts, []byte{0xff}, math.NaN()}, `[0.5,"2024-01-02T02:04:05Z","/w==","NaN"]`},
		"empty array":   {[]any{}, `[]`},
		"nested tables": {amqp091.Table{"t": amqp091.Table{"u": amqp091.Table{}}}, `{"t":{"u":{}}}`},
	} {
		t.Run(name, func(t *testing.T) {
			msg, err := amqp.Marshaler{}.Unmarshal(amqp091.Delivery{Headers: amqp091.Table{"h": tc.v}})
			require.NoError(t, err)
			require.Equal(t, tc.want, msg.Metadata.Get("h"))
			require.Empty(t, msg.Metadata.Get(delivery.DecodeError))
		})
	}
}

func TestUnmarshalDeliveryFacts(t *testing.T) {
	for name, tc := range map[string]struct {
		d           amqp091.Delivery
		topic       string
		redelivered string
		attempts    string // "" = absent
	}{
		"first delivery, classic queue": {
			d:     amqp091.Delivery{Exchange: "orders", RoutingKey: "rk"},
			topic: "orders", redelivered: "false", attempts: "1",
		},
		"default exchange: routing key is the queue": {
			d:     amqp091.Delivery{RoutingKey: "orders.billing"},
			topic: "orders.billing", redelivered: "false", attempts: "1",
		},
		"quorum first delivery": {
			d:     amqp091.Delivery{Exchange: "t", Headers: amqp091.Table{amqp.HeaderDeliveryCount: int64(0)}},
			topic: "t", redelivered: "false", attempts: "1",
		},
		"quorum redelivery": {
			d:     amqp091.Delivery{Exchange: "t", Redelivered: true, Headers: amqp091.Table{amqp.HeaderDeliveryCount: int64(1)}},
			topic: "t", redelivered: "true", attempts: "2",
		},
		"RabbitMQ 4.3: acquired count exceeds delivery count": {
			d: amqp091.Delivery{Exchange: "t", Redelivered: true, Headers: amqp091.Table{
				amqp.HeaderDeliveryCount: int64(0), amqp.HeaderAcquiredCount: int64(4),
			}},
			topic: "t", redelivered: "true", attempts: "5",
		},
		"classic queue redelivery has no count": {
			d:     amqp091.Delivery{Exchange: "t", Redelivered: true},
			topic: "t", redelivered: "true", attempts: "",
		},
		"a count that is not an integer is ignored": {
			d:     amqp091.Delivery{Exchange: "t", Headers: amqp091.Table{amqp.HeaderDeliveryCount: "9"}},
			topic: "t", redelivered: "false", attempts: "1",
		},
		"publisher-set facts are overwritten": {
			d: amqp091.Delivery{Exchange: "t", Headers: amqp091.Table{
				delivery.Topic: "forged", delivery.Attempts: "99", delivery.Redelivered: "true",
			}},
			topic: "t", redelivered: "false", attempts: "1",
		},
	} {
		t.Run(name, func(t *testing.T) {
			msg, err := amqp.Marshaler{}.Unmarshal(tc.d)
			require.NoError(t, err)
			require.Equal(t, tc.topic, msg.Metadata.Get(delivery.Topic))
			require.Equal(t, tc.redelivered, msg.Metadata.Get(delivery.Redelivered))
			got, ok := msg.Metadata[delivery.Attempts]
			if tc.attempts == "" {
				require.False(t, ok, "attempts %q", got)
			} else {
				require.Equal(t, tc.attempts, got)
			}
		})
	}
}

func TestUnmarshalUUID(t *testing.T) {
	um := func(d amqp091.Delivery) *message.Message {
		msg, err := amqp.Marshaler{}.Unmarshal(d)
		require.NoError(t, err)
		return msg
	}
	require.Equal(t, "from-header", um(amqp091.Delivery{MessageId: "mid", Headers: amqp091.Table{amqp.UUIDHeader: "from-header"}}).UUID)
	require.Equal(t, "mid", um(amqp091.Delivery{MessageId: "mid", Headers: amqp091.Table{amqp.UUIDHeader: ""}}).UUID)
	require.Equal(t, "42", um(amqp091.Delivery{Headers: amqp091.Table{amqp.UUIDHeader: int64(42)}}).UUID)

	// Without either: a version 5 UUID of the content that ignores what
	// redelivery and dead-lettering change.
	base := amqp091.Delivery{Body: []byte("b"), Headers: amqp091.Table{"k": "v"}, ContentType: "text/plain"}
	u := um(base).UUID
	require.Regexp(t, `^[0-9a-f]{8}-[0-9a-f]{4}-5[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$`, u)
	moved := base
	moved.Exchange, moved.RoutingKey, moved.Redelivered = "dlx", "dead", true
	moved.Headers = amqp091.Table{"k": "v", amqp.HeaderDeliveryCount: int64(3), amqp.HeaderDeath: []any{amqp091.Table{"count": int64(1)}}}
	require.Equal(t, u, um(moved).UUID)
	for name, d := range map[string]amqp091.Delivery{
		"body":         {Body: []byte("c"), Headers: amqp091.Table{"k": "v"}, ContentType: "text/plain"},
		"header":       {Body: []byte("b"), Headers: amqp091.Table{"k": "w"}, ContentType: "text/plain"},
		"content type": {Body: []byte("b"), Headers: amqp091.Table{"k": "v"}},
		"timestamp":    {Body: []byte("b"), Headers: amqp091.Table{"k": "v"}, ContentType: "text/plain", Timestamp: time.Unix(1, 0)},
	} {
		require.NotEqual(t, u, um(d).UUID, name)
	}
}

type notAnAMQPType struct{ X int }

func TestUnmarshalUndecodableHeader(t *testing.T) {
	msg, err := amqp.Marshaler{}.Unmarshal(amqp091.Delivery{
		Exchange: "t",
		Body:     []byte("raw"),
		Headers: amqp091.Table{
			"bad":    notAnAMQPType{1},
			"nested": []any{notAnAMQPType{2}},
			"good":   "ok",
		},
	})
	require.NoError(t, err, "Unmarshal never fails")
	require.Equal(t, "raw", string(msg.Payload))
	require.Equal(t, "ok", msg.Metadata.Get("good"))
	require.Equal(t, "{1}", msg.Metadata.Get("bad"))
	require.Equal(t, "t", msg.Metadata.Get(delivery.Topic))
	require.Equal(t, "1", msg.Metadata.Get(delivery.Attempts))
	require.Equal(t,
		`amqp: cannot decode header "bad": unsupported AMQP field type amqp_test.notAnAMQPType; `+
			`header "nested": [0]: unsupported AMQP field type amqp_test.notAnAMQPType`,
		delivery.DecodeErrorOf(msg))
	require.NotEmpty(t, msg.UUID)
}
