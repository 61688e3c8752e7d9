package main

import (
	"context"
	"encoding/json"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/dlq"
	"github.com/oncemill/oncemill/internal/testing/mysqltest"
	"github.com/oncemill/oncemill/internal/testing/pgtest"
	"github.com/oncemill/oncemill/internal/testing/sqltest"
	"github.com/oncemill/oncemill/retry"
	"github.com/oncemill/oncemill/sqlschema"
)

// parkedDB is the table of parked messages, migrated with the
// dead-letter table beside it, on a database the command reaches by URL.
type parkedDB struct {
	// url and schema are what --database and --schema take (schema is
	// empty on SQLite, which has none).
	url, schema string
	store       *retry.Store
	dlq         *dlq.Store
}

// parkedDBs are the three database families, each a database of the
// test's own.
var parkedDBs = []struct {
	name string
	open func(t *testing.T) parkedDB
}{
	{"postgres", func(t *testing.T) parkedDB {
		pool := pgtest.Pool(t, 4)
		cfg := sqlschema.Config{Schema: pgtest.Schema(t, pool)}
		store, err := retry.NewStore(pool, cfg)
		require.NoError(t, err)
		dead, err := dlq.NewStore(pool, cfg)
		require.NoError(t, err)
		return parkedDB{url: pgtest.URL(), schema: cfg.Schema, store: store, dlq: dead}
	}},
	{"mariadb", func(t *testing.T) parkedDB {
		db, name := mysqltest.DB(t, 4)
		cfg := sqlschema.Config{Schema: name}
		require.NoError(t, sqlschema.MigrateSQL(context.Background(), db, sqlschema.MySQL, cfg))
		store, err := retry.NewSQLStore(db, sqlschema.MySQL, cfg)
		require.NoError(t, err)
		dead, err := dlq.NewSQLStore(db, sqlschema.MySQL, cfg)
		require.NoError(t, err)
		return parkedDB{url: mysqlURL(t), schema: name, store: store, dlq: dead}
	}},
	{"sqlite", func(t *testing.T) parkedDB {
		path := filepath.Join(t.TempDir(), "consumer.db")
		db := sqltest.OpenSQLite(t, path)
		require.NoError(t, sqlschema.MigrateSQLite(context.Background(), db, sqlschema.Config{}))
		store, err := retry.NewSQLStore(db, sqlschema.SQLite, sqlschema.Config{})
		require.NoError(t, err)
		dead, err := dlq.NewSQLStore(db, sqlschema.SQLite, sqlschema.Config{})
		require.NoError(t, err)
		return parkedDB{url: "sqlite://" + path, store: store, dlq: dead}
	}},
}

// retries runs "oncemill retries <sub> args... --database <url> [--schema <schema>]".
func (p parkedDB) retries(t *testing.T, sub string, args ...string) result {
	t.Helper()
	full := append([]string{"retries", sub}, args...)
	full = append(full, "--database", p.url)
	if p.schema != "" {
		full = append(full, "--schema", p.schema)
	}
	return oncemill(t, nil, full...)
}

// park parks m as the poison middleware does and returns its id.
func (p parkedDB) park(t *testing.T, m retry.Message) int64 {
	t.Helper()
	wrote, err := p.store.Park(context.Background(), m)
	require.NoError(t, err)
	require.True(t, wrote)
	ms, err := p.store.List(context.Background(), retry.Filter{UUID: m.UUID})
	require.NoError(t, err)
	require.Len(t, ms, 1)
	return ms[0].ID
}

// parkedMessage is a message of consumer parked after attempts failed
// attempts, due at due.
func parkedMessage(consumer, order string, attempts int, errText string, due time.Time) retry.Message {
	uuid := watermill.NewUUID()
	first := time.Date(2026, 3, 1, 10, 0, 0, 0, time.UTC)
	return retry.Message{Consumer: consumer, Topic: "orders", UUID: uuid, Key: "key-" + uuid, OrderKey: order,
		Attempts: attempts, Error: errText, FirstFailedAt: first, LastFailedAt: first.Add(90 * time.Second), DueAt: due,
		Payload: []byte(`{"order":"` + uuid + `"}`), Metadata: map[string]string{delivery.PartitionKey: order, "trace_id": "tr-1"}}
}

// listed reads the ID and STATE columns of "retries list".
func listed(t *testing.T, table string) ([]int64, []string) {
	t.Helper()
	lines := strings.Split(strings.TrimSuffix(table, "\n"), "\n")
	header := lines[0]
	require.True(t, strings.HasPrefix(header, "ID  "), table)
	state, consumer := strings.Index(header, "STATE"), strings.Index(header, "CONSUMER")
	ids, states := []int64{}, []string{}
	for _, l := range lines[1:] {
		id, err := strconv.ParseInt(strings.Fields(l)[0], 10, 64)
		require.NoError(t, err, l)
		ids = append(ids, id)
		states = append(states, strings.TrimSpace(l[state:consumer]))
	}
	return ids, states
}

func idArg(id int64) string { return strconv.FormatInt(id, 10) }

// TestRetriesCommand: "oncemill retries" lists the parked messages in the
// order they go out, with their state; shows one; makes one due now; and
// cancels into the dead-letter table, on PostgreSQL, MariaDB and SQLite.
func TestRetriesCommand(t *testing.T) {
	t.Parallel()
	for _, b := range parkedDBs {
		t.Run(b.name, func(t *testing.T) {
			t.Parallel()
			p := b.open(t)
			now := time.Now()
			overdue := parkedMessage("charge", "acct-1", 6, "gateway 503\nupstream", now.Add(-5*time.Minute))
			ids := []int64{
				p.park(t, overdue),
				p.park(t, retry.Message{Consumer: "charge", Topic: "orders", UUID: watermill.NewUUID(), OrderKey: "acct-1", Behind: true,
					DueAt: now, Payload: []byte("second")}),
				p.park(t, parkedMessage("charge", "acct-2", 5, "timeout", now.Add(time.Hour))),
				p.park(t, parkedMessage("ship", "", 5, "no address", now.Add(-5*time.Second))),
			}

			r := p.retries(t, "list")
			require.Equal(t, exitOK, r.code, r.stderr)
			require.Empty(t, r.stderr)
			gotIDs, states := listed(t, r.stdout)
			require.Equal(t, []int64{ids[0], ids[3], ids[1], ids[2]}, gotIDs, "in the order they go out: by due time")
			require.Equal(t, []string{"overdue", "due", "behind " + idArg(ids[0]), "waiting"}, states)
			require.Contains(t, r.stdout, "gateway 503 upstream", "an error's newline does not break the row")

			r = p.retries(t, "list", "--json")
			require.Equal(t, exitOK, r.code, r.stderr)
			var views []map[string]any
			require.NoError(t, json.Unmarshal([]byte(r.stdout), &views))
			require.Len(t, views, 4)
			first := views[0]
			require.EqualValues(t, ids[0], first["id"])
			require.Equal(t, overdue.UUID, first["uuid"])
			require.Equal(t, "charge", first["consumer"])
			require.Equal(t, "orders", first["topic"])
			require.Equal(t, "acct-1", first["order_key"])
			require.EqualValues(t, 6, first["attempts"])
			require.Equal(t, "overdue", first["state"])
			require.Equal(t, "2026-03-01T10:00:00Z", first["first_failed_at"])
			require.Equal(t, string(overdue.Payload), first["payload"])
			require.Equal(t, "tr-1", first["metadata"].(map[string]any)["trace_id"])
			require.EqualValues(t, ids[0], views[2]["waits_for"])
			require.Equal(t, true, views[2]["behind"])

			for _, tc := range []struct {
				args []string
				want []int64
			}{
				{[]string{"--consumer", "ship"}, []int64{ids[3]}},
				{[]string{"--order-key", "acct-1"}, []int64{ids[0], ids[1]}},
				{[]string{"--uuid", overdue.UUID}, []int64{ids[0]}},
				{[]string{"--key", overdue.Key}, []int64{ids[0]}},
				{[]string{"--consumer", "charge", "--limit", "2"}, []int64{ids[0], ids[1]}},
			} {
				r := p.retries(t, "list", tc.args...)
				require.Equal(t, exitOK, r.code, "%v: %s", tc.args, r.stderr)
				got, _ := listed(t, r.stdout)
				require.Equal(t, tc.want, got, tc.args)
			}
			r = p.retries(t, "list", "--topic", "nothing-here")
			require.Equal(t, exitOK, r.code, r.stderr)
			require.Equal(t, "no parked messages matched\n", r.stdout)
			r = p.retries(t, "list", "--topic", "nothing-here", "--json")
			require.Equal(t, "[]\n", r.stdout)
			require.Equal(t, "no parked messages matched\n", r.stderr)

			env := map[string]string{"DATABASE_URL": p.url}
			args := []string{"retries", "list", "--consumer", "ship"}
			if p.schema != "" {
				args = append(args, "--schema", p.schema)
			}
			r = oncemill(t, env, args...)
			require.Equal(t, exitOK, r.code, r.stderr)
			got, _ := listed(t, r.stdout)
			require.Equal(t, []int64{ids[3]}, got, "DATABASE_URL stands in for --database")

			r = p.retries(t, "show", idArg(ids[0]))
			require.Equal(t, exitOK, r.code, r.stderr)
			for _, want := range []string{
				"ID:               " + idArg(ids[0]) + "\n",
				"State:            overdue\n",
				"UUID:             " + overdue.UUID + "\n",
				"Consumer:         charge\n",
				"Order key:        acct-1\n",
				"Failed attempts:  6\n",
				"Last error:       gateway 503\n                  upstream\n",
				"First failed at:  2026-03-01T10:00:00Z\n",
				"Last failed at:   2026-03-01T10:01:30Z\n",
				"Out until:        -\n",
				"Metadata (2):\n  partition_key = acct-1\n  trace_id = tr-1\n",
				"Payload (text, " + strconv.Itoa(len(overdue.Payload)) + " bytes):\n" + string(overdue.Payload) + "\n",
			} {
				require.Contains(t, r.stdout, want)
			}
			r = p.retries(t, "show", idArg(ids[1]), "--json")
			require.Equal(t, exitOK, r.code, r.stderr)
			var v map[string]any
			require.NoError(t, json.Unmarshal([]byte(r.stdout), &v))
			require.Equal(t, "behind "+idArg(ids[0]), v["state"])
			r = p.retries(t, "show", "999999999")
			require.Equal(t, exitFailure, r.code, r.stderr)
			require.Contains(t, r.stderr, "oncemill retries show: no such parked message: id 999999999")
			requireOneLine(t, r.stderr)

			// now: the message due in an hour is due now; the one behind
			// another is due already, and stays as it is.
			r = p.retries(t, "now", idArg(ids[2]), idArg(ids[1]))
			require.Equal(t, exitOK, r.code, r.stderr)
			require.Contains(t, r.stdout, "1 parked message is due now")
			require.Contains(t, r.stdout, "1 of the 2 matched is left as it was: due already")
			m, err := p.store.Get(context.Background(), ids[2])
			require.NoError(t, err)
			require.False(t, m.DueAt.After(time.Now()), "due now")
			r = p.retries(t, "now", idArg(ids[2]), "999999999")
			require.Equal(t, exitFailure, r.code, r.stderr)
			require.Contains(t, r.stderr, "not parked: 999999999 (handed back, cancelled, or never parked); nothing retried")
			r = p.retries(t, "now", "--consumer", "nobody", "--json")
			require.Equal(t, exitOK, r.code, r.stderr)
			require.Equal(t, "no parked messages matched\n", r.stderr)

			// cancel: into the dead-letter table, once; the message behind
			// the cancelled one is first of its key now.
			r = p.retries(t, "cancel", idArg(ids[0]), "--json")
			require.Equal(t, exitOK, r.code, r.stderr)
			var res map[string]any
			require.NoError(t, json.Unmarshal([]byte(r.stdout), &res))
			require.EqualValues(t, 1, res["matched"])
			require.EqualValues(t, 1, res["cancelled"])
			entries, err := p.dlq.List(context.Background(), dlq.Filter{})
			require.NoError(t, err)
			require.Len(t, entries, 1)
			require.Equal(t, overdue.UUID, entries[0].UUID)
			require.Equal(t, "charge", entries[0].Consumer)
			require.Equal(t, "orders", entries[0].Topic)
			require.Equal(t, 6, entries[0].Attempts)
			require.Equal(t, retry.CancelReason+" while parked for a delayed retry after 6 failed attempts; last error: gateway 503\nupstream", entries[0].Error)
			r = p.retries(t, "list", "--order-key", "acct-1")
			got, states = listed(t, r.stdout)
			require.Equal(t, []int64{ids[1]}, got)
			require.Equal(t, []string{"due"}, states, "no longer behind the cancelled message")
			r = p.retries(t, "cancel", idArg(ids[0]))
			require.Equal(t, exitFailure, r.code, r.stderr)
			require.Contains(t, r.stderr, "not parked: "+idArg(ids[0]))

			r = p.retries(t, "cancel", "--consumer", "ship")
			require.Equal(t, exitOK, r.code, r.stderr)
			require.Contains(t, r.stdout, "cancelled 1 parked message: moved to the dead-letter table")
			entries, err = p.dlq.List(context.Background(), dlq.Filter{ErrorContains: retry.CancelReason})
			require.NoError(t, err)
			require.Len(t, entries, 2, "one dead letter per cancelled message")

			r = p.retries(t, "list", "--table", "nothere")
			require.Equal(t, exitFailure, r.code, r.stderr)
			require.Contains(t, r.stderr, "the table of parked messages does not exist")
			require.Contains(t, r.stderr, "--table nothere")
			requireOneLine(t, r.stderr)
			r = p.retries(t, "cancel", "--all", "--dlq-table", "nodlq")
			require.Equal(t, exitFailure, r.code, r.stderr)
			require.Contains(t, r.stderr, "--dlq-table nodlq")
			requireOneLine(t, r.stderr)
			left, err := p.store.Count(context.Background(), retry.Filter{})
			require.NoError(t, err)
			require.Equal(t, 2, left, "a cancel whose dead-letter table is missing moves nothing")
		})
	}
}

// TestRetriesUsageErrors: the mistakes of the command line are found
// before anything connects, in one line that names the flag.
func TestRetriesUsageErrors(t *testing.T) {
	t.Parallel()
	const db = "postgres://postgres@127.0.0.1:1/never"
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"retries"}, "oncemill retries: missing subcommand (list, show, now or cancel)"},
		{[]string{"retries", "retry"}, `oncemill retries: unknown subcommand "retry"`},
		{[]string{"retries", "list"}, "--database is required (or set DATABASE_URL)"},
		{[]string{"retries", "list", "--limit", "-1", "--database", db}, "--limit must be 0 (all) or more, got -1"},
		{[]string{"retries", "list", "7", "--database", db}, `unexpected argument "7": list takes no IDs`},
		{[]string{"retries", "list", "--table", "parked-messages", "--database", db}, `--table "parked-messages" is not a valid identifier`},
		{[]string{"retries", "show", "--database", db}, "missing ID: show takes one parked message's ID"},
		{[]string{"retries", "show", "x", "--database", db}, `ID "x" is not a positive integer`},
		{[]string{"retries", "now", "--database", db}, "nothing selected: give IDs, a filter flag (--consumer, --topic, --uuid, --key, --order-key) or --all"},
		{[]string{"retries", "now", "--limit", "3", "--database", db}, "nothing selected"},
		{[]string{"retries", "cancel", "--database", db}, "oncemill retries cancel: nothing selected"},
		{[]string{"retries", "cancel", "--all", "--dlq-table", "dead letters", "--database", db}, `--dlq-table "dead letters" is not a valid identifier`},
		{[]string{"retries", "cancel", "0", "--database", db}, `ID "0" is not a positive integer`},
	} {
		r := oncemill(t, nil, tc.args...)
		require.Equal(t, exitUsage, r.code, "%v: %s", tc.args, r.stderr)
		require.Contains(t, r.stderr, tc.want, tc.args)
		requireOneLine(t, r.stderr)
		require.Empty(t, r.stdout, tc.args)
	}
}
