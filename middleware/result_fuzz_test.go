package middleware

import (
	"bytes"
	"encoding/json"
	"errors"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
)

// FuzzStoredResult: the messages a handler produced, stored with its
// claim, come back from the stored result with the same UUIDs, payloads
// and metadata, whatever their bytes (a duplicate delivery publishes them
// again, and the next consumer's inbox deduplicates by UUID); and stored
// bytes that are not a result decode to an error wrapping ErrBadResult,
// never a panic.
func FuzzStoredResult(f *testing.F) {
	f.Add("order-1", []byte(`{"total":10}`), "trace_id", "tr-1", uint8(2), []byte(nil))
	f.Add("", []byte{}, "", "", uint8(1), []byte(`[{"uuid":"a","payload":"AA=="}]`))
	f.Add("\xff\xfe", []byte{0, 0xff}, "k\xff", "\x00v", uint8(3), []byte(`{`))
	f.Add("u", []byte(nil), "k", "v", uint8(0), []byte(`[{"uuid":"a","raw_metadata":["AA=="]}]`))
	f.Add("u", []byte("p"), "k", "v", uint8(1), []byte(`[{"raw_uuid":"/w==","payload":null,"raw_metadata":["aw==","dg=="]}]`))
	f.Fuzz(func(t *testing.T, uuid string, payload []byte, key, value string, n uint8, stored []byte) {
		var msgs []*message.Message
		for i := range int(n % 4) {
			m := message.NewMessage(uuid+string(rune('a'+i)), payload)
			if i > 0 {
				m.Metadata.Set(key, value)
				m.Metadata.Set("n", string(rune('0'+i)))
			}
			msgs = append(msgs, m)
		}
		b, err := encodeResult(msgs)
		if err != nil {
			t.Fatalf("encode: %v", err)
		}
		got, err := decodeResult(b)
		if err != nil {
			t.Fatalf("decode what encode wrote (%q): %v", b, err)
		}
		if len(got) != len(msgs) {
			t.Fatalf("%d messages stored, %d back", len(msgs), len(got))
		}
		for i, m := range msgs {
			g := got[i]
			if g.UUID != m.UUID {
				t.Fatalf("message %d: uuid %q stored, %q back", i, m.UUID, g.UUID)
			}
			if !bytes.Equal(g.Payload, m.Payload) {
				t.Fatalf("message %d: payload %q stored, %q back", i, m.Payload, g.Payload)
			}
			if len(g.Metadata) != len(m.Metadata) {
				t.Fatalf("message %d: metadata %q stored, %q back", i, m.Metadata, g.Metadata)
			}
			for k, v := range m.Metadata {
				if g.Metadata[k] != v {
					t.Fatalf("message %d: metadata %q = %q stored, %q back", i, k, v, g.Metadata[k])
				}
			}
		}

		if _, err := decodeResult(stored); err != nil && !errors.Is(err, ErrBadResult) {
			t.Fatalf("stored %q: error %v does not wrap ErrBadResult", stored, err)
		} else if err == nil && len(stored) > 0 && !json.Valid(stored) {
			t.Fatalf("stored %q is not JSON and decoded", stored)
		}
	})
}
