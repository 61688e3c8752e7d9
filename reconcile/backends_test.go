package reconcile_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	_ "modernc.org/sqlite"

	"github.com/oncemill/oncemill/internal/sqldb"
	"github.com/oncemill/oncemill/internal/testing/sqltest"
	"github.com/oncemill/oncemill/reconcile"
	"github.com/oncemill/oncemill/sqlschema"
)

// open opens oncemill's tables, migrated, on b (sqltest.Backends): the
// Tables a check reads and the database the test writes its rows through.
func open(t *testing.T, b sqltest.Backend) (reconcile.Tables, sqldb.DB) {
	db := b.Open(t, 4)
	return reconcile.Tables{Pool: db.Pool, DB: db.DB, Dialect: db.Dialect, Schema: db.Schema}, db.SQL()
}

// rows writes a backend's ledger, inbox and dead-letter rows with plain
// SQL, times as the application's clock gives them.
type rows struct {
	t     *testing.T
	db    sqldb.DB
	names sqlschema.Names
}

func (r rows) exec(q string, args ...any) {
	r.t.Helper()
	d := r.db.Dialect()
	_, err := r.db.Exec(context.Background(), d.Rebind(q), args...)
	require.NoError(r.t, err)
}

func (r rows) ledger(uuid, key string, ago time.Duration) {
	r.t.Helper()
	d := r.db.Dialect()
	r.exec(`INSERT INTO `+r.names.Ledger+` (uuid, topic, partition_key, idempotency_key, published_at) VALUES (?, 'orders', 'p', ?, `+d.FromMicros("?")+`)`,
		d.Text(uuid), d.Text(key), time.Now().Add(-ago).UnixMicro())
}

func (r rows) inbox(key, status string, doneAgo time.Duration) {
	r.t.Helper()
	d := r.db.Dialect()
	var done any
	if status == "done" {
		done = time.Now().Add(-doneAgo).UnixMicro()
	}
	r.exec(`INSERT INTO `+r.names.Inbox+` (consumer, `+d.Quote("key")+`, status, done_at, expires_at)
VALUES (?, ?, ?, `+d.FromMicros("?")+`, `+d.FromMicros("?")+`)`,
		d.Text(consumer), d.Text(key), status, done, time.Now().Add(7*24*time.Hour).UnixMicro())
}

func (r rows) deadLetter(uuid, key string) {
	r.t.Helper()
	d := r.db.Dialect()
	r.exec(`INSERT INTO `+r.names.DLQ+` (uuid, topic, dlq_topic, consumer, `+d.Quote("key")+`, `+d.Quote("error")+`, payload, metadata, dead_at)
VALUES (?, 'orders', '', ?, ?, 'boom', ?, `+d.JSON("?")+`, `+d.FromMicros("?")+`)`,
		d.Text(uuid), d.Text(consumer), d.Text(key), []byte{}, "{}", time.Now().UnixMicro())
}

// TestCheckOnEveryDatabase: on each database, one check reports the
// event no inbox row has as lost and the failing one as stuck, passes
// over the dead-lettered, the dead and the done, reports a done key no
// event explains (Strict), and reports nothing once every event is done.
func TestCheckOnEveryDatabase(t *testing.T) {
	t.Parallel()
	for _, b := range sqltest.Backends {
		t.Run(b.Name, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			tables, db := open(t, b)
			r := rows{t: t, db: db, names: db.Dialect().Names(tables.Schema)}
			r.ledger("u-done", "k-done", 20*time.Minute)
			r.ledger("u-lost", "k-lost", 19*time.Minute)
			r.ledger("u-stuck", "k-stuck", 18*time.Minute)
			r.ledger("u-letter", "k-letter", 17*time.Minute)
			r.ledger("u-dead", "k-dead", 16*time.Minute)
			r.ledger("u-young", "k-young", time.Minute)
			r.inbox("k-done", "done", 15*time.Minute)
			r.inbox("k-stuck", "failed", 0)
			r.inbox("k-dead", "dead", 0)
			r.inbox("k-ghost", "done", 14*time.Minute)
			r.deadLetter("u-letter", "k-letter")
			cfg := reconcile.Config{Ledger: tables, Consumer: consumer, Strict: true}

			rep, err := reconcile.Check(ctx, cfg)
			require.NoError(t, err)
			require.Equal(t, 5, rep.Checked, "the window holds every event but the one within the grace")
			require.Equal(t, 1, rep.Lost)
			require.Equal(t, 1, rep.Stuck)
			require.Equal(t, []string{"u-lost ", "u-stuck failed"}, described(rep.Missing))
			require.Equal(t, "k-lost", rep.Missing[0].Key)
			require.WithinDuration(t, time.Now().Add(-19*time.Minute), rep.Missing[0].PublishedAt, time.Minute)
			require.Equal(t, 1, rep.UnexplainedKeys)
			require.Equal(t, "k-ghost", rep.Unexplained[0].Key)
			require.False(t, rep.OK())

			r.inbox("k-lost", "done", time.Minute)
			r.exec(`UPDATE `+r.names.Inbox+` SET status = 'done', done_at = `+db.Dialect().FromMicros("?")+` WHERE `+db.Dialect().Quote("key")+` = ?`,
				time.Now().Add(-time.Minute).UnixMicro(), db.Dialect().Text("k-stuck"))
			rep, err = reconcile.Check(ctx, reconcile.Config{Ledger: tables, Consumer: consumer})
			require.NoError(t, err)
			require.Equal(t, 5, rep.Checked)
			require.True(t, rep.OK(), "every event is done or dead: %+v", rep)
			require.Empty(t, rep.Missing)
		})
	}
}
