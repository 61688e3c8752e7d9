package nats

import (
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill/message"
	natsgo "github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/oncemill/oncemill/delivery"
)

// Headers the publisher sets besides the metadata.
const (
	// UUIDHeader carries the Watermill message UUID, under the name
	// watermill-nats uses. A message without it gets its Nats-Msg-Id as
	// UUID, else "<stream>:<stream sequence>", both the same on every
	// delivery.
	UUIDHeader = "_watermill_message_uuid"
	// MetadataHeader carries all metadata of a message as one JSON object
	// of strings, when the metadata cannot travel as one header per key;
	// see the package documentation.
	MetadataHeader = "oncemill_metadata"
	// MsgIDHeader is JetStream's deduplication header, which the
	// publisher sets to the message's idempotency key.
	MsgIDHeader = natsgo.MsgIdHdr
)

// isProtocolHeader reports whether name is a header of the NATS protocol
// (Nats-Msg-Id, Nats-Expected-Stream, ...), which the server interprets
// and a metadata key must not set.
func isProtocolHeader(name string) bool {
	return len(name) >= 5 && strings.EqualFold(name[:5], "Nats-")
}

// headerKey reports whether k can travel as a header name as it is:
// printable ASCII without the characters nats.go rejects, and none of
// the names this package or the protocol uses.
func headerKey(k string) bool {
	if k == "" || k == UUIDHeader || k == MetadataHeader || isProtocolHeader(k) {
		return false
	}
	for i := 0; i < len(k); i++ {
		c := k[i]
		if c < 33 || c > 126 || strings.IndexByte("\"()/,:;<=>?@[\\]{}", c) >= 0 {
			return false
		}
	}
	return true
}

// headerValue reports whether v travels as a header value unchanged:
// valid UTF-8 without control characters other than tab, and without
// leading or trailing whitespace, which header parsing trims.
func headerValue(v string) bool {
	if !utf8.ValidString(v) {
		return false
	}
	if v != strings.Trim(v, " \t") {
		return false
	}
	return strings.IndexFunc(v, func(r rune) bool { return (r < ' ' && r != '\t') || r == 0x7f }) < 0
}

// marshal returns the NATS message for msg, published to subject topic
// with Nats-Msg-Id msgID.
func marshal(msg *message.Message, topic, msgID string) (*natsgo.Msg, error) {
	md := make(map[string]string, len(msg.Metadata))
	fits := true
	for k, v := range msg.Metadata {
		if delivery.IsAdapterFact(k) {
			continue
		}
		md[k] = v
		fits = fits && headerKey(k) && headerValue(v)
	}
	h := make(natsgo.Header, len(md)+2)
	if fits {
		for k, v := range md {
			h.Set(k, v)
		}
	} else {
		b, err := json.Marshal(md)
		if err != nil {
			return nil, fmt.Errorf("encode metadata: %w", err)
		}
		h.Set(MetadataHeader, string(b))
	}
	h.Set(UUIDHeader, msg.UUID)
	h.Set(MsgIDHeader, msgID)
	return &natsgo.Msg{Subject: topic, Header: h, Data: msg.Payload}, nil
}

// msgID returns the Nats-Msg-Id of msg published to topic. JetStream
// drops a message whose ID the stream has seen within its duplicate
// window, so the ID names one logical publish: the same for a producer's
// retries of it, different for another publish of the same message. It is
// the message's idempotency key, else its UUID. A replay from the
// dead-letter queue (delivery.Replay, the replay grant, fresh for every
// replay) and a dead-lettered copy (delivery.DeadConsumer and
// delivery.DeadLastFailedAt, which differ between two dead-letterings of
// one message) are publishes of their own: their ID is the key followed
// by the SHA-256, in hex, of the key and those fields. In a shared stream,
// whose duplicate window spans every topic, the topic comes first,
// followed by a space (which no subject has). An ID that would not travel
// as a header value unchanged is replaced by its SHA-256 in hex.
func msgID(msg *message.Message, topic string, shared bool) string {
	key := msg.Metadata.Get(delivery.IdempotencyKey)
	if key == "" {
		key = msg.UUID
	}
	id := key
	extra := []string{
		msg.Metadata.Get(delivery.Replay),
		msg.Metadata.Get(delivery.DeadConsumer),
		msg.Metadata.Get(delivery.DeadLastFailedAt),
	}
	if extra[0] != "" || extra[1] != "" || extra[2] != "" {
		h := sha256.New()
		for _, f := range append([]string{key}, extra...) {
			var n [8]byte
			binary.BigEndian.PutUint64(n[:], uint64(len(f)))
			h.Write(n[:])
			h.Write([]byte(f))
		}
		id = key + ":" + hex.EncodeToString(h.Sum(nil))
	}
	if shared {
		id = topic + " " + id
	}
	if id == "" || !headerValue(id) {
		sum := sha256.Sum256([]byte(id))
		return hex.EncodeToString(sum[:])
	}
	return id
}

// unmarshal returns the Watermill message for m, received from topic. It
// never fails: when the metadata cannot be decoded, the message has the
// raw data as payload and delivery.DecodeError says what failed.
func unmarshal(m jetstream.Msg, topic string, meta *jetstream.MsgMetadata) *message.Message {
	h := m.Headers()
	md := make(message.Metadata, len(h)+6)
	var problems []string
	uuid := h.Get(UUIDHeader)
	if uuid == "" {
		uuid = h.Get(MsgIDHeader)
	}
	if uuid == "" && meta != nil {
		uuid = meta.Stream + ":" + strconv.FormatUint(meta.Sequence.Stream, 10)
	}
	for name, values := range h {
		switch {
		case name == UUIDHeader, isProtocolHeader(name), delivery.IsAdapterFact(name):
		case name == MetadataHeader:
			var decoded map[string]string
			if err := json.Unmarshal([]byte(strings.Join(values, ", ")), &decoded); err != nil {
				problems = append(problems, fmt.Sprintf("header %s is not a JSON object of strings: %v", MetadataHeader, err))
				continue
			}
			for k, v := range decoded {
				if !delivery.IsAdapterFact(k) {
					md[k] = v
				}
			}
		default:
			// A header given several times, by a producer that is not
			// this package, keeps every value, as HTTP joins them.
			md[name] = strings.Join(values, ", ")
		}
	}
	md[delivery.Topic] = topic
	if meta != nil {
		md[delivery.Stream] = meta.Stream
		md[delivery.StreamSequence] = strconv.FormatUint(meta.Sequence.Stream, 10)
		md[delivery.Attempts] = strconv.FormatUint(meta.NumDelivered, 10)
		md[delivery.Redelivered] = strconv.FormatBool(meta.NumDelivered > 1)
	} else {
		problems = append(problems, "reply subject has no JetStream metadata: "+m.Reply())
	}
	if len(problems) > 0 {
		slices.Sort(problems)
		md[delivery.DecodeError] = "nats: cannot decode message " + uuid + ": " + strings.Join(problems, "; ")
	}
	msg := message.NewMessage(uuid, m.Data())
	msg.Metadata = md
	return msg
}
