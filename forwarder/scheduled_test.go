package forwarder_test

import (
	"context"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/forwarder"
	"github.com/oncemill/oncemill/internal/testing/sqltest"
	"github.com/oncemill/oncemill/sqlschema"
)

// timedSink records what the relay published and when.
type timedSink struct {
	mu   sync.Mutex
	msgs []*message.Message
	at   []time.Time
}

func (s *timedSink) Publish(_ string, msgs ...*message.Message) error {
	now := time.Now()
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, m := range msgs {
		s.msgs = append(s.msgs, m)
		s.at = append(s.at, now)
	}
	return nil
}

func (s *timedSink) Close() error { return nil }

// published returns the UUIDs published, in order, and when each went.
func (s *timedSink) published() ([]string, map[string][]time.Time) {
	s.mu.Lock()
	defer s.mu.Unlock()
	ids, at := make([]string, len(s.msgs)), map[string][]time.Time{}
	for i, m := range s.msgs {
		ids[i] = m.UUID
		at[m.UUID] = append(at[m.UUID], s.at[i])
	}
	return ids, at
}

// message returns the message published as uuid, or nil.
func (s *timedSink) message(uuid string) *message.Message {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, m := range s.msgs {
		if m.UUID == uuid {
			return m
		}
	}
	return nil
}

// named is a message of key whose UUID is name, for the order asserts.
func named(name, key string) *message.Message {
	m := message.NewMessage(name+"-"+watermill.NewShortUUID(), []byte(name))
	m.Metadata.Set(delivery.PartitionKey, key)
	return m
}

// scheduledCount counts the rows of the scheduled table.
func (o outboxUnderTest) scheduledCount(t *testing.T) int {
	t.Helper()
	var n int
	require.NoError(t, o.sql.QueryRow(context.Background(), `SELECT COUNT(*) FROM `+o.names.Scheduled).Scan(&n))
	return n
}

// TestScheduledOnEveryBackend: on PostgreSQL through pgx and through
// database/sql, on MariaDB and on SQLite, messages of one key written
// with due times 1 to 2 s ahead wait in the scheduled table (Lag counts
// them, not as pending, and names the earliest due time), are not
// published before their due times, and are each published once after
// them, within a generous bound; the key's rows go out in (due time,
// write) order: the immediate rows written before the due times first,
// a row whose due time had passed when it was written as an immediate
// one, then the scheduled ones by due time, two with the same due time
// in their write order, and a row written after they went out last. A
// malformed due time fails the write.
func TestScheduledOnEveryBackend(t *testing.T) {
	t.Parallel()
	for _, backend := range sqltest.Backends {
		t.Run(backend.Name, func(t *testing.T) {
			t.Parallel()
			o := openOutbox(t, backend)
			ctx := context.Background()
			const key = "order-7"
			start := time.Now()
			late, early := start.Add(2*time.Second), start.Add(1200*time.Millisecond)

			first := named("first", key)
			past := named("past", key)
			forwarder.PublishAt(past, start.Add(-time.Second))
			schedLate := named("sched-late", key)
			forwarder.PublishAt(schedLate, late)
			schedEarly1 := named("sched-early-1", key)
			forwarder.PublishAt(schedEarly1, early)
			schedEarly2 := named("sched-early-2", key)
			forwarder.PublishAt(schedEarly2, early)
			other := named("other-key", "order-8")
			forwarder.Delay(other, 1500*time.Millisecond)
			second := named("second", key)

			require.NoError(t, o.write(ctx, "orders", true, first))
			require.NoError(t, o.write(ctx, "orders", true, past, schedLate, schedEarly1))
			require.NoError(t, o.write(ctx, "orders", true, schedEarly2, other))
			require.NoError(t, o.write(ctx, "orders", true, second))

			bad := named("bad", key)
			bad.Metadata.Set(forwarder.DueAtKey, "tomorrow")
			require.ErrorContains(t, o.write(ctx, "orders", true, named("ok", key), bad), `metadata oncemill_due_at "tomorrow" is not an RFC 3339 time`)

			lag := o.lag(t)
			require.Equal(t, 3, lag.Pending, "first, past and second are in the outbox")
			require.Equal(t, 4, lag.Scheduled, "four rows wait for their due time")
			require.Equal(t, early.UnixMicro(), lag.NextDue.UnixMicro(), "the earliest due time, to the microsecond")
			require.Equal(t, 4, o.scheduledCount(t))

			s := &timedSink{}
			// LockOrderedWriters: the writes above are one after the
			// other, and the promoted rows need not wait for the other
			// tests' transactions on the shared server, which the
			// lateness bound below would feel.
			r := o.relay(t, s, func(c *forwarder.RelayConfig) { c.LockOrderedWriters = true })
			run(t, r)
			require.Eventually(t, func() bool {
				ids, _ := s.published()
				return len(ids) >= 7 && o.pending(t) == 0 && o.scheduledCount(t) == 0
			}, 20*time.Second, 10*time.Millisecond, "every row published, both tables drained")
			after := named("after", key)
			require.NoError(t, o.write(ctx, "orders", true, after))
			require.Eventually(t, func() bool { ids, _ := s.published(); return len(ids) >= 8 }, 10*time.Second, 10*time.Millisecond)

			ids, at := s.published()
			var order []string
			for _, id := range ids {
				if !strings.HasPrefix(id, "other-key") {
					order = append(order, id)
				}
			}
			want := []*message.Message{first, past, second, schedEarly1, schedEarly2, schedLate, after}
			require.Len(t, order, len(want), "each message once: %v", ids)
			for i, m := range want {
				require.Equal(t, m.UUID, order[i], "%s: position %d of %v", key, i, order)
			}
			for _, c := range []struct {
				m   *message.Message
				due time.Time
			}{{schedEarly1, early}, {schedEarly2, early}, {schedLate, late}, {other, start.Add(1500 * time.Millisecond)}} {
				require.Len(t, at[c.m.UUID], 1, "%s published once", c.m.UUID)
				went := at[c.m.UUID][0]
				require.False(t, went.Before(c.due), "%s published %s before its due time", c.m.UUID, c.due.Sub(went))
				require.Less(t, went.Sub(c.due), 5*time.Second, "%s published within a generous bound of its due time", c.m.UUID)
			}
			require.Equal(t, late.UTC().Format(time.RFC3339Nano), s.message(schedLate.UUID).Metadata.Get(forwarder.DueAtKey),
				"the published message keeps its due time")

			lag = o.lag(t)
			require.Zero(t, lag.Scheduled)
			require.True(t, lag.NextDue.IsZero())
		})
	}
}

// TestScheduledPastDueKeepsOrder: on every backend, a message whose due
// time has passed when it is written goes out after the rows of its key
// due before it that still wait in the scheduled table: a row its own
// transaction wrote while that row's due time was ahead (a writer slower
// than its delay: b after a), and rows of an earlier transaction that no
// relay has moved yet (c after a and b). A message of a key with nothing
// waiting goes to the outbox at once, its due time past or not (other).
// Each is published once, none before its due time.
func TestScheduledPastDueKeepsOrder(t *testing.T) {
	t.Parallel()
	for _, backend := range sqltest.Backends {
		t.Run(backend.Name, func(t *testing.T) {
			t.Parallel()
			o := openOutbox(t, backend)
			ctx := context.Background()
			const key = "order-9"
			a, b := named("a", key), named("b", key)
			dueA := time.Now().Add(100 * time.Millisecond)
			forwarder.PublishAt(a, dueA)
			forwarder.PublishAt(b, dueA.Add(time.Millisecond))
			require.NoError(t, o.writeWith(ctx, true, func(pub *forwarder.TxPublisher) error {
				if err := pub.Publish("orders", a); err != nil { // ahead: scheduled
					return err
				}
				// The writer is held up past both due times.
				time.Sleep(time.Until(dueA.Add(20 * time.Millisecond)))
				return pub.Publish("orders", b)
			}))
			c, other := named("c", key), named("other", "order-10")
			forwarder.PublishAt(c, time.Now())
			forwarder.PublishAt(other, time.Now())
			require.NoError(t, o.write(ctx, "orders", true, c, other))

			lag := o.lag(t)
			require.Equal(t, 1, lag.Pending, "other is in the outbox")
			require.Equal(t, 3, lag.Scheduled, "b and c wait behind a")

			s := &timedSink{}
			run(t, o.relay(t, s, func(c *forwarder.RelayConfig) { c.LockOrderedWriters = true }))
			require.Eventually(t, func() bool {
				ids, _ := s.published()
				return len(ids) >= 4 && o.pending(t) == 0 && o.scheduledCount(t) == 0
			}, 20*time.Second, 10*time.Millisecond, "every row published, both tables drained")

			ids, at := s.published()
			var order []string
			for _, id := range ids {
				if !strings.HasPrefix(id, "other") {
					order = append(order, id)
				}
			}
			require.Equal(t, []string{a.UUID, b.UUID, c.UUID}, order, "%s in (due time, write) order", key)
			for _, m := range []*message.Message{a, b, c, other} {
				require.Len(t, at[m.UUID], 1, "%s published once", m.UUID)
				due, err := time.Parse(time.RFC3339Nano, m.Metadata.Get(forwarder.DueAtKey))
				require.NoError(t, err)
				require.False(t, at[m.UUID][0].Before(due), "%s published before its due time", m.UUID)
			}
		})
	}
}

// TestRelayWithoutScheduledTable: on a schema migrated before the
// scheduled table (every backend, the table dropped), the relay relays
// the outbox as before and logs the missing table once, however often it
// looks again; Lag counts nothing scheduled; a write with a due time,
// ahead or past, fails with ErrNoScheduledTable. Once the table is created, the
// relay finds it at its next look, says so once, and publishes a
// scheduled message after its due time.
func TestRelayWithoutScheduledTable(t *testing.T) {
	t.Parallel()
	for _, backend := range sqltest.Backends {
		t.Run(backend.Name, func(t *testing.T) {
			t.Parallel()
			o := openOutbox(t, backend)
			ctx := context.Background()
			_, err := o.sql.Exec(ctx, `DROP TABLE `+o.names.Scheduled)
			require.NoError(t, err)

			s := &timedSink{}
			logs := watermill.NewCaptureLogger()
			r := o.relay(t, s, func(c *forwarder.RelayConfig) { c.Logger, c.LockOrderedWriters = logs, true })
			forwarder.SetScheduledRecheck(r, 100*time.Millisecond)
			run(t, r)

			events := []*message.Message{named("a", "k"), named("b", "k"), named("c", "k")}
			require.NoError(t, o.write(ctx, "orders", true, events...))
			require.Eventually(t, func() bool { ids, _ := s.published(); return len(ids) == 3 }, 10*time.Second, 10*time.Millisecond,
				"the outbox is relayed without the scheduled table")
			_, err = r.PromoteDue(ctx)
			require.ErrorIs(t, err, forwarder.ErrNoScheduledTable)

			scheduled := named("later", "k")
			forwarder.Delay(scheduled, time.Minute)
			require.ErrorIs(t, o.write(ctx, "orders", true, scheduled), forwarder.ErrNoScheduledTable)
			past := named("past", "k")
			forwarder.PublishAt(past, time.Now().Add(-time.Second))
			require.ErrorIs(t, o.write(ctx, "orders", true, past), forwarder.ErrNoScheduledTable,
				"a due time already past needs the table too: rows of its key may wait there")
			require.Zero(t, o.lag(t).Scheduled)

			// A window of five looks again, each finding nothing.
			time.Sleep(500 * time.Millisecond)
			require.Len(t, infoLines(logs, "Outbox scheduled table missing"), 1, "the missing table is logged once")
			require.Empty(t, logs.Captured()[watermill.ErrorLogLevel], "no error: the relay runs as before")

			// The table comes with the migration.
			ms, err := sqlschema.Migrations(o.d.Name, o.Schema)
			require.NoError(t, err)
			for _, m := range ms {
				if m.Name == "outbox_scheduled" {
					_, err := o.sql.Exec(ctx, m.Up)
					require.NoError(t, err)
				}
			}
			require.Equal(t, 0, o.scheduledCount(t))
			due := time.Now().Add(300 * time.Millisecond)
			forwarder.PublishAt(scheduled, due)
			require.NoError(t, o.write(ctx, "orders", true, scheduled))
			require.Eventually(t, func() bool { ids, _ := s.published(); return len(ids) == 4 }, 10*time.Second, 10*time.Millisecond,
				"the relay finds the table and publishes the scheduled message")
			_, at := s.published()
			require.False(t, at[scheduled.UUID][0].Before(due), "not before its due time")
			require.Len(t, infoLines(logs, "Outbox scheduled table found"), 1)
			require.Len(t, infoLines(logs, "Outbox scheduled table missing"), 1)
		})
	}
}

// infoLines are the captured info lines that start with prefix.
func infoLines(logs *watermill.CaptureLoggerAdapter, prefix string) []watermill.CapturedMessage {
	var out []watermill.CapturedMessage
	for _, m := range logs.Captured()[watermill.InfoLogLevel] {
		if strings.HasPrefix(m.Msg, prefix) {
			out = append(out, m)
		}
	}
	return out
}
