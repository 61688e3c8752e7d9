package forwarder_test

import (
	"bytes"
	"context"
	"errors"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/forwarder"
	"github.com/oncemill/oncemill/internal/sqldb"
	"github.com/oncemill/oncemill/internal/testing/sqltest"
	"github.com/oncemill/oncemill/sqlschema"
)

// FuzzScheduledRow, on SQLite: a scheduled message with any topic, UUID,
// partition key, metadata, payload and due time, written through the
// outbox's publisher, is refused with a reason (a topic that is not text,
// a due time past year 9999, one that is not an RFC 3339 time) or written,
// and once due is published once with its UUID, payload and metadata byte
// for byte. A row written into the scheduled table by plain SQL, with any
// metadata column and due time, never fails the relay's move nor its
// batch: it is published once due, dead-lettered with the reason when the
// relay cannot publish it (its metadata, an empty topic or uuid, a due time
// no relay reaches), or still waits for its due time; never two of these.
func FuzzScheduledRow(f *testing.F) {
	db := sqltest.OpenSQLite(f, filepath.Join(f.TempDir(), "outbox.db"))
	if err := sqlschema.MigrateSQLite(context.Background(), db, sqlschema.Config{}); err != nil {
		f.Fatal(err)
	}
	o := outboxUnderTest{Database: sqltest.Database{DB: db, Dialect: sqlschema.SQLite}}
	o.sql = o.Database.SQL()
	o.d = o.sql.Dialect()
	o.names = o.d.Names(sqlschema.Config{})
	f.Add("orders", "uuid-1", "acct-1", "trace_id", "tr-1", []byte("1"), time.Now().Add(time.Hour).UnixMicro(), false, []byte(`{}`))
	f.Add("orders", "uuid-\x00", "\x00\x00\x00\x00\x00\x00\x00*", "h", "\x00\xff", []byte{0xff}, int64(0), true, []byte(`{"a":"b"}`))
	f.Add("", "", "", "", "", []byte(nil), int64(1)<<62, true, []byte(`[]`))
	f.Add("or\x00ders", "u", "k", "k", "v", []byte{}, int64(-1)<<62, false, []byte(nil))
	f.Add("orders", "u", "k", sqldb.ExactKey, "{", []byte{}, time.Date(12000, 1, 1, 0, 0, 0, 0, time.UTC).UnixMicro(), false, []byte(nil))
	f.Fuzz(func(t *testing.T, topic, uuid, key, mdKey, mdValue string, payload []byte, due int64, plain bool, rawMetadata []byte) {
		ctx := context.Background()
		defer func() {
			for _, table := range []string{o.names.Outbox, o.names.Scheduled, o.names.DLQ} {
				if _, err := o.sql.Exec(ctx, `DELETE FROM `+table); err != nil {
					t.Fatalf("clean %s: %v", table, err)
				}
			}
		}()
		s := &timedSink{}
		r, err := forwarder.NewRelay(forwarder.RelayConfig{DB: db, Dialect: sqlschema.SQLite, Publisher: s})
		if err != nil {
			t.Fatal(err)
		}
		relay := func() {
			t.Helper()
			if _, err := r.PromoteDue(ctx); err != nil {
				t.Fatalf("move: %v", err)
			}
			if _, err := r.RelayBatch(ctx); err != nil {
				t.Fatalf("batch: %v", err)
			}
		}

		if plain {
			_, err := o.sql.Exec(ctx, `INSERT INTO `+o.names.Scheduled+` (topic, uuid, partition_key, payload, metadata, due_at) VALUES (?, ?, ?, ?, ?, ?)`,
				topic, uuid, key, payload, string(rawMetadata), due)
			if err != nil {
				t.Fatalf("plain insert: %v", err)
			}
			relay()
			ids, _ := s.published()
			waiting, refused := o.scheduledCount(t), len(o.dead(t))
			if len(ids)+waiting+refused != 1 {
				t.Fatalf("row (%q, %q, due %d, metadata %q): published %d, waiting %d, refused %d; want one of them", topic, uuid, due, rawMetadata, len(ids), waiting, refused)
			}
			if waiting == 1 && (due <= time.Now().UnixMicro() || due > forwarder.MaxDueAt.UnixMicro()) {
				t.Fatalf("row due at %d still waits", due)
			}
			if len(ids) == 1 && (!bytes.Equal(s.message(ids[0]).Payload, payload) || topic == "") {
				t.Fatalf("row published as %q %q", ids[0], s.message(ids[0]).Payload)
			}
			return
		}

		m := message.NewMessage(uuid, payload)
		m.Metadata.Set(mdKey, mdValue)
		m.Metadata.Set(delivery.PartitionKey, key)
		forwarder.PublishAt(m, time.UnixMicro(due))
		want := m.Copy()
		if err := o.write(ctx, topic, true, m); err != nil {
			if !errors.Is(err, sqldb.ErrNotStorable) && !errors.Is(err, forwarder.ErrDueTooLate) && !strings.Contains(err.Error(), "is not an RFC 3339 time") {
				t.Fatalf("write (%q, %q, due %d) refused without a reason of its own: %v", topic, uuid, due, err)
			}
			if o.scheduledCount(t) != 0 || o.pending(t) != 0 {
				t.Fatal("a refused write left rows")
			}
			return
		}
		if _, err := o.sql.Exec(ctx, `UPDATE `+o.names.Scheduled+` SET due_at = 0`); err != nil {
			t.Fatal(err)
		}
		relay()
		if topic == "" || uuid == "" {
			if len(o.dead(t)) != 1 {
				t.Fatalf("message without topic or uuid not dead-lettered")
			}
			return
		}
		ids, _ := s.published()
		if len(ids) != 1 {
			t.Fatalf("published %d messages of one", len(ids))
		}
		got := s.message(ids[0])
		if got.UUID != want.UUID || !bytes.Equal(got.Payload, want.Payload) || len(got.Metadata) != len(want.Metadata) {
			t.Fatalf("published %q %q %q, want %q %q %q", got.UUID, got.Payload, got.Metadata, want.UUID, want.Payload, want.Metadata)
		}
		for k, v := range want.Metadata {
			if got.Metadata.Get(k) != v {
				t.Fatalf("metadata %q: %q published as %q", k, v, got.Metadata.Get(k))
			}
		}
	})
}
