package middleware

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"fmt"
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
// payload that is not a JSON object, a missing field, or any other type is a
// permanent error.
func KeyFromJSON(path string) KeyFunc {
	parts := strings.Split(path, ".")
	return func(msg *message.Message) (string, error) {
		dec := json.NewDecoder(bytes.NewReader(msg.Payload))
		dec.UseNumber()
		var doc any
		if err := dec.Decode(&doc); err != nil {
			return "", keyError(err, "payload is not JSON, so key field %q cannot be read", path)
		}
		v := doc
		for i, p := range parts {
			obj, ok := v.(map[string]any)
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
			return k.String(), nil
		default:
			return "", keyError(nil, "key field %q is a %T, want a string or a number", path, v)
		}
	}
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
