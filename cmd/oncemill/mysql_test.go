package main

import (
	"context"
	"database/sql"
	"encoding/json"
	"net/http"
	"net/url"
	"strconv"
	"testing"
	"time"

	"github.com/oncemill/oncemill/internal/testing/proctest"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/dedup"
	"github.com/oncemill/oncemill/dedup/sqlstore"
	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/dlq"
	"github.com/oncemill/oncemill/forwarder"
	"github.com/oncemill/oncemill/internal/testing/msgtest"
	"github.com/oncemill/oncemill/internal/testing/mysqltest"
	"github.com/oncemill/oncemill/internal/testing/pgtest"
	"github.com/oncemill/oncemill/sqlschema"
)

// TestParseMySQLURL: a mysql:// URL becomes go-sql-driver/mysql's config,
// with the port, the connect timeout and the driver's parameters; a bad
// one is a usage error that never shows the password.
func TestParseMySQLURL(t *testing.T) {
	t.Parallel()
	cfg, err := parseDSN("--database", "mysql://app:p%40ss%3Aw%2Frd@db.internal/shop?tls=skip-verify&readTimeout=30s")
	require.NoError(t, err)
	require.Equal(t, "tcp", cfg.Net)
	require.Equal(t, "db.internal:3306", cfg.Addr, "the port defaults to 3306")
	require.Equal(t, "app", cfg.User)
	require.Equal(t, "p@ss:w/rd", cfg.Passwd, "percent-decoded")
	require.Equal(t, "shop", cfg.DBName)
	require.Equal(t, "skip-verify", cfg.TLSConfig)
	require.Equal(t, 30*time.Second, cfg.ReadTimeout)
	require.Equal(t, 10*time.Second, cfg.Timeout, "the connect timeout of adapters.Open")

	cfg, err = parseDSN("--database", "MySQL://root@127.0.0.1:3307/?timeout=2s&readTimeout=0")
	require.NoError(t, err)
	require.Equal(t, "127.0.0.1:3307", cfg.Addr)
	require.Empty(t, cfg.DBName)
	require.Empty(t, cfg.Passwd)
	require.Equal(t, 2*time.Second, cfg.Timeout)
	require.Zero(t, cfg.ReadTimeout, "the URL's own value wins, 0 (no bound) too")
	require.Equal(t, ioTimeout, cfg.WriteTimeout, "a statement's write is bounded by default")

	cfg, err = parseDSN("--database", "mysql://root@127.0.0.1/test")
	require.NoError(t, err)
	require.Equal(t, ioTimeout, cfg.ReadTimeout, "a statement's answer is awaited for a bounded time by default")
	require.Equal(t, ioTimeout, cfg.WriteTimeout)

	for _, raw := range []string{
		"mysql://app:secret@host/db?nosuchparam=1&timeout=never",
		"mysql:secret@host",
		"mysql://app:secret@host/a/b",
	} {
		_, err := parseDSN("--database", raw)
		require.Error(t, err, raw)
		var u usageError
		require.ErrorAs(t, err, &u, raw)
		require.NotContains(t, err.Error(), "secret", raw)
		require.Contains(t, err.Error(), "--database", raw)
	}
}

// mysqlFixture is a dead-letter table, with its inbox table beside it, in
// a database of its own on the MySQL/MariaDB test server.
type mysqlFixture struct {
	db    *sql.DB
	name  string
	url   string
	pub   *dlq.Publisher
	store *dlq.Store
	inbox *sqlstore.Store
}

func setupMySQL(t *testing.T) mysqlFixture {
	t.Helper()
	db, name := mysqltest.DB(t, 4)
	cfg := sqlschema.Config{Schema: name}
	require.NoError(t, sqlschema.MigrateSQL(context.Background(), db, sqlschema.MySQL, cfg))
	pub, err := dlq.NewSQLPublisher(db, sqlschema.MySQL, cfg)
	require.NoError(t, err)
	store, err := dlq.NewSQLStore(db, sqlschema.MySQL, cfg)
	require.NoError(t, err)
	inbox, err := sqlstore.New(db, sqlstore.Config{Dialect: sqlstore.MySQL, Schema: cfg})
	require.NoError(t, err)
	// The test server as a mysql:// URL; the tables are in the database
	// that --schema names, not in the URL's.
	return mysqlFixture{db: db, name: name, url: mysqlURL(t), pub: pub, store: store, inbox: inbox}
}

func (f mysqlFixture) dlq(t *testing.T, sub string, args ...string) result {
	t.Helper()
	full := append([]string{"dlq", sub}, args...)
	full = append(full, "--database", f.url, "--schema", f.name)
	return oncemill(t, nil, full...)
}

func (f mysqlFixture) ids(t *testing.T) []int64 {
	t.Helper()
	entries, err := f.store.List(context.Background(), dlq.Filter{})
	require.NoError(t, err)
	ids := make([]int64, len(entries))
	for i, e := range entries {
		ids[i] = e.ID
	}
	return ids
}

// seed dead-letters msgs as a consumer's MariaDB inbox and the poison
// middleware do: the key dead in the inbox table, the message in the
// dead-letter table.
func (f mysqlFixture) seed(t *testing.T, msgs ...*message.Message) []int64 {
	t.Helper()
	before := len(f.ids(t))
	for _, m := range msgs {
		f.seedEntries(t, f, m)
	}
	ids := f.ids(t)
	require.Len(t, ids, before+len(msgs))
	return ids[before:]
}

// seedEntries dead-letters m with its key dead in inbox's inbox table and
// returns its id.
func (f mysqlFixture) seedEntries(t *testing.T, inbox mysqlFixture, m *message.Message) int64 {
	t.Helper()
	ctx := context.Background()
	key := dedup.Key{Consumer: m.Metadata.Get(delivery.DeadConsumer), Key: m.Metadata.Get(delivery.DeadKey)}
	tx, err := inbox.inbox.InboxBegin(ctx)
	require.NoError(t, err)
	_, err = tx.InboxClaim(ctx, key, time.Hour)
	require.NoError(t, err)
	require.NoError(t, tx.InboxBury(ctx, key, dedup.Failure{Err: "seeded", At: time.Now()}))
	require.NoError(t, tx.Commit(ctx))
	before := f.ids(t)
	require.NoError(t, f.pub.Publish("dead-letters", m))
	after := f.ids(t)
	require.Len(t, after, len(before)+1)
	return after[len(before)]
}

// TestMySQLDLQListShowReplay: oncemill dlq list, show, replay and purge
// with a mysql:// --database, on MariaDB.
func TestMySQLDLQListShowReplay(t *testing.T) {
	t.Parallel()
	f := setupMySQL(t)
	declined := dead("orders_mysql", "charge", "card declined\nby issuer")
	declined.Metadata.Set(delivery.DeadPartition, "3")
	timeout := dead("orders_mysql", "ship", "timeout")
	other := dead("payments", "charge", "card declined")
	ids := f.seed(t, declined, timeout, other)

	r := f.dlq(t, "list")
	require.Equal(t, exitOK, r.code, r.stderr)
	require.Equal(t, ids, listedIDs(t, r.stdout))
	require.Contains(t, r.stdout, "key-"+declined.UUID)

	r = f.dlq(t, "list", "--json", "--consumer", "charge", "--error", "CARD DECLINED")
	require.Equal(t, exitOK, r.code, r.stderr)
	var listed []map[string]any
	require.NoError(t, json.Unmarshal([]byte(r.stdout), &listed))
	require.Len(t, listed, 2)
	require.Equal(t, declined.UUID, listed[0]["uuid"])
	require.Equal(t, "orders_mysql", listed[0]["topic"])
	require.EqualValues(t, 3, listed[0]["kafka_partition"])
	require.Equal(t, other.UUID, listed[1]["uuid"])

	r = f.dlq(t, "show", strconv.FormatInt(ids[0], 10))
	require.Equal(t, exitOK, r.code, r.stderr)
	for _, want := range []string{
		"UUID:               " + declined.UUID + "\n",
		"Topic:              orders_mysql\n",
		"Consumer:           charge\n",
		"Error:              card declined\n                    by issuer\n",
		"Kafka partition:    3\n",
		"Copies since dead:  0 (later deliveries of the key, acked by the inbox without running)\n",
	} {
		require.Contains(t, r.stdout, want)
	}
	r = f.dlq(t, "show", strconv.FormatInt(ids[2]+100, 10))
	require.NotEqual(t, exitOK, r.code)
	require.Contains(t, r.stderr, "no such entry")

	// Replay to the topic through a durable broker.
	broker := pgBroker(t, pgtest.Pool(t, 2), "orders_mysql")
	msgs := subscribe(t, broker, "orders_mysql")
	r = f.dlq(t, "replay", strconv.FormatInt(ids[0], 10), "--broker", broker)
	require.Equal(t, exitOK, r.code, r.stderr)
	require.Contains(t, r.stdout, "replayed 1 entry")
	got := msgtest.Receive(t, msgs, 30*time.Second)
	got.Ack()
	require.Equal(t, declined.UUID, got.UUID)
	require.Equal(t, string(declined.Payload), string(got.Payload))
	grant := got.Metadata.Get(delivery.Replay)
	require.NotEmpty(t, grant, "a replay grant")
	granted, err := f.inbox.InboxReplayGranted(context.Background(), dedup.Key{Consumer: "charge", Key: "key-" + declined.UUID}, grant)
	require.NoError(t, err)
	require.True(t, granted, "written on the dead key in the MariaDB inbox")
	require.Equal(t, ids[1:], f.ids(t), "the replayed entry is gone")

	// To the consumer: a request its replay subscriber serves, once it
	// announced itself (on a topic of its own: it delivers nothing here).
	replays, err := dlq.NewSQLReplaySubscriber(f.db, sqlschema.MySQL, sqlschema.Config{Schema: f.name},
		dlq.ReplaySubscriberConfig{Consumer: "ship", PollInterval: 50 * time.Millisecond})
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, replays.Close()) })
	_, err = replays.Subscribe(context.Background(), "announce-only")
	require.NoError(t, err)
	require.Eventually(t, func() bool {
		p, ok, err := f.store.Replayer(context.Background(), "ship")
		require.NoError(t, err)
		return ok && p.Alive
	}, 30*time.Second, 10*time.Millisecond, "the replay subscriber announced itself")
	r = f.dlq(t, "replay", "--to-consumer", "--consumer", "ship")
	require.Equal(t, exitOK, r.code, r.stderr)
	require.Contains(t, r.stdout, "requested a replay of 1 entry")
	entries, err := f.store.List(context.Background(), dlq.Filter{Consumer: "ship"})
	require.NoError(t, err)
	require.Len(t, entries, 1)

	r = f.dlq(t, "purge", "--topic", "payments")
	require.Equal(t, exitOK, r.code, r.stderr)
	require.Contains(t, r.stdout, "purged 1 entry")
	require.Equal(t, []int64{ids[1]}, f.ids(t))

	r = oncemill(t, nil, "dlq", "list", "--database", f.url+"?timeout=never", "--schema", f.name)
	require.Equal(t, exitUsage, r.code)
	requireOneLine(t, r.stderr)
	require.Contains(t, r.stderr, "--database")
}

// TestMySQLConsole: oncemill console with a mysql:// --database serves the
// MariaDB tables, and replays to the original topic through --broker.
func TestMySQLConsole(t *testing.T) {
	t.Parallel()
	f := setupMySQL(t)
	topic := pgtest.Name(t)
	broker := pgBroker(t, pgtest.Pool(t, 2), topic)
	msgs := subscribe(t, broker, topic)
	m := dead(topic, "billing", "card declined")
	ids := f.seed(t, m, dead(topic, "billing", "card declined"))

	const token = "mysql-console-token-0123"
	r := startConsole(t, nil, "--addr", "127.0.0.1:0", "--token", token, "--broker", broker,
		"--database", f.url, "--schema", f.name)
	code, body := get(t, r.url, "", token)
	require.Equal(t, http.StatusOK, code, body)
	require.Contains(t, body, "card declined", "the overview's groups")
	code, body = get(t, r.url, "dlq", token)
	require.Equal(t, http.StatusOK, code, body)
	require.Contains(t, body, `<tr data-id="`+strconv.FormatInt(ids[0], 10)+`">`)

	id := strconv.FormatInt(ids[0], 10)
	code, body = post(t, r.url, "dlq/confirm", token, url.Values{"action": {"replay-topic"}, "scope": {"entry"}, "ids": {id}, "confirm": {"1"}})
	require.Equal(t, http.StatusSeeOther, code, body)
	requireReplayed(t, m, receive(t, msgs, 1)[m.UUID])
	require.Equal(t, ids[1:], f.ids(t), "the replayed entry is gone, the other stays")
	require.Equal(t, exitOK, r.stop(t), "stderr: %s", r.stderr)
}

// TestMySQLReplayGrantsOnInbox: --inbox mysql://…?schema=DB names a MySQL
// inbox in another database than the dead-letter table's: the replay
// writes its grant there.
func TestMySQLReplayGrantsOnInbox(t *testing.T) {
	t.Parallel()
	f := setupMySQL(t)
	other := setupMySQL(t) // the consumers' inbox, in a database of its own
	// A topic of its own: the broker's tables are shared by the tests
	// that run beside this one.
	m := dead("orders_grants", "charge", "declined")
	// The key is dead in the other database's inbox only.
	id := f.seedEntries(t, other, m)
	broker := pgBroker(t, pgtest.Pool(t, 2), "orders_grants")
	msgs := subscribe(t, broker, "orders_grants")

	r := f.dlq(t, "replay", strconv.FormatInt(id, 10), "--broker", broker)
	require.NotEqual(t, exitOK, r.code, "no record in the inbox beside: refused")
	require.Contains(t, r.stderr, "has no record")

	r = f.dlq(t, "replay", strconv.FormatInt(id, 10), "--broker", broker, "--inbox", other.url+"?schema="+other.name)
	require.Equal(t, exitOK, r.code, r.stderr)
	got := msgtest.Receive(t, msgs, 30*time.Second)
	got.Ack()
	require.Equal(t, m.UUID, got.UUID)
	granted, err := other.inbox.InboxReplayGranted(context.Background(), dedup.Key{Consumer: "charge", Key: "key-" + m.UUID}, got.Metadata.Get(delivery.Replay))
	require.NoError(t, err)
	require.True(t, granted)

	r = f.dlq(t, "replay", "--all", "--broker", broker, "--inbox", "mysql://app:secret@127.0.0.1:1/x?schema=bad;name")
	require.Equal(t, exitUsage, r.code)
	require.NotContains(t, r.stderr, "secret")
}

// TestMySQLRelayLedgerFlag: "oncemill relay --ledger" on a mysql://
// database keeps the ledger: every row it relays has its ledger row, with
// the inbox's default key. Without the ledger table the relay refuses to
// start, naming it.
func TestMySQLRelayLedgerFlag(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := setupMySQL(t)
	topic := pgtest.Name(t)
	broker := pgBroker(t, pgtest.Pool(t, 2), topic)

	tx, err := f.db.BeginTx(ctx, nil)
	require.NoError(t, err)
	defer tx.Rollback() //nolint:errcheck // no-op after commit
	pub, err := forwarder.NewSQLTxPublisher(ctx, tx, sqlschema.MySQL, sqlschema.Config{Schema: f.name})
	require.NoError(t, err)
	want := map[string]string{} // uuid: key
	for i := range 3 {
		m := message.NewMessage(watermill.NewUUID(), []byte(strconv.Itoa(i)))
		want[m.UUID] = m.UUID
		if i > 0 {
			m.Metadata.Set(delivery.IdempotencyKey, "order-"+strconv.Itoa(i))
			want[m.UUID] = "order-" + strconv.Itoa(i)
		}
		require.NoError(t, pub.Publish(topic, m))
	}
	require.NoError(t, tx.Commit())

	ledger := "`" + f.name + "`.`outbox_ledger`"
	count := func(table string) (n int) {
		require.NoError(t, f.db.QueryRowContext(ctx, "SELECT COUNT(*) FROM "+table).Scan(&n))
		return n
	}
	runCtx, stop := context.WithCancel(ctx)
	var out, errOut proctest.Buffer
	done := make(chan int, 1)
	go func() {
		done <- run(runCtx, []string{"relay", "--database", f.url, "--schema", f.name, "--broker", broker,
			"--listen", "", "--ledger", "--ledger-retention", "48h"}, func(string) string { return "" }, &out, &errOut)
	}()
	require.Eventually(t, func() bool {
		return count(ledger) == len(want)
	}, 30*time.Second, 20*time.Millisecond, errOut.String())
	stop()
	require.Equal(t, exitOK, <-done, errOut.String())
	require.Zero(t, count("`"+f.name+"`.`outbox`"))
	rs, err := f.db.QueryContext(ctx, "SELECT uuid, topic, idempotency_key FROM "+ledger)
	require.NoError(t, err)
	got := map[string]string{}
	for rs.Next() {
		var uuid, tpc, key string
		require.NoError(t, rs.Scan(&uuid, &tpc, &key))
		require.Equal(t, topic, tpc)
		got[uuid] = key
	}
	require.NoError(t, rs.Err())
	require.Equal(t, want, got, "one ledger row per relayed row, with its key")

	_, err = f.db.ExecContext(ctx, "DROP TABLE "+ledger)
	require.NoError(t, err)
	r := oncemill(t, nil, "relay", "--database", f.url, "--schema", f.name, "--broker", broker, "--listen", "", "--ledger")
	require.Equal(t, exitFailure, r.code, r.stderr)
	requireOneLine(t, r.stderr)
	require.Contains(t, r.stderr, ledger+" does not exist")
	require.Contains(t, r.stderr, "--ledger")
}
