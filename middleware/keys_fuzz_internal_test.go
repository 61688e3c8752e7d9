package middleware

import (
	"bytes"
	"encoding/json"
	"errors"
	"regexp"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/oncemill/oncemill/delivery"
)

// canonicalRE is the form of every key KeyFromJSON gives for a number.
var canonicalRE = regexp.MustCompile(`^(0|-?[1-9][0-9]*|-?(0|[1-9][0-9]*)\.[0-9]*[1-9])$`)

// FuzzKeyFromJSON: on any payload and path KeyFromJSON never panics,
// gives one key for one input, and either a key the inbox accepts or a
// permanent error wrapping ErrKey. A number's key is canonical: in plain
// decimal form, and the same for the other spellings of its value.
func FuzzKeyFromJSON(f *testing.F) {
	for _, seed := range []struct{ payload, path string }{
		{`{"orderId":"A"}`, "orderId"},
		{`{"orderId":1}`, "orderId"},
		{`{"orderId":1.0}`, "orderId"},
		{`{"orderId":1e0}`, "orderId"},
		{`{"orderId":-0.0e5}`, "orderId"},
		{`{"orderId":1.50E+2}`, "orderId"},
		{`{"orderId":123e-7}`, "orderId"},
		{`{"orderId":1e99999999999999999999}`, "orderId"},
		{`{"order":{"id":7}}`, "order.id"},
		{`{"orderId":"A"} trailing garbage {{{`, "orderId"},
		{`{"orderId":"A"}}`, "orderId"},
		{`[1,2]`, "0"},
		{`{"a":{"b":[1]}}`, "a.b"},
		{`{"a":"\u0000"}`, "a"},
		{"", ""},
	} {
		f.Add([]byte(seed.payload), seed.path)
	}
	f.Fuzz(func(t *testing.T, payload []byte, path string) {
		fn := KeyFromJSON(path)
		msg := message.NewMessage("uuid-1", payload)
		k, err := fn(msg)
		k2, err2 := fn(message.NewMessage("uuid-2", append([]byte(nil), payload...)))
		if k != k2 || (err == nil) != (err2 == nil) {
			t.Fatalf("one payload gave %q, %v and %q, %v", k, err, k2, err2)
		}
		if err != nil {
			if !errors.Is(err, ErrKey) || !IsPermanent(err) {
				t.Fatalf("error %v is not a permanent ErrKey", err)
			}
			return
		}
		if k == "" {
			t.Fatal("no error and an empty key")
		}
		if _, err := keyOf(fn, msg); err != nil && !errors.Is(err, ErrKey) {
			t.Fatalf("keyOf error %v does not wrap ErrKey", err)
		}
		// A number's key is canonical and a fixed point; its other
		// spellings give it too.
		if !isNumberAt(payload, path) {
			return
		}
		if !canonicalRE.MatchString(k) || len(k) > MaxKeyBytes {
			t.Fatalf("number key %q is not in plain canonical form", k)
		}
		spellings := []string{k, k + "e0", k + "E+0"}
		if strings.Contains(k, ".") {
			spellings = append(spellings, k+"0", k+"00e-0")
		} else {
			spellings = append(spellings, k+".0", k+".000E0")
			if k != "0" {
				spellings = append(spellings, k+"0e-1")
			}
		}
		for _, s := range spellings {
			got, err := KeyFromJSON("id")(message.NewMessage("u", []byte(`{"id":`+s+`}`)))
			if err != nil || got != k {
				t.Fatalf("%s gave %q, %v; want %q as for %q", s, got, err, k, payload)
			}
		}
	})
}

// isNumberAt reports whether path in payload holds a JSON number.
func isNumberAt(payload []byte, path string) bool {
	var doc any
	if decodeNumber(payload, &doc) != nil {
		return false
	}
	for _, p := range strings.Split(path, ".") {
		obj, ok := doc.(map[string]any)
		if !ok {
			return false
		}
		doc = obj[p]
	}
	_, ok := doc.(interface{ Int64() (int64, error) })
	return ok
}

// FuzzKeys: DefaultKey, KeyFromMetadata, KeyFromHash and the inbox's key
// check never panic; equal messages give equal keys; an empty key is an
// error wrapping ErrEmptyKey; the check accepts exactly the non-empty
// UTF-8 keys without NUL of at most MaxKeyBytes, and its error wraps
// ErrKey and is permanent.
func FuzzKeys(f *testing.F) {
	f.Add("uuid-1", "order-1", true, []byte("payload"), "tenant", "acme")
	f.Add("", "", true, []byte(nil), "", "")
	f.Add("", "", false, []byte{0}, "a", "bc")
	f.Add("u", "bad\xff", true, []byte("x"), "ab", "c")
	f.Add("u", "nul\x00", true, []byte("x"), delivery.IdempotencyKey, "k")
	f.Add("u", strings.Repeat("k", MaxKeyBytes+1), true, []byte("x"), "", "")
	f.Fuzz(func(t *testing.T, id, key string, present bool, payload []byte, field, value string) {
		msg := func() *message.Message {
			m := message.NewMessage(id, append([]byte(nil), payload...))
			if present {
				m.Metadata.Set(delivery.IdempotencyKey, key)
			}
			m.Metadata.Set(field, value)
			return m
		}
		for name, fn := range map[string]KeyFunc{
			"DefaultKey":      DefaultKey,
			"KeyFromMetadata": KeyFromMetadata(field),
			"KeyFromHash":     KeyFromHash(field, delivery.IdempotencyKey),
		} {
			k, err := fn(msg())
			k2, err2 := fn(msg())
			if k != k2 || (err == nil) != (err2 == nil) {
				t.Fatalf("%s: one message gave %q, %v and %q, %v", name, k, err, k2, err2)
			}
			if err != nil {
				if !errors.Is(err, ErrEmptyKey) || !IsPermanent(err) {
					t.Fatalf("%s: error %v is not a permanent ErrEmptyKey", name, err)
				}
				continue
			}
			if k == "" {
				t.Fatalf("%s: no error and an empty key", name)
			}
			got, err := keyOf(fn, msg())
			valid := len(k) <= MaxKeyBytes && utf8.ValidString(k) && !strings.ContainsRune(k, 0)
			switch {
			case valid && (err != nil || got != k):
				t.Fatalf("%s: key %q refused: %v", name, k, err)
			case !valid && (err == nil || !errors.Is(err, ErrKey) || !IsPermanent(err)):
				t.Fatalf("%s: key %q accepted or refused without a permanent ErrKey: %v", name, k, err)
			}
		}
		h, _ := KeyFromHash(field)(msg())
		if len(h) != 64 || checkKey(h) != nil {
			t.Fatalf("KeyFromHash gave %q", h)
		}
		if other, _ := KeyFromHash(field)(message.NewMessage(id, append(append([]byte(nil), payload...), 'x'))); other == h {
			t.Fatal("KeyFromHash gave one key for two payloads")
		}
	})
}

// decodeNumber decodes payload as KeyFromJSON does, numbers kept as text.
func decodeNumber(payload []byte, v *any) error {
	dec := json.NewDecoder(bytes.NewReader(payload))
	dec.UseNumber()
	return dec.Decode(v)
}
