package sqlschema_test

import (
	"context"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/dlq"
	"github.com/oncemill/oncemill/internal/testing/sqltest"
	"github.com/oncemill/oncemill/retry"
	"github.com/oncemill/oncemill/sqlschema"
)

// TestMigrateMessageIdentity upgrades, on every dialect, a schema of the
// version before message_identity (PostgreSQL 014, MySQL 008, SQLite 010)
// that holds a parked message and a dead letter: before, a second message
// of the same UUID with another key is taken for a copy and not written;
// the migration keeps the rows, and after it the second message is parked
// and dead-lettered, while a copy of the first is still written once.
func TestMigrateMessageIdentity(t *testing.T) {
	t.Parallel()
	versions := map[sqlschema.Dialect]int{sqlschema.Postgres: 14, sqlschema.MySQL: 8, sqlschema.SQLite: 10}
	for _, backend := range sqltest.Backends {
		t.Run(backend.Name, func(t *testing.T) {
			t.Parallel()
			db := backend.Open(t, 4)
			s := db.SQL()
			d := s.Dialect()
			ctx := context.Background()
			ms, err := sqlschema.Migrations(d.Name, db.Schema)
			require.NoError(t, err)
			at := slices.IndexFunc(ms, func(m sqlschema.Migration) bool { return m.Name == "message_identity" })
			require.GreaterOrEqual(t, at, 0, "the message_identity step")
			require.Equal(t, versions[d.Name], ms[at].Version)

			// The schema of the version before: the step's down and every
			// later step's, newest first, their versions forgotten, as
			// Migrate would have left it.
			versionsTable := `oncemill_migrations`
			if schema := d.Names(db.Schema).Schema; schema != "" {
				versionsTable = schema + "." + versionsTable
			}
			for i := len(ms) - 1; i >= at; i-- {
				for _, stmt := range statements(ms[i].Down) {
					_, err := s.Exec(ctx, stmt)
					require.NoError(t, err, stmt)
				}
				_, err = s.Exec(ctx, d.Rebind(`DELETE FROM `+versionsTable+` WHERE version = ?`), ms[i].Version)
				require.NoError(t, err)
			}

			var (
				store *retry.Store
				pub   *dlq.Publisher
				dead  *dlq.Store
			)
			if db.Pool != nil {
				store, err = retry.NewStore(db.Pool, db.Schema)
				require.NoError(t, err)
				pub, err = dlq.NewPublisher(db.Pool, db.Schema)
				require.NoError(t, err)
				dead, err = dlq.NewStore(db.Pool, db.Schema)
			} else {
				store, err = retry.NewSQLStore(db.DB, db.Dialect, db.Schema)
				require.NoError(t, err)
				pub, err = dlq.NewSQLPublisher(db.DB, db.Dialect, db.Schema)
				require.NoError(t, err)
				dead, err = dlq.NewSQLStore(db.DB, db.Dialect, db.Schema)
			}
			require.NoError(t, err)

			first := retry.Message{Consumer: "charge", Topic: "orders", UUID: "u-1", Key: "order-1", Attempts: 3,
				Error: "gateway 503", DueAt: time.Now().Add(time.Hour), Payload: []byte("first")}
			second := first
			second.Key, second.Payload = "order-2", []byte("second")
			park := func(m retry.Message) bool {
				t.Helper()
				wrote, err := store.Park(ctx, m)
				require.NoError(t, err)
				return wrote
			}
			letter := func(m retry.Message) *message.Message {
				msg := message.NewMessage(m.UUID, m.Payload)
				msg.Metadata.Set(delivery.DeadTopic, m.Topic)
				msg.Metadata.Set(delivery.DeadConsumer, m.Consumer)
				msg.Metadata.Set(delivery.DeadKey, m.Key)
				msg.Metadata.Set(delivery.DeadError, "card declined")
				return msg
			}
			count := func(f func() (int, error)) int {
				t.Helper()
				n, err := f()
				require.NoError(t, err)
				return n
			}
			parked := func() int { return count(func() (int, error) { return store.Count(ctx, retry.Filter{}) }) }
			letters := func() int { return count(func() (int, error) { return dead.Count(ctx, dlq.Filter{}) }) }

			require.True(t, park(first))
			require.False(t, park(second), "before: the second message of the UUID is taken for a copy")
			require.NoError(t, pub.Publish("dlq", letter(first), letter(second)))
			require.Equal(t, 1, parked())
			require.Equal(t, 1, letters(), "before: one dead letter of two")

			if db.Pool != nil {
				require.NoError(t, sqlschema.Migrate(ctx, db.Pool, db.Schema))
			} else {
				require.NoError(t, sqlschema.MigrateSQL(ctx, db.DB, db.Dialect, db.Schema))
			}

			listed, err := store.List(ctx, retry.Filter{})
			require.NoError(t, err)
			require.Len(t, listed, 1, "the parked row is kept")
			require.Equal(t, "order-1", listed[0].Key)
			require.Equal(t, []byte("first"), listed[0].Payload)
			require.True(t, park(second), "after: the second message of the UUID is parked")
			require.False(t, park(first), "a copy of the first is still parked once")
			require.Equal(t, 2, parked())
			require.NoError(t, pub.Publish("dlq", letter(second), letter(first)))
			require.Equal(t, 2, letters(), "after: each message dead-lettered once")
			entries, err := dead.List(ctx, dlq.Filter{})
			require.NoError(t, err)
			require.Equal(t, "order-1", entries[0].Key, "the dead letter written before the migration is kept")
			require.Equal(t, "order-2", entries[1].Key)
		})
	}
}

// statements splits a migration step at the ';' that ends a line, as the
// MySQL migrator does; a database that takes several statements at once
// takes them one by one too.
func statements(step string) []string {
	var out []string
	for _, s := range strings.Split(step, ";\n") {
		if s = strings.TrimSpace(s); s != "" {
			out = append(out, s)
		}
	}
	return out
}
