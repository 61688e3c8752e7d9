package forwarder

import (
	"encoding/json"
	"errors"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/internal/sqldb"
)

// refuseSpaces is a publisher's topic rule for the fuzz target: a topic
// with a space is refused, as NATS refuses one.
func refuseSpaces(topic string) error {
	if strings.ContainsRune(topic, ' ') {
		return errors.New("the topic has a space")
	}
	return nil
}

// FuzzOutboxRow: the relay's reading of an outbox row. A row it refuses
// says why, wrapping ErrRefusedRow, in a reason of bounded length, and its
// dead letter's metadata is a JSON object of strings that keeps the row's
// uuid when the letter is filed under another; a row it accepts has a
// topic and a uuid, and its metadata comes back key for key.
func FuzzOutboxRow(f *testing.F) {
	f.Add("orders", "uuid-1", []byte(`{"trace_id":"tr-1"}`), "k", "v", false)
	f.Add("", "uuid-1", []byte(`{}`), "k", "v", true)
	f.Add("orders", "", []byte(`null`), "", "", false)
	f.Add("with space", "u", []byte(`{"a":1}`), "k\xff", "v", true)
	f.Add("orders", "u", []byte(`[]`), "k", "\x00", false)
	f.Add("orders", "u", []byte("\xff{"), "k", "v", true)
	f.Fuzz(func(t *testing.T, topic, uuid string, raw []byte, key, value string, taken bool) {
		for _, metadata := range [][]byte{raw, mustJSON(t, map[string]string{key: value})} {
			md, gotUUID, err := checkRow(topic, uuid, metadata, refuseSpaces)
			if err != nil {
				if !errors.Is(err, ErrRefusedRow) {
					t.Fatalf("row (%q, %q, %q): reason %v does not wrap ErrRefusedRow", topic, uuid, metadata, err)
				}
				// The column's text is quoted from its first 500 bytes,
				// \xNN for each byte that is not UTF-8.
				if n := len(err.Error()); n > 3000 {
					t.Fatalf("row (%q, %q, %q): reason of %d bytes", topic, uuid, metadata, n)
				}
				x := row{id: 7, topic: topic, uuid: gotUUID, metadata: md, refused: err}
				checkDeadLetter(t, x, taken)
				continue
			}
			if topic == "" || uuid == "" || refuseSpaces(topic) != nil {
				t.Fatalf("row (%q, %q, %q) accepted", topic, uuid, metadata)
			}
			var want map[string]string
			if json.Unmarshal(metadata, &want) != nil {
				t.Fatalf("row metadata %q accepted, but it is not a JSON object of strings", metadata)
			}
			if _, exact := want[sqldb.ExactKey]; exact {
				continue // what it keeps comes back decoded: sqldb's TestMetadataRoundTrip
			}
			if gotUUID != uuid {
				t.Fatalf("row uuid %q read as %q", uuid, gotUUID)
			}
			if len(md) != len(want) {
				t.Fatalf("metadata %q read as %q", metadata, md)
			}
			for k, v := range want {
				if md[k] != v {
					t.Fatalf("metadata %q: %q read as %q, want %q", metadata, k, md[k], v)
				}
			}
		}
		if utf8.ValidString(key) && utf8.ValidString(value) && topic != "" && uuid != "" && refuseSpaces(topic) == nil {
			md, _, err := checkRow(topic, uuid, mustJSON(t, map[string]string{key: value}), refuseSpaces)
			if err != nil || key != sqldb.ExactKey && md[key] != value {
				t.Fatalf("metadata {%q: %q} read as %q, %v", key, value, md, err)
			}
		}
	})
}

// checkDeadLetter files the refused row x as deadLetterRow does, the
// table holding its uuid already when taken, and checks what it wrote.
func checkDeadLetter(t *testing.T, x row, taken bool) {
	t.Helper()
	var uuids []string
	err := deadLetterRow(x, func(uuid, metadata string) (bool, error) {
		var md map[string]string
		if err := json.Unmarshal([]byte(metadata), &md); err != nil {
			t.Fatalf("dead letter metadata %q is not a JSON object of strings: %v", metadata, err)
		}
		if len(uuid) > delivery.MaxBoundBytes {
			t.Fatalf("dead letter uuid of %d bytes, more than %d", len(uuid), delivery.MaxBoundBytes)
		}
		// A uuid that is not text (not UTF-8, or with NUL) cannot be kept
		// as JSON text in every database: it is kept with U+FFFD in place
		// of those bytes, as the table keeps text.
		if uuid != x.uuid && (md[delivery.DeadUUID] != sqldb.CleanText(x.uuid) || md[delivery.DeadUUID] == "" && x.uuid != "") {
			t.Fatalf("dead letter filed under %q keeps %q as the row's uuid, want %q", uuid, md[delivery.DeadUUID], x.uuid)
		}
		uuids = append(uuids, uuid)
		return !(taken && len(uuids) == 1), nil
	})
	if err != nil {
		t.Fatalf("dead letter: %v", err)
	}
	if want := map[bool]int{false: 1, true: 2}[taken]; len(uuids) != want || (taken && uuids[0] == uuids[1]) {
		t.Fatalf("dead letters written under %q, taken %t", uuids, taken)
	}
}

func mustJSON(t *testing.T, v any) []byte {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return b
}
