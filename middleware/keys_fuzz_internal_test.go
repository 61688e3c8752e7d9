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

// TestBadKeys: each key a message cannot give is refused with the error
// the user reads, which wraps ErrKey (and ErrEmptyKey for an empty key)
// and is permanent, so the message is dead-lettered on its first
// delivery. The case names are the rows of "Bad input" in
// docs/testing.md.
func TestBadKeys(t *testing.T) {
	payload := func(p string) *message.Message { return message.NewMessage("u", []byte(p)) }
	meta := func(k, v string) *message.Message {
		m := message.NewMessage("u", nil)
		m.Metadata.Set(k, v)
		return m
	}
	const prefix = "middleware: cannot read message key: "
	for _, tc := range []struct {
		name  string
		fn    KeyFunc
		msg   *message.Message
		empty bool
		want  string
	}{
		{"payload not JSON", KeyFromJSON("orderId"), payload(`not json`), false,
			`payload is not JSON, so key field "orderId" cannot be read: invalid character 'o' in literal null (expecting 'u')`},
		{"empty payload", KeyFromJSON("orderId"), payload(" \n"), false,
			`payload is empty, so key field "orderId" cannot be read`},
		{"data after the JSON value", KeyFromJSON("orderId"), payload(`{"orderId":"A"} trailing garbage {{{`), false,
			`payload has data after its JSON value at byte 15, so key field "orderId" cannot be read: send one JSON object per message`},
		{"second JSON value", KeyFromJSON("orderId"), payload(`{"orderId":"A"} {"orderId":"B"}`), false,
			`payload has data after its JSON value at byte 15, so key field "orderId" cannot be read: send one JSON object per message`},
		{"payload a JSON array", KeyFromJSON("orderId"), payload(`[{"orderId":"A"}]`), false,
			`key field "orderId": the payload is not a JSON object`},
		{"key field missing", KeyFromJSON("orderId"), payload(`{"amount":5}`), true,
			`key field "orderId" is missing from the payload: middleware: message key is empty`},
		{"key field null", KeyFromJSON("orderId"), payload(`{"orderId":null}`), true,
			`key field "orderId" is missing from the payload: middleware: message key is empty`},
		{"key field empty string", KeyFromJSON("orderId"), payload(`{"orderId":""}`), true,
			`key field "orderId" is an empty string: middleware: message key is empty`},
		{"key field a bool", KeyFromJSON("orderId"), payload(`{"orderId":true}`), false,
			`key field "orderId" is a bool, want a string or a number`},
		{"key field an object", KeyFromJSON("orderId"), payload(`{"orderId":{"id":1}}`), false,
			`key field "orderId" is a JSON object, want a string or a number`},
		{"key field an array", KeyFromJSON("orderId"), payload(`{"orderId":[1]}`), false,
			`key field "orderId" is a JSON array, want a string or a number`},
		{"key number too long", KeyFromJSON("orderId"), payload(`{"orderId":1e600}`), false,
			`key field "orderId" is the number "1e600", whose plain decimal form is longer than 512 bytes: use a string or KeyFromHash`},
		{"dotted path through a string", KeyFromJSON("order.id"), payload(`{"order":"A"}`), false,
			`key field "order.id": "order" is not a JSON object`},
		{"idempotency_key present but empty", DefaultKey, meta(delivery.IdempotencyKey, ""), true,
			`metadata "idempotency_key" is present but empty: middleware: message key is empty`},
		{"no idempotency_key and no UUID", DefaultKey, message.NewMessage("", nil), true,
			`no "idempotency_key" metadata and no message UUID: middleware: message key is empty`},
		{"metadata key field missing", KeyFromMetadata("order_id"), meta("x", "y"), true,
			`metadata field "order_id" is missing or empty: middleware: message key is empty`},
		{"key over 512 bytes", KeyFromMetadata("order_id"), meta("order_id", strings.Repeat("k", 513)), false,
			`key is 513 bytes, more than 512: hash it with KeyFromHash`},
		{"key with a NUL byte", KeyFromMetadata("order_id"), meta("order_id", "a\x00b"), false,
			`key "a\x00b" is not valid UTF-8 text without NUL bytes`},
		{"key not UTF-8", KeyFromMetadata("order_id"), meta("order_id", "a\xffb"), false,
			`key "a\xffb" is not valid UTF-8 text without NUL bytes`},
		{"key function panics", func(*message.Message) (string, error) { panic("boom") }, meta("x", "y"), false,
			`key function panicked: boom`},
		{"key function returns an empty key", func(*message.Message) (string, error) { return "", nil }, meta("x", "y"), true,
			`key function returned an empty key: middleware: message key is empty`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			k, err := keyOf(tc.fn, tc.msg)
			if err == nil {
				t.Fatalf("key %q accepted", k)
			}
			if got := err.Error(); got != prefix+tc.want {
				t.Fatalf("error\n got %s\nwant %s", got, prefix+tc.want)
			}
			if !errors.Is(err, ErrKey) || !IsPermanent(err) || errors.Is(err, ErrEmptyKey) != tc.empty {
				t.Fatalf("error %v: ErrKey %v, permanent %v, ErrEmptyKey %v (want %v)",
					err, errors.Is(err, ErrKey), IsPermanent(err), errors.Is(err, ErrEmptyKey), tc.empty)
			}
		})
	}
}

// TestKeyFromJSONNumbers: one key for every spelling of a number's value.
func TestKeyFromJSONNumbers(t *testing.T) {
	for want, spellings := range map[string][]string{
		"1":        {"1", "1.0", "1e0", "10e-1", "0.1e1", "1.000E+0"},
		"-42":      {"-42", "-42.00", "-4.2e1", "-420e-1"},
		"0":        {"0", "-0", "0.0", "0e5", "-0.0e-9", "0e99999999999999999999"},
		"1.5":      {"1.5", "1.50", "15e-1", "0.15E1"},
		"0.000123": {"0.000123", "1.23e-4", "123e-6"},
		"12300":    {"12300", "1.23e4", "123e2", "12300.000"},
	} {
		for _, s := range spellings {
			got, err := KeyFromJSON("id")(message.NewMessage("u", []byte(`{"id":`+s+`}`)))
			if err != nil || got != want {
				t.Errorf("%s: got %q, %v; want %q", s, got, err, want)
			}
		}
	}
}
