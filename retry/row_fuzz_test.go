package retry_test

import (
	"bytes"
	"context"
	"errors"
	"path/filepath"
	"testing"
	"time"

	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/dlq"
	"github.com/oncemill/oncemill/internal/sqldb"
	"github.com/oncemill/oncemill/internal/testing/sqltest"
	"github.com/oncemill/oncemill/retry"
	"github.com/oncemill/oncemill/sqlschema"
)

// FuzzRetryRow, on SQLite: a message parked with any consumer, topic,
// UUID, key, ordering key, error, metadata and payload is refused with
// ErrNotParkable when it names no consumer, topic or UUID, and is
// otherwise parked once (a copy is not written again); Waiting finds its
// ordering key by its bytes; the list finds it by the values given and
// reads it back with its UUID, payload and metadata byte for byte, its
// error as text and its identifiers in their stored form; a cancel moves
// it into the dead-letter table with its payload, and nothing is left.
func FuzzRetryRow(f *testing.F) {
	db := sqltest.OpenSQLite(f, filepath.Join(f.TempDir(), "retries.db"))
	if err := sqlschema.MigrateSQLite(context.Background(), db, sqlschema.Config{}); err != nil {
		f.Fatal(err)
	}
	store, err := retry.NewSQLStore(db, sqlschema.SQLite, sqlschema.Config{})
	if err != nil {
		f.Fatal(err)
	}
	pub, err := dlq.NewSQLPublisher(db, sqlschema.SQLite, sqlschema.Config{})
	if err != nil {
		f.Fatal(err)
	}
	dead, err := dlq.NewSQLStore(db, sqlschema.SQLite, sqlschema.Config{})
	if err != nil {
		f.Fatal(err)
	}
	f.Add("charge", "orders", "uuid-1", "key-1", "acct-1", "gateway 503", "trace_id", "tr-1", []byte(`{"order":1}`), false)
	f.Add("charge", "orders", "uuid-2", "", kafkaKey, "\x00\xff", delivery.PartitionKey, kafkaKey, []byte{0, 0xff}, true)
	f.Add("", "orders", "u", "k", "", "", "", "", []byte(nil), false)
	f.Add("c\xff", "t\x00", string(make([]byte, 600)), "k\x00", "o\xff", "e", sqldb.ExactKey, "\xff", []byte{}, false)
	f.Fuzz(func(t *testing.T, consumer, topic, uuid, key, order, errText, mdKey, mdValue string, payload []byte, behind bool) {
		ctx := context.Background()
		m := retry.Message{Consumer: consumer, Topic: topic, UUID: uuid, Key: key, OrderKey: order, Attempts: 2, Error: errText,
			Behind: behind, DueAt: time.Now().Add(-time.Second), Payload: payload, Metadata: map[string]string{mdKey: mdValue}}
		wrote, err := store.Park(ctx, m)
		if consumer == "" || topic == "" || uuid == "" {
			if !errors.Is(err, retry.ErrNotParkable) || wrote {
				t.Fatalf("park without consumer, topic or UUID: %t, %v; want ErrNotParkable", wrote, err)
			}
			return
		}
		if err != nil || !wrote {
			t.Fatalf("park: %t, %v", wrote, err)
		}
		defer func() {
			if _, err := dead.Purge(ctx, dlq.Filter{All: true}); err != nil {
				t.Fatalf("purge: %v", err)
			}
		}()
		if again, err := store.Park(ctx, m); err != nil || again {
			t.Fatalf("a copy parked again: %t, %v", again, err)
		}
		if order != "" {
			if waiting, err := store.Waiting(ctx, consumer, topic, order); err != nil || !waiting {
				t.Fatalf("Waiting(%q): %t, %v", order, waiting, err)
			}
		}
		listed, err := store.List(ctx, retry.Filter{Consumer: consumer, Topic: topic, UUID: uuid, Key: key, OrderKey: order})
		if err != nil || len(listed) != 1 {
			t.Fatalf("list: %d, %v", len(listed), err)
		}
		got := listed[0]
		wantOrder := ""
		if order != "" {
			wantOrder = sqldb.Ident(order)
		}
		switch {
		case got.UUID != uuid:
			t.Fatalf("uuid %q read as %q", uuid, got.UUID)
		case !bytes.Equal(got.Payload, payload):
			t.Fatalf("payload %q read as %q", payload, got.Payload)
		case len(got.Metadata) != 1 || got.Metadata[mdKey] != mdValue:
			t.Fatalf("metadata {%q: %q} read as %q", mdKey, mdValue, got.Metadata)
		case got.Error != sqldb.CleanText(errText):
			t.Fatalf("error %q read as %q", errText, got.Error)
		case got.Consumer != sqldb.Ident(consumer) || got.Topic != sqldb.Ident(topic) || got.Key != sqldb.Ident(key) || got.OrderKey != wantOrder:
			t.Fatalf("identifiers %q %q %q %q read as %q %q %q %q", consumer, topic, key, order, got.Consumer, got.Topic, got.Key, got.OrderKey)
		case got.Behind != behind:
			t.Fatalf("behind %t read as %t", behind, got.Behind)
		}
		n, err := store.Cancel(ctx, retry.Filter{IDs: []int64{got.ID}}, pub, "")
		if err != nil || n != 1 {
			t.Fatalf("cancel: %d, %v", n, err)
		}
		if left, err := store.Count(ctx, retry.Filter{}); err != nil || left != 0 {
			t.Fatalf("%d parked after the cancel, %v", left, err)
		}
		entries, err := dead.List(ctx, dlq.Filter{})
		if err != nil || len(entries) != 1 || !bytes.Equal(entries[0].Payload, payload) {
			t.Fatalf("dead letters after the cancel: %v, %v", entries, err)
		}
	})
}
