package forwarder_test

import (
	"context"
	"database/sql"
	"errors"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/go-sql-driver/mysql"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/forwarder"
	"github.com/oncemill/oncemill/internal/testing/msgtest"
	"github.com/oncemill/oncemill/internal/testing/mysqltest"
	"github.com/oncemill/oncemill/internal/testing/pgtest"
	"github.com/oncemill/oncemill/internal/testing/sqltest"
	"github.com/oncemill/oncemill/sqlschema"
)

// all returns every line logged so far.
func (l *lineLogger) all() []logLine {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]logLine(nil), l.lines...)
}

// insertScheduled writes a row into the scheduled table by plain SQL, as
// a writer other than the outbox's publisher would, due at the SQL
// expression due.
func (o outboxUnderTest) insertScheduled(t *testing.T, uuid, key, due string) {
	t.Helper()
	cols, vals := "topic, uuid, partition_key, payload, metadata, due_at", "?, ?, ?, ?, "+o.d.JSON("?")+", "+due
	if o.d.Name == sqlschema.MySQL {
		cols, vals = cols+", created_at", vals+", "+o.d.Now()
	}
	_, err := o.sql.Exec(context.Background(), o.d.Rebind(`INSERT INTO `+o.names.Scheduled+` (`+cols+`) VALUES (`+vals+`)`),
		o.d.Text("orders"), o.d.Text(uuid), o.d.Text(key), []byte(uuid), `{"trace_id":"tr-`+uuid+`"}`)
	require.NoError(t, err)
}

// TestScheduledRowNeverDueRefusedAlone: a scheduled row written by plain
// SQL with a due time no relay reaches (PostgreSQL's 'infinity', the last
// microsecond of MySQL's DATETIME, SQLite's largest integer) is
// dead-lettered alone, with the reason, and deleted; one due at the
// other end ('-infinity', year 1000, the smallest integer) is published
// at once; the outbox's own rows and the scheduled rows due now go out as
// ever, and no batch fails.
func TestScheduledRowNeverDueRefusedAlone(t *testing.T) {
	t.Parallel()
	ends := map[sqlschema.Dialect][2]string{
		sqlschema.Postgres: {`'infinity'::timestamptz`, `'-infinity'::timestamptz`},
		sqlschema.MySQL:    {`'9999-12-31 23:59:59.999999'`, `'1000-01-01 00:00:00'`},
		sqlschema.SQLite:   {`9223372036854775807`, `-9223372036854775808`},
	}
	for _, backend := range sqltest.Backends {
		t.Run(backend.Name, func(t *testing.T) {
			t.Parallel()
			o := openOutbox(t, backend)
			ctx := context.Background()
			end := ends[o.d.Name]
			o.insertScheduled(t, "never", "acct-1", end[0])
			o.insertScheduled(t, "long-ago", "acct-2", end[1])
			o.insertScheduled(t, "due", "acct-3", o.d.Now())
			require.NoError(t, o.write(ctx, "orders", true, named("outbox-1", "acct-4"), named("outbox-2", "acct-5")))

			lag := o.lag(t) // reads the earliest due time: no "cannot convert infinity to bigint"
			require.Equal(t, 3, lag.Scheduled)

			s := &timedSink{}
			logger := &lineLogger{}
			run(t, o.relay(t, s, func(c *forwarder.RelayConfig) {
				c.PollInterval, c.Logger = 10*time.Millisecond, logger
				c.LockOrderedWriters = true // no wait for what other tests leave open on the server
			}))
			msgtest.WaitFor(t, "the outbox's rows and the scheduled rows that are due published", func() bool {
				ids, _ := s.published()
				return len(ids) >= 4
			})
			msgtest.WaitFor(t, "the row never due refused and deleted", func() bool { return o.scheduledCount(t) == 0 })
			ids, _ := s.published()
			var names []string
			for _, id := range ids {
				names = append(names, strings.SplitN(id, "-", 2)[0])
			}
			require.ElementsMatch(t, []string{"long", "due", "outbox", "outbox"}, names, "published: %q", ids)
			require.Nil(t, s.message("never"))

			dead := o.dead(t)
			require.Len(t, dead, 1)
			require.Equal(t, "never", dead[0].UUID)
			require.Equal(t, "relay:"+o.Schema.WithDefaults().Schema+".outbox", dead[0].Consumer)
			require.True(t, dead[0].Permanent)
			require.Contains(t, dead[0].Error, "forwarder: outbox row refused: scheduled row")
			require.Contains(t, dead[0].Error, "its due time is after 9999-12-31T23:59:59Z")
			require.Equal(t, []byte("never"), dead[0].Payload)
			require.Equal(t, "tr-never", dead[0].Metadata["trace_id"])

			// Alone in the table, with nothing due: refused all the same.
			o.insertScheduled(t, "never-alone", "acct-6", end[0])
			msgtest.WaitFor(t, "a row never due, alone, refused", func() bool { return len(o.dead(t)) == 2 })
			require.Zero(t, o.scheduledCount(t))
			for _, l := range logger.all() {
				require.NotEqual(t, "error", l.level, "no batch failed: %s %v", l.msg, l.err)
			}
		})
	}
}

// TestRelayWithoutScheduledGrant: a relay whose role may use the outbox
// but not its scheduled table (a least-privilege role right after the
// migration that added it) publishes the outbox, and says why it moves no
// scheduled row once, however many polls it runs, on PostgreSQL and on
// MariaDB.
func TestRelayWithoutScheduledGrant(t *testing.T) {
	t.Parallel()
	cases := map[string]func(t *testing.T) (writer outboxUnderTest, relay outboxUnderTest){
		"postgres": func(t *testing.T) (outboxUnderTest, outboxUnderTest) {
			o := openOutbox(t, sqltest.Backends[0])
			role := pgtest.NewRole(t, o.Pool, o.Schema.Schema)
			_, err := o.Pool.Exec(context.Background(), `REVOKE ALL ON `+o.names.Scheduled+` FROM `+pgx.Identifier{role.Name}.Sanitize())
			require.NoError(t, err)
			cfg, err := pgxpool.ParseConfig(pgtest.URL())
			require.NoError(t, err)
			k, v := role.Param()
			cfg.ConnConfig.RuntimeParams[k] = v
			pool, err := pgxpool.NewWithConfig(t.Context(), cfg)
			require.NoError(t, err)
			t.Cleanup(pool.Close)
			as := o
			as.Database.Pool = pool
			return o, as
		},
		"mariadb": func(t *testing.T) (outboxUnderTest, outboxUnderTest) {
			var mariadb sqltest.Backend
			for _, b := range sqltest.Backends {
				if b.Name == "mariadb" {
					mariadb = b
				}
			}
			o := openOutbox(t, mariadb)
			user := mysqltest.NewUser(t, o.DB, o.Schema.Schema)
			_, err := o.DB.ExecContext(context.Background(), "REVOKE SELECT, INSERT, UPDATE, DELETE ON "+o.names.Scheduled+" FROM '"+user.Name+"'@'%'")
			require.NoError(t, err)
			connector, err := mysql.NewConnector(user.Config(t))
			require.NoError(t, err)
			db := sql.OpenDB(connector)
			t.Cleanup(func() { require.NoError(t, db.Close()) })
			as := o
			as.Database.DB = db
			return o, as
		},
	}
	for name, open := range cases {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			writer, relayAs := open(t)
			ctx := context.Background()
			require.NoError(t, writer.write(ctx, "orders", true, named("a", "acct-1"), named("b", "acct-2")))
			s := &timedSink{}
			logger := &lineLogger{}
			run(t, relayAs.relay(t, s, func(c *forwarder.RelayConfig) {
				c.PollInterval, c.Logger = 10*time.Millisecond, logger
				c.LockOrderedWriters = true // no wait for what other tests leave open on the server
			}))
			msgtest.WaitFor(t, "the outbox published", func() bool { ids, _ := s.published(); return len(ids) == 2 })
			require.NoError(t, writer.write(ctx, "orders", true, named("c", "acct-1")))
			msgtest.WaitFor(t, "a row written later published", func() bool { ids, _ := s.published(); return len(ids) == 3 })
			time.Sleep(200 * time.Millisecond) // twenty polls
			var said []logLine
			for _, l := range logger.all() {
				require.NotEqual(t, "error", l.level, "no batch failed: %s %v", l.msg, l.err)
				if strings.Contains(l.msg, "not usable by the relay's role") {
					said = append(said, l)
				}
			}
			require.Len(t, said, 1, "said once")
			require.Contains(t, said[0].msg, "grant the relay SELECT and DELETE on the scheduled table")
		})
	}
}

// TestRelayConfigDatabaseTimeoutBound: a DatabaseTimeout under 100ms is
// refused, naming the field and the minimum; 0 is the default.
func TestRelayConfigDatabaseTimeoutBound(t *testing.T) {
	t.Parallel()
	for _, d := range []time.Duration{time.Nanosecond, 99 * time.Millisecond, -time.Second} {
		err := forwarder.RelayConfig{Pool: &pgxpool.Pool{}, Publisher: &timedSink{}, DatabaseTimeout: d}.Validate()
		require.ErrorContains(t, err, "forwarder: RelayConfig.DatabaseTimeout must be at least 100ms")
	}
	require.NoError(t, forwarder.RelayConfig{Pool: &pgxpool.Pool{}, Publisher: &timedSink{}}.Validate())
}

// TestPublishAtPastYear9999: a due time after year 9999, set with
// PublishAt or written into the metadata, is refused by the write with
// ErrDueTooLate, which says what to do, and nothing is written.
func TestPublishAtPastYear9999(t *testing.T) {
	t.Parallel()
	o := openOutbox(t, sqltest.Backends[len(sqltest.Backends)-1])
	ctx := context.Background()
	far := named("far", "acct-1")
	forwarder.PublishAt(far, time.Date(12000, 1, 1, 0, 0, 0, 0, time.UTC))
	edge := named("edge", "acct-1")
	edge.Metadata.Set(forwarder.DueAtKey, "9999-12-31T23:59:59.5Z")
	for _, m := range []*message.Message{far, edge} {
		err := o.write(ctx, "orders", true, m)
		require.ErrorIs(t, err, forwarder.ErrDueTooLate)
		require.ErrorContains(t, err, "give an earlier one")
		require.NotContains(t, err.Error(), "not an RFC 3339 time")
	}
	require.Zero(t, o.scheduledCount(t))
	require.Zero(t, o.pending(t))
	last := named("last", "acct-1")
	forwarder.PublishAt(last, forwarder.MaxDueAt)
	require.NoError(t, o.write(ctx, "orders", true, last))
	require.Equal(t, 1, o.scheduledCount(t), "the last second of year 9999 is a due time")
}

// TestRelayNamesTheSQLiteWriteLock: while another connection holds the
// SQLite file's write lock, the relay's failed batches say the file is
// locked, not only "context deadline exceeded"; once the lock is
// released, the rows go out and are deleted.
func TestRelayNamesTheSQLiteWriteLock(t *testing.T) {
	t.Parallel()
	path := filepath.Join(t.TempDir(), "app.db")
	db := sqltest.OpenSQLite(t, path)
	require.NoError(t, sqlschema.MigrateSQLite(context.Background(), db, sqlschema.Config{}))
	o := outboxUnderTest{Database: sqltest.Database{DB: db, Dialect: sqlschema.SQLite}}
	o.sql = o.Database.SQL()
	o.d = o.sql.Dialect()
	o.names = o.d.Names(sqlschema.Config{})
	ctx := context.Background()
	require.NoError(t, o.write(ctx, "orders", true, named("a", "acct-1")))

	holder := sqltest.OpenSQLite(t, path)
	conn, err := holder.Conn(ctx)
	require.NoError(t, err)
	defer conn.Close()
	_, err = conn.ExecContext(ctx, "BEGIN IMMEDIATE")
	require.NoError(t, err)

	s := &timedSink{}
	logger := &lineLogger{}
	run(t, o.relay(t, s, func(c *forwarder.RelayConfig) { c.DatabaseTimeout = 300 * time.Millisecond; c.Logger = logger }))
	msgtest.WaitFor(t, "a batch failed on the lock", func() bool {
		for _, l := range logger.all() {
			if l.level == "error" && l.err != nil && strings.Contains(l.err.Error(), "the database file is locked") {
				require.Contains(t, l.err.Error(), "RelayConfig.DatabaseTimeout (300ms)")
				require.True(t, errors.Is(l.err, context.DeadlineExceeded))
				return true
			}
		}
		return false
	})
	_, err = conn.ExecContext(ctx, "ROLLBACK")
	require.NoError(t, err)
	msgtest.WaitFor(t, "the row published and deleted once the lock is released", func() bool { return o.pending(t) == 0 })
	ids, _ := s.published()
	require.NotEmpty(t, ids)
}

// TestPlainSQLWriterSchedules: a writer other than the outbox's
// publisher schedules a message by writing it into the scheduled table
// with its due time (docs/outbox-contract.md); one written into the
// outbox goes out at once, whatever oncemill_due_at its metadata holds,
// which is published with it.
func TestPlainSQLWriterSchedules(t *testing.T) {
	t.Parallel()
	o := openOutbox(t, sqltest.Backends[0])
	ctx := context.Background()
	o.insert(t, []outboxRow{{topic: "orders", uuid: "now", key: "acct-1", payload: []byte("now"),
		metadata: `{"oncemill_due_at":"` + time.Now().Add(time.Hour).UTC().Format(time.RFC3339Nano) + `"}`}})
	due := time.Now().Add(300 * time.Millisecond)
	o.insertScheduled(t, "later", "acct-2", o.d.FromMicros(strconv.FormatInt(due.UnixMicro(), 10)))
	s := &timedSink{}
	// Lock-ordered: a transaction left open on the server by another test
	// does not hold the row back.
	r := o.relay(t, s, func(c *forwarder.RelayConfig) { c.LockOrderedWriters = true })
	moved, err := r.PromoteDue(ctx)
	require.NoError(t, err)
	require.Zero(t, moved, "the scheduled row is not due yet")
	n, err := r.RelayBatch(ctx)
	require.NoError(t, err)
	require.Equal(t, 1, n)
	require.NotEmpty(t, s.message("now").Metadata.Get(forwarder.DueAtKey), "published at once, the key kept")
	msgtest.WaitFor(t, "the scheduled row published once due", func() bool {
		_, err := r.PromoteDue(ctx)
		require.NoError(t, err)
		_, err = r.RelayBatch(ctx)
		require.NoError(t, err)
		return s.message("later") != nil
	})
	_, at := s.published()
	require.False(t, at["later"][0].Before(due), "not before its due time")
}
