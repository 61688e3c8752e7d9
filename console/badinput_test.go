package console_test

import (
	"html"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
)

// TestConsoleBadInput, on SQLite: each bad query, form or request gets
// its status and a message that says what is wrong and what to do, never
// a 500.
func TestConsoleBadInput(t *testing.T) {
	t.Parallel()
	fc := newFuzzConsole(t)
	big := "action=purge&scope=entry&ids=1&back=" + strings.Repeat("a", 1<<20)
	for name, tc := range map[string]struct {
		method, path, body string
		csrf               bool
		header             map[string]string
		status             int
		want               string
	}{
		"form over 1 MiB":                    {"POST", "/dlq/confirm", big, true, nil, 413, "Refused: form too large (limit 1 MiB)."},
		"form over 1 MiB without CSRF token": {"POST", "/dlq/confirm", big, false, nil, 413, "Refused: form too large (limit 1 MiB)."},
		"form without CSRF token":            {"POST", "/dlq/confirm", "action=purge&scope=entry&ids=1", false, nil, 403, "Refused: the form's CSRF token is missing or does not belong to this session. Reload the page and try again."},
		"form from another origin":           {"POST", "/dlq/confirm", "action=purge", true, map[string]string{"Sec-Fetch-Site": "cross-site"}, 403, "Refused: the request comes from another origin."},
		"unknown dead-letter action":         {"POST", "/dlq/confirm", "action=explode", true, nil, 400, `Unknown action "explode": use replay-consumer, replay-topic, reopen or purge.`},
		"unknown dead-letter scope":          {"POST", "/dlq/confirm", "action=purge&scope=all", true, nil, 400, `Unknown scope "all": use entry, selection, group or filter.`},
		"selection without ids":              {"POST", "/dlq/confirm", "action=purge&scope=selection", true, nil, 400, "No entries selected: tick the entries first."},
		"reversed id range":                  {"POST", "/dlq/confirm", "action=purge&confirm=1&ids=5-1", true, nil, 400, `bad id range "5-1"`},
		"selected id not a number":           {"POST", "/dlq/confirm", "action=purge&scope=selection&id=abc", true, nil, 400, `"abc" is not an entry id`},
		"confirmed without ids":              {"POST", "/dlq/confirm", "action=purge&confirm=1", true, nil, 400, "Nothing confirmed: no entry ids."},
		"unknown retries action":             {"POST", "/retries/confirm", "action=explode", true, nil, 400, `Unknown action "explode": use retry-now or cancel.`},
		"unknown retries scope":              {"POST", "/retries/confirm", "action=cancel&scope=all", true, nil, 400, `Unknown scope "all": use selection or filter.`},
		"page not a number":                  {"GET", "/dlq?page=abc", "", false, nil, 400, `page must be a positive number, got "abc"`},
		"page zero":                          {"GET", "/dlq?page=0", "", false, nil, 400, `page must be a positive number, got "0"`},
		"since not a time":                   {"GET", "/dlq?since=yesterday", "", false, nil, 400, `since: "yesterday" is neither a time (RFC 3339, or 2006-01-02T15:04 in UTC) nor a duration ago like 90m, 2h or 7d`},
		"since after until":                  {"GET", "/dlq?since=2026-01-02T00:00&until=2026-01-01T00:00", "", false, nil, 400, "since (2026-01-02"},
		"entry id not a number":              {"GET", "/dlq/abc", "", false, nil, 404, `No such dead letter: "abc" is not an entry id.`},
		"entry that does not exist":          {"GET", "/dlq/999999", "", false, nil, 404, "No dead letter 999999: it was replayed or purged, or never existed."},
		"unknown page":                       {"GET", "/nope", "", false, nil, 404, "No such page."},
		"wrong method":                       {"DELETE", "/dlq", "", false, nil, 405, "This page takes GET, HEAD."},
	} {
		t.Run(name, func(t *testing.T) {
			req := httptest.NewRequest(tc.method, "http://console.test"+tc.path, strings.NewReader(tc.body))
			if tc.method == http.MethodPost {
				req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
				req.Header.Set("Sec-Fetch-Site", "same-origin")
			}
			if tc.csrf {
				req.Header.Set("X-CSRF-Token", fc.csrf)
			}
			for k, v := range tc.header {
				req.Header.Set(k, v)
			}
			rec := fc.serve(t, req)
			if rec.Code != tc.status || !strings.Contains(html.UnescapeString(rec.Body.String()), tc.want) {
				t.Fatalf("%s %s: %d, want %d saying %q; got\n%s", tc.method, tc.path, rec.Code, tc.status, tc.want, rec.Body)
			}
		})
	}
}
