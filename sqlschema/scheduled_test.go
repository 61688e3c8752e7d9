package sqlschema_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/internal/sqldb"
	"github.com/oncemill/oncemill/internal/testing/sqltest"
	"github.com/oncemill/oncemill/sqlschema"
)

// TestScheduledTableOnEveryDialect: the outbox's scheduled table is the
// outbox table's name and "_scheduled", in its schema, on every dialect;
// its migration is PostgreSQL's 011, MySQL's 005 and SQLite's 007; it
// holds rows with their due times, read back in (due_at, id) order, and
// its down step drops it.
func TestScheduledTableOnEveryDialect(t *testing.T) {
	t.Parallel()
	for d, want := range map[sqlschema.Dialect]string{
		sqlschema.Postgres: `"billing"."events_scheduled"`,
		sqlschema.MySQL:    "`billing`.`events_scheduled`",
		sqlschema.SQLite:   `"events_scheduled"`,
	} {
		names := sqlschema.NamesFor(d, sqlschema.Config{Schema: "billing", OutboxTable: "events"}.WithDefaults())
		require.Equal(t, want, names.Scheduled, d)
		require.Equal(t, "events_scheduled", names.ScheduledName, d)
	}
	versions := map[sqlschema.Dialect]int{sqlschema.Postgres: 11, sqlschema.MySQL: 5, sqlschema.SQLite: 7}
	for _, backend := range sqltest.Backends {
		t.Run(backend.Name, func(t *testing.T) {
			t.Parallel()
			db := backend.Open(t, 2)
			s := db.SQL()
			d := s.Dialect()
			names := d.Names(db.Schema)
			ctx := context.Background()

			ms, err := sqlschema.Migrations(d.Name, db.Schema)
			require.NoError(t, err)
			var step *sqlschema.Migration
			for i := range ms {
				if ms[i].Name == "outbox_scheduled" {
					step = &ms[i]
				}
			}
			require.NotNil(t, step, "a step creates the scheduled table")
			require.Equal(t, versions[d.Name], step.Version)

			cols, vals := "topic, uuid, partition_key, metadata, due_at", "?, ?, ?, ?, "+d.FromMicros("?")
			if d.Name == sqlschema.MySQL {
				cols, vals = cols+", created_at", vals+", "+d.Now()
			}
			insert := d.Rebind(`INSERT INTO ` + names.Scheduled + ` (` + cols + `) VALUES (` + vals + `)`)
			for _, r := range []struct {
				uuid string
				due  int64
			}{{"late", 3_000_000}, {"early-1", 1_000_000}, {"early-2", 1_000_000}} {
				_, err := s.Exec(ctx, insert, d.Text("orders"), d.Text(r.uuid), d.Text("order-7"), "{}", r.due)
				require.NoError(t, err)
			}
			rs, err := s.Query(ctx, `SELECT uuid FROM `+names.Scheduled+` ORDER BY due_at, id`)
			got, err := sqldb.Collect(rs, err, sqldb.Value[string])
			require.NoError(t, err)
			require.Equal(t, []string{"early-1", "early-2", "late"}, got)

			_, err = s.Exec(ctx, step.Down)
			require.NoError(t, err)
			_, err = s.Exec(ctx, `SELECT COUNT(*) FROM `+names.Scheduled)
			require.True(t, d.UndefinedTable(err), "the down step drops the table: %v", err)
		})
	}
}
