package dlq_test

import (
	"bytes"
	"context"
	"errors"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	_ "modernc.org/sqlite"

	"github.com/oncemill/oncemill/adapters"
	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/dlq"
	"github.com/oncemill/oncemill/internal/sqldb"
	"github.com/oncemill/oncemill/internal/testing/sqltest"
	"github.com/oncemill/oncemill/sqlschema"
)

// storable is s as the dead-letter table stores text: valid UTF-8, no NUL.
func storable(s string) string {
	return strings.ReplaceAll(strings.ToValidUTF8(s, "\uFFFD"), "\x00", "\uFFFD")
}

// FuzzDeadLetter, on SQLite: a message dead-lettered with any UUID,
// payload, metadata and dead-letter fields is one entry whose fields read
// back as written (identifiers in their sqldb.Ident form, bounded and
// digested when not text, text made storable, a count that
// is not one read as 0), and whose replay publishes the same UUID (whole),
// payload and metadata, without the failed delivery's facts, with a fresh
// grant; an entry with no topic is refused with ErrNoTopic, one whose key
// has no record with ErrNoDeadKey, both left in the table; a filter out
// of range is refused with ErrInvalidFilter.
func FuzzDeadLetter(f *testing.F) {
	db := sqltest.OpenSQLite(f, filepath.Join(f.TempDir(), "dlq.db"))
	if err := sqlschema.MigrateSQLite(context.Background(), db, sqlschema.Config{}); err != nil {
		f.Fatal(err)
	}
	pub, err := dlq.NewSQLPublisher(db, sqlschema.SQLite, sqlschema.Config{})
	if err != nil {
		f.Fatal(err)
	}
	store, err := dlq.NewSQLStore(db, sqlschema.SQLite, sqlschema.Config{})
	if err != nil {
		f.Fatal(err)
	}
	f.Add("uuid-1", []byte(`{"order":1}`), "orders", "charge", "key-1", "declined", "3", "trace_id", "tr-1", 0, int64(1))
	f.Add("uuid-2", []byte{}, "orders", "", "", "", "x", "", "", 5, int64(0))
	f.Add(strings.Repeat("u", 600), []byte{0, 0xff}, "", "charge", "k", "e", "-1", "k\x00", "\xff", -1, int64(-3))
	f.Add("\xff\x00", []byte(nil), "orders", "charge", "", "e", "99999999999", delivery.DeadPrefix+"x", "v", 1, int64(2))
	f.Fuzz(func(t *testing.T, uuid string, payload []byte, topic, consumer, key, errText, attempts, mdKey, mdValue string, limit int, id int64) {
		ctx := context.Background()
		m := message.NewMessage(uuid, payload)
		m.Metadata.Set(delivery.DeadTopic, topic)
		m.Metadata.Set(delivery.DeadConsumer, consumer)
		m.Metadata.Set(delivery.DeadKey, key)
		m.Metadata.Set(delivery.DeadError, errText)
		m.Metadata.Set(delivery.DeadAttempts, attempts)
		m.Metadata.Set(delivery.DeadPermanent, "true")
		m.Metadata.Set(mdKey, mdValue)
		if err := pub.Publish("orders.dlq", m); err != nil {
			t.Fatalf("dead-letter %q: %v", uuid, err)
		}
		entries, err := store.List(ctx, dlq.Filter{})
		if err != nil || len(entries) != 1 {
			t.Fatalf("one message dead-lettered, %d entries: %v", len(entries), err)
		}
		e := entries[0]
		defer func() {
			if _, err := store.Purge(ctx, dlq.Filter{All: true}); err != nil {
				t.Fatalf("purge: %v", err)
			}
		}()
		wantAttempts, perr := strconv.ParseInt(strings.TrimSpace(attempts), 10, 32)
		if perr != nil || wantAttempts < 0 {
			wantAttempts = 0
		}
		switch {
		case e.UUID != sqldb.Ident(uuid):
			t.Fatalf("uuid %q stored as %q", uuid, e.UUID)
		case e.Topic != sqldb.Ident(topic) || e.Consumer != sqldb.Ident(consumer) || e.Key != sqldb.Ident(key):
			t.Fatalf("topic, consumer, key %q %q %q stored as %q %q %q", topic, consumer, key, e.Topic, e.Consumer, e.Key)
		case e.Error != storable(errText):
			t.Fatalf("error %q stored as %q", errText, e.Error)
		case int64(e.Attempts) != wantAttempts:
			t.Fatalf("attempts %q stored as %d, want %d", attempts, e.Attempts, wantAttempts)
		case !e.Permanent:
			t.Fatal("permanent stored as false")
		case !bytes.Equal(e.Payload, payload):
			t.Fatalf("payload %q stored as %q", payload, e.Payload)
		}
		back := e.Message("")
		if back.UUID != storable(uuid) {
			t.Fatalf("uuid %q replays as %q", uuid, back.UUID)
		}
		if !delivery.IsDeliveryFact(mdKey) && back.Metadata.Get(storable(mdKey)) != storable(mdValue) {
			t.Fatalf("metadata %q: %q replays as %q", mdKey, mdValue, back.Metadata)
		}
		for k := range back.Metadata {
			if delivery.IsDeliveryFact(k) {
				t.Fatalf("replay carries the delivery fact %q", k)
			}
		}

		broker := adapters.NewGoChannel(gochannel.Config{Persistent: true, OutputChannelBuffer: 1}, nil)
		defer broker.Close()
		n, err := store.Replay(ctx, broker, dlq.Filter{IDs: []int64{e.ID}}, nil)
		switch {
		case e.Topic == "":
			if !errors.Is(err, dlq.ErrNoTopic) || n != 0 {
				t.Fatalf("entry without topic: replayed %d, %v; want ErrNoTopic", n, err)
			}
		case e.Consumer != "" && e.Key != "":
			if !errors.Is(err, dlq.ErrNoDeadKey) || n != 0 {
				t.Fatalf("entry whose key has no record: replayed %d, %v; want ErrNoDeadKey", n, err)
			}
		default:
			if err != nil || n != 1 {
				t.Fatalf("replay: %d, %v", n, err)
			}
			msgs, err := broker.Subscribe(ctx, e.Topic)
			if err != nil {
				t.Fatal(err)
			}
			select {
			case got := <-msgs:
				got.Ack()
				if got.UUID != back.UUID || !bytes.Equal(got.Payload, payload) || len(got.Metadata.Get(delivery.Replay)) != 32 {
					t.Fatalf("replayed %q %q %q, want uuid %q payload %q and a grant", got.UUID, got.Payload, got.Metadata, back.UUID, payload)
				}
			case <-time.After(5 * time.Second):
				t.Fatal("replay published nothing")
			}
			return
		}
		if left, err := store.Count(ctx, dlq.Filter{}); err != nil || left != 1 {
			t.Fatalf("refused replay left %d entries, %v; want the entry kept", left, err)
		}

		_, err = store.Count(ctx, dlq.Filter{Limit: limit, IDs: []int64{id}})
		if (limit < 0 || id <= 0) != errors.Is(err, dlq.ErrInvalidFilter) {
			t.Fatalf("filter limit %d id %d: %v", limit, id, err)
		}
		if limit < 0 && !strings.Contains(err.Error(), "Limit") || limit >= 0 && id <= 0 && !strings.Contains(err.Error(), "IDs[0]") {
			t.Fatalf("filter limit %d id %d: error %q does not name the field", limit, id, err)
		}
	})
}
