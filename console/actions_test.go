package console_test

import (
	"context"
	"errors"
	"fmt"
	"html"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/console"
	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/dlq"
	"github.com/oncemill/oncemill/internal/testing/msgtest"
	"github.com/oncemill/oncemill/retry"
	"github.com/oncemill/oncemill/sqlschema"
)

func idText(id int64) string { return strconv.FormatInt(id, 10) }

// replayRequested are the entries whose replay was requested.
func (f *fixture) replayRequested() []int64 {
	f.t.Helper()
	rows, err := f.pool.Query(context.Background(), `SELECT id FROM `+f.table("dlq")+` WHERE replay_requested_at IS NOT NULL ORDER BY id`)
	require.NoError(f.t, err)
	var ids []int64
	for rows.Next() {
		var id int64
		require.NoError(f.t, rows.Scan(&id))
		ids = append(ids, id)
	}
	require.NoError(f.t, rows.Err())
	return ids
}

// TestReplayToConsumer: the confirm step names the consumer and topic with
// the count; the action marks the entries, and the consumer's
// ReplaySubscriber delivers and deletes them.
func TestReplayToConsumer(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	letters := []*message.Message{
		f.deadLetter("orders", "charge", "declined", []byte(`{"n":1}`)),
		f.deadLetter("orders", "charge", "declined", []byte(`{"n":2}`)),
		f.deadLetter("orders", "ship", "no address", nil),
	}
	f.bury(letters...)
	ids := f.seed(append(letters,
		message.NewMessage(watermill.NewUUID(), nil), // no consumer, no topic
	)...)
	cl := bearer(t, f.console(nil))

	summary, _ := cl.confirm(url.Values{"action": {"replay-consumer"}, "scope": {"selection"}, "id": {idText(ids[0]), idText(ids[2]), idText(ids[3])}})
	require.Equal(t, "Replay 2 entries to their consumers, 2 of them: only the consumer of each receives it, through its replay subscriber.", summary)
	body := cl.post("/dlq/confirm", url.Values{"action": {"replay-consumer"}, "scope": {"selection"}, "id": {idText(ids[0]), idText(ids[2]), idText(ids[3])}}).Body.String()
	require.Contains(t, body, "1 entry has no consumer or no topic and is left out")
	require.Contains(t, body, `<td class="mono">ship</td><td class="mono">orders</td><td class="num">1</td>`)

	summary, next := cl.confirm(url.Values{"action": {"replay-consumer"}, "scope": {"selection"}, "id": {idText(ids[1]), idText(ids[0])}})
	require.Equal(t, "Replay 2 entries to consumer charge (topic orders): only that consumer receives them, through its replay subscriber.", summary)
	require.Equal(t, idText(ids[0])+"-"+idText(ids[1]), next.Get("ids"))
	require.Empty(t, f.replayRequested(), "nothing marked by the confirm step")

	body = cl.follow(cl.post("/dlq/confirm", next), "/dlq/confirm")
	require.Equal(t, "ok: Requested a replay of 2 entries to their consumer: each is delivered by its consumer's replay subscriber and deleted once handled.", flashOf(body))
	require.Equal(t, ids[:2], f.replayRequested())
	require.Contains(t, cl.page("/dlq/"+idText(ids[0]), http.StatusOK), `id="replay-state"`)
	require.Contains(t, body, "replay requested", "the list shows the state")

	// Asked again: they are already waiting.
	_, next = cl.confirm(url.Values{"action": {"replay-consumer"}, "scope": {"entry"}, "id": {idText(ids[0])}})
	body = cl.follow(cl.post("/dlq/confirm", next), "/dlq/confirm")
	require.Contains(t, flashOf(body), "Requested a replay of 0 of 1 entry")

	sub, err := dlq.NewReplaySubscriber(f.pool, f.schema, dlq.ReplaySubscriberConfig{Consumer: "charge", PollInterval: 10 * time.Millisecond})
	require.NoError(t, err)
	defer sub.Close()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	msgs, err := sub.Subscribe(ctx, "orders")
	require.NoError(t, err)
	for range ids[:2] {
		m := msgtest.Receive(t, msgs, 10*time.Second)
		require.Len(t, m.Metadata.Get(delivery.Replay), 32, "marked with a fresh replay grant")
		m.Ack()
	}
	require.Eventually(t, func() bool { return len(f.ids()) == 2 }, 10*time.Second, 10*time.Millisecond)
	require.Equal(t, ids[2:], f.ids(), "the replayed entries are gone once handled, the others stay")
}

// recordingPublisher publishes to a GoChannel and records, for every
// message, whether its entry was still in the table when it was published.
type recordingPublisher struct {
	f      *fixture
	next   message.Publisher
	failAt int // fail the failAt-th publish (from 1); 0: never

	mu       sync.Mutex
	calls    int
	inTable  []bool
	uuidsOut []string
}

func (p *recordingPublisher) Publish(topic string, msgs ...*message.Message) error {
	p.mu.Lock()
	p.calls++
	call := p.calls
	p.mu.Unlock()
	if call == p.failAt {
		return errors.New("broker unavailable")
	}
	for _, m := range msgs {
		var n int
		if err := p.f.pool.QueryRow(context.Background(), `SELECT count(*) FROM `+p.f.table("dlq")+` WHERE uuid = $1`, m.UUID).Scan(&n); err != nil {
			return err
		}
		p.mu.Lock()
		p.inTable = append(p.inTable, n == 1)
		p.uuidsOut = append(p.uuidsOut, m.UUID)
		p.mu.Unlock()
	}
	return p.next.Publish(topic, msgs...)
}

func (p *recordingPublisher) Close() error { return nil }

// TestReplayToTopic: with a Publisher, entries go to their topic, each
// deleted only after it was published; a broker that fails stops the
// replay and keeps the rest.
func TestReplayToTopic(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	broker := gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 16, Persistent: true}, watermill.NopLogger{})
	defer broker.Close()
	received, err := broker.Subscribe(context.Background(), "orders")
	require.NoError(t, err)

	msgs := []*message.Message{
		f.deadLetter("orders", "charge", "declined", []byte(`{"n":1}`)),
		f.deadLetter("orders", "ship", "declined", []byte(`{"n":2}`)),
		f.deadLetter("orders", "charge", "timeout", []byte(`{"n":3}`)),
	}
	f.bury(msgs...)
	ids := f.seed(msgs...)
	other := f.seed(f.deadLetter("refunds", "refund", "declined", nil))
	pub := &recordingPublisher{f: f, next: broker}
	cl := bearer(t, f.console(func(c *console.Config) { c.Publisher = pub }))

	body := cl.page("/dlq", http.StatusOK)
	require.Contains(t, body, `value="replay-topic"`)
	require.Contains(t, cl.page("/dlq/"+idText(ids[0]), http.StatusOK), `value="replay-topic"`)

	summary, next := cl.confirm(url.Values{"action": {"replay-topic"}, "scope": {"filter"}, "topic": {"orders"}})
	require.Equal(t, "Replay 3 entries to topic orders: every consumer group of it receives them.", summary)
	require.Zero(t, pub.calls, "nothing published by the confirm step")

	body = cl.follow(cl.post("/dlq/confirm", next), "/dlq/confirm")
	require.Equal(t, "ok: Replayed 3 entries to their topic.", flashOf(body))
	for _, m := range msgs {
		got := msgtest.Receive(t, received, 10*time.Second)
		require.Equal(t, m.UUID, got.UUID)
		require.Equal(t, []byte(m.Payload), []byte(got.Payload))
		require.Len(t, got.Metadata.Get(delivery.Replay), 32, "marked with a fresh replay grant")
		got.Ack()
	}
	require.Equal(t, []bool{true, true, true}, pub.inTable, "each entry was still in the table when it was published")
	require.Equal(t, other, f.ids(), "deleted once published; the other topic's entry stays")

	// The broker fails on the second entry: the first is replayed and
	// gone, the second and third stay.
	more := []*message.Message{f.deadLetter("orders", "charge", "x", nil), f.deadLetter("orders", "charge", "y", nil), f.deadLetter("orders", "charge", "z", nil)}
	f.bury(more...)
	ids = f.seed(more...)
	failing := &recordingPublisher{f: f, next: broker, failAt: 2}
	cl = bearer(t, f.console(func(c *console.Config) { c.Publisher = failing }))
	_, next = cl.confirm(url.Values{"action": {"replay-topic"}, "scope": {"filter"}, "topic": {"orders"}})
	body = cl.follow(cl.post("/dlq/confirm", next), "/dlq/confirm")
	require.Contains(t, flashOf(body), "error: Replayed 1 of 3 entries, then failed:")
	require.Contains(t, flashOf(body), "broker unavailable")
	msgtest.Receive(t, received, 10*time.Second).Ack()
	require.Equal(t, append(other, ids[1:]...), f.ids())

	// Without a Publisher there is no replay to the topic.
	plain := bearer(t, f.console(nil))
	require.NotContains(t, plain.page("/dlq", http.StatusOK), `value="replay-topic"`)
	rec := plain.post("/dlq/confirm", url.Values{"action": {"replay-topic"}, "scope": {"filter"}, "topic": {"orders"}})
	require.Equal(t, http.StatusBadRequest, rec.Code)
	require.Contains(t, rec.Body.String(), "no publisher")
	rec = plain.post("/dlq/confirm", url.Values{"action": {"replay-topic"}, "ids": {idText(ids[1])}, "confirm": {"1"}})
	require.Equal(t, http.StatusBadRequest, rec.Code)
	require.Equal(t, append(other, ids[1:]...), f.ids())
}

// TestPurgeActsOnTheConfirmedEntries: a group, a filter or a selection is
// resolved to ids at the confirm step, and the purge deletes those ids
// only: an entry that arrived in between survives.
func TestPurgeActsOnTheConfirmedEntries(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	ids := f.seedErrors("order 1 not found", "order 22 not found", "timeout")
	cl := bearer(t, f.console(nil))

	body := cl.page("/dlq?"+url.Values{"group": {"order <n> not found"}}.Encode(), http.StatusOK)
	require.Contains(t, body, `<span class="label">All 2 in this group</span>`)
	summary, next := cl.confirm(url.Values{"action": {"purge"}, "scope": {"group"}, "group": {"order <n> not found"}, "back": {"group=order+%3Cn%3E+not+found&page=3"}})
	require.Equal(t, "Purge 2 entries: they are deleted for good, never delivered again.", summary)
	require.Equal(t, idText(ids[0])+"-"+idText(ids[1]), next.Get("ids"))
	late := f.seedErrors("order 333 not found")

	rec := cl.post("/dlq/confirm", next)
	require.Equal(t, http.StatusSeeOther, rec.Code)
	require.True(t, strings.HasPrefix(rec.Header().Get("Location"), "../dlq?"), rec.Header().Get("Location"))
	require.NotContains(t, rec.Header().Get("Location"), "page=", "back to the first page")
	body = cl.follow(rec, "/dlq/confirm")
	require.Equal(t, "ok: Purged 2 entries.", flashOf(body))
	require.Equal(t, []int64{ids[2], late[0]}, f.ids(), "the entry that arrived after the confirm step survives")
	require.Equal(t, []int64{late[0]}, rowIDs(body), "back on the group's list")

	// A filter.
	f.seed(f.deadLetter("payments", "ledger", "a", nil), f.deadLetter("payments", "ledger", "b", nil))
	_, next = cl.confirm(url.Values{"action": {"purge"}, "scope": {"filter"}, "consumer": {"ledger"}})
	late2 := f.seed(f.deadLetter("payments", "ledger", "c", nil))
	body = cl.follow(cl.post("/dlq/confirm", next), "/dlq/confirm")
	require.Equal(t, "ok: Purged 2 entries.", flashOf(body))
	require.Equal(t, []int64{ids[2], late[0], late2[0]}, f.ids())

	// A selection, one of whose entries goes meanwhile.
	summary, next = cl.confirm(url.Values{"action": {"purge"}, "scope": {"selection"}, "id": {idText(ids[2]), idText(late[0])}})
	require.Equal(t, "Purge 2 entries: they are deleted for good, never delivered again.", summary)
	_, err := f.store.Purge(context.Background(), dlq.Filter{IDs: []int64{late[0]}})
	require.NoError(t, err)
	body = cl.follow(cl.post("/dlq/confirm", next), "/dlq/confirm")
	require.Equal(t, "ok: Purged 1 of 2 entries (the others were gone, or already waiting for a replay).", flashOf(body))
	require.Equal(t, []int64{late2[0]}, f.ids())

	// Nothing selected, nothing matching, a forged flash.
	require.Equal(t, http.StatusBadRequest, cl.post("/dlq/confirm", url.Values{"action": {"purge"}, "scope": {"selection"}}).Code)
	summary, next = cl.confirm(url.Values{"action": {"purge"}, "scope": {"filter"}, "topic": {"nothing-here"}})
	require.Equal(t, "Nothing to do: no entry matches.", summary)
	require.Nil(t, next, "no confirm button")
	require.Empty(t, flashOf(cl.page("/dlq?flash=Purged+everything&flash_ok=1&flash_sig=x", http.StatusOK)), "an unsigned flash is not shown")
	require.Equal(t, http.StatusBadRequest, cl.post("/dlq/confirm", url.Values{"action": {"purge"}, "ids": {"1-99999999"}, "confirm": {"1"}}).Code)
	require.Equal(t, http.StatusBadRequest, cl.post("/dlq/confirm", url.Values{"action": {"explode"}, "scope": {"filter"}}).Code)
	require.Equal(t, []int64{late2[0]}, f.ids())
}

// TestReadOnly: no buttons, and every replay or purge is refused with 403.
func TestReadOnly(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	ids := f.seedErrors("order 1 not found", "timeout")
	broker := gochannel.NewGoChannel(gochannel.Config{Persistent: true}, watermill.NopLogger{})
	defer broker.Close()
	cl := bearer(t, f.console(func(c *console.Config) { c.ReadOnly = true; c.Publisher = broker }))

	for _, path := range []string{"/dlq", "/dlq/" + idText(ids[0])} {
		body := cl.page(path, http.StatusOK)
		for _, hidden := range []string{`value="replay-consumer"`, `value="replay-topic"`, `value="purge"`, `name="id"`, "dlq/confirm"} {
			require.NotContains(t, body, hidden, path)
		}
		require.Contains(t, body, "read-only")
	}
	for _, form := range []url.Values{
		{"action": {"purge"}, "scope": {"filter"}, "topic": {"orders"}},
		{"action": {"purge"}, "ids": {idText(ids[0]) + "-" + idText(ids[1])}, "confirm": {"1"}},
		{"action": {"replay-consumer"}, "ids": {idText(ids[0])}, "confirm": {"1"}},
		{"action": {"replay-topic"}, "ids": {idText(ids[0])}, "confirm": {"1"}},
	} {
		rec := cl.post("/dlq/confirm", form)
		require.Equal(t, http.StatusForbidden, rec.Code, form.Encode())
		require.Contains(t, rec.Body.String(), "read-only")
	}
	require.Equal(t, ids, f.ids(), "nothing purged")
	require.Empty(t, f.replayRequested(), "nothing marked")
}

// TestDisableAuth: behind the caller's own auth, no token is needed, and
// POSTs still need the CSRF token, bound to a cookie of the console's.
func TestDisableAuth(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	ids := f.seedErrors("boom")
	c := f.console(func(cfg *console.Config) { cfg.Token = ""; cfg.DisableAuth = true })
	anon := &client{t: t, h: c}
	rec := anon.get("/dlq")
	require.Equal(t, http.StatusOK, rec.Code)
	require.NotContains(t, rec.Body.String(), "Log out")
	cookies := rec.Result().Cookies()
	require.Len(t, cookies, 1)
	anon.cookie = cookies[0]

	form := url.Values{"action": {"purge"}, "ids": {idText(ids[0])}, "confirm": {"1"}}
	require.Equal(t, http.StatusForbidden, anon.do(http.MethodPost, "/dlq/confirm", form).Code, "no CSRF token")
	require.Equal(t, ids, f.ids())
	require.Equal(t, http.StatusSeeOther, anon.post("/dlq/confirm", form).Code)
	require.Empty(t, f.ids())

	_, err := console.New(console.Config{Pool: f.pool, Schema: sqlschema.Config{Schema: f.schema.Schema}, DisableAuth: true})
	require.NoError(t, err)
}

// TestIDRanges: the confirm form carries its ids as ranges, and the action
// reads back exactly those, within the limit.
func TestIDRanges(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		ids  []int64
		text string
	}{
		{nil, ""},
		{[]int64{7}, "7"},
		{[]int64{1, 2, 3, 5, 8, 9}, "1-3,5,8-9"},
		{[]int64{48211, 48212, 48213, 48214, 48215}, "48211-48215"},
	} {
		require.Equal(t, tc.text, console.FormatRanges(tc.ids))
		got, err := console.ParseRanges(tc.text)
		require.NoError(t, err)
		if tc.ids == nil {
			require.Empty(t, got)
			continue
		}
		require.Equal(t, tc.ids, got)
	}
	got, err := console.ParseRanges("9, 3-4,4,1")
	require.NoError(t, err)
	require.Equal(t, []int64{1, 3, 4, 9}, got, "ascending, without repeats")
	for _, bad := range []string{"x", "0", "-3", "5-2", "1-", "1-10001", "1-6000,7000-12000", "3,,4"} {
		_, err := console.ParseRanges(bad)
		require.Error(t, err, bad)
	}
	_, err = console.ParseRanges("1-10000")
	require.NoError(t, err, "10000 ids is the limit")
}

// TestBulkActionIDsAtTheInt64Limit: a confirmed purge of dead letters, and
// a confirmed cancel of parked retries, whose ids reach 9223372036854775807,
// the largest id, alone or as the end of a range, with the token and the
// CSRF field. The range loop used to step past the largest id, wrap to a
// negative one and never end: the console ran out of memory. Now such
// ids are taken as they are, a range of them ends at its end, the action
// finds none of them and says so, and the entries that exist are
// untouched. An id past the largest, or a range wider than one action
// takes, is refused with a message that names the limit.
func TestBulkActionIDsAtTheInt64Limit(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	dead := f.seedErrors("order 1 not found")
	parked, err := retry.NewStore(f.pool, f.schema)
	require.NoError(t, err)
	waiting := parkOne(t, parked, "charge", "acct-1", 5, time.Now().Add(time.Hour))
	cl := bearer(t, f.console(nil))

	for _, tc := range []struct {
		path, action, flash string
	}{
		{"/dlq/confirm", "purge", "ok: Purged 0 of %d %s (the others were gone, or already waiting for a replay)."},
		{"/retries/confirm", "cancel", "ok: Cancelled 0 of %d parked %s: moved to the dead-letter table (the others were gone, due already, or out to their consumer)."},
	} {
		noun := map[string][2]string{"purge": {"entry", "entries"}, "cancel": {"message", "messages"}}[tc.action]
		for ids, n := range map[string]int{
			"9223372036854775807":                                         1,
			"9223372036854775807-9223372036854775807":                     1,
			"9223372036854775000-9223372036854775807":                     808,
			"9223372036854775806-9223372036854775807,9223372036854775807": 2,
		} {
			form := url.Values{"action": {tc.action}, "confirm": {"1"}, "ids": {ids}}
			rec := cl.post(tc.path, form)
			body := cl.follow(rec, tc.path)
			word := noun[1]
			if n == 1 {
				word = noun[0]
			}
			require.Equal(t, fmt.Sprintf(tc.flash, n, word), flashOf(body), "%s ids=%s", tc.path, ids)
		}
		for ids, want := range map[string]string{
			"9223372036854775808":   `bad id range "9223372036854775808": an id is a whole number from 1 to 9223372036854775807`,
			"1-9223372036854775807": "more than 10000 ids: one action takes at most 10000",
			"9223372036854775807-1": `bad id range "9223372036854775807-1": an id is a whole number from 1 to 9223372036854775807, a range is FROM-TO with FROM at most TO`,
		} {
			rec := cl.post(tc.path, url.Values{"action": {tc.action}, "confirm": {"1"}, "ids": {ids}})
			require.Equal(t, http.StatusBadRequest, rec.Code, "%s ids=%s", tc.path, ids)
			require.Contains(t, html.UnescapeString(rec.Body.String()), want, "%s ids=%s", tc.path, ids)
		}
	}
	require.Equal(t, dead, f.ids(), "the dead letter is still there")
	_, err = parked.Get(context.Background(), waiting)
	require.NoError(t, err, "the parked message is still parked")
}
