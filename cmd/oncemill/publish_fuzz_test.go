package main

import (
	"bytes"
	"io"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/oncemill/oncemill/delivery"
)

// FuzzPublishLines: any standard input of "oncemill publish", with or
// without --key, is checked the same from a file (read twice) and from a
// pipe (copied aside): refused with the same error, or accepted with one
// message per line that is not blank, no more, no fewer, in order. An
// accepted message carries what its line says and nothing the decoders
// guessed: its key is the line's, or --key's when the line has none,
// never empty; its metadata and text are UTF-8; and no U+FFFD appears in
// it that the line did not write itself.
func FuzzPublishLines(f *testing.F) {
	f.Add(`{"payload":{"orderId":"A-42"}}`+"\n\n"+`{"payload":"PAYMENT OK","key":"A-42"}`, "")
	f.Add(`{"uuid":"u-1","key":"A-42","partition_key":"c-1","metadata":{"source":"cli"},"payload":"x"}`, "fallback")
	f.Add(`{"key":"A-42","key":"A-43","payload":"x"}`, "")
	f.Add(`{"payload":"x","metadata":{"a":"1","a":"2"}}`, "")
	f.Add(`{"key":"","payload":"x"}`, "fallback")
	f.Add("{\"payload\":\"caf\xe9\"}", "")
	f.Add(`{"payload":"\ud83d\ude00 \ud83d"}`, "")
	f.Add(`{"payload":"\ufffd is U+FFFD"}`, "")
	f.Add("\r\n  \n{\"payload\":[1,2,{\"b\":null}]}\r\n", "k")
	f.Add(`{"payload":"x"} {"payload":"y"}`, "")
	f.Fuzz(func(t *testing.T, stdin, key string) {
		if !utf8.ValidString(key) {
			t.Skip("--key is a command-line argument, not a line")
		}
		defaults := publishLine{Key: key}
		type run struct {
			msgs []*message.Message
			from []string
			err  string
		}
		read := func(r io.Reader) run {
			in, err := checkPublishInput(r, defaults)
			if err != nil {
				return run{err: err.Error()}
			}
			var got run
			err = in.each(func(o outgoing) error {
				got.msgs = append(got.msgs, o.msg)
				got.from = append(got.from, o.from)
				return nil
			})
			if err != nil {
				t.Fatalf("checked, then refused when read again: %v", err)
			}
			if err := in.close(); err != nil {
				t.Fatalf("close: %v", err)
			}
			if len(got.msgs) != in.lines {
				t.Fatalf("%d lines checked, %d messages read again", in.lines, len(got.msgs))
			}
			return got
		}
		file := read(strings.NewReader(stdin))
		pipe := read(struct{ io.Reader }{strings.NewReader(stdin)})
		if file.err != pipe.err || len(file.msgs) != len(pipe.msgs) || strings.Join(file.from, ",") != strings.Join(pipe.from, ",") {
			t.Fatalf("a file and a pipe differ: %q %v, %q %v", file.err, file.from, pipe.err, pipe.from)
		}
		if file.err != "" {
			return
		}
		wroteFFFD := strings.Contains(stdin+key, "\uFFFD") || strings.Contains(strings.ToLower(stdin), `\ufffd`)
		for i, msg := range file.msgs {
			other := pipe.msgs[i]
			if !bytes.Equal(msg.Payload, other.Payload) || msg.Metadata.Get(delivery.IdempotencyKey) != other.Metadata.Get(delivery.IdempotencyKey) {
				t.Fatalf("%s: a file and a pipe give different messages", file.from[i])
			}
			k, hasKey := msg.Metadata[delivery.IdempotencyKey]
			if hasKey && k == "" {
				t.Fatalf("%s: an empty key was sent", file.from[i])
			}
			if key != "" && !hasKey {
				t.Fatalf("%s: --key %q was not applied", file.from[i], key)
			}
			texts := []string{msg.UUID}
			for name, value := range msg.Metadata {
				texts = append(texts, name, value)
			}
			for _, s := range texts {
				if !utf8.ValidString(s) {
					t.Fatalf("%s: %q is not UTF-8", file.from[i], s)
				}
				if !wroteFFFD && strings.ContainsRune(s, utf8.RuneError) {
					t.Fatalf("%s: U+FFFD in %q that the line did not write", file.from[i], s)
				}
			}
			if !wroteFFFD && bytes.ContainsRune(msg.Payload, utf8.RuneError) {
				t.Fatalf("%s: U+FFFD in the payload %q that the line did not write", file.from[i], msg.Payload)
			}
		}
	})
}
