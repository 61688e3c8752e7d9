package nats

import (
	"encoding/json"
	"maps"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/delivery"
)

// TestMarshalHeaders: metadata travels as one header per key when every
// key and value does unchanged, else as one JSON header; delivery facts
// never travel, a replay's grant does.
func TestMarshalHeaders(t *testing.T) {
	msg := message.NewMessage("uuid-1", []byte("payload"))
	msg.Metadata.Set(delivery.IdempotencyKey, "order-42")
	msg.Metadata.Set("trace", "a b\tc")
	msg.Metadata.Set(delivery.Replay, "grant-1")
	msg.Metadata.Set(delivery.Attempts, "3")
	msg.Metadata.Set(delivery.StreamSequence, "9")
	m, err := marshal(msg, "orders", "order-42")
	require.NoError(t, err)
	require.Equal(t, "orders", m.Subject)
	require.Equal(t, []byte("payload"), m.Data)
	require.Equal(t, "uuid-1", m.Header.Get(UUIDHeader))
	require.Equal(t, "order-42", m.Header.Get(MsgIDHeader))
	require.Equal(t, "order-42", m.Header.Get(delivery.IdempotencyKey))
	require.Equal(t, "a b\tc", m.Header.Get("trace"))
	require.Equal(t, "grant-1", m.Header.Get(delivery.Replay))
	require.Empty(t, m.Header.Values(delivery.Attempts))
	require.Empty(t, m.Header.Values(delivery.StreamSequence))
	require.Empty(t, m.Header.Values(MetadataHeader))

	for name, md := range map[string]map[string]string{
		"key with a colon":         {"a:b": "x"},
		"value with a newline":     {"note": "line 1\nline 2"},
		"value with a blank start": {"note": " padded"},
		"value not UTF-8":          {"bin": "\xff\xfe"},
		"a protocol header":        {"Nats-Expected-Stream": "other"},
		"the UUID header":          {UUIDHeader: "forged"},
	} {
		t.Run(name, func(t *testing.T) {
			msg := message.NewMessage("uuid-2", nil)
			for k, v := range md {
				msg.Metadata.Set(k, v)
			}
			msg.Metadata.Set(delivery.IdempotencyKey, "k")
			m, err := marshal(msg, "orders", "k")
			require.NoError(t, err)
			var got map[string]string
			require.NoError(t, json.Unmarshal([]byte(m.Header.Get(MetadataHeader)), &got))
			want := maps.Clone(md)
			want[delivery.IdempotencyKey] = "k"
			if v, ok := md["bin"]; ok {
				want["bin"] = string([]rune(v)) // JSON carries U+FFFD
			}
			require.Equal(t, want, got)
			require.Len(t, m.Header, 3, "only the metadata, UUID and Msg-Id headers")
			require.Equal(t, "uuid-2", m.Header.Get(UUIDHeader))
		})
	}
}

// TestMsgID: the idempotency key, else the UUID; a replay and a dead
// letter have IDs of their own, each replay and each dead-lettering a
// different one; the topic leads in a shared stream; an ID that would not
// travel unchanged is hashed.
func TestMsgID(t *testing.T) {
	msg := func(md map[string]string) *message.Message {
		m := message.NewMessage("uuid-1", nil)
		for k, v := range md {
			m.Metadata.Set(k, v)
		}
		return m
	}
	require.Equal(t, "uuid-1", msgID(msg(nil), "orders", false))
	require.Equal(t, "order-42", msgID(msg(map[string]string{delivery.IdempotencyKey: "order-42"}), "orders", false))
	require.Equal(t, "orders order-42", msgID(msg(map[string]string{delivery.IdempotencyKey: "order-42"}), "orders", true))

	replay1 := msgID(msg(map[string]string{delivery.IdempotencyKey: "order-42", delivery.Replay: "grant-1"}), "orders", false)
	replay2 := msgID(msg(map[string]string{delivery.IdempotencyKey: "order-42", delivery.Replay: "grant-2"}), "orders", false)
	require.Regexp(t, `^order-42:[0-9a-f]{64}$`, replay1)
	require.NotEqual(t, replay1, replay2)
	dead1 := msgID(msg(map[string]string{delivery.IdempotencyKey: "order-42", delivery.DeadConsumer: "billing", delivery.DeadLastFailedAt: "t1"}), "orders", false)
	dead2 := msgID(msg(map[string]string{delivery.IdempotencyKey: "order-42", delivery.DeadConsumer: "billing", delivery.DeadLastFailedAt: "t2"}), "orders", false)
	require.NotEqual(t, dead1, dead2)
	require.NotEqual(t, replay1, dead1)
	require.Equal(t, dead1, msgID(msg(map[string]string{delivery.IdempotencyKey: "order-42", delivery.DeadConsumer: "billing", delivery.DeadLastFailedAt: "t1"}), "orders", false),
		"a retry of the same dead-letter publish has the same ID")

	hashed := msgID(msg(map[string]string{delivery.IdempotencyKey: " order\n42"}), "orders", false)
	require.Regexp(t, `^[0-9a-f]{64}$`, hashed)
}

func TestSubjectMatches(t *testing.T) {
	for _, tc := range []struct {
		pattern, subject string
		want             bool
	}{
		{"orders", "orders", true},
		{"orders", "orders.eu", false},
		{"orders.*", "orders.eu", true},
		{"orders.*", "orders.eu.created", false},
		{"orders.>", "orders.eu.created", true},
		{"orders.>", "orders", false},
		{">", "anything.at.all", true},
		{"*.created", "orders.created", true},
		{"*.created", "orders.paid", false},
	} {
		require.Equal(t, tc.want, subjectMatches(tc.pattern, tc.subject), "%s ~ %s", tc.pattern, tc.subject)
	}
}

func TestInvalidTopic(t *testing.T) {
	require.Empty(t, invalidTopic("orders.eu.created"))
	for _, topic := range []string{"", "orders eu", "orders.", ".orders", "orders..eu", "orders.*", "orders.>", "a\tb"} {
		require.NotEmpty(t, invalidTopic(topic), "%q", topic)
	}
}
