package amqp

import (
	"bytes"
	"crypto/sha1"
	"encoding/base64"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"math"
	"math/big"
	"slices"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/oncemill/oncemill/delivery"
)

// UUIDHeader is the header that carries the Watermill message UUID; it is
// watermill-amqp's, so messages interoperate with its DefaultMarshaler.
const UUIDHeader = wamqp.DefaultMessageUUIDHeaderKey

// Headers that RabbitMQ sets on deliveries.
const (
	// HeaderDeliveryCount is set by quorum queues: how many earlier
	// deliveries failed (before RabbitMQ 4.3: every earlier return).
	// RabbitMQ 3.10.8 sets it on every delivery, to 0 on the first.
	HeaderDeliveryCount = "x-delivery-count"
	// HeaderAcquiredCount is set by quorum queues since RabbitMQ 4.3 on a
	// redelivery: how many times the message was handed to a consumer
	// before, counting every return.
	HeaderAcquiredCount = "x-acquired-count"
	// HeaderDeath is the table of dead-letter events RabbitMQ adds when it
	// dead-letters a message.
	HeaderDeath = "x-death"
)

// isBrokerHeader reports whether the broker sets header k on deliveries.
// [Marshaler.Marshal] does not publish these headers: they describe an
// earlier delivery, and their stringified form is not what the broker
// expects to read back.
func isBrokerHeader(k string) bool {
	switch k {
	case HeaderDeliveryCount, HeaderAcquiredCount, HeaderDeath,
		"x-first-death-exchange", "x-first-death-queue", "x-first-death-reason",
		"x-last-death-exchange", "x-last-death-queue", "x-last-death-reason":
		return true
	}
	return false
}

// uuidNamespace is the name-based UUID namespace (16 bytes) of
// [Marshaler]'s fallback message UUIDs.
const uuidNamespace = "oncemill-amqp-id"

// Marshaler converts between Watermill messages and AMQP messages. Unlike
// watermill-amqp's DefaultMarshaler it accepts headers of every AMQP type
// and never fails to unmarshal, so a foreign or dead-lettered message cannot
// make the subscriber nack it in a loop. The zero value is ready to use.
//
// Marshal publishes the metadata as string headers, the UUID in
// [UUIDHeader] and as the AMQP message-id (when it fits its 255 bytes), with persistent delivery mode.
// It leaves out the delivery facts of the delivery the message came from
// (delivery.IsAdapterFact: its topic, attempts, redelivered flag, decode
// error, and the partition, offset or stream sequence of another broker)
// and the headers the broker owns (x-death, x-delivery-count,
// x-acquired-count, x-first-death-*, x-last-death-*).
//
// Unmarshal turns each header into metadata: strings as they are;
// integers, floats and decimals in decimal; booleans as "true"/"false";
// timestamps in RFC 3339 (UTC); byte arrays as text when they are UTF-8,
// else in standard base64; void as ""; tables (x-death) and arrays as JSON
// with the same rules inside. It then sets:
//
//   - delivery.Topic: the exchange the message was published to, or its
//     routing key when it came through the default exchange;
//   - delivery.Redelivered: "true" or "false", the broker's redelivered flag;
//   - delivery.Attempts: 1 + the larger of x-delivery-count and
//     x-acquired-count when either is present, "1" when neither is and the
//     message is not redelivered; left out when the message is redelivered
//     without a count (a classic queue), because the broker has none.
//
// The message UUID is the [UUIDHeader] header, else the AMQP message-id,
// else a name-based (version 5) UUID of the body, the properties a
// publisher sets and the headers other than the broker's. The fallback is
// deterministic on purpose: a redelivery of a message must keep its UUID,
// because oncemill's inbox falls back to the UUID as the idempotency key. Two
// byte-identical messages published without any id therefore share a UUID
// and count as one effect, as they must when the second is a publisher's
// retry; a producer that means them as two messages must give them an id.
//
// When a header has a value of a type that is not an AMQP field type, or
// decoding panics, Unmarshal still returns a message: its payload is the
// raw body and delivery.DecodeError says what failed, so the handler chain
// can dead-letter it. Headers named after delivery facts are ignored: a
// delivery.DecodeError header some publisher sent says nothing of this
// delivery, which decoded (a dead-letter copy carries its reason in the
// delivery.Dead* fields).
type Marshaler struct{}

var _ wamqp.Marshaler = Marshaler{}

// Marshal returns the AMQP publishing for msg.
func (Marshaler) Marshal(msg *message.Message) (amqp091.Publishing, error) {
	headers := make(amqp091.Table, len(msg.Metadata)+1)
	for k, v := range msg.Metadata {
		if delivery.IsAdapterFact(k) || isBrokerHeader(k) {
			continue
		}
		headers[k] = v
	}
	headers[UUIDHeader] = msg.UUID
	pub := amqp091.Publishing{
		Headers:      headers,
		DeliveryMode: amqp091.Persistent,
		Body:         msg.Payload,
	}
	// message-id is a short string: a longer UUID would break the frame,
	// and the channel with it. The UUIDHeader header carries it whole.
	if len(msg.UUID) <= maxNameLength {
		pub.MessageId = msg.UUID
	}
	return pub, nil
}

// Unmarshal returns the Watermill message for d. Its error is always nil.
func (Marshaler) Unmarshal(d amqp091.Delivery) (msg *message.Message, err error) {
	defer func() {
		if r := recover(); r != nil {
			msg = undecodable(d, fmt.Sprintf("amqp: unmarshal panicked: %v", r))
		}
	}()

	md := make(message.Metadata, len(d.Headers)+3)
	var bad []string
	for k, v := range d.Headers {
		if k == UUIDHeader || delivery.IsAdapterFact(k) {
			continue
		}
		s, err := headerString(v)
		if err != nil {
			bad = append(bad, fmt.Sprintf("header %q: %v", k, err))
		}
		md[k] = s
	}
	setDeliveryFacts(md, d)
	if len(bad) > 0 {
		slices.Sort(bad)
		md[delivery.DecodeError] = "amqp: cannot decode " + strings.Join(bad, "; ")
	}

	msg = message.NewMessage(messageUUID(d), d.Body)
	msg.Metadata = md
	return msg, nil
}

// undecodable returns d as a message that carries only the delivery facts,
// the raw body and why it could not be decoded.
func undecodable(d amqp091.Delivery, why string) *message.Message {
	md := make(message.Metadata, 4)
	func() {
		defer func() { _ = recover() }()
		setDeliveryFacts(md, d)
	}()
	md[delivery.DecodeError] = why
	uuid := d.MessageId
	if uuid == "" {
		uuid = nameUUID(d.Body)
	}
	msg := message.NewMessage(uuid, d.Body)
	msg.Metadata = md
	return msg
}

// setDeliveryFacts sets delivery.Topic, delivery.Redelivered and
// delivery.Attempts from d.
func setDeliveryFacts(md message.Metadata, d amqp091.Delivery) {
	topic := d.Exchange
	if topic == "" {
		topic = d.RoutingKey
	}
	md[delivery.Topic] = topic
	md[delivery.Redelivered] = strconv.FormatBool(d.Redelivered)
	if n, ok := attempts(d.Headers, d.Redelivered); ok {
		md[delivery.Attempts] = strconv.FormatInt(n, 10)
	}
}

// attempts returns the broker's count of deliveries of a message, this one
// included.
func attempts(h amqp091.Table, redelivered bool) (int64, bool) {
	var n int64 = -1
	for _, k := range []string{HeaderDeliveryCount, HeaderAcquiredCount} {
		if c, ok := headerInt(h[k]); ok && c >= 0 && c > n {
			n = c
		}
	}
	switch {
	case n >= 0 && n < math.MaxInt64:
		return n + 1, true
	case n < 0 && !redelivered:
		return 1, true
	default:
		return 0, false
	}
}

// headerInt returns v as an integer if it is one of the AMQP integer types.
func headerInt(v any) (int64, bool) {
	switch v := v.(type) {
	case int8:
		return int64(v), true
	case int16:
		return int64(v), true
	case int32:
		return int64(v), true
	case int64:
		return v, true
	case int:
		return int64(v), true
	case uint8:
		return int64(v), true
	case uint16:
		return int64(v), true
	case uint32:
		return int64(v), true
	case uint64:
		if v > math.MaxInt64 {
			return 0, false
		}
		return int64(v), true
	}
	return 0, false
}

// messageUUID returns the UUID of d: the Watermill header, the AMQP
// message-id, or a name-based UUID of d's content.
func messageUUID(d amqp091.Delivery) string {
	if v, ok := d.Headers[UUIDHeader]; ok {
		if s, err := headerString(v); err == nil && s != "" {
			return s
		}
	}
	if d.MessageId != "" {
		return d.MessageId
	}
	return contentUUID(d)
}

// contentUUID hashes what stays the same when the broker redelivers or
// dead-letters d: the body, the publisher-set properties and the headers
// other than the broker's. Exchange, routing key, delivery mode, priority
// and expiration are left out because dead-lettering may change them.
func contentUUID(d amqp091.Delivery) string {
	var b bytes.Buffer
	field := func(s string) {
		var n [8]byte
		binary.BigEndian.PutUint64(n[:], uint64(len(s)))
		b.Write(n[:])
		b.WriteString(s)
	}
	field(d.ContentType)
	field(d.ContentEncoding)
	field(d.CorrelationId)
	field(d.ReplyTo)
	field(d.Type)
	field(d.UserId)
	field(d.AppId)
	if !d.Timestamp.IsZero() {
		field(strconv.FormatInt(d.Timestamp.Unix(), 10))
	} else {
		field("")
	}
	keys := make([]string, 0, len(d.Headers))
	for k := range d.Headers {
		if !isBrokerHeader(k) {
			keys = append(keys, k)
		}
	}
	slices.Sort(keys)
	for _, k := range keys {
		s, _ := headerString(d.Headers[k])
		field(k)
		field(s)
	}
	field(string(d.Body))
	return nameUUID(b.Bytes())
}

// nameUUID returns the version 5 UUID of name in uuidNamespace.
func nameUUID(name []byte) string {
	h := sha1.New()
	h.Write([]byte(uuidNamespace))
	h.Write(name)
	var u [16]byte
	copy(u[:], h.Sum(nil))
	u[6] = (u[6] & 0x0f) | 0x50 // version 5
	u[8] = (u[8] & 0x3f) | 0x80 // RFC 4122 variant
	var s [36]byte
	hex.Encode(s[0:8], u[0:4])
	s[8] = '-'
	hex.Encode(s[9:13], u[4:6])
	s[13] = '-'
	hex.Encode(s[14:18], u[6:8])
	s[18] = '-'
	hex.Encode(s[19:23], u[8:10])
	s[23] = '-'
	hex.Encode(s[24:], u[10:])
	return string(s[:])
}

// errUnsupported reports a header value of a type that AMQP tables cannot
// hold.
type errUnsupported struct{ v any }

func (e errUnsupported) Error() string {
	return fmt.Sprintf("unsupported AMQP field type %T", e.v)
}

// headerString returns the metadata form of an AMQP header value. For a
// value of an unsupported type it returns its fmt form and an error.
func headerString(v any) (string, error) {
	switch v := v.(type) {
	case string:
		return v, nil
	case []byte:
		return bytesString(v), nil
	case bool:
		return strconv.FormatBool(v), nil
	case float32:
		return strconv.FormatFloat(float64(v), 'g', -1, 32), nil
	case float64:
		return strconv.FormatFloat(v, 'g', -1, 64), nil
	case amqp091.Decimal:
		return decimalString(v), nil
	case time.Time:
		return v.UTC().Format(time.RFC3339), nil
	case nil:
		return "", nil
	case amqp091.Table, map[string]any, []any:
		j, err := jsonValue(v)
		if err != nil {
			return fmt.Sprintf("%v", v), err
		}
		var b bytes.Buffer
		enc := json.NewEncoder(&b)
		enc.SetEscapeHTML(false)
		if err := enc.Encode(j); err != nil {
			return fmt.Sprintf("%v", v), err
		}
		return string(bytes.TrimSuffix(b.Bytes(), []byte("\n"))), nil
	}
	if n, ok := headerInt(v); ok {
		return strconv.FormatInt(n, 10), nil
	}
	if n, ok := v.(uint64); ok {
		return strconv.FormatUint(n, 10), nil
	}
	return fmt.Sprintf("%v", v), errUnsupported{v}
}

// jsonValue returns v as a value encoding/json encodes with the same rules
// as headerString: numbers stay numbers, the rest become strings.
func jsonValue(v any) (any, error) {
	switch v := v.(type) {
	case string, bool, nil:
		return v, nil
	case []byte:
		return bytesString(v), nil
	case float32:
		return jsonFloat(float64(v), 32), nil
	case float64:
		return jsonFloat(v, 64), nil
	case amqp091.Decimal:
		return json.Number(decimalString(v)), nil
	case time.Time:
		return v.UTC().Format(time.RFC3339), nil
	case amqp091.Table:
		return jsonObject(v)
	case map[string]any:
		return jsonObject(v)
	case []any:
		out := make([]any, len(v))
		for i, e := range v {
			j, err := jsonValue(e)
			if err != nil {
				return nil, fmt.Errorf("[%d]: %w", i, err)
			}
			out[i] = j
		}
		return out, nil
	}
	if n, ok := headerInt(v); ok {
		return n, nil
	}
	if n, ok := v.(uint64); ok {
		return n, nil
	}
	return nil, errUnsupported{v}
}

func jsonObject(m map[string]any) (map[string]any, error) {
	out := make(map[string]any, len(m))
	for k, e := range m {
		j, err := jsonValue(e)
		if err != nil {
			return nil, fmt.Errorf("%q: %w", k, err)
		}
		out[k] = j
	}
	return out, nil
}

// jsonFloat returns f as a JSON number, or as a string for NaN and the
// infinities, which JSON cannot hold.
func jsonFloat(f float64, bits int) any {
	if math.IsNaN(f) || math.IsInf(f, 0) {
		return strconv.FormatFloat(f, 'g', -1, bits)
	}
	return json.Number(strconv.FormatFloat(f, 'g', -1, bits))
}

// bytesString returns b as text if it is UTF-8, else in standard base64.
func bytesString(b []byte) string {
	if utf8.Valid(b) {
		return string(b)
	}
	return base64.StdEncoding.EncodeToString(b)
}

// decimalString returns d (Value × 10^-Scale) in exact decimal notation.
func decimalString(d amqp091.Decimal) string {
	r := new(big.Rat).SetFrac(big.NewInt(int64(d.Value)), new(big.Int).Exp(big.NewInt(10), big.NewInt(int64(d.Scale)), nil))
	return r.FloatString(int(d.Scale))
}
