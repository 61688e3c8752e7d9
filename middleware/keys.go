package middleware

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"strconv"
	"strings"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/oncemill/oncemill/delivery"
)

// MaxKeyBytes is the longest key accepted. Longer business keys should be
// hashed ([KeyFromHash]); a database index cannot hold arbitrary lengths.
const MaxKeyBytes = 512

// KeyFunc returns the key that identifies a message's effect. Two deliveries
// with the same key are the same effect. An error, or an empty key, is
// permanent: the message cannot be deduplicated, so it must not be applied.
type KeyFunc func(msg *message.Message) (string, error)

// DefaultKey reads metadata "idempotency_key" and falls back to the
// message UUID when the field is absent. Prefer a producer-set key: a UUID
// is only stable if the producer reuses it when it retries. A field that is
// present but empty is a permanent key error, not a fallback: the producer
// meant to set a key and did not, and its retries would carry new UUIDs.
func DefaultKey(msg *message.Message) (string, error) {
	if k, ok := msg.Metadata[delivery.IdempotencyKey]; ok {
		if k == "" {
			return "", keyError(ErrEmptyKey, "metadata %q is present but empty", delivery.IdempotencyKey)
		}
		return k, nil
	}
	if msg.UUID == "" {
		return "", keyError(ErrEmptyKey, "no %q metadata and no message UUID", delivery.IdempotencyKey)
	}
	return msg.UUID, nil
}

// KeyFromMetadata returns a KeyFunc that reads the metadata field named
// field. A missing or empty field is a permanent error.
func KeyFromMetadata(field string) KeyFunc {
	return func(msg *message.Message) (string, error) {
		k := msg.Metadata.Get(field)
		if k == "" {
			return "", keyError(ErrEmptyKey, "metadata field %q is missing or empty", field)
		}
		return k, nil
	}
}

// KeyFromJSON returns a KeyFunc that reads a business key, such as
// "orderId", from the JSON payload. A dotted path ("order.id") reaches into
// nested objects. The value must be a non-empty string or a number; a
// payload that is not one JSON object (data after it included), a missing
// field, or any other type is a permanent error.
//
// A number's key is its exact value in plain decimal, the same for every
// way of writing it: 1, 1.0, 1e0 and 10e-1 all give "1", and 1.50, 15e-1
// give "1.5". There is no exponent, no "+", no leading zero but the one
// before a point, no trailing zero after a point, and -0 is "0", so that
// producers that format one id differently still meet on one key. A
// number whose plain form is longer than [MaxKeyBytes] is an error.
func KeyFromJSON(path string) KeyFunc {
	parts := strings.Split(path, ".")
	return func(msg *message.Message) (string, error) {
		dec := json.NewDecoder(bytes.NewReader(msg.Payload))
		dec.UseNumber()
		var doc any
		if len(bytes.TrimLeft(msg.Payload, " \t\r\n")) == 0 {
			return "", keyError(nil, "payload is empty, so key field %q cannot be read", path)
		}
		if err := dec.Decode(&doc); err != nil {
			return "", keyError(err, "payload is not JSON, so key field %q cannot be read", path)
		}
		if end := dec.InputOffset(); !onlySpace(msg.Payload[end:]) {
			return "", keyError(nil, "payload has data after its JSON value at byte %d, so key field %q cannot be read: send one JSON object per message", end, path)
		}
		v := doc
		for i, p := range parts {
			obj, ok := v.(map[string]any)
			if !ok && i == 0 {
				return "", keyError(nil, "key field %q: the payload is not a JSON object", path)
			}
			if !ok {
				return "", keyError(nil, "key field %q: %q is not a JSON object", path, strings.Join(parts[:i], "."))
			}
			if v, ok = obj[p]; !ok || v == nil {
				return "", keyError(ErrEmptyKey, "key field %q is missing from the payload", path)
			}
		}
		switch k := v.(type) {
		case string:
			if k == "" {
				return "", keyError(ErrEmptyKey, "key field %q is an empty string", path)
			}
			return k, nil
		case json.Number:
			c, ok := canonicalNumber(string(k))
			if !ok {
				return "", keyError(nil, "key field %q is the number %s, whose plain decimal form is longer than %d bytes: use a string or KeyFromHash", path, quote(string(k)), MaxKeyBytes)
			}
			return c, nil
		case map[string]any:
			return "", keyError(nil, "key field %q is a JSON object, want a string or a number", path)
		case []any:
			return "", keyError(nil, "key field %q is a JSON array, want a string or a number", path)
		default:
			return "", keyError(nil, "key field %q is a %T, want a string or a number", path, v)
		}
	}
}

// onlySpace reports whether b holds nothing but JSON white space.
func onlySpace(b []byte) bool {
	return len(bytes.TrimLeft(b, " \t\r\n")) == 0
}

// canonicalNumber returns the JSON number n (already checked by the
// decoder) as its exact value in plain decimal: no exponent, no sign for
// zero, no leading zeros, no trailing zeros after the point, no point for
// an integer. It is false when that form would be longer than MaxKeyBytes.
func canonicalNumber(n string) (string, bool) {
	neg := strings.HasPrefix(n, "-")
	n = strings.TrimPrefix(n, "-")
	mant, exp := n, int64(0)
	if i := strings.IndexAny(n, "eE"); i >= 0 {
		mant = n[:i]
		e, err := strconv.ParseInt(strings.TrimPrefix(n[i+1:], "+"), 10, 64)
		if err != nil {
			// An exponent beyond int64 is either far too long or zero.
			if strings.Trim(strings.ReplaceAll(mant, ".", ""), "0") == "" {
				return "0", true
			}
			return "", false
		}
		exp = e
	}
	digits := mant
	if i := strings.IndexByte(mant, '.'); i >= 0 {
		digits = mant[:i] + mant[i+1:]
		exp -= int64(len(mant) - i - 1)
	}
	digits = strings.TrimLeft(digits, "0")
	if digits == "" {
		return "0", true
	}
	trimmed := strings.TrimRight(digits, "0")
	exp += int64(len(digits) - len(trimmed))
	digits = trimmed
	// The value is digits × 10^exp; bound the length before building it.
	var size int64
	switch {
	case exp >= 0:
		size = int64(len(digits)) + exp
	case -exp < int64(len(digits)):
		size = int64(len(digits)) + 1
	default:
		size = 2 - exp
	}
	if neg {
		size++
	}
	if exp > MaxKeyBytes || exp < -MaxKeyBytes || size > MaxKeyBytes {
		return "", false
	}
	var b strings.Builder
	if neg {
		b.WriteByte('-')
	}
	switch {
	case exp >= 0:
		b.WriteString(digits)
		b.WriteString(strings.Repeat("0", int(exp)))
	case -exp < int64(len(digits)):
		point := len(digits) + int(exp)
		b.WriteString(digits[:point])
		b.WriteByte('.')
		b.WriteString(digits[point:])
	default:
		b.WriteString("0.")
		b.WriteString(strings.Repeat("0", int(-exp)-len(digits)))
		b.WriteString(digits)
	}
	return b.String(), true
}

// quote quotes s for an error message, cut to 64 bytes.
func quote(s string) string {
	const limit = 64
	if len(s) > limit {
		return strconv.Quote(s[:limit]) + "..."
	}
	return strconv.Quote(s)
}

// KeyFromHash returns a KeyFunc that hashes the payload and the named
// metadata fields with SHA-256 (hex). Use it when producers set no key and
// the content itself identifies the effect; two different effects with the
// same content would be taken for one.
func KeyFromHash(metadataFields ...string) KeyFunc {
	fields := append([]string(nil), metadataFields...)
	return func(msg *message.Message) (string, error) {
		h := sha256.New()
		// Length-prefix every part so that ("ab","c") and ("a","bc")
		// hash differently.
		var n [8]byte
		write := func(b []byte) {
			binary.BigEndian.PutUint64(n[:], uint64(len(b)))
			h.Write(n[:])
			h.Write(b)
		}
		write(msg.Payload)
		for _, f := range fields {
			write([]byte(f))
			write([]byte(msg.Metadata.Get(f)))
		}
		return hex.EncodeToString(h.Sum(nil)), nil
	}
}

// checkKey rejects keys that no store can hold faithfully.
func checkKey(k string) error {
	switch {
	case k == "":
		return keyError(ErrEmptyKey, "key function returned an empty key")
	case len(k) > MaxKeyBytes:
		return keyError(nil, "key is %d bytes, more than %d: hash it with KeyFromHash", len(k), MaxKeyBytes)
	case !utf8.ValidString(k) || strings.ContainsRune(k, 0):
		return keyError(nil, "key %q is not valid UTF-8 text without NUL bytes", k)
	}
	return nil
}

// keyOf runs fn and checks its answer; every failure is permanent. A
// panic in fn is recovered and is a key error that says so: a key function
// that panics on a message panics on every delivery of it, and left to the
// router's recovery the message would loop forever.
func keyOf(fn KeyFunc, msg *message.Message) (string, error) {
	k, err := callKey(fn, msg)
	if err != nil {
		if !IsPermanent(err) {
			err = Permanent(fmt.Errorf("%w: %w", ErrKey, err))
		}
		return "", err
	}
	if err := checkKey(k); err != nil {
		return "", err
	}
	return k, nil
}

// callKey runs fn under recover.
func callKey(fn KeyFunc, msg *message.Message) (k string, err error) {
	defer func() {
		if r := recover(); r != nil {
			k, err = "", keyError(nil, "key function panicked: %v", r)
		}
	}()
	return fn(msg)
}
