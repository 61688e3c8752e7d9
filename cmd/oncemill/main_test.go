package main

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"maps"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/oncemill/oncemill/adapters"
	"github.com/oncemill/oncemill/dedup"
	"github.com/oncemill/oncemill/dedup/postgres"
	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/dlq"
	"github.com/oncemill/oncemill/internal/testing/msgtest"
	"github.com/oncemill/oncemill/internal/testing/netfault"
	"github.com/oncemill/oncemill/internal/testing/pgtest"
	"github.com/oncemill/oncemill/internal/testing/proctest"
	"github.com/oncemill/oncemill/sqlschema"
)

func TestMain(m *testing.M) {
	// A child process started by a test of this package (the relay's
	// consumer, the Kafka broker) runs its role and exits here.
	proctest.Main(relayConsumerRole)
	goleak.VerifyTestMain(m)
}

// result is one run of the command.
type result struct {
	code           int
	stdout, stderr string
}

// oncemill runs the command in-process with the given environment.
func oncemill(t *testing.T, env map[string]string, args ...string) result {
	t.Helper()
	var out, errOut bytes.Buffer
	code := run(context.Background(), args, func(k string) string { return env[k] }, &out, &errOut)
	return result{code: code, stdout: out.String(), stderr: errOut.String()}
}

// requireOneLine asserts that a failure was reported in exactly one line.
func requireOneLine(t *testing.T, s string) {
	t.Helper()
	require.Equal(t, 1, strings.Count(s, "\n"), "one line: %q", s)
	require.True(t, strings.HasSuffix(s, "\n"), s)
}

type fixture struct {
	pool   *pgxpool.Pool
	schema string
	pub    *dlq.Publisher
}

func setup(t *testing.T) fixture {
	t.Helper()
	pool := pgtest.Pool(t, 4)
	schema := pgtest.Schema(t, pool)
	pub, err := dlq.NewPublisher(pool, sqlschema.Config{Schema: schema})
	require.NoError(t, err)
	return fixture{pool: pool, schema: schema, pub: pub}
}

// dlq runs "oncemill dlq <sub> args... --database <test db> --schema <test schema>".
func (f fixture) dlq(t *testing.T, sub string, args ...string) result {
	t.Helper()
	full := append([]string{"dlq", sub}, args...)
	full = append(full, "--database", pgtest.URL(), "--schema", f.schema)
	return oncemill(t, nil, full...)
}

func (f fixture) ids(t *testing.T) []int64 {
	t.Helper()
	rows, err := f.pool.Query(context.Background(), `SELECT id FROM `+pgx.Identifier{f.schema, "dlq"}.Sanitize()+` ORDER BY id`)
	require.NoError(t, err)
	ids, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	require.NoError(t, err)
	return ids
}

// seed dead-letters msgs as a consumer's inbox and poison middleware do
// (the key of each is dead in the inbox table beside the dead-letter
// table, and the message goes through dlq.Publisher) and returns their ids.
func (f fixture) seed(t *testing.T, msgs ...*message.Message) []int64 {
	t.Helper()
	for _, m := range msgs {
		bury(t, f.pool, f.schema, m.Metadata.Get(delivery.DeadConsumer), m.Metadata.Get(delivery.DeadKey))
	}
	return f.seedEntries(t, msgs...)
}

// seedEntries writes msgs through dlq.Publisher only, with no inbox
// record, and returns their ids.
func (f fixture) seedEntries(t *testing.T, msgs ...*message.Message) []int64 {
	t.Helper()
	before := len(f.ids(t))
	require.NoError(t, f.pub.Publish("dead-letters", msgs...))
	ids := f.ids(t)
	require.Len(t, ids, before+len(msgs))
	return ids[before:]
}

// bury marks key dead for consumer in the PostgreSQL inbox table of
// schema, as the inbox does when it gives up on a message; it does
// nothing without a consumer or key.
func bury(t *testing.T, pool *pgxpool.Pool, schema, consumer, key string) {
	t.Helper()
	if consumer == "" || key == "" {
		return
	}
	ctx := context.Background()
	store, err := postgres.New(pool, postgres.Config{Schema: schema})
	require.NoError(t, err)
	k := dedup.Key{Consumer: consumer, Key: key}
	c, err := store.LeaseClaim(ctx, k, time.Minute, time.Hour)
	require.NoError(t, err)
	require.Equal(t, dedup.StateNew, c.State)
	require.NoError(t, store.LeaseBury(ctx, k, c.Token, dedup.Failure{Err: "seeded", At: time.Now()}))
}

func (f fixture) setDeadAt(t *testing.T, id int64, at time.Time) {
	t.Helper()
	_, err := f.pool.Exec(context.Background(), `UPDATE `+pgx.Identifier{f.schema, "dlq"}.Sanitize()+` SET dead_at = $1 WHERE id = $2`, at, id)
	require.NoError(t, err)
}

// dead is a message as the poison middleware dead-letters it.
func dead(topic, consumer, errText string) *message.Message {
	m := message.NewMessage(watermill.NewUUID(), []byte(`{"order":"`+watermill.NewShortUUID()+`"}`))
	m.Metadata.Set(delivery.IdempotencyKey, "key-"+m.UUID)
	m.Metadata.Set(delivery.PartitionKey, "customer-7")
	m.Metadata.Set(delivery.DeadTopic, topic)
	m.Metadata.Set(delivery.DeadConsumer, consumer)
	m.Metadata.Set(delivery.DeadKey, "key-"+m.UUID)
	m.Metadata.Set(delivery.DeadAttempts, "4")
	m.Metadata.Set(delivery.DeadError, errText)
	m.Metadata.Set(delivery.DeadPermanent, "false")
	m.Metadata.Set(delivery.DeadFirstFailedAt, "2026-03-01T10:00:00Z")
	m.Metadata.Set(delivery.DeadLastFailedAt, "2026-03-01T10:04:00.5Z")
	// What the adapter had set on the failed delivery, kept by the poison
	// middleware's copy.
	m.Metadata.Set(delivery.Topic, topic)
	m.Metadata.Set(delivery.Attempts, "4")
	m.Metadata.Set(delivery.Redelivered, "true")
	return m
}

// original is the metadata a replay must deliver: dead's without the
// oncemill_dlq_* keys and the facts of the failed delivery.
func original(m *message.Message) map[string]string {
	md := map[string]string{}
	for k, v := range m.Metadata {
		if !delivery.IsDeliveryFact(k) {
			md[k] = v
		}
	}
	return md
}

func TestUsageErrors(t *testing.T) {
	t.Parallel()
	// Never contacted: usage errors are found before connecting.
	const db = "postgres://postgres@127.0.0.1:1/never"
	for _, tc := range []struct {
		args []string
		want string
	}{
		{nil, "oncemill: missing command"},
		{[]string{"frobnicate"}, `oncemill: unknown command "frobnicate"`},
		{[]string{"dlq"}, "oncemill dlq: missing subcommand"},
		{[]string{"dlq", "wipe"}, `oncemill dlq: unknown subcommand "wipe"`},
		{[]string{"dlq", "list", "--bogus", "--database", db}, "oncemill dlq list: flag provided but not defined: -bogus"},
		{[]string{"dlq", "list", "--limit", "x", "--database", db}, `invalid value "x" for flag -limit`},
		{[]string{"dlq", "list", "--limit", "-1", "--database", db}, "--limit must be 0 (all) or more, got -1"},
		{[]string{"dlq", "list", "--since", "yesterday", "--database", db}, `invalid value "yesterday" for flag -since: "yesterday" is neither RFC 3339 nor a duration ago`},
		{[]string{"dlq", "list", "--until", "-2h", "--database", db}, `invalid value "-2h" for flag -until`},
		{[]string{"dlq", "list", "--since", "2026-01-02T00:00:00Z", "--until", "2026-01-01T00:00:00Z", "--database", db}, "--since (2026-01-02T00:00:00Z) is after --until (2026-01-01T00:00:00Z)"},
		{[]string{"dlq", "list", "7", "--database", db}, `unexpected argument "7": list takes no IDs`},
		{[]string{"dlq", "list"}, "--database is required (or set DATABASE_URL)"},
		{[]string{"dlq", "list", "--database", db, "--schema", "Billing"}, `--schema "Billing" is not a valid identifier`},
		{[]string{"dlq", "list", "--database", db, "--table", "dead-letters"}, `--table "dead-letters" is not a valid identifier`},
		{[]string{"dlq", "list", "--database", "postgres://h:notaport/db"}, "--database: "},
		{[]string{"dlq", "show", "--database", db}, "missing ID"},
		{[]string{"dlq", "show", "abc", "--database", db}, `ID "abc" is not a positive integer`},
		{[]string{"dlq", "show", "0", "--database", db}, `ID "0" is not a positive integer`},
		{[]string{"dlq", "show", "1", "2", "--database", db}, `unexpected argument "2"`},
		{[]string{"dlq", "show", "--topic", "x", "1", "--database", db}, "flag provided but not defined: -topic"},
		{[]string{"dlq", "replay", "--database", db, "--broker", "gochannel://"}, "nothing selected: give IDs, a filter flag"},
		{[]string{"dlq", "replay", "--limit", "5", "--database", db, "--broker", "gochannel://"}, "nothing selected"},
		{[]string{"dlq", "replay", "3", "x1", "--database", db, "--broker", "gochannel://"}, `ID "x1" is not a positive integer`},
		{[]string{"dlq", "replay", "3", "--database", db}, "--broker is required (or set BROKER_URL)"},
		{[]string{"dlq", "replay", "--all", "--broker", "amqp://guest:guest@127.0.0.1:1/"}, "--database is required"},
		{[]string{"dlq", "replay", "--all", "--broker", "gochannel://", "--database", db}, "--broker: adapters: not a durable destination: gochannel:// lives inside this process"},
		{[]string{"dlq", "purge", "--database", db}, "oncemill dlq purge: nothing selected"},
		{[]string{"dlq", "purge", "-5", "--database", db}, "flag provided but not defined: -5"},
		{[]string{"dlq", "purge", "0", "--database", db}, `ID "0" is not a positive integer`},
	} {
		r := oncemill(t, nil, tc.args...)
		require.Equal(t, exitUsage, r.code, "%v: %s", tc.args, r.stderr)
		require.Contains(t, r.stderr, tc.want, tc.args)
		requireOneLine(t, r.stderr)
		require.Empty(t, r.stdout, tc.args)
	}
}

func TestHelp(t *testing.T) {
	t.Parallel()
	for _, args := range [][]string{{"-h"}, {"help"}} {
		r := oncemill(t, nil, args...)
		require.Equal(t, exitOK, r.code, args)
		require.Contains(t, r.stdout, "  dlq replay ", args)
		require.Empty(t, r.stderr, args)
	}
	r := oncemill(t, nil, "dlq", "--help")
	require.Equal(t, exitOK, r.code)
	require.Contains(t, r.stdout, "Usage: oncemill dlq <command>")
	require.Contains(t, r.stdout, "  replay ")
	for _, args := range [][]string{{"dlq", "list", "-h"}, {"dlq", "replay", "3", "--help"}} {
		r := oncemill(t, nil, args...)
		require.Equal(t, exitOK, r.code, args)
		require.Contains(t, r.stdout, "Usage: oncemill dlq "+args[1]+" ", args)
		require.Empty(t, r.stderr, args)
	}
}

func TestRuntimeErrors(t *testing.T) {
	t.Parallel()
	f := setup(t)
	r := oncemill(t, nil, "dlq", "list", "--database", "postgres://postgres:hunter2@127.0.0.1:1/x?connect_timeout=5")
	require.Equal(t, exitFailure, r.code, r.stderr)
	require.Contains(t, r.stderr, "oncemill dlq list: connect to the database:")
	require.NotContains(t, r.stderr, "hunter2")
	requireOneLine(t, r.stderr)

	// A database that accepts the connection and never answers: the
	// command gives up after adapters.DefaultConnectTimeout and names it.
	silent := netfault.Silent(t)
	r = oncemill(t, nil, "dlq", "list", "--database", "postgres://postgres@"+silent+"/x")
	require.Equal(t, exitFailure, r.code, r.stderr)
	require.Contains(t, r.stderr, "oncemill dlq list: connect to the database:")
	require.Contains(t, r.stderr, silent)
	requireOneLine(t, r.stderr)

	r = f.dlq(t, "list", "--table", "nothere")
	require.Equal(t, exitFailure, r.code, r.stderr)
	require.Contains(t, r.stderr, `oncemill dlq list: dead-letter table "`+f.schema+`"."nothere" (--schema `+f.schema+` --table nothere) not found in this database: give the consumers' dead-letter table with --schema NAME and --table NAME`)
	requireOneLine(t, r.stderr)
}

// TestDLQTableMissingNamesTheFlags: every dlq command run on a schema
// without oncemill's tables (a consumer's schema other than the default,
// not given) says which table the flags named and that --schema and
// --table name another, not to run sqlschema.Migrate, which a user of
// the command has no program to run in.
func TestDLQTableMissingNamesTheFlags(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t, 2)
	empty := pgtest.Schema(t, pool) + "_none"
	for _, args := range [][]string{{"list"}, {"show", "1"}, {"purge", "1"}, {"replay", "--all", "--to-consumer"}, {"reopen", "1"}} {
		r := oncemill(t, nil, append(append([]string{"dlq"}, args...), "--database", pgtest.URL(), "--schema", empty)...)
		require.Equal(t, exitFailure, r.code, "%v: %s", args, r.stderr)
		require.Equal(t, "oncemill dlq "+args[0]+`: dead-letter table "`+empty+`"."dlq" (--schema `+empty+` --table dlq) not found in this database: `+
			`give the consumers' dead-letter table with --schema NAME and --table NAME (their sqlschema.Config's Schema and DLQTable; on SQLite --table alone); `+
			"their migrations create it (sqlschema.Migrate)\n", r.stderr, args)
	}
}

// seedList writes four entries dead-lettered at fixed times in 2000 and a
// fresh one, and returns their ids and messages.
func seedList(t *testing.T, f fixture) ([]int64, []*message.Message) {
	t.Helper()
	msgs := []*message.Message{
		dead("orders", "charge", "Card declined\nby issuer"),
		dead("orders", "ship", "timeout"),
		dead("refunds", "refund", "card DECLINED"),
		dead("refunds", "charge", "db down"),
		dead("payments", "charge", "fresh"),
	}
	msgs[0].Metadata.Set(delivery.DeadPartition, "3")
	msgs[0].Metadata.Set(delivery.DeadOffset, "1234")
	ids := f.seed(t, msgs...)
	for i := 0; i < 4; i++ {
		f.setDeadAt(t, ids[i], time.Date(2000, 1, 1, i, 0, 0, 0, time.UTC))
	}
	return ids, msgs
}

// listedIDs reads the ID column of list's table.
func listedIDs(t *testing.T, table string) []int64 {
	t.Helper()
	lines := strings.Split(strings.TrimSuffix(table, "\n"), "\n")
	require.True(t, strings.HasPrefix(lines[0], "ID  "), table)
	ids := []int64{}
	for _, l := range lines[1:] {
		id, err := strconv.ParseInt(strings.Fields(l)[0], 10, 64)
		require.NoError(t, err, l)
		ids = append(ids, id)
	}
	return ids
}

func TestList(t *testing.T) {
	t.Parallel()
	f := setup(t)
	ids, msgs := seedList(t, f)

	r := f.dlq(t, "list")
	require.Equal(t, exitOK, r.code, r.stderr)
	require.Empty(t, r.stderr)
	require.Equal(t, ids, listedIDs(t, r.stdout))
	lines := strings.Split(strings.TrimSuffix(r.stdout, "\n"), "\n")
	header := lines[0]
	for _, col := range []string{"ID", "DEAD AT", "TOPIC", "CONSUMER", "KEY", "ATTEMPTS", "COUNTED BY", "PERMANENT", "ERROR"} {
		require.Contains(t, header, col)
	}
	// Aligned: every row's topic starts under TOPIC, its error under ERROR.
	for i, l := range lines[1:] {
		require.Equal(t, strings.Index(header, "TOPIC"), strings.Index(l, msgs[i].Metadata.Get(delivery.DeadTopic)), l)
		require.Equal(t, strings.Index(header, "ERROR"), strings.LastIndex(l, "  ")+2, l)
	}
	require.Contains(t, lines[1], "2000-01-01T00:00:00Z")
	require.Contains(t, lines[1], "Card declined by issuer", "an error's newline does not break the row")
	require.Contains(t, lines[1], "key-"+msgs[0].UUID)

	r = f.dlq(t, "list", "--json")
	require.Equal(t, exitOK, r.code, r.stderr)
	var listed []map[string]any
	require.NoError(t, json.Unmarshal([]byte(r.stdout), &listed))
	require.Len(t, listed, 5)
	first := listed[0]
	require.EqualValues(t, ids[0], first["id"])
	require.Equal(t, msgs[0].UUID, first["uuid"])
	require.Equal(t, "orders", first["topic"])
	require.Equal(t, "dead-letters", first["dlq_topic"])
	require.Equal(t, "charge", first["consumer"])
	require.EqualValues(t, 4, first["attempts"])
	require.EqualValues(t, 3, first["kafka_partition"])
	require.EqualValues(t, 1234, first["kafka_offset"])
	require.Equal(t, string(msgs[0].Payload), first["payload"])
	require.Equal(t, "text", first["payload_encoding"])
	require.Equal(t, "2000-01-01T00:00:00Z", first["dead_at"])
	require.Equal(t, "2026-03-01T10:04:00.5Z", first["last_failed_at"])
	require.Equal(t, "orders", first["metadata"].(map[string]any)[delivery.DeadTopic])
	_, has := listed[1]["kafka_partition"]
	require.False(t, has, "an unknown partition is left out")

	for _, tc := range []struct {
		args []string
		want []int64
	}{
		{[]string{"--topic", "refunds"}, []int64{ids[2], ids[3]}},
		{[]string{"--consumer", "charge"}, []int64{ids[0], ids[3], ids[4]}},
		{[]string{"--error", "DECLINED"}, []int64{ids[0], ids[2]}},
		{[]string{"--since", "2000-01-01T02:00:00Z"}, []int64{ids[2], ids[3], ids[4]}},
		{[]string{"--until", "2000-01-01T01:00:00Z"}, []int64{ids[0], ids[1]}},
		{[]string{"--since", "2000-01-01T01:00:00Z", "--until", "2000-01-01T02:00:00Z"}, []int64{ids[1], ids[2]}},
		{[]string{"--since", "1h"}, []int64{ids[4]}},
		{[]string{"--until", "7d"}, []int64{ids[0], ids[1], ids[2], ids[3]}},
		{[]string{"--limit", "2"}, []int64{ids[0], ids[1]}},
		{[]string{"--consumer", "charge", "--error", "d", "--limit", "1"}, []int64{ids[0]}},
	} {
		r := f.dlq(t, "list", tc.args...)
		require.Equal(t, exitOK, r.code, "%v: %s", tc.args, r.stderr)
		require.Equal(t, tc.want, listedIDs(t, r.stdout), tc.args)
	}

	r = f.dlq(t, "list", "--topic", "nothing-here")
	require.Equal(t, exitOK, r.code, r.stderr)
	require.Equal(t, "no entries matched\n", r.stdout)
	r = f.dlq(t, "list", "--topic", "nothing-here", "--json")
	require.Equal(t, exitOK, r.code, r.stderr)
	require.Equal(t, "[]\n", r.stdout)
	require.Equal(t, "no entries matched\n", r.stderr)

	// DATABASE_URL stands in for --database.
	r = oncemill(t, map[string]string{"DATABASE_URL": pgtest.URL()}, "dlq", "list", "--schema", f.schema, "--topic", "orders")
	require.Equal(t, exitOK, r.code, r.stderr)
	require.Equal(t, []int64{ids[0], ids[1]}, listedIDs(t, r.stdout))
}

func TestShow(t *testing.T) {
	t.Parallel()
	f := setup(t)
	text := dead("orders", "charge", "card declined\nby issuer")
	text.Metadata.Set(delivery.DeadPartition, "3")
	binary := dead("orders", "charge", "undecodable")
	binary.Payload = []byte{0xde, 0xad, 0xbe, 0xef}
	ids := f.seedEntries(t, text, binary)
	// The inbox beside the table holds text's key dead, with two copies
	// acked since it was dead-lettered; binary's key has no record.
	_, err := f.pool.Exec(context.Background(), `INSERT INTO `+pgx.Identifier{f.schema, "inbox"}.Sanitize()+
		` (consumer, key, status, expires_at) VALUES ('charge', $1, 'dead', now() + interval '1 day')`, "key-"+text.UUID)
	require.NoError(t, err)
	_, err = f.pool.Exec(context.Background(), `INSERT INTO `+pgx.Identifier{f.schema, "inbox_failures"}.Sanitize()+
		` (consumer, key, dead_copies) VALUES ('charge', $1, 2)`, "key-"+text.UUID)
	require.NoError(t, err)

	r := f.dlq(t, "show", strconv.FormatInt(ids[0], 10))
	require.Equal(t, exitOK, r.code, r.stderr)
	for _, want := range []string{
		"ID:                 " + strconv.FormatInt(ids[0], 10) + "\n",
		"UUID:               " + text.UUID + "\n",
		"Topic:              orders\n",
		"Dead-letter table:  " + f.schema + ".dlq\n",
		"Dead-letter topic:  dead-letters (the name the dead-letter publisher was given, such as PoisonConfig.Topic; the entry is in the table above, not on a broker)\n",
		"Consumer:           charge\n",
		"Key:                key-" + text.UUID + "\n",
		"Attempts:           4 (source not recorded)\n",
		"Permanent:          false\n",
		"Error:              card declined\n                    by issuer\n",
		"First failed at:    2026-03-01T10:00:00Z\n",
		"Last failed at:     2026-03-01T10:04:00.5Z\n",
		"Kafka partition:    3\n",
		"Dead at:            ",
		"Copies since dead:  2 (later deliveries of the key, acked by the inbox without running)\n",
		fmt.Sprintf("Metadata (%d):\n", len(text.Metadata)),
		"  oncemill_dlq_topic = orders\n",
		"  oncemill_dlq_error = card declined\n" + strings.Repeat(" ", len("  oncemill_dlq_error = ")) + "by issuer\n",
		"  partition_key = customer-7\n",
		fmt.Sprintf("Payload (text, %d bytes):\n%s\n", len(text.Payload), text.Payload),
	} {
		require.Contains(t, r.stdout, want)
	}
	require.NotContains(t, r.stdout, "Kafka offset:", "the entry has no offset")

	// Flags may follow the ID.
	r = f.dlq(t, "show", strconv.FormatInt(ids[1], 10), "--json")
	require.Equal(t, exitOK, r.code, r.stderr)
	var shown map[string]any
	require.NoError(t, json.Unmarshal([]byte(r.stdout), &shown))
	require.Equal(t, binary.UUID, shown["uuid"])
	require.Equal(t, base64.StdEncoding.EncodeToString([]byte{0xde, 0xad, 0xbe, 0xef}), shown["payload"])
	require.Equal(t, "base64", shown["payload_encoding"])
	require.Equal(t, "undecodable", shown["metadata"].(map[string]any)[delivery.DeadError])
	require.NotContains(t, shown, "copies_since", "no inbox record for the key")

	r = f.dlq(t, "show", strconv.FormatInt(ids[1], 10))
	require.Equal(t, exitOK, r.code, r.stderr)
	require.Contains(t, r.stdout, "Payload (base64, 4 bytes):\n3q2+7w==\n")
	require.Contains(t, r.stdout, "Copies since dead:  - (no dead record of the key in an inbox table beside the dead-letter table)\n")

	r = f.dlq(t, "show", "abc")
	require.Equal(t, exitUsage, r.code)
	require.Contains(t, r.stderr, `ID "abc" is not a positive integer`)

	unknown := strconv.FormatInt(ids[1]+1000, 10)
	r = f.dlq(t, "show", unknown)
	require.Equal(t, exitFailure, r.code)
	require.Equal(t, "oncemill dlq show: no such entry: "+unknown+"\n", r.stderr)
	require.Empty(t, r.stdout)
}

// pgBroker is the watermill-sql broker on the test database, as
// adapters.Open takes it, and its tables for topic are dropped at the end.
func pgBroker(t *testing.T, pool *pgxpool.Pool, topic string) string {
	t.Helper()
	t.Cleanup(func() {
		_, err := pool.Exec(context.Background(), `DROP TABLE IF EXISTS `+
			pgx.Identifier{"watermill_" + topic}.Sanitize()+`, `+pgx.Identifier{"watermill_offsets_" + topic}.Sanitize())
		require.NoError(t, err)
	})
	return pgtest.URL()
}

// subscribe reads topic from the broker at brokerURL in a group of its own.
func subscribe(t *testing.T, brokerURL, topic string) <-chan *message.Message {
	t.Helper()
	u, err := url.Parse(brokerURL)
	require.NoError(t, err)
	q := u.Query()
	q.Set("group", pgtest.Name(t))
	u.RawQuery = q.Encode()
	ctx, cancel := context.WithCancel(context.Background())
	ps, err := adapters.Open(ctx, u.String(), adapters.Options{})
	require.NoError(t, err)
	t.Cleanup(func() {
		cancel()
		require.NoError(t, ps.Close())
	})
	msgs, err := ps.Subscriber.Subscribe(ctx, topic)
	require.NoError(t, err)
	return msgs
}

// receive takes n messages and returns them by UUID.
func receive(t *testing.T, msgs <-chan *message.Message, n int) map[string]*message.Message {
	t.Helper()
	got := map[string]*message.Message{}
	for i := 0; i < n; i++ {
		m := msgtest.Receive(t, msgs, 30*time.Second)
		m.Ack()
		require.NotContains(t, got, m.UUID, "received twice")
		got[m.UUID] = m
	}
	return got
}

func requireReplayed(t *testing.T, want *message.Message, got *message.Message) {
	t.Helper()
	require.NotNil(t, got, "message %s not replayed", want.UUID)
	require.Equal(t, want.UUID, got.UUID)
	require.Equal(t, string(want.Payload), string(got.Payload))
	md := map[string]string(got.Metadata)
	require.NotEmpty(t, md[delivery.Replay], "marked as a replay")
	require.Equal(t, want.Metadata.Get(delivery.DeadConsumer), md[delivery.ReplayConsumer],
		"marked for the consumer that dead-lettered it")
	require.Regexp(t, `^[1-9][0-9]*$`, md[dlq.ReplayedFrom], "names the entry it was replayed from")
	md = maps.Clone(md)
	delete(md, delivery.Replay)
	delete(md, delivery.ReplayConsumer)
	delete(md, dlq.ReplayedFrom)
	require.Equal(t, original(want), md, "original metadata, no oncemill_dlq_* keys")
	for k := range got.Metadata {
		require.False(t, strings.HasPrefix(k, "oncemill_dlq_"), k)
	}
}

func TestReplayToPostgresBroker(t *testing.T) {
	t.Parallel()
	f := setup(t)
	topic := pgtest.Name(t)
	broker := pgBroker(t, f.pool, topic)
	msgs := subscribe(t, broker, topic)

	byID := dead(topic, "one", "boom")
	ids := f.seed(t, byID)
	var bulk, keep []*message.Message
	for i := 0; i < 25; i++ {
		bulk = append(bulk, dead(topic, "bulk", "timeout "+strconv.Itoa(i)))
	}
	for i := 0; i < 2; i++ {
		keep = append(keep, dead(topic, "keep", "timeout"))
	}
	bulkIDs := f.seed(t, bulk...)
	keepIDs := f.seed(t, keep...)

	r := f.dlq(t, "replay", strconv.FormatInt(ids[0], 10), "--broker", broker)
	require.Equal(t, exitOK, r.code, r.stderr)
	require.Equal(t, "replayed 1 entry\n", r.stdout)
	require.Empty(t, r.stderr)
	got := receive(t, msgs, 1)
	requireReplayed(t, byID, got[byID.UUID])
	require.Equal(t, append(bulkIDs, keepIDs...), f.ids(t))

	// By filter, through BROKER_URL, more than 20 entries: no progress bar
	// when stderr is not a terminal.
	r = oncemill(t, map[string]string{"BROKER_URL": broker}, "dlq", "replay", "--consumer", "bulk", "--error", "TIMEOUT",
		"--json", "--database", pgtest.URL(), "--schema", f.schema)
	require.Equal(t, exitOK, r.code, r.stderr)
	require.JSONEq(t, `{"matched": 25, "replayed": 25}`, r.stdout)
	require.Empty(t, r.stderr)
	got = receive(t, msgs, 25)
	for _, m := range bulk {
		requireReplayed(t, m, got[m.UUID])
	}
	require.Equal(t, keepIDs, f.ids(t), "replayed rows are gone, unmatched rows remain")

	var published int
	require.NoError(t, f.pool.QueryRow(context.Background(), `SELECT count(*) FROM `+pgx.Identifier{"watermill_" + topic}.Sanitize()).Scan(&published))
	require.Equal(t, 26, published, "each replayed entry published once")
}

func TestReplayUnreachableBroker(t *testing.T) {
	t.Parallel()
	f := setup(t)
	ids := f.seed(t, dead("orders", "c", "e"), dead("orders", "c", "e"), dead("refunds", "c", "e"))

	r := f.dlq(t, "replay", "--all", "--broker", "amqp://guest:s3cret@127.0.0.1:1/")
	require.Equal(t, exitFailure, r.code, r.stderr)
	require.Contains(t, r.stderr, "oncemill dlq replay: nothing replayed: adapters: open amqp://guest:xxxxx@127.0.0.1:1/")
	require.NotContains(t, r.stderr, "s3cret")
	requireOneLine(t, r.stderr)
	require.Empty(t, r.stdout)
	require.Equal(t, ids, f.ids(t), "no row deleted")

	r = oncemill(t, map[string]string{"BROKER_URL": "amqp://guest:guest@127.0.0.1:1/", "DATABASE_URL": pgtest.URL()},
		"dlq", "replay", strconv.FormatInt(ids[2], 10), "--schema", f.schema)
	require.Equal(t, exitFailure, r.code, r.stderr)
	require.Contains(t, r.stderr, "nothing replayed")
	require.Equal(t, ids, f.ids(t), "no row deleted")

	r = f.dlq(t, "replay", "--all", "--broker", "nsq://127.0.0.1:4150")
	require.Equal(t, exitUsage, r.code, r.stderr)
	require.Contains(t, r.stderr, `oncemill dlq replay: --broker: adapters: unknown broker scheme "nsq"`)
	requireOneLine(t, r.stderr)
	require.Equal(t, ids, f.ids(t), "no row deleted")

	// Nothing matched: the broker is not even opened.
	r = f.dlq(t, "replay", "--topic", "payments", "--broker", "amqp://guest:guest@127.0.0.1:1/")
	require.Equal(t, exitOK, r.code, r.stderr)
	require.Equal(t, "no entries matched\n", r.stdout)
}

func TestReplayAndPurgeUnknownIDs(t *testing.T) {
	t.Parallel()
	f := setup(t)
	ids := f.seed(t, dead("orders", "c", "e"), dead("orders", "c", "e"))
	a, b := strconv.FormatInt(ids[1]+100, 10), strconv.FormatInt(ids[1]+7, 10)

	r := f.dlq(t, "replay", strconv.FormatInt(ids[0], 10), a, b, "--broker", "amqp://guest:guest@127.0.0.1:1/")
	require.Equal(t, exitFailure, r.code, r.stderr)
	require.Equal(t, "oncemill dlq replay: no such entries: "+b+", "+a+"; nothing replayed\n", r.stderr)
	r = f.dlq(t, "purge", a, strconv.FormatInt(ids[1], 10))
	require.Equal(t, exitFailure, r.code, r.stderr)
	require.Equal(t, "oncemill dlq purge: no such entry: "+a+"; nothing purged\n", r.stderr)
	require.Equal(t, ids, f.ids(t))
}

func TestPurge(t *testing.T) {
	t.Parallel()
	f := setup(t)
	ids := f.seed(t,
		dead("orders", "charge", "e"),
		dead("orders", "charge", "e"),
		dead("refunds", "refund", "e"),
		dead("refunds", "refund", "e"),
		dead("orders", "ship", "e"),
		dead("orders", "ship", "e"),
	)

	for _, args := range [][]string{{}, {"--json"}, {"--limit", "3"}} {
		r := f.dlq(t, "purge", args...)
		require.Equal(t, exitUsage, r.code, r.stderr)
		require.Contains(t, r.stderr, "nothing selected: give IDs, a filter flag (--topic, --consumer, --error, --since, --until) or --all")
		require.Equal(t, ids, f.ids(t), "nothing deleted")
	}

	r := f.dlq(t, "purge", strconv.FormatInt(ids[0], 10))
	require.Equal(t, exitOK, r.code, r.stderr)
	require.Equal(t, "purged 1 entry\n", r.stdout)
	require.Equal(t, ids[1:], f.ids(t))

	r = f.dlq(t, "purge", "--topic", "refunds")
	require.Equal(t, exitOK, r.code, r.stderr)
	require.Equal(t, "purged 2 entries\n", r.stdout)
	require.Equal(t, []int64{ids[1], ids[4], ids[5]}, f.ids(t))

	r = f.dlq(t, "purge", "--consumer", "ship", "--limit", "1", "--json")
	require.Equal(t, exitOK, r.code, r.stderr)
	require.JSONEq(t, `{"purged": 1}`, r.stdout)
	require.Equal(t, []int64{ids[1], ids[5]}, f.ids(t))

	r = f.dlq(t, "purge", "--topic", "payments")
	require.Equal(t, exitOK, r.code, r.stderr)
	require.Equal(t, "no entries matched\n", r.stdout)
	require.Equal(t, []int64{ids[1], ids[5]}, f.ids(t))

	r = f.dlq(t, "purge", "--all")
	require.Equal(t, exitOK, r.code, r.stderr)
	require.Equal(t, "purged 2 entries\n", r.stdout)
	require.Empty(t, f.ids(t))
}

func TestProgressBar(t *testing.T) {
	t.Parallel()
	var b bytes.Buffer
	require.Nil(t, newProgress(&b, 40, false), "not a terminal")
	require.Nil(t, newProgress(&b, 20, true), "20 entries or fewer")
	var none *progress
	none.finish() // a nil bar does nothing

	bar := newProgress(&b, 40, true)
	require.NotNil(t, bar)
	bar.update(0, 40)
	bar.update(12, 40)
	bar.update(40, 40)
	bar.finish()
	require.Equal(t,
		"\r[..............................] 0/40"+
			"\r[#########.....................] 12/40"+
			"\r[##############################] 40/40\n", b.String())

	require.False(t, isTerminal(&b))
	file, err := os.Create(filepath.Join(t.TempDir(), "stderr"))
	require.NoError(t, err)
	defer file.Close()
	require.False(t, isTerminal(file), "a regular file is no terminal")
}

func TestParseTime(t *testing.T) {
	t.Parallel()
	now := time.Date(2026, 3, 10, 12, 0, 0, 0, time.UTC)
	for in, want := range map[string]time.Time{
		"2026-03-01T10:00:00Z":         time.Date(2026, 3, 1, 10, 0, 0, 0, time.UTC),
		"2026-03-01T10:00:00.25+02:00": time.Date(2026, 3, 1, 8, 0, 0, 250e6, time.UTC),
		"2h":                           now.Add(-2 * time.Hour),
		"90m":                          now.Add(-90 * time.Minute),
		"7d":                           now.Add(-7 * 24 * time.Hour),
		"0s":                           now,
	} {
		got, err := parseTime(in, now)
		require.NoError(t, err, in)
		require.True(t, want.Equal(got), "%s: %s", in, got)
	}
	for _, bad := range []string{"", "yesterday", "-2h", "xd", "-1d", "2026-03-01"} {
		_, err := parseTime(bad, now)
		require.ErrorContains(t, err, "is neither RFC 3339 nor a duration ago", bad)
	}
}

func TestParseInterleaved(t *testing.T) {
	t.Parallel()
	c := &cmd{name: "t"}
	fs := c.flags()
	pos, err := parse(fs, []string{"1", "--json", "2", "--schema", "s", "3", "--", "--4"})
	require.NoError(t, err)
	require.Equal(t, []string{"1", "2", "3", "--4"}, pos)
	require.True(t, c.json)
	require.Equal(t, "s", c.schema)
}

// TestReplayStopsWhenBrokerRefuses replays three entries to the PostgreSQL
// broker, which refuses the second one's topic: the first is replayed and
// deleted, the second and third stay.
func TestReplayStopsWhenBrokerRefuses(t *testing.T) {
	t.Parallel()
	f := setup(t)
	topic := pgtest.Name(t)
	broker := pgBroker(t, f.pool, topic)
	msgs := subscribe(t, broker, topic)

	first := dead(topic, "c", "e")
	ids := f.seed(t, first, dead("not a topic name", "c", "e"), dead(topic, "c", "e"))
	r := f.dlq(t, "replay", "--consumer", "c", "--broker", broker)
	require.Equal(t, exitFailure, r.code, r.stderr)
	require.Contains(t, r.stderr, fmt.Sprintf(`oncemill dlq replay: replayed 1 of 3 entries, then: dlq: replay entry %d`, ids[1]))
	requireOneLine(t, r.stderr)
	require.Equal(t, ids[1:], f.ids(t), "the refused entry and the ones after it stay")

	requireReplayed(t, first, receive(t, msgs, 1)[first.UUID])
	var published int
	require.NoError(t, f.pool.QueryRow(context.Background(), `SELECT count(*) FROM `+pgx.Identifier{"watermill_" + topic}.Sanitize()).Scan(&published))
	require.Equal(t, 1, published)
}

// TestReplayToConsumer: --to-consumer publishes nothing; it marks the
// entries for their consumers' replay subscribers, which deliver and
// delete them, and leaves them in the table meanwhile.
func TestReplayToConsumer(t *testing.T) {
	t.Parallel()
	f := setup(t)
	ids := f.seed(t, dead("orders", "charge", "card declined"), dead("orders", "ship", "no address"))
	f.announce(t, "charge", time.Second)

	r := f.dlq(t, "replay", strconv.FormatInt(ids[0], 10), "--to-consumer")
	require.Equal(t, exitOK, r.code, r.stderr)
	require.Contains(t, r.stdout, "requested a replay of 1 entry to its consumer")
	var requested []int64
	rows, err := f.pool.Query(context.Background(), `SELECT id FROM `+pgx.Identifier{f.schema, "dlq"}.Sanitize()+` WHERE replay_requested_at IS NOT NULL`)
	require.NoError(t, err)
	requested, err = pgx.CollectRows(rows, pgx.RowTo[int64])
	require.NoError(t, err)
	require.Equal(t, []int64{ids[0]}, requested)
	require.Equal(t, ids, f.ids(t), "nothing deleted until the consumer took it")

	r = f.dlq(t, "replay", strconv.FormatInt(ids[1], 10), "--to-consumer", "--broker", "kafka://127.0.0.1:1")
	require.Equal(t, exitUsage, r.code)
	require.Contains(t, r.stderr, "--to-consumer publishes nothing")
}

// TestErrorPrefixNotDoubled: a library's error starts with its package,
// which the command's own prefix already names; the command prints it
// once ("oncemill reconcile: no ledger table …", not "oncemill reconcile:
// reconcile: no ledger table …").
func TestErrorPrefixNotDoubled(t *testing.T) {
	t.Parallel()
	f := setup(t)
	ids := f.seed(t, dead("orders", "c", "e"))
	unknown := strconv.FormatInt(ids[0]+1000, 10)
	none := pgtest.Name(t) // a schema with no tables
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"reconcile", "--database", pgtest.URL(), "--schema", none, "--consumer", "c"},
			`oncemill reconcile: no ledger table "` + none + `"."outbox_ledger"`},
		{[]string{"dlq", "show", unknown, "--database", pgtest.URL(), "--schema", f.schema},
			"oncemill dlq show: no such entry: " + unknown + "\n"},
	} {
		r := oncemill(t, nil, tc.args...)
		require.NotEqual(t, exitOK, r.code, r.stderr)
		require.True(t, strings.HasPrefix(r.stderr, tc.want), "%v: %q", tc.args, r.stderr)
		requireOneLine(t, r.stderr)
	}
	require.Equal(t, "no such entry: 7", errorText("oncemill dlq show", "dlq: no such entry: 7"))
	require.Equal(t, "replay: x", errorText("oncemill dlq show", "dlq: replay: x"), "only the command's own words")
	require.Equal(t, "x", errorText("oncemill dlq replay", "dlq: replay: x"))
	require.Equal(t, "oncemill: x", errorText("oncemill reconcile", "oncemill: x"))
}
