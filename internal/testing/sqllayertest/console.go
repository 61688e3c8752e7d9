package sqllayertest

import (
	"net/http"
	"net/http/httptest"
	"regexp"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/dedup"
)

// consoleToken is the console's token in the suite.
const consoleToken = "sqllayertest-console-token-9c41d2"

func itoa(n int) string { return strconv.Itoa(n) }

// page gets path from h as an operator's browser does, and requires 200.
func page(t *testing.T, h http.Handler, path string) string {
	t.Helper()
	req := httptest.NewRequest(http.MethodGet, "http://console.test"+path, nil)
	req.Header.Set("Accept", "text/html")
	req.Header.Set("Authorization", "Bearer "+consoleToken)
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, req)
	require.Equal(t, http.StatusOK, rec.Code, "GET %s: %s", path, rec.Body.String())
	return rec.Body.String()
}

// section is the overview's section id.
func section(t *testing.T, body, id string) string {
	t.Helper()
	i := strings.Index(body, `id="`+id+`"`)
	require.Positive(t, i, "section %s", id)
	end := strings.Index(body[i:], "</section>")
	require.Positive(t, end, "section %s ends", id)
	return body[i : i+end]
}

// cells are the cells after the first of the row whose first cell is
// first.
func cells(t *testing.T, section, first string) []string {
	t.Helper()
	m := regexp.MustCompile(`(?s)<tr><td class="mono">` + regexp.QuoteMeta(first) + `</td>(.*?)</tr>`).FindStringSubmatch(section)
	require.NotNil(t, m, "row %s in %s", first, section)
	var out []string
	for _, c := range regexp.MustCompile(`<td[^>]*>(?:<[^>]+>)?([^<]*)`).FindAllStringSubmatch(m[1], -1) {
		out = append(out, c[1])
	}
	return out
}

// rowIDs are the ids of a dead-letter list's rows, in order.
func rowIDs(body string) []int64 {
	ids := []int64{}
	for _, m := range regexp.MustCompile(`<tr data-id="(\d+)">`).FindAllStringSubmatch(body, -1) {
		id, _ := strconv.ParseInt(m[1], 10, 64)
		ids = append(ids, id)
	}
	return ids
}

// consoleCounts: after a consumer applied three orders and dead-lettered
// a fourth, with one event waiting in the outbox, the console's overview
// counts them, lists the dead letter and shows the keys.
func consoleCounts(t *testing.T, e *env) {
	broker := e.broker(false)
	var broken atomic.Bool
	broken.Store(true)
	c, msg, en := e.deadLettered(&broken, broker, broker, "bad")
	broken.Store(false)
	for _, k := range []string{"a", "b", "c"} {
		require.NoError(t, broker.Publish("orders", order(k)))
	}
	e.eventually("three orders applied", func() bool {
		return c.effectsOf("a") == 1 && c.effectsOf("b") == 1 && c.effectsOf("c") == 1
	})
	for _, k := range []string{"a", "b", "c"} {
		e.eventually("key "+k+" done", func() bool { return e.state(c.store, c.key(k)) == dedup.StateDone })
	}
	e.write("orders.charged", event("a", 1))

	h := e.console(nil)
	body := page(t, h, "/")
	require.Equal(t, []string{"3", "3", "0", "0", "1", "0"}, cells(t, section(t, body, "overview-inbox"), "charge"),
		"last hour, last day, in flight, failing, dead, dead copies")
	require.Contains(t, section(t, body, "overview-dlq"), `href="./dlq">1</a>`, "one dead letter")
	require.Contains(t, section(t, body, "overview-outbox"), `id="outbox-pending">1<`, "one event waits in the outbox")

	require.Equal(t, []int64{en.ID}, rowIDs(page(t, h, "/dlq")))
	entry := page(t, h, "/dlq/"+strconv.FormatInt(en.ID, 10))
	require.Contains(t, entry, msg.UUID)
	require.Contains(t, entry, "ledger refuses the order")
	require.Contains(t, page(t, h, "/inbox?consumer=charge&key=a"), `id="inbox-status">done<`)
	require.Contains(t, page(t, h, "/inbox?consumer=charge&key=bad"), `id="inbox-status">dead<`)
}
