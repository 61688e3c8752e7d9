package console_test

import (
	"context"
	"net/http"
	"net/url"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	_ "modernc.org/sqlite"

	"github.com/oncemill/oncemill/console"
	"github.com/oncemill/oncemill/internal/sqldb"
	"github.com/oncemill/oncemill/internal/testing/sqltest"
	"github.com/oncemill/oncemill/sqlschema"
)

// open opens oncemill's tables, migrated, on b (sqltest.Backends): the
// Config fields that name them and the database the test writes its rows
// through.
func open(t *testing.T, b sqltest.Backend) (console.Config, sqldb.DB) {
	db := b.Open(t, 4)
	return console.Config{Pool: db.Pool, DB: db.DB, Dialect: db.Dialect, Schema: db.Schema}, db.SQL()
}

// seeder writes rows with plain SQL, as the writers of the tables would.
type seeder struct {
	t     *testing.T
	db    sqldb.DB
	d     *sqldb.Dialect
	names sqlschema.Names
}

func (s seeder) exec(q string, args ...any) {
	s.t.Helper()
	q = strings.NewReplacer("{key}", s.d.Quote("key"), "{error}", s.d.Quote("error"), "{at}", s.d.FromMicros("?"), "{json}", s.d.JSON("?")).Replace(q)
	_, err := s.db.Exec(context.Background(), s.d.Rebind(q), args...)
	require.NoError(s.t, err)
}

// at is testNow moved by d, as a time parameter.
func at(d time.Duration) int64 { return testNow.Add(d).UnixMicro() }

// deadLetter writes one entry as dlq's publisher writes it and returns
// its id.
func (s seeder) deadLetter(topic, consumer, key, errText string, payload []byte, deadAgo time.Duration, partition, offset any) int64 {
	s.t.Helper()
	s.exec(`INSERT INTO `+s.names.DLQ+` (uuid, topic, dlq_topic, consumer, {key}, attempts, {error}, permanent,
	first_failed_at, last_failed_at, kafka_partition, kafka_offset, payload, metadata, dead_at)
VALUES (?, ?, 'orders.dlq', ?, ?, 5, ?, ?, {at}, {at}, ?, ?, ?, {json}, {at})`,
		s.d.Text("uuid-"+key), s.d.Text(topic), s.d.Text(consumer), s.d.Text(key), errText, false,
		at(-2*time.Hour), at(-115*time.Minute), partition, offset, payload, `{"trace_id":"tr-1"}`, at(-deadAgo))
	var id int64
	require.NoError(s.t, s.db.QueryRow(context.Background(), `SELECT max(id) FROM `+s.names.DLQ).Scan(&id))
	return id
}

// ids are the ids of the dead letters where selects, in order.
func (s seeder) ids(where string) []int64 {
	s.t.Helper()
	rows, err := s.db.Query(context.Background(), `SELECT id FROM `+s.names.DLQ+` `+where+` ORDER BY id`)
	ids, err := sqldb.Collect(rows, err, func(r sqldb.Rows) (id int64, err error) { return id, r.Scan(&id) })
	require.NoError(s.t, err)
	return ids
}

// inbox writes one inbox row of consumer's key (stored as the inbox
// store stores it).
func (s seeder) inbox(consumer, key, status string, attempts int, result []byte, firstError, lastError any, done, dead any, copies int) {
	s.t.Helper()
	consumer, key = s.d.InboxKey(consumer, key)
	s.exec(`INSERT INTO `+s.names.Inbox+` (consumer, {key}, status, result, done_at, expires_at)
VALUES (?, ?, ?, ?, {at}, {at})`,
		s.d.Text(consumer), s.d.Text(key), status, result, done, at(72*time.Hour))
	s.exec(`INSERT INTO `+s.names.InboxFailures+` (consumer, {key}, attempts, first_error, last_error,
	created_at, updated_at, dead_at, dead_copies)
VALUES (?, ?, ?, ?, ?, {at}, {at}, {at}, ?)`,
		s.d.Text(consumer), s.d.Text(key), attempts, firstError, lastError,
		at(-3*time.Hour), at(-3*time.Hour), dead, copies)
}

// TestConsoleOnEveryDatabase: on each database the console shows the
// same pages of the same rows: the overview's inbox, dead letters and
// outbox, the dead letters newest first with their groups and filters, an
// entry's page, and the inbox lookup, a key longer than MySQL's column
// included; replay to the consumer and purge act through the confirm
// step; a missing table is said, not failed.
func TestConsoleOnEveryDatabase(t *testing.T) {
	t.Parallel()
	for _, b := range sqltest.Backends {
		t.Run(b.Name, func(t *testing.T) {
			t.Parallel()
			cfg, db := open(t, b)
			d := db.Dialect()
			s := seeder{t: t, db: db, d: d, names: d.Names(cfg.Schema.WithDefaults())}
			ids := []int64{
				s.deadLetter("orders", "charge", "key-1", "order 123 not found", []byte(`{"order":"A-1"}`), 4*time.Hour, 3, 42),
				s.deadLetter("orders", "charge", "key-2", "order 4567 not found", []byte{0x00, 0xff, 'A'}, 3*time.Hour, nil, nil),
				s.deadLetter("orders", "ship", "key-3", `user "bob" unknown`, []byte{}, 2*time.Hour, nil, nil),
				s.deadLetter("refunds", "refund", "key-4", "", []byte{}, time.Hour, nil, nil),
			}
			long := strings.Repeat("k", 2000)
			s.inbox("charge", "a", "done", 3, []byte(`{"charged":true}`), "gateway timeout", "gateway 502", at(-30*time.Minute), nil, 0)
			s.inbox("charge", "b", "done", 1, nil, nil, nil, at(-5*time.Hour), nil, 0)
			s.inbox("charge", "key-1", "dead", 5, nil, "x", "x", nil, at(-4*time.Hour), 4)
			s.inbox("charge", long, "done", 1, nil, nil, nil, at(-48*time.Hour), nil, 0)
			s.inbox("ship", "a", "failed", 1, nil, "boom", "boom", nil, nil, 0)
			s.exec(`INSERT INTO `+s.names.Outbox+` (topic, uuid, partition_key, payload, metadata, created_at) VALUES (?, ?, ?, ?, {json}, `+d.Now()+`)`,
				s.d.Text("orders.confirmed"), s.d.Text("u-1"), s.d.Text("k"), []byte(`{}`), "{}")

			cfg.Token, cfg.MaxPayload, cfg.Now = testToken, 16, func() time.Time { return testNow }
			c, err := console.New(cfg)
			require.NoError(t, err)
			cl := bearer(t, c)

			body := cl.page("/", http.StatusOK)
			section := func(id string) string {
				i := strings.Index(body, `id="`+id+`"`)
				require.Positive(t, i, id)
				return body[i : i+strings.Index(body[i:], "</section>")]
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
			dlqs := section("overview-dlq")
			require.Contains(t, dlqs, `href="./dlq">4</a>`)
			require.Regexp(t, `<td class="mono">charge</td><td class="mono">orders</td>\s*<td class="num"><a class="badge dead" href="./dlq\?consumer=charge&amp;topic=orders">2</a>`, dlqs)
			require.Contains(t, dlqs, "order &lt;n&gt; not found")
			require.Contains(t, section("overview-outbox"), `id="outbox-pending">1<`)

			body = cl.page("/dlq", http.StatusOK)
			require.Equal(t, []int64{ids[3], ids[2], ids[1], ids[0]}, rowIDs(body), "newest first")
			counts, links := groupsOf(t, body)
			require.Equal(t, map[string]int{"order <n> not found": 2, `user "<s>" unknown`: 1, "<empty>": 1}, counts, "grouped in SQL as NormalizeError groups")
			require.Equal(t, []int64{ids[1], ids[0]}, rowIDs(cl.page(strings.TrimPrefix(links["order <n> not found"], "."), http.StatusOK)))
			require.Equal(t, []int64{ids[2]}, rowIDs(cl.page("/dlq?"+url.Values{"consumer": {"ship"}}.Encode(), http.StatusOK)))
			require.Equal(t, []int64{ids[2]}, rowIDs(cl.page("/dlq?"+url.Values{"error": {"USER"}, "topic": {"orders"}}.Encode(), http.StatusOK)),
				"the error ignoring case, the topic exactly")
			require.Equal(t, []int64{ids[2], ids[1]}, rowIDs(cl.page("/dlq?"+url.Values{"since": {"190m"}, "until": {"90m"}}.Encode(), http.StatusOK)),
				"dead between 190 and 90 minutes ago")

			body = cl.page("/dlq/"+strconv.FormatInt(ids[0], 10), http.StatusOK)
			for _, want := range []string{"uuid-key-1", "orders.dlq", `>key-1</a></dd>`, `<dt>Kafka partition</dt><dd class="mono">3</dd>`, `<dt>Kafka offset</dt><dd class="mono">42</dd>`,
				"2026-03-01 10:00:00Z", "2026-03-01 08:00:00Z", "order 123 not found", "trace_id", `id="payload-size">15 bytes<`, "<dd>4 <span"} {
				require.Contains(t, body, want)
			}
			require.Contains(t, cl.page("/dlq/"+strconv.FormatInt(ids[1], 10), http.StatusOK), `id="payload-kind">binary<`)
			require.Contains(t, cl.page("/dlq/999999999", http.StatusNotFound), "No dead letter 999999999")

			require.Contains(t, cl.page("/inbox", http.StatusOK), `<option value="charge">charge</option><option value="ship">ship</option>`)
			body = cl.page("/inbox?consumer=charge&key=a", http.StatusOK)
			for _, want := range []string{`id="inbox-status">done<`, "gateway timeout", "gateway 502", "<dt>Attempts</dt><dd>3</dd>", "&#34;charged&#34;: true", "2026-03-01 11:30:00Z"} {
				require.Contains(t, body, want)
			}
			require.Contains(t, cl.page("/inbox?"+url.Values{"consumer": {"charge"}, "key": {long}}.Encode(), http.StatusOK), `id="inbox-status">done<`,
				"a key longer than MySQL's column, found as the inbox stores it")
			cl.page("/inbox?consumer=charge&key=nope", http.StatusNotFound)

			// Replay to the consumer, then purge, through the confirm step.
			_, next := cl.confirm(url.Values{"action": {"replay-consumer"}, "scope": {"selection"}, "id": {idText(ids[0]), idText(ids[1])}})
			require.Contains(t, flashOf(cl.follow(cl.post("/dlq/confirm", next), "/dlq/confirm")), "Requested a replay of 2 entries")
			require.Equal(t, ids[:2], s.ids(`WHERE replay_requested_at IS NOT NULL`), "the replay of the two requested")
			require.Regexp(t, `(?s)id="overview-pending-replays".*<td class="mono">charge</td><td class="mono">orders</td>\s*<td class="num"><a [^>]*>2</a>.*`+
				`No replay subscriber seen for consumer charge ever`, cl.page("/", http.StatusOK),
				"the overview shows the requests that no replay subscriber picks up")
			_, next = cl.confirm(url.Values{"action": {"purge"}, "scope": {"selection"}, "id": {idText(ids[2]), idText(ids[3])}})
			require.Contains(t, flashOf(cl.follow(cl.post("/dlq/confirm", next), "/dlq/confirm")), "Purged 2 entries")
			require.Equal(t, ids[:2], s.ids(``), "the two purged")

			s.exec(`DROP TABLE ` + s.names.Outbox)
			body = cl.page("/", http.StatusOK)
			require.Contains(t, section("overview-outbox"), "There is no outbox table")
			require.Contains(t, section("overview-inbox"), "charge", "the other sections are there")
		})
	}
}
