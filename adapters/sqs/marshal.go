package sqs

import (
	"encoding/base64"
	"encoding/json"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"unicode/utf16"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/sqs/types"

	"github.com/oncemill/oncemill/delivery"
)

// Message attributes the publisher sets besides the metadata.
const (
	// UUIDAttribute carries the Watermill message UUID. A message without
	// it gets its SQS MessageId as UUID, which is the same on every
	// delivery.
	UUIDAttribute = "_watermill_message_uuid"
	// MetadataAttribute carries all metadata of a message as one JSON
	// object of strings, when the metadata cannot travel as one String
	// attribute per key; see the package documentation.
	MetadataAttribute = "oncemill_metadata"
	// BodyEncodingAttribute says how the body encodes the payload when it
	// is not the payload itself: [BodyEncodingBase64] or
	// [BodyEncodingEmpty].
	BodyEncodingAttribute = "oncemill_body_encoding"

	// BodyEncodingBase64 marks a body that is the standard base64 encoding
	// of the payload, for payloads that are not text SQS accepts.
	BodyEncodingBase64 = "base64"
	// BodyEncodingEmpty marks an empty payload: SQS rejects empty bodies,
	// so the body is a placeholder.
	BodyEncodingEmpty = "empty"

	// MaxMessageAttributes is how many message attributes SQS accepts on a
	// message.
	MaxMessageAttributes = 10
)

// emptyBody is the body sent for an empty payload.
const emptyBody = "-"

// stringType is the DataType of the attributes the publisher sets.
const stringType = "String"

func isReservedAttribute(name string) bool {
	return name == UUIDAttribute || name == MetadataAttribute || name == BodyEncodingAttribute
}

// validText reports whether s is text that SQS accepts in a body or a
// String attribute: valid UTF-8 of the characters #x9, #xA, #xD, #x20 to
// #xD7FF and #xE000 to #xFFFD.
//
// AWS also accepts #x10000 to #x10FFFF (emoji and other characters outside
// the Basic Multilingual Plane), but emulators do not all do so (fauxqs
// 1.9.2 rejects them with InvalidMessageContents), so the publisher treats
// them as binary: such a payload travels in base64, such metadata in the
// JSON attribute, where they are escaped. That keeps one wire format that
// every SQS implementation accepts.
func validText(s string) bool {
	for _, r := range s {
		if !validRune(r) {
			return false
		}
	}
	return utf8.ValidString(s)
}

func validRune(r rune) bool {
	switch {
	case r == 0x9 || r == 0xA || r == 0xD:
		return true
	case r >= 0x20 && r <= 0xD7FF:
		return true
	case r >= 0xE000 && r <= 0xFFFD:
		return true
	}
	return false
}

// validAttributeName reports whether SQS accepts name as a message
// attribute name: 1 to 256 of A-Z, a-z, 0-9, '_', '-' and '.', not
// starting or ending with '.', no "..", not starting with "AWS." or
// "Amazon." in any case.
func validAttributeName(name string) bool {
	if name == "" || len(name) > 256 || name[0] == '.' || name[len(name)-1] == '.' || strings.Contains(name, "..") {
		return false
	}
	lower := strings.ToLower(name)
	if strings.HasPrefix(lower, "aws.") || strings.HasPrefix(lower, "amazon.") {
		return false
	}
	for i := 0; i < len(name); i++ {
		c := name[i]
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '_' || c == '-' || c == '.') {
			return false
		}
	}
	return true
}

func stringAttribute(v string) types.MessageAttributeValue {
	return types.MessageAttributeValue{DataType: aws.String(stringType), StringValue: aws.String(v)}
}

// marshal returns the body and message attributes that carry msg.
func marshal(msg *message.Message) (string, map[string]types.MessageAttributeValue, error) {
	attrs := make(map[string]types.MessageAttributeValue, len(msg.Metadata)+2)
	if msg.UUID != "" {
		if !validText(msg.UUID) {
			return "", nil, fmt.Errorf("%w: UUID %q has characters SQS does not accept", ErrInvalidMessage, msg.UUID)
		}
		attrs[UUIDAttribute] = stringAttribute(msg.UUID)
	}

	var body string
	switch {
	case len(msg.Payload) == 0:
		body = emptyBody
		attrs[BodyEncodingAttribute] = stringAttribute(BodyEncodingEmpty)
	case validText(string(msg.Payload)):
		body = string(msg.Payload)
	default:
		body = base64.StdEncoding.EncodeToString(msg.Payload)
		attrs[BodyEncodingAttribute] = stringAttribute(BodyEncodingBase64)
	}

	md := make(map[string]string, len(msg.Metadata))
	for k, v := range msg.Metadata {
		if !delivery.IsAdapterFact(k) {
			md[k] = v
		}
	}
	if fitsAttributes(md, MaxMessageAttributes-len(attrs)) {
		for k, v := range md {
			attrs[k] = stringAttribute(v)
		}
		return body, attrs, nil
	}
	js, err := metadataJSON(md)
	if err != nil {
		return "", nil, fmt.Errorf("%w: metadata: %w", ErrInvalidMessage, err)
	}
	attrs[MetadataAttribute] = stringAttribute(js)
	return body, attrs, nil
}

// fitsAttributes reports whether md can travel as one String attribute per
// key in at most n attributes: SQS accepts each name and value, values are
// not empty (SQS rejects empty attribute values) and no key is one of the
// publisher's own attributes.
func fitsAttributes(md map[string]string, n int) bool {
	if len(md) > n {
		return false
	}
	for k, v := range md {
		if isReservedAttribute(k) || !validAttributeName(k) || v == "" || !validText(v) {
			return false
		}
	}
	return true
}

// metadataJSON returns md as a JSON object that [validText] accepts, to
// travel as a String attribute. encoding/json escapes control characters;
// what it leaves as it is but validText rejects (U+FFFE, U+FFFF and
// characters above U+FFFF) is escaped here, the latter as UTF-16 surrogate
// pairs. Invalid UTF-8 becomes U+FFFD, as encoding/json does.
func metadataJSON(md map[string]string) (string, error) {
	b, err := json.Marshal(md)
	if err != nil {
		return "", err
	}
	s := string(b)
	if validText(s) {
		return s, nil
	}
	var out strings.Builder
	out.Grow(len(s) + 12)
	for _, r := range s {
		switch {
		case validRune(r):
			out.WriteRune(r)
		case r > 0xFFFF:
			hi, lo := utf16.EncodeRune(r)
			fmt.Fprintf(&out, `\u%04x\u%04x`, hi, lo)
		default:
			fmt.Fprintf(&out, `\u%04x`, r)
		}
	}
	return out.String(), nil
}

// unmarshal returns the Watermill message for m, received from topic. It
// never fails: when the payload or metadata cannot be decoded, the message
// has the raw body as payload and delivery.DecodeError says what failed.
func unmarshal(m types.Message, topic string) *message.Message {
	uuid := aws.ToString(m.MessageId)
	body := aws.ToString(m.Body)
	md := make(message.Metadata, len(m.MessageAttributes)+2)
	var problems []string

	var encoding, metadata string
	var hasMetadata bool
	for name, v := range m.MessageAttributes {
		switch {
		case name == UUIDAttribute:
			if s := attributeString(v); s != "" {
				uuid = s
			}
		case name == BodyEncodingAttribute:
			encoding = attributeString(v)
		case name == MetadataAttribute:
			metadata, hasMetadata = attributeString(v), true
		case delivery.IsAdapterFact(name):
		default:
			md[name] = attributeString(v)
		}
	}
	if hasMetadata {
		var decoded map[string]string
		if err := json.Unmarshal([]byte(metadata), &decoded); err != nil {
			problems = append(problems, fmt.Sprintf("attribute %s is not a JSON object of strings: %v", MetadataAttribute, err))
		} else {
			for k, v := range decoded {
				if !delivery.IsAdapterFact(k) {
					md[k] = v
				}
			}
		}
	}

	payload := []byte(body)
	switch encoding {
	case "":
	case BodyEncodingBase64:
		p, err := base64.StdEncoding.DecodeString(body)
		if err != nil {
			problems = append(problems, fmt.Sprintf("body is not base64 as attribute %s says: %v", BodyEncodingAttribute, err))
		} else {
			payload = p
		}
	case BodyEncodingEmpty:
		payload = []byte{}
	default:
		problems = append(problems, fmt.Sprintf("attribute %s has unknown value %q", BodyEncodingAttribute, encoding))
	}
	if len(problems) > 0 {
		slices.Sort(problems)
		md[delivery.DecodeError] = "sqs: cannot decode message " + aws.ToString(m.MessageId) + ": " + strings.Join(problems, "; ")
		payload = []byte(body)
	}

	md[delivery.Topic] = topic
	if n, err := strconv.Atoi(m.Attributes[string(types.MessageSystemAttributeNameApproximateReceiveCount)]); err == nil && n > 0 {
		md[delivery.Attempts] = strconv.Itoa(n)
	}

	msg := message.NewMessage(uuid, payload)
	msg.Metadata = md
	return msg
}

// attributeString returns the value of a message attribute as a string:
// String and Number values as they are, Binary values as their bytes.
func attributeString(v types.MessageAttributeValue) string {
	if v.StringValue != nil {
		return *v.StringValue
	}
	if v.BinaryValue != nil {
		return string(v.BinaryValue)
	}
	return ""
}

// attempt returns m's ApproximateReceiveCount, at least 1.
func attempt(m types.Message) int {
	n, err := strconv.Atoi(m.Attributes[string(types.MessageSystemAttributeNameApproximateReceiveCount)])
	if err != nil || n < 1 {
		return 1
	}
	return n
}
