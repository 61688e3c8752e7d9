package sqs

import (
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/sqs/types"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/delivery"
)

func TestValidText(t *testing.T) {
	t.Parallel()
	for s, want := range map[string]bool{
		"plain":              true,
		"tab\tnl\ncr\r":      true,
		"ünïcödé ✓":          true,
		"emoji 🚀":            false, // AWS accepts it, fauxqs 1.9.2 does not
		"\uE000\uFFFD":       true,
		"nul\x00":            false,
		"bell\x07":           false,
		"\uFFFE":             false,
		"\uFFFF":             false,
		"bad utf-8 \xff":     false,
		string([]byte{0xc3}): false,
	} {
		assert.Equal(t, want, validText(s), "%q", s)
	}
}

func TestValidAttributeName(t *testing.T) {
	t.Parallel()
	for name, want := range map[string]bool{
		"trace_id":               true,
		"a.b-c_D9":               true,
		"":                       false,
		".a":                     false,
		"a.":                     false,
		"a..b":                   false,
		"has space":              false,
		"a:b":                    false,
		"AWS.x":                  false,
		"aws.x":                  false,
		"Amazon.x":               false,
		"AWSx":                   true,
		strings.Repeat("a", 256): true,
		strings.Repeat("a", 257): false,
	} {
		assert.Equal(t, want, validAttributeName(name), "%q", name)
	}
}

func TestMarshalChoosesJSONMetadata(t *testing.T) {
	t.Parallel()
	md := func(kv ...string) message.Metadata {
		m := message.Metadata{}
		for i := 0; i < len(kv); i += 2 {
			m[kv[i]] = kv[i+1]
		}
		return m
	}
	for _, tc := range []struct {
		name    string
		payload []byte
		md      message.Metadata
		json    bool
	}{
		{"nine keys fit next to the UUID", []byte("x"), md("1", "a", "2", "a", "3", "a", "4", "a", "5", "a", "6", "a", "7", "a", "8", "a", "9", "a"), false},
		{"ten keys do not", []byte("x"), md("1", "a", "2", "a", "3", "a", "4", "a", "5", "a", "6", "a", "7", "a", "8", "a", "9", "a", "10", "a"), true},
		{"eight keys fit next to UUID and body encoding", nil, md("1", "a", "2", "a", "3", "a", "4", "a", "5", "a", "6", "a", "7", "a", "8", "a"), false},
		{"nine keys do not", nil, md("1", "a", "2", "a", "3", "a", "4", "a", "5", "a", "6", "a", "7", "a", "8", "a", "9", "a"), true},
		{"delivery facts are not counted", []byte("x"), md("1", "a", "2", "a", "3", "a", "4", "a", "5", "a", "6", "a", "7", "a", "8", "a", "9", "a", delivery.Topic, "t", delivery.Attempts, "3"), false},
		{"empty value", []byte("x"), md("k", ""), true},
		{"invalid name", []byte("x"), md("k k", "v"), true},
		{"reserved name", []byte("x"), md(MetadataAttribute, "v"), true},
		{"invalid value", []byte("x"), md("k", "\x00"), true},
		{"no metadata", []byte("x"), nil, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			msg := message.NewMessage("uuid-1", tc.payload)
			for k, v := range tc.md {
				msg.Metadata.Set(k, v)
			}
			_, attrs, err := marshal(msg)
			require.NoError(t, err)
			assert.LessOrEqual(t, len(attrs), MaxMessageAttributes)
			_, isJSON := attrs[MetadataAttribute]
			assert.Equal(t, tc.json, isJSON)
			assert.NotContains(t, attrs, delivery.Topic)
			assert.NotContains(t, attrs, delivery.Attempts)

			// Whatever the form, unmarshal restores the metadata.
			back := unmarshal(received(attrs, "body"), "topic")
			want := message.Metadata{delivery.Topic: "topic", delivery.Attempts: "1"}
			for k, v := range tc.md {
				if !delivery.IsAdapterFact(k) {
					want[k] = v
				}
			}
			assert.Equal(t, want, back.Metadata)
		})
	}
}

// received returns a message as SQS would deliver it on a first attempt.
func received(attrs map[string]types.MessageAttributeValue, body string) types.Message {
	return types.Message{
		MessageId:         aws.String("sqs-id"),
		ReceiptHandle:     aws.String("receipt"),
		Body:              aws.String(body),
		MessageAttributes: attrs,
		Attributes:        map[string]string{"ApproximateReceiveCount": "1"},
	}
}

func TestMetadataJSONEscapesNoncharacters(t *testing.T) {
	t.Parallel()
	md := map[string]string{"k\uffff": "a\ufffeb\x00c", "plain": "ü", "emoji 🚀": "🚀 and 𝄞"}
	js, err := metadataJSON(md)
	require.NoError(t, err)
	assert.True(t, validText(js), "%q", js)
	back := unmarshal(received(map[string]types.MessageAttributeValue{MetadataAttribute: stringAttribute(js)}, "x"), "t")
	assert.Empty(t, back.Metadata.Get(delivery.DecodeError))
	assert.Equal(t, "a\ufffeb\x00c", back.Metadata.Get("k\uffff"))
	assert.Equal(t, "ü", back.Metadata.Get("plain"))
	assert.Equal(t, "🚀 and 𝄞", back.Metadata.Get("emoji 🚀"))
	assert.Contains(t, js, `\ud83d\ude80`, "a surrogate pair")
}

func TestMarshalPayloads(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name     string
		payload  []byte
		body     string
		encoding string
	}{
		{"text", []byte("héllo"), "héllo", ""},
		{"empty", nil, emptyBody, BodyEncodingEmpty},
		{"empty, not nil", []byte{}, emptyBody, BodyEncodingEmpty},
		{"binary", []byte{0, 1, 0xff}, "AAH/", BodyEncodingBase64},
		{"control characters", []byte("a\x1bb"), "YRti", BodyEncodingBase64},
		{"outside the BMP", []byte("🚀"), "8J+agA==", BodyEncodingBase64},
	} {
		t.Run(tc.name, func(t *testing.T) {
			body, attrs, err := marshal(message.NewMessage("u", tc.payload))
			require.NoError(t, err)
			assert.Equal(t, tc.body, body)
			assert.Equal(t, tc.encoding, aws.ToString(attrs[BodyEncodingAttribute].StringValue))
			back := unmarshal(received(attrs, body), "t")
			assert.Empty(t, back.Metadata.Get(delivery.DecodeError))
			assert.Equal(t, "u", back.UUID)
			assert.Equal(t, len(tc.payload), len(back.Payload))
			assert.Equal(t, string(tc.payload), string(back.Payload))
		})
	}
}

func TestMarshalRejectsInvalidUUID(t *testing.T) {
	t.Parallel()
	_, _, err := marshal(message.NewMessage("bad\x00uuid", nil))
	require.ErrorIs(t, err, ErrInvalidMessage)
}

func TestUnmarshalNeverFails(t *testing.T) {
	t.Parallel()
	// An empty body cannot reach a queue (SQS rejects it), but decoding
	// one must not fail either.
	msg := unmarshal(types.Message{MessageId: aws.String("id-1"), Body: aws.String("")}, "t")
	assert.Equal(t, "id-1", msg.UUID)
	assert.Empty(t, msg.Payload)
	assert.Empty(t, msg.Metadata.Get(delivery.DecodeError))
	assert.Empty(t, msg.Metadata.Get(delivery.Attempts), "no ApproximateReceiveCount, no attempts")
	assert.Equal(t, "t", msg.Metadata.Get(delivery.Topic))

	msg = unmarshal(received(map[string]types.MessageAttributeValue{
		BodyEncodingAttribute: stringAttribute("rot13"),
		delivery.DecodeError:  stringAttribute("stale, from an earlier hop"),
		UUIDAttribute:         stringAttribute("u-2"),
	}, "raw"), "t")
	assert.Equal(t, "u-2", msg.UUID)
	assert.Contains(t, msg.Metadata.Get(delivery.DecodeError), `unknown value "rot13"`)
	assert.Equal(t, "raw", string(msg.Payload))

	msg = unmarshal(received(map[string]types.MessageAttributeValue{
		MetadataAttribute:     stringAttribute(`["not", "an object"]`),
		BodyEncodingAttribute: stringAttribute(BodyEncodingBase64),
	}, "aGk="), "t")
	assert.Contains(t, msg.Metadata.Get(delivery.DecodeError), MetadataAttribute)
	assert.Equal(t, "aGk=", string(msg.Payload), "the raw body when anything failed")

	msg = unmarshal(received(map[string]types.MessageAttributeValue{
		delivery.DecodeError: stringAttribute("stale"),
		delivery.Attempts:    stringAttribute("99"),
	}, "ok"), "t")
	assert.Empty(t, msg.Metadata.Get(delivery.DecodeError), "an incoming decode error is not this delivery's")
	assert.Equal(t, "1", msg.Metadata.Get(delivery.Attempts))
}

func TestFIFOID(t *testing.T) {
	t.Parallel()
	assert.Equal(t, "order-42", fifoID("order-42", "uuid"))
	assert.Equal(t, "uuid", fifoID("", "uuid"))
	assert.Equal(t, `!"#$%&'()*+,-./:;<=>?@[\]^_{|}~`, fifoID(`!"#$%&'()*+,-./:;<=>?@[\]^_{|}~`))
	long := strings.Repeat("x", 129)
	assert.Len(t, fifoID(long), 64)
	assert.Equal(t, fifoID(long), fifoID(long), "hashing is deterministic")
	assert.Equal(t, strings.Repeat("x", 128), fifoID(strings.Repeat("x", 128)))
	assert.Len(t, fifoID("with space"), 64)
	assert.Len(t, fifoID("ünïcode"), 64)
	assert.NotEmpty(t, fifoID("", ""), "a random ID when there is nothing")
}

func TestNackBackoff(t *testing.T) {
	t.Parallel()
	want := []time.Duration{time.Second, time.Second, 2 * time.Second, 4 * time.Second, 8 * time.Second, 16 * time.Second,
		32 * time.Second, 64 * time.Second, 128 * time.Second, 256 * time.Second, 5 * time.Minute, 5 * time.Minute}
	for attempt, w := range want {
		assert.Equal(t, w, DefaultNackBackoff(attempt), "attempt %d", attempt)
	}
	assert.Equal(t, 5*time.Minute, DefaultNackBackoff(1000))
	assert.Equal(t, int32(0), visibilitySeconds(-time.Second))
	assert.Equal(t, int32(0), visibilitySeconds(0))
	assert.Equal(t, int32(1), visibilitySeconds(time.Millisecond))
	assert.Equal(t, int32(2), visibilitySeconds(1500*time.Millisecond))
	assert.Equal(t, int32(43200), visibilitySeconds(24*time.Hour))
}
