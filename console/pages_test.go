package console_test

import (
	"context"
	"html"
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
	"github.com/oncemill/oncemill/forwarder"
	"github.com/oncemill/oncemill/reconcile"
)

// TestDeadLetterFilters: each field of the filter form, alone and
// together, newest first.
func TestDeadLetterFilters(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	ids := f.seed(
		f.deadLetter("orders", "charge", "Card DECLINED by issuer", nil),
		f.deadLetter("orders", "charge", "timeout", nil),
		f.deadLetter("orders", "ship", "address invalid", nil),
		f.deadLetter("refunds", "refund", "card declined", nil),
		f.deadLetter("refunds", "charge", "timeout", nil),
		f.deadLetter("orders", "ship", "timeout", nil),
	)
	// Dead 6h, 5h, … 1h before the console's now.
	for i, id := range ids {
		f.setDeadAt(id, testNow.Add(-time.Duration(6-i)*time.Hour))
	}
	pick := func(is ...int) []int64 {
		out := []int64{}
		for j := len(is) - 1; j >= 0; j-- { // newest first
			out = append(out, ids[is[j]])
		}
		return out
	}
	cl := bearer(t, f.console(nil))
	for name, tc := range map[string]struct {
		query url.Values
		want  []int64
	}{
		"all":                  {url.Values{}, pick(0, 1, 2, 3, 4, 5)},
		"topic":                {url.Values{"topic": {"refunds"}}, pick(3, 4)},
		"consumer":             {url.Values{"consumer": {"ship"}}, pick(2, 5)},
		"error ignores case":   {url.Values{"error": {"card declined"}}, pick(0, 3)},
		"error substring":      {url.Values{"error": {"OUT"}}, pick(1, 4, 5)},
		"since as a duration":  {url.Values{"since": {"2h"}}, pick(4, 5)},
		"since in minutes":     {url.Values{"since": {"150m"}}, pick(4, 5)},
		"since in days":        {url.Values{"since": {"1d"}}, pick(0, 1, 2, 3, 4, 5)},
		"since RFC 3339":       {url.Values{"since": {"2026-03-01T09:00:00Z"}}, pick(3, 4, 5)},
		"since, another zone":  {url.Values{"since": {"2026-03-01T10:00:00+01:00"}}, pick(3, 4, 5)},
		"since datetime-local": {url.Values{"since": {"2026-03-01T09:00"}}, pick(3, 4, 5)},
		"until":                {url.Values{"until": {"5h"}}, pick(0, 1)},
		"until datetime-local": {url.Values{"until": {"2026-03-01T07:00"}}, pick(0, 1)},
		"since and until":      {url.Values{"since": {"4h"}, "until": {"3h"}}, pick(2, 3)},
		"combined":             {url.Values{"topic": {"orders"}, "consumer": {"charge"}, "error": {"time"}}, pick(1)},
		"nothing":              {url.Values{"topic": {"payments"}}, pick()},
	} {
		body := cl.page("/dlq?"+tc.query.Encode(), http.StatusOK)
		require.Equal(t, tc.want, rowIDs(body), name)
		require.Contains(t, body, `id="dlq-total">`+strconv.Itoa(len(tc.want))+`<`, name)
		for k, v := range tc.query {
			require.Contains(t, html.UnescapeString(body), `name="`+k+`" value="`+v[0]+`"`, "%s: the form shows the filter back", name)
		}
	}
	for name, q := range map[string]url.Values{
		"bad since":         {"since": {"yesterday"}},
		"bad until":         {"until": {"-2h"}},
		"since after until": {"since": {"1h"}, "until": {"2h"}},
		"bad page":          {"page": {"0"}},
		"page not a number": {"page": {"two"}},
	} {
		body := cl.page("/dlq?"+q.Encode(), http.StatusBadRequest)
		require.Contains(t, body, `id="filter-error"`, name)
		require.Empty(t, rowIDs(body), name)
	}
}

// groupsOf reads the groups table: normalised text → entries, and the
// links.
func groupsOf(t *testing.T, body string) (map[string]int, map[string]string) {
	t.Helper()
	i := strings.Index(body, `id="dlq-groups"`)
	require.Positive(t, i, body)
	end := strings.Index(body[i:], "</table>")
	counts, links := map[string]int{}, map[string]string{}
	re := regexp.MustCompile(`(?s)<span class="badge dead">(\d+)</span></td>\s*<td[^>]*><a class="group-link" href="([^"]*)" title="[^"]*">([^<]*)</a>`)
	for _, m := range re.FindAllStringSubmatch(body[i:i+end], -1) {
		n, _ := strconv.Atoi(m[1])
		text := html.UnescapeString(m[3])
		counts[text] = n
		links[text] = html.UnescapeString(m[2])
	}
	return counts, links
}

// TestDeadLetterGroups: the errors grouped by their normalised text, with
// counts; a group's link filters the list to it.
func TestDeadLetterGroups(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	ids := f.seedErrors(
		"order 123 not found",
		"order 4567 not found",
		`user "alice" unknown`,
		`user "bob" unknown`,
		"lock 0c8f9a4e-51f2-4b8e-9a0d-3c7e5d2b1a90 held",
		"lock 9b2e1d4c-0a3f-4c5b-8d7e-6f1a2b3c4d5e held",
		"timeout after 5s",
		"",
	)
	f.setDeadAt(ids[0], testNow.Add(-3*time.Hour))
	f.setDeadAt(ids[1], testNow.Add(-1*time.Hour))
	other := f.seed(f.deadLetter("refunds", "refund", "order 9 not found", nil))

	cl := bearer(t, f.console(nil))
	body := cl.page("/dlq", http.StatusOK)
	counts, links := groupsOf(t, body)
	require.Equal(t, map[string]int{
		"order <n> not found": 3,
		`user "<s>" unknown`:  2,
		"lock <uuid> held":    2,
		"timeout after <n>s":  1,
		"<empty>":             1,
	}, counts)
	for text := range counts {
		require.Equal(t, text, console.NormalizeError(text), "a group's text is its own group")
	}
	require.Regexp(t, `(?s)order &lt;n&gt; not found</a></td>\s*<td[^>]*><span class="muted">2 consumers</span>`, body)

	// Following a group's link lists its entries only.
	list := cl.page(strings.TrimPrefix(links["order <n> not found"], "."), http.StatusOK)
	require.Equal(t, []int64{other[0], ids[1], ids[0]}, rowIDs(list))
	require.Contains(t, list, `id="active-group"`)
	require.Contains(t, list, `name="group" value="order &lt;n&gt; not found"`)
	require.Contains(t, list, `name="scope" value="group"`, "the bulk form acts on the group")
	list = cl.page("/dlq?"+url.Values{"group": {"<empty>"}}.Encode(), http.StatusOK)
	require.Equal(t, []int64{ids[7]}, rowIDs(list), "entries without an error text")

	// A group within a filter.
	list = cl.page("/dlq?"+url.Values{"group": {"order <n> not found"}, "consumer": {"charge"}}.Encode(), http.StatusOK)
	require.Equal(t, []int64{ids[1], ids[0]}, rowIDs(list))
	counts, _ = groupsOf(t, list)
	require.Equal(t, 2, counts["order <n> not found"], "the groups follow the filter")
	require.Equal(t, 2, counts[`user "<s>" unknown`], "and show the other groups of it")
	require.Regexp(t, `(?s)<tr class="active">\s*<td class="num"><span class="badge dead">2</span></td>\s*<td[^>]*><a class="group-link"[^>]*>order &lt;n&gt; not found`, list)

	// The overview shows the largest groups.
	overview := cl.page("/", http.StatusOK)
	require.Regexp(t, `(?s)id="overview-dlq-groups".*<span class="badge dead">3</span></td>\s*<td[^>]*><a class="group-link" href="./dlq\?group=order%20%3cn%3e%20not%20found"`, overview)
}

// TestPagination: PageSize entries a page, newest first, with links to the
// neighbours only where there are some.
func TestPagination(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	ids := f.seedErrors("a", "b", "c", "d", "e", "f", "g")
	cl := bearer(t, f.console(func(c *console.Config) { c.PageSize = 3 }))
	for page, want := range map[int][]int64{
		1: {ids[6], ids[5], ids[4]},
		2: {ids[3], ids[2], ids[1]},
		3: {ids[0]},
		4: {},
	} {
		body := cl.page("/dlq?page="+strconv.Itoa(page), http.StatusOK)
		require.Equal(t, want, rowIDs(body), "page %d", page)
		require.Equal(t, page > 1, strings.Contains(body, `id="page-prev"`), "page %d", page)
		require.Equal(t, page < 3, strings.Contains(body, `id="page-next"`), "page %d", page)
		if page == 2 {
			require.Contains(t, body, "4–6 of 7 · page 2 of 3")
			require.Contains(t, body, `href="./dlq?page=3"`)
			require.Contains(t, body, `href="./dlq"`, "page 1 is the plain list")
		}
		if page == 4 {
			require.Contains(t, body, "No entries on this page.")
			require.Contains(t, body, `id="page-prev" rel="prev" href="./dlq?page=3"`, "back to the last page")
		}
	}
	body := cl.page("/dlq?page=2&topic=orders", http.StatusOK)
	require.Contains(t, body, `href="./dlq?page=3&amp;topic=orders"`, "the links keep the filter")
	require.Equal(t, []int64{ids[3], ids[2], ids[1]}, rowIDs(body))
}

// TestEntryPage: the payload pretty-printed, as text or as a hex dump,
// capped at MaxPayload; every column of the entry.
func TestEntryPage(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	js := f.deadLetter("orders", "charge", "card declined", []byte(`{"order":"A-1","items":[1,2]}`))
	js.Metadata.Set(delivery.DeadPartition, "3")
	js.Metadata.Set(delivery.DeadOffset, "42")
	js.Metadata.Set(delivery.DeadPermanent, "true")
	js.Metadata.Set(delivery.DeadAttemptsSource, delivery.AttemptsFromProcess)
	bin := f.deadLetter("orders", "charge", "bad encoding", []byte{0x00, 0x01, 0x02, 0xff, 'A'})
	bin.Metadata.Set(delivery.DeadAttemptsSource, delivery.AttemptsFromBroker) // a RabbitMQ delivery
	big := f.deadLetter("orders", "charge", "too big", []byte(strings.Repeat("a", 100)))
	bigJSON := f.deadLetter("orders", "charge", "too big", []byte(`{"xy":"`+strings.Repeat("é", 40)+`"}`))
	text := f.deadLetter("orders", "charge", "not json", []byte("plain text\nline 2"))
	ids := f.seed(js, bin, big, bigJSON, text)
	cl := bearer(t, f.console(func(c *console.Config) { c.MaxPayload = 16 }))
	wide := bearer(t, f.console(nil))

	body := wide.page("/dlq/"+strconv.FormatInt(ids[0], 10), http.StatusOK)
	require.Contains(t, body, `id="payload-kind">json<`)
	require.Contains(t, body, "{\n  &#34;order&#34;: &#34;A-1&#34;,\n  &#34;items&#34;: [\n    1,\n    2\n  ]\n}", "pretty-printed")
	require.Contains(t, body, `id="payload-size">29 bytes<`)
	for _, want := range []string{js.UUID, "orders.dlq", "key-" + js.UUID, "2026-03-01 10:00:00Z", "2026-03-01 10:05:00Z", "card declined", "trace_id", "tr-1",
		`<div><dt>Kafka partition</dt><dd class="mono">3</dd></div>`, `<div><dt>Kafka offset</dt><dd class="mono">42</dd></div>`} {
		require.Contains(t, body, want)
	}
	require.Contains(t, body, `<span class="badge dead">permanent</span></h1>`)
	require.Contains(t, body, `<div><dt>Failed attempts</dt><dd id="entry-attempts">5 <span class="muted">counted in the consumer&#39;s memory since it started</span></dd></div>`)
	require.Contains(t, body, `href="../inbox?consumer=charge&amp;key=key-`+js.UUID+`"`, "the key links to the inbox lookup")
	require.Contains(t, body, `href="../dlq?group=card&#43;declined"`, "and the error to its group")
	require.Contains(t, body, `value="replay-consumer"`)
	require.NotContains(t, body, `value="replay-topic"`, "no publisher")
	require.Contains(t, body, `value="purge"`)
	require.Contains(t, body, `<div><dt>Replay requested</dt><dd>no</dd></div>`)

	body = wide.page("/dlq/"+strconv.FormatInt(ids[1], 10), http.StatusOK)
	require.Contains(t, body, `id="payload-kind">binary<`)
	require.Contains(t, body, `<div><dt>Broker deliveries</dt><dd id="entry-attempts">5 <span class="muted">the broker&#39;s count, not failures: RabbitMQ x-delivery-count or SQS ApproximateReceiveCount</span></dd></div>`)
	require.NotContains(t, body, "Kafka", "a RabbitMQ entry has no Kafka facts")
	require.NotContains(t, body, "JetStream")

	list := wide.page("/dlq", http.StatusOK)
	require.Regexp(t, `title="Broker deliveries: 5, the broker&#39;s count, not failures: [^"]*">5 <span class="hint-inline">broker</span>`, list)
	require.Regexp(t, `title="Failed attempts: 5, counted in the consumer&#39;s memory[^"]*">5 <span class="hint-inline">process</span>`, list)
	require.Contains(t, list, `5 <span class="hint-inline">-</span>`, "an entry that does not say who counted")
	require.Contains(t, body, "00000000  00 01 02 ff 41")
	require.Contains(t, body, "|....A|")

	body = cl.page("/dlq/"+strconv.FormatInt(ids[2], 10), http.StatusOK)
	require.Contains(t, body, `id="payload-size">showing 16 of 100 bytes<`)
	require.Contains(t, body, `<pre class="payload" id="payload">`+strings.Repeat("a", 16)+`</pre>`, "16 bytes read")

	body = cl.page("/dlq/"+strconv.FormatInt(ids[3], 10), http.StatusOK)
	require.Contains(t, body, `id="payload-kind">text<`, "a cut JSON document is shown as text")
	require.Contains(t, body, `{&#34;xy&#34;:&#34;éééé</pre>`, "7 bytes and 4 whole é of 16: the half é cut is left out")

	body = wide.page("/dlq/"+strconv.FormatInt(ids[4], 10), http.StatusOK)
	require.Contains(t, body, `id="payload-kind">text<`)
	require.Contains(t, body, "plain text\nline 2")

	// Replay requested, and copies since (the key is dead in the inbox).
	_, err := f.pool.Exec(context.Background(), `INSERT INTO `+f.table("inbox")+` (consumer, key, status, expires_at)
VALUES ('charge', $1, 'dead', now() + interval '1 day')`, "key-"+js.UUID)
	require.NoError(t, err)
	_, err = f.pool.Exec(context.Background(), `INSERT INTO `+f.table("inbox_failures")+` (consumer, key, dead_copies, dead_at)
VALUES ('charge', $1, 4, now())`, "key-"+js.UUID)
	require.NoError(t, err)
	_, err = f.pool.Exec(context.Background(), `UPDATE `+f.table("dlq")+` SET replay_requested_at = $1 WHERE id = $2`, testNow.Add(-time.Minute), ids[0])
	require.NoError(t, err)
	body = wide.page("/dlq/"+strconv.FormatInt(ids[0], 10), http.StatusOK)
	require.Contains(t, body, `id="replay-state"`)
	require.Contains(t, body, "replay requested 1m0s ago")
	require.Contains(t, body, "<dd>4 <span")

	require.Contains(t, wide.page("/dlq/999999999", http.StatusNotFound), "No dead letter 999999999")
	wide.page("/dlq/abc", http.StatusNotFound)
	wide.page("/dlq/1/x", http.StatusNotFound)
}

// TestInboxLookup: a key's record, found or not.
func TestInboxLookup(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	ctx := context.Background()
	_, err := f.pool.Exec(ctx, `INSERT INTO `+f.table("inbox")+` (consumer, key, status, result, done_at, expires_at) VALUES
('charge', 'order-1', 'done', '{"charged":true,"amount":42}'::bytea, '2026-03-01T09:15:00Z', '2026-03-04T09:15:00Z'),
('charge', 'order-2', 'failed', NULL, NULL, now() + interval '3 days'),
('ship', 'order-1', 'done', $1, now(), now() + interval '3 days')`,
		[]byte(strings.Repeat("r", 40)))
	require.NoError(t, err)
	_, err = f.pool.Exec(ctx, `INSERT INTO `+f.table("inbox_failures")+` (consumer, key, attempts,
	first_error, last_error, first_failed_at, last_failed_at, created_at, updated_at) VALUES
('charge', 'order-1', 3, 'gateway timeout', 'gateway 502',
	'2026-03-01T09:00:00Z', '2026-03-01T09:10:00Z', '2026-03-01T08:59:00Z', '2026-03-01T09:15:00Z'),
('charge', 'order-2', 1, 'boom', 'boom', now(), now(), now(), now())`)
	require.NoError(t, err)
	cl := bearer(t, f.console(func(c *console.Config) { c.MaxPayload = 32 }))

	body := cl.page("/inbox", http.StatusOK)
	require.Contains(t, body, `<select name="consumer" required>`)
	require.Contains(t, body, `<option value="charge">charge</option><option value="ship">ship</option>`, "the inbox's consumers")
	require.NotContains(t, body, `id="inbox-record"`)

	body = cl.page("/inbox?consumer=charge&key=order-1", http.StatusOK)
	require.Contains(t, body, `<option value="charge" selected>`)
	require.Contains(t, body, `id="inbox-status">done<`)
	for _, want := range []string{"gateway timeout", "gateway 502", "2026-03-01 09:00:00Z", "2026-03-01 09:10:00Z",
		"2026-03-01 08:59:00Z", "2026-03-01 09:15:00Z", "2026-03-04 09:15:00Z", "<dt>Attempts</dt><dd>3</dd>"} {
		require.Contains(t, body, want)
	}
	require.Contains(t, body, "{\n  &#34;charged&#34;: true,\n  &#34;amount&#34;: 42\n}", "the result, pretty-printed")

	body = cl.page("/inbox?consumer=charge&key=order-2", http.StatusOK)
	require.Contains(t, body, `id="inbox-status">failed<`)
	require.Contains(t, body, "No result stored.")

	body = cl.page("/inbox?consumer=ship&key=order-1", http.StatusOK)
	require.Contains(t, body, `id="result-size">showing 32 of 40 bytes<`)
	require.Contains(t, body, ">"+strings.Repeat("r", 32)+"</pre>")

	body = cl.page("/inbox?consumer=ship&key=order-9", http.StatusNotFound)
	require.Contains(t, body, `id="inbox-not-found"`)
	require.Contains(t, body, "Not found")
	require.NotContains(t, body, `id="inbox-record"`)
	body = cl.page("/inbox?consumer=nobody&key=x", http.StatusNotFound)
	require.Contains(t, body, `<option value="nobody" selected>nobody</option>`, "a consumer the inbox does not know is kept")
}

// TestOverview: the inbox per consumer, the dead letters, the outbox; a
// missing outbox table is said, not failed.
func TestOverview(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	ctx := context.Background()
	_, err := f.pool.Exec(ctx, `INSERT INTO `+f.table("inbox")+` (consumer, key, status, done_at, expires_at) VALUES
('charge', 'a', 'done', $1::timestamptz - interval '30 minutes', now() + interval '1 day'),
('charge', 'b', 'done', $1::timestamptz - interval '5 hours', now() + interval '1 day'),
('charge', 'c', 'done', $1::timestamptz - interval '2 days', now() + interval '1 day'),
('charge', 'd', 'failed', NULL, now() + interval '1 day'),
('charge', 'e', 'dead', NULL, now() + interval '1 day'),
('charge', 'f', 'dead', NULL, now() + interval '1 day'),
('ship', 'a', 'processing', NULL, now() + interval '1 day')`, testNow)
	require.NoError(t, err)
	_, err = f.pool.Exec(ctx, `INSERT INTO `+f.table("inbox_failures")+` (consumer, key, dead_copies) VALUES
('charge', 'e', 3), ('charge', 'f', 2)`)
	require.NoError(t, err)
	f.seed(f.deadLetter("orders", "charge", "order 1 not found", nil), f.deadLetter("orders", "charge", "order 2 not found", nil),
		f.deadLetter("refunds", "ship", "timeout", nil))

	// One outbox row, committed.
	tx, err := f.pool.Begin(ctx)
	require.NoError(t, err)
	out, err := forwarder.NewTxPublisher(ctx, tx, f.schema)
	require.NoError(t, err)
	ev := message.NewMessage(watermill.NewUUID(), []byte(`{}`))
	ev.Metadata.Set(delivery.PartitionKey, "k")
	require.NoError(t, out.Publish("orders.confirmed", ev))
	require.NoError(t, tx.Commit(ctx))

	cl := bearer(t, f.console(nil))
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
	require.Equal(t, []string{"1", "2", "0", "1", "2", "5"}, cells(inbox, "charge"), "last hour, last day, in flight, failing, dead, dead copies")
	require.Equal(t, []string{"0", "0", "1", "0", "0", "0"}, cells(inbox, "ship"))
	require.Contains(t, inbox, `oncemill_inbox_messages_total{outcome="duplicate"}`)
	require.Contains(t, inbox, "writes nothing for a duplicate")
	// ship has a dead letter and no dead inbox row: the page says why the
	// two counts differ, and for whom; charge's agree.
	differ := regexp.MustCompile(`(?s)<p class="notice" id="dead-counts-differ">(.*?)</p>`).FindStringSubmatch(inbox)
	require.NotNil(t, differ, "the overview explains the differing counts")
	require.Contains(t, differ[1], `<span class="mono">ship</span> (0 dead in the inbox, 1 dead letter)`)
	require.NotContains(t, differ[1], "charge")
	require.Contains(t, differ[1], "counts the consumer's inbox rows in state dead")
	require.Contains(t, differ[1], "counts entries in the dead-letter table")
	require.Contains(t, differ[1], "without one, an undecodable message, an empty key")

	dlqs := section("overview-dlq")
	require.Contains(t, dlqs, `href="./dlq">3</a>`)
	require.Regexp(t, `<td class="mono">charge</td><td class="mono">orders</td>\s*<td class="num"><a class="badge dead" href="./dlq\?consumer=charge&amp;topic=orders">2</a>`, dlqs)
	require.Contains(t, dlqs, "order &lt;n&gt; not found")
	require.Contains(t, dlqs, `id="dlq-counts-caption">Entries in the dead-letter table. They are not the inbox's dead keys above`)

	outbox := section("overview-outbox")
	require.Contains(t, outbox, `id="outbox-pending">1<`)
	require.Contains(t, outbox, `id="outbox-waiting">`)

	_, err = f.pool.Exec(ctx, `DROP TABLE `+f.table("outbox"))
	require.NoError(t, err)
	body = cl.page("/", http.StatusOK)
	require.Contains(t, section("overview-outbox"), "There is no outbox table")
	require.Contains(t, section("overview-inbox"), "charge", "the other sections are there")
}

// TestOverviewReconcile: the overview shows what each configured
// consumer misses of the events the relay's ledger holds, lists the
// oldest with a link to the key's inbox page, and says when there is no
// ledger.
func TestOverviewReconcile(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	ctx := context.Background()
	// Six orders events and a payment, an hour old; one order a minute
	// old (within the grace).
	_, err := f.pool.Exec(ctx, `INSERT INTO `+f.table("outbox_ledger")+` (uuid, topic, partition_key, idempotency_key, published_at) VALUES
('u-1', 'orders', 'p', 'order-1', now() - interval '60 minutes'),
('u-2', 'orders', 'p', 'order-2', now() - interval '59 minutes'),
('u-3', 'orders', 'p', 'order-3', now() - interval '58 minutes'),
('u-4', 'orders', 'p', 'order-4', now() - interval '57 minutes'),
('u-5', 'orders', 'p', 'order-5', now() - interval '56 minutes'),
('u-6', 'orders', 'p', 'order-<6>', now() - interval '55 minutes'),
('u-7', 'payments', 'p', 'payment-7', now() - interval '55 minutes'),
('u-8', 'orders', 'p', 'order-8', now() - interval '1 minute')`)
	require.NoError(t, err)
	// charge: 1 and 2 done, 3 failing, 4 dead, 5 dead-lettered, 6
	// absent; and a done key no event explains. ship: order-1 only.
	_, err = f.pool.Exec(ctx, `INSERT INTO `+f.table("inbox")+` (consumer, key, status, done_at, expires_at) VALUES
('charge', 'order-1', 'done', now() - interval '50 minutes', now() + interval '1 day'),
('charge', 'order-2', 'done', now() - interval '50 minutes', now() + interval '1 day'),
('charge', 'order-3', 'failed', NULL, now() + interval '1 day'),
('charge', 'order-4', 'dead', NULL, now() + interval '1 day'),
('charge', 'forged', 'done', now() - interval '40 minutes', now() + interval '1 day'),
('ship', 'order-1', 'done', now() - interval '50 minutes', now() + interval '1 day')`)
	require.NoError(t, err)
	letter := f.deadLetter("orders", "charge", "card declined", nil)
	letter.UUID = "u-5"
	letter.Metadata.Set(delivery.DeadKey, "order-5")
	f.seed(letter)

	cl := bearer(t, f.console(func(c *console.Config) {
		c.Reconcile = []reconcile.Config{
			{Consumer: "charge", Topics: []string{"orders"}, Strict: true},
			{Consumer: "ship", Topics: []string{"orders"}, Limit: 2},
		}
	}))
	body := cl.page("/", http.StatusOK)
	i := strings.Index(body, `id="overview-reconcile"`)
	require.Positive(t, i, "the reconciliation card")
	card := body[i : i+strings.Index(body[i:], "</section>")]
	row := func(consumer string) []string {
		m := regexp.MustCompile(`(?s)<tr><td class="mono">` + consumer + `</td>(.*?)</tr>`).FindStringSubmatch(card)
		require.NotNil(t, m, consumer)
		var out []string
		for _, c := range regexp.MustCompile(`<td[^>]*>(?:<[^>]+>)?([^<]*)`).FindAllStringSubmatch(m[1], 5) {
			out = append(out, c[1])
		}
		return out
	}
	require.Equal(t, []string{"orders", "6", "1", "1", "1"}, row("charge"), "topics, checked, lost, stuck, unexplained")
	require.Equal(t, []string{"orders", "6", "5", "0", "–"}, row("ship"), "not strict")

	missing := func(consumer string) string {
		m := regexp.MustCompile(`(?s)<table class="grid reconcile-missing" data-consumer="` + consumer + `">(.*?)</table>`).FindStringSubmatch(card)
		require.NotNil(t, m, consumer)
		return m[1]
	}
	charge := missing("charge")
	require.Equal(t, 2, strings.Count(charge, "<tr><td>"), charge)
	require.Regexp(t, `(?s)stuck</span></td><td class="mono">u-3</td>.*failed`, charge)
	require.Regexp(t, `(?s)lost</span></td><td class="mono">u-6</td>.*href="./inbox\?consumer=charge&amp;key=order-%3c6%3e">order-&lt;6&gt;</a>`, charge)
	require.NotContains(t, charge, "u-5", "dead-lettered")
	require.NotContains(t, charge, "u-4", "dead in the inbox")
	require.NotContains(t, charge, "u-8", "within the grace")
	require.NotContains(t, charge, "u-7", "another topic")
	ship := missing("ship")
	require.Equal(t, 2, strings.Count(ship, "<tr><td>"), "Limit")
	require.Contains(t, ship, "u-2")
	require.Contains(t, ship, "u-3")
	require.Contains(t, card, "the oldest 2 of 5")
	require.Regexp(t, `(?s)<table class="grid reconcile-unexplained" data-consumer="charge">.*forged`, card)
	require.NotContains(t, card, `reconcile-unexplained" data-consumer="ship"`)

	// Without the ledger table, the card says so and the rest stays.
	_, err = f.pool.Exec(ctx, `DROP TABLE `+f.table("outbox_ledger"))
	require.NoError(t, err)
	body = cl.page("/", http.StatusOK)
	require.Contains(t, body, "No ledger table: the relay keeps none")
	require.Contains(t, body, `id="overview-inbox"`)

	// No checks, no card.
	body = bearer(t, f.console(nil)).page("/", http.StatusOK)
	require.NotContains(t, body, `id="overview-reconcile"`)
}
