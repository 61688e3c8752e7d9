package console_test

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"net/url"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	_ "modernc.org/sqlite"

	"github.com/oncemill/oncemill/console"
	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/dlq"
	"github.com/oncemill/oncemill/internal/testing/sqltest"
	"github.com/oncemill/oncemill/sqlschema"
)

// fuzzConsole is a console on a SQLite database of its own, with a few
// dead letters, and the CSRF token of its bearer session.
type fuzzConsole struct {
	c    *console.Console
	csrf string
}

func newFuzzConsole(f testing.TB) fuzzConsole {
	ctx := context.Background()
	db := sqltest.OpenSQLite(f, filepath.Join(f.TempDir(), "console.db"))
	if err := sqlschema.MigrateSQLite(ctx, db, sqlschema.Config{}); err != nil {
		f.Fatal(err)
	}
	pub, err := dlq.NewSQLPublisher(db, sqlschema.SQLite, sqlschema.Config{})
	if err != nil {
		f.Fatal(err)
	}
	for i := range 5 {
		m := message.NewMessage(fmt.Sprintf("uuid-%d", i), []byte(`{"order":1}`))
		m.Metadata.Set(delivery.DeadTopic, "orders")
		m.Metadata.Set(delivery.DeadConsumer, []string{"charge", "ship"}[i%2])
		m.Metadata.Set(delivery.DeadKey, fmt.Sprintf("key-%d", i))
		m.Metadata.Set(delivery.DeadError, "order not found")
		if err := pub.Publish("orders.dlq", m); err != nil {
			f.Fatal(err)
		}
	}
	c, err := console.New(console.Config{DB: db, Dialect: sqlschema.SQLite, Token: testToken, Now: func() time.Time { return testNow }})
	if err != nil {
		f.Fatal(err)
	}
	rec := httptest.NewRecorder()
	req := httptest.NewRequest(http.MethodGet, "http://console.test/", nil)
	req.Header.Set("Authorization", "Bearer "+testToken)
	c.ServeHTTP(rec, req)
	if rec.Code != http.StatusOK || rec.Header().Get("X-CSRF-Token") == "" {
		f.Fatalf("overview: %d, CSRF token %q", rec.Code, rec.Header().Get("X-CSRF-Token"))
	}
	return fuzzConsole{c: c, csrf: rec.Header().Get("X-CSRF-Token")}
}

// serve sends req as the bearer would and checks what every answer must
// be: no 500 and no token in the page.
func (fc fuzzConsole) serve(t *testing.T, req *http.Request) *httptest.ResponseRecorder {
	t.Helper()
	req.Header.Set("Authorization", "Bearer "+testToken)
	req.Header.Set("Accept", "text/html")
	rec := httptest.NewRecorder()
	fc.c.ServeHTTP(rec, req)
	if rec.Code >= 500 {
		t.Fatalf("%s %s: %d %s", req.Method, req.URL, rec.Code, rec.Body)
	}
	if strings.Contains(rec.Body.String(), testToken) || strings.Contains(fmt.Sprint(rec.Header()), testToken) {
		t.Fatalf("%s %s: the token is in the answer", req.Method, req.URL)
	}
	return rec
}

var fuzzPages = []string{"/", "/dlq", "/dlq/1", "/dlq/", "/retries", "/inbox", "/login"}

// FuzzConsoleQuery: any query string on any page of the console (paging,
// filters, the inbox lookup, an entry's id) gets a page or a 4xx, never a
// 500 nor a panic, and never shows the token.
func FuzzConsoleQuery(f *testing.F) {
	fc := newFuzzConsole(f)
	f.Add(uint8(1), "", "page=2&consumer=charge&topic=orders")
	f.Add(uint8(1), "", "page=-1&since=yesterday&until=2020-01-01T00:00:00Z&error=%25")
	f.Add(uint8(1), "", "page=99999999999999999999&limit=0")
	f.Add(uint8(3), "1", "")
	f.Add(uint8(3), "99999999999999999999", "")
	f.Add(uint8(3), "-1", "")
	f.Add(uint8(4), "", "state=due&page=a")
	f.Add(uint8(5), "", "consumer=charge&key=key-1")
	f.Add(uint8(5), "", "consumer=%00&key=%FF")
	f.Add(uint8(0), "", "%zz")
	f.Fuzz(func(t *testing.T, page uint8, id, query string) {
		path := fuzzPages[int(page)%len(fuzzPages)]
		if path == "/dlq/" {
			path += url.PathEscape(id)
		}
		req := httptest.NewRequest(http.MethodGet, "http://console.test/", nil)
		req.URL.Path, req.URL.RawQuery = path, query
		fc.serve(t, req)
	})
}

var fuzzForms = []string{"/dlq/confirm", "/retries/confirm", "/login", "/logout"}

// FuzzConsoleForm: any form posted to the console's actions (replay,
// purge, retry now, cancel, the login) with a valid CSRF token, or any
// body, gets an answer that is not a 500 nor a panic, and never shows the
// token.
func FuzzConsoleForm(f *testing.F) {
	fc := newFuzzConsole(f)
	f.Add(uint8(0), "action=purge&scope=entry&ids=1&back=page%3D2", true)
	f.Add(uint8(0), "action=replay-consumer&scope=selection&ids=1-3,5&confirm=1", true)
	f.Add(uint8(0), "action=purge&scope=filter&consumer=charge&error=x&confirm=1", true)
	f.Add(uint8(0), "action=purge&scope=group&ids=9223372036854775807-1", true)
	f.Add(uint8(1), "action=cancel&scope=selection&ids=1&confirm=1", true)
	f.Add(uint8(1), "action=retry-now&scope=filter&state=due", true)
	f.Add(uint8(2), "token=wrong", false)
	f.Add(uint8(3), "", true)
	f.Add(uint8(0), "%zz&;=", false)
	f.Fuzz(func(t *testing.T, which uint8, body string, withCSRF bool) {
		path := fuzzForms[int(which)%len(fuzzForms)]
		req := httptest.NewRequest(http.MethodPost, "http://console.test"+path, strings.NewReader(body))
		req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
		req.Header.Set("Sec-Fetch-Site", "same-origin")
		if withCSRF {
			req.Header.Set("X-CSRF-Token", fc.csrf)
		}
		fc.serve(t, req)
	})
}
