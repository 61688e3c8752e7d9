package console_test

import (
	"context"
	"database/sql"
	"math/rand/v2"
	"net/http"
	"net/url"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/console"
	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/dlq"
	"github.com/oncemill/oncemill/forwarder"
	"github.com/oncemill/oncemill/internal/testing/mysqltest"
	"github.com/oncemill/oncemill/sqlschema"
)

// myFixture is oncemill's tables in a database of their own on the
// MySQL/MariaDB test server, with the dead-letter publisher and store.
type myFixture struct {
	t      *testing.T
	db     *sql.DB
	schema sqlschema.Config
	pub    *dlq.Publisher
	store  *dlq.Store
	f      *fixture // for deadLetter
}

func newMySQLFixture(t *testing.T) *myFixture {
	t.Helper()
	db, name := mysqltest.DB(t, 8)
	schema := sqlschema.Config{Schema: name}
	require.NoError(t, sqlschema.MigrateSQL(context.Background(), db, sqlschema.MySQL, schema))
	pub, err := dlq.NewSQLPublisher(db, sqlschema.MySQL, schema)
	require.NoError(t, err)
	store, err := dlq.NewSQLStore(db, sqlschema.MySQL, schema)
	require.NoError(t, err)
	return &myFixture{t: t, db: db, schema: schema, pub: pub, store: store, f: &fixture{t: t}}
}

func (m *myFixture) console(mod func(*console.Config)) *console.Console {
	m.t.Helper()
	cfg := console.Config{DB: m.db, Dialect: sqlschema.MySQL, Schema: m.schema, Token: testToken, Now: func() time.Time { return testNow }}
	if mod != nil {
		mod(&cfg)
	}
	c, err := console.New(cfg)
	require.NoError(m.t, err)
	return c
}

func (m *myFixture) table(name string) string { return "`" + m.schema.Schema + "`.`" + name + "`" }

func (m *myFixture) ids() []int64 {
	m.t.Helper()
	entries, err := m.store.List(context.Background(), dlq.Filter{})
	require.NoError(m.t, err)
	ids := make([]int64, len(entries))
	for i, e := range entries {
		ids[i] = e.ID
	}
	return ids
}

func (m *myFixture) seed(msgs ...*message.Message) []int64 {
	m.t.Helper()
	before := m.ids()
	require.NoError(m.t, m.pub.Publish("orders.dlq", msgs...))
	after := m.ids()
	require.Len(m.t, after, len(before)+len(msgs))
	return after[len(before):]
}

func (m *myFixture) exec(q string, args ...any) {
	m.t.Helper()
	_, err := m.db.ExecContext(context.Background(), q, args...)
	require.NoError(m.t, err)
}

// TestMySQLConsole: the console on MariaDB: the overview's three sections,
// the dead letters with their groups and filters, an entry's page, the
// inbox lookup, and replay and purge through the confirm step.
func TestMySQLConsole(t *testing.T) {
	t.Parallel()
	m := newMySQLFixture(t)
	ctx := context.Background()
	js := m.f.deadLetter("orders", "charge", "order 123 not found", []byte(`{"order":"A-1"}`))
	js.Metadata.Set(delivery.DeadPartition, "3")
	js.Metadata.Set(delivery.DeadOffset, "42")
	ids := m.seed(js,
		m.f.deadLetter("orders", "charge", "order 4567 not found", []byte{0x00, 0xff, 'A'}),
		m.f.deadLetter("orders", "ship", `user "bob" unknown`, nil),
		m.f.deadLetter("refunds", "refund", "", nil))
	at := func(d time.Duration) int64 { return testNow.Add(d).UnixMicro() }
	ts := "TIMESTAMPADD(MICROSECOND, ?, TIMESTAMP'1970-01-01 00:00:00')"
	m.exec("INSERT INTO "+m.table("inbox")+" (consumer, `key`, status, attempts, result, first_error, last_error, first_failed_at, last_failed_at,\n"+
		"    created_at, updated_at, done_at, dead_at, expires_at, dead_copies) VALUES\n"+
		"('charge', 'a', 'done', 3, '{\"charged\":true}', 'gateway timeout', 'gateway 502', "+ts+", "+ts+", "+ts+", "+ts+", "+ts+", NULL, "+ts+", 0),\n"+
		"('charge', 'b', 'done', 1, NULL, NULL, NULL, NULL, NULL, "+ts+", "+ts+", "+ts+", NULL, "+ts+", 0),\n"+
		"('charge', ?, 'dead', 5, NULL, 'x', 'x', NULL, NULL, "+ts+", "+ts+", NULL, "+ts+", "+ts+", 4),\n"+
		"('ship', 'a', 'failed', 1, NULL, 'boom', 'boom', NULL, NULL, "+ts+", "+ts+", NULL, NULL, "+ts+", 0)",
		at(-2*time.Hour), at(-90*time.Minute), at(-3*time.Hour), at(-time.Hour), at(-30*time.Minute), at(72*time.Hour),
		at(-3*time.Hour), at(-3*time.Hour), at(-5*time.Hour), at(72*time.Hour),
		"key-"+js.UUID, at(-time.Hour), at(-time.Hour), at(-time.Hour), at(72*time.Hour),
		at(-time.Hour), at(-time.Hour), at(72*time.Hour))
	// One outbox row, committed.
	tx, err := m.db.BeginTx(ctx, nil)
	require.NoError(t, err)
	out, err := forwarder.NewSQLTxPublisher(ctx, tx, sqlschema.MySQL, m.schema)
	require.NoError(t, err)
	ev := message.NewMessage(watermill.NewUUID(), []byte(`{}`))
	ev.Metadata.Set(delivery.PartitionKey, "k")
	require.NoError(t, out.Publish("orders.confirmed", ev))
	require.NoError(t, tx.Commit())

	cl := bearer(t, m.console(func(c *console.Config) { c.MaxPayload = 16 }))
	body := cl.page("/", http.StatusOK)
	section := func(id string) string {
		i := strings.Index(body, `id="`+id+`"`)
		require.Positive(t, i, id)
		end := strings.Index(body[i:], "</section>")
		return body[i : i+end]
	}
	cells := func(section, first string) []string {
		m := regexp.MustCompile(`(?s)<tr><td class="mono">` + first + `</td>(.*?)</tr>`).FindStringSubmatch(section)
		require.NotNil(t, m, "row %s in %s", first, section)
		var out []string
		for _, c := range regexp.MustCompile(`<td[^>]*>(?:<[^>]+>)?([^<]*)`).FindAllStringSubmatch(m[1], -1) {
			out = append(out, c[1])
		}
		return out
	}
	inbox := section("overview-inbox")
	require.Equal(t, []string{"1", "2", "0", "0", "1", "4"}, cells(inbox, "charge"), "last hour, last day, in flight, failing, dead, dead copies")
	require.Equal(t, []string{"0", "0", "0", "1", "0", "0"}, cells(inbox, "ship"))
	require.Contains(t, section("overview-dlq"), `href="./dlq">4</a>`)
	require.Contains(t, section("overview-dlq"), "order &lt;n&gt; not found")
	require.Contains(t, section("overview-outbox"), `id="outbox-pending">1<`)

	body = cl.page("/dlq", http.StatusOK)
	require.Equal(t, []int64{ids[3], ids[2], ids[1], ids[0]}, rowIDs(body), "newest first")
	counts, links := groupsOf(t, body)
	require.Equal(t, map[string]int{"order <n> not found": 2, `user "<s>" unknown`: 1, "<empty>": 1}, counts,
		"grouped in SQL on MariaDB as NormalizeError groups")
	list := cl.page(strings.TrimPrefix(links["order <n> not found"], "."), http.StatusOK)
	require.Equal(t, []int64{ids[1], ids[0]}, rowIDs(list))
	list = cl.page("/dlq?"+url.Values{"consumer": {"ship"}}.Encode(), http.StatusOK)
	require.Equal(t, []int64{ids[2]}, rowIDs(list))
	list = cl.page("/dlq?"+url.Values{"error": {"USER"}, "topic": {"orders"}}.Encode(), http.StatusOK)
	require.Equal(t, []int64{ids[2]}, rowIDs(list), "the error ignoring case, the topic exactly")

	body = cl.page("/dlq/"+strconv.FormatInt(ids[0], 10), http.StatusOK)
	for _, want := range []string{js.UUID, "orders.dlq", "key-" + js.UUID, `<dt>Kafka partition</dt><dd class="mono">3</dd>`, `<dt>Kafka offset</dt><dd class="mono">42</dd>`, "2026-03-01 10:00:00Z", "order 123 not found", "trace_id",
		`id="payload-size">15 bytes<`, "<dd>4 <span"} {
		require.Contains(t, body, want)
	}
	body = cl.page("/dlq/"+strconv.FormatInt(ids[1], 10), http.StatusOK)
	require.Contains(t, body, `id="payload-kind">binary<`)
	require.Contains(t, cl.page("/dlq/999999999", http.StatusNotFound), "No dead letter 999999999")

	body = cl.page("/inbox", http.StatusOK)
	require.Contains(t, body, `<option value="charge">charge</option><option value="ship">ship</option>`)
	body = cl.page("/inbox?consumer=charge&key=a", http.StatusOK)
	require.Contains(t, body, `id="inbox-status">done<`)
	for _, want := range []string{"gateway timeout", "gateway 502", "<dt>Attempts</dt><dd>3</dd>", "&#34;charged&#34;: true"} {
		require.Contains(t, body, want)
	}
	cl.page("/inbox?consumer=charge&key=nope", http.StatusNotFound)

	// Replay to the consumer, then purge, through the confirm step.
	_, next := cl.confirm(url.Values{"action": {"replay-consumer"}, "scope": {"selection"}, "id": {idText(ids[0]), idText(ids[1])}})
	body = cl.follow(cl.post("/dlq/confirm", next), "/dlq/confirm")
	require.Contains(t, flashOf(body), "Requested a replay of 2 entries")
	requested, err := m.store.Count(ctx, dlq.Filter{Consumer: "charge"})
	require.NoError(t, err)
	require.Equal(t, 2, requested)
	_, next = cl.confirm(url.Values{"action": {"purge"}, "scope": {"selection"}, "id": {idText(ids[2]), idText(ids[3])}})
	body = cl.follow(cl.post("/dlq/confirm", next), "/dlq/confirm")
	require.Contains(t, flashOf(body), "Purged 2 entries")
	require.Equal(t, ids[:2], m.ids())

	// A missing table is said, not failed.
	m.exec("DROP TABLE " + m.table("outbox"))
	body = cl.page("/", http.StatusOK)
	require.Contains(t, section("overview-outbox"), "There is no outbox table")
}

// TestNormalizeErrorInMySQL runs a corpus through NormalizeError and its
// MySQL form: they must agree on MariaDB as on PostgreSQL.
func TestNormalizeErrorInMySQL(t *testing.T) {
	t.Parallel()
	db, name := mysqltest.DB(t, 2)
	ctx := context.Background()
	_, err := db.ExecContext(ctx, "CREATE TABLE `"+name+"`.corpus (i INT NOT NULL PRIMARY KEY, s LONGTEXT CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL)")
	require.NoError(t, err)
	corpus := []string{}
	for in := range normalizeCases {
		if !strings.ContainsAny(in, "\x00\xff") {
			corpus = append(corpus, in)
		}
	}
	alphabet := []rune("0123456789abcdefABCDEFxXgz-\"' \t\r\n:./_()[]<>é日\u00a0\u2028")
	rng := rand.New(rand.NewPCG(1, 2))
	for i := 0; i < 1500; i++ {
		n := rng.IntN(60)
		if i%100 == 0 {
			n = 1990 + rng.IntN(40)
		}
		var b strings.Builder
		for j := 0; j < n; j++ {
			if rng.IntN(20) == 0 {
				b.WriteString("0c8f9a4e-51f2-4b8e-9a0d-3c7e5d2b1a90")
				continue
			}
			b.WriteRune(alphabet[rng.IntN(len(alphabet))])
		}
		corpus = append(corpus, b.String())
	}
	corpus = append(corpus, strings.Repeat("1", 2500), strings.Repeat("é1", 1200), strings.Repeat(`"x"`, 800))
	tx, err := db.BeginTx(ctx, nil)
	require.NoError(t, err)
	for i, s := range corpus {
		_, err := tx.ExecContext(ctx, "INSERT INTO `"+name+"`.corpus (i, s) VALUES (?, ?)", i, s)
		require.NoError(t, err)
	}
	require.NoError(t, tx.Commit())

	rows, err := db.QueryContext(ctx, "SELECT "+console.NormalizeMySQL("s")+" FROM `"+name+"`.corpus ORDER BY i")
	require.NoError(t, err)
	defer rows.Close()
	i := 0
	for rows.Next() {
		var got string
		require.NoError(t, rows.Scan(&got))
		require.Equal(t, console.NormalizeError(corpus[i]), got, "%q", corpus[i])
		i++
	}
	require.NoError(t, rows.Err())
	require.Equal(t, len(corpus), i)
}
