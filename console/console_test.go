package console_test

import (
	"context"
	"crypto/tls"
	"html"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/console"
	"github.com/oncemill/oncemill/dedup"
	"github.com/oncemill/oncemill/dedup/postgres"
	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/dlq"
	"github.com/oncemill/oncemill/internal/testing/pgtest"
	"github.com/oncemill/oncemill/reconcile"
	"github.com/oncemill/oncemill/sqlschema"
)

// testToken is the token of the consoles under test.
const testToken = "console-test-token-5a1f0c2e9b7d"

// testNow is the consoles' clock, unless a test moves it.
var testNow = time.Date(2026, 3, 1, 12, 0, 0, 0, time.UTC)

// fixture is a schema of its own with the dead-letter publisher and store.
type fixture struct {
	t      *testing.T
	pool   *pgxpool.Pool
	schema sqlschema.Config
	pub    *dlq.Publisher
	store  *dlq.Store
}

func newFixture(t *testing.T) *fixture {
	t.Helper()
	pool := pgtest.Pool(t, 8)
	schema := sqlschema.Config{Schema: pgtest.Schema(t, pool)}
	pub, err := dlq.NewPublisher(pool, schema)
	require.NoError(t, err)
	store, err := dlq.NewStore(pool, schema)
	require.NoError(t, err)
	return &fixture{t: t, pool: pool, schema: schema, pub: pub, store: store}
}

// console returns a console on the fixture's schema with the test token
// and clock; mod changes the config.
func (f *fixture) console(mod func(*console.Config)) *console.Console {
	f.t.Helper()
	cfg := console.Config{Pool: f.pool, Schema: f.schema, Token: testToken, Now: func() time.Time { return testNow }}
	if mod != nil {
		mod(&cfg)
	}
	c, err := console.New(cfg)
	require.NoError(f.t, err)
	return c
}

func (f *fixture) table(name string) string { return pgx.Identifier{f.schema.Schema, name}.Sanitize() }

// deadLetter is a message as the poison middleware dead-letters it.
func (f *fixture) deadLetter(topic, consumer, errText string, payload []byte) *message.Message {
	m := message.NewMessage(watermill.NewUUID(), payload)
	m.Metadata.Set("trace_id", "tr-1")
	m.Metadata.Set(delivery.DeadTopic, topic)
	m.Metadata.Set(delivery.DeadConsumer, consumer)
	m.Metadata.Set(delivery.DeadKey, "key-"+m.UUID)
	m.Metadata.Set(delivery.DeadAttempts, "5")
	m.Metadata.Set(delivery.DeadError, errText)
	m.Metadata.Set(delivery.DeadFirstFailedAt, "2026-03-01T10:00:00Z")
	m.Metadata.Set(delivery.DeadLastFailedAt, "2026-03-01T10:05:00Z")
	return m
}

// bury marks the key of each of msgs dead in the inbox table beside the
// dead-letter table, as the consumer's inbox does before the poison
// middleware writes its dead letter: a replay grants on that record.
func (f *fixture) bury(msgs ...*message.Message) {
	f.t.Helper()
	ctx := context.Background()
	store, err := postgres.New(f.pool, postgres.Config{Schema: f.schema.Schema})
	require.NoError(f.t, err)
	for _, m := range msgs {
		k := dedup.Key{Consumer: m.Metadata.Get(delivery.DeadConsumer), Key: m.Metadata.Get(delivery.DeadKey)}
		c, err := store.LeaseClaim(ctx, k, time.Minute, time.Hour)
		require.NoError(f.t, err)
		require.NoError(f.t, store.LeaseBury(ctx, k, c.Token, dedup.Failure{Err: "seeded", At: time.Now()}))
	}
}

// seed writes msgs as dead letters and returns their ids.
func (f *fixture) seed(msgs ...*message.Message) []int64 {
	f.t.Helper()
	before := f.ids()
	require.NoError(f.t, f.pub.Publish("orders.dlq", msgs...))
	after := f.ids()
	require.Len(f.t, after, len(before)+len(msgs))
	return after[len(before):]
}

// seedErrors writes one dead letter of topic orders and consumer charge per
// error text.
func (f *fixture) seedErrors(errs ...string) []int64 {
	f.t.Helper()
	msgs := make([]*message.Message, len(errs))
	for i, e := range errs {
		msgs[i] = f.deadLetter("orders", "charge", e, []byte(`{"n":`+strconv.Itoa(i)+`}`))
	}
	return f.seed(msgs...)
}

// ids are the dead letters' ids, ascending.
func (f *fixture) ids() []int64 {
	f.t.Helper()
	rows, err := f.pool.Query(context.Background(), `SELECT id FROM `+f.table("dlq")+` ORDER BY id`)
	require.NoError(f.t, err)
	ids, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	require.NoError(f.t, err)
	return ids
}

func (f *fixture) setDeadAt(id int64, at time.Time) {
	f.t.Helper()
	_, err := f.pool.Exec(context.Background(), `UPDATE `+f.table("dlq")+` SET dead_at = $1 WHERE id = $2`, at, id)
	require.NoError(f.t, err)
}

// client sends requests to a handler, as a browser or a script would.
type client struct {
	t      *testing.T
	h      http.Handler
	prefix string // where the console is mounted, "" for the root
	bearer string
	cookie *http.Cookie
	header http.Header
}

// bearer returns a client with the right token.
func bearer(t *testing.T, h http.Handler) *client {
	return &client{t: t, h: h, bearer: testToken}
}

// do sends a request for path, below the mount point; form, when not nil,
// is the POST body.
func (c *client) do(method, path string, form url.Values) *httptest.ResponseRecorder {
	c.t.Helper()
	var body io.Reader
	if form != nil {
		body = strings.NewReader(form.Encode())
	}
	req := httptest.NewRequest(method, "http://console.test"+c.prefix+path, body)
	if form != nil {
		req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	}
	req.Header.Set("Accept", "text/html,application/xhtml+xml")
	if c.bearer != "" {
		req.Header.Set("Authorization", "Bearer "+c.bearer)
	}
	if c.cookie != nil {
		req.AddCookie(c.cookie)
	}
	for k, v := range c.header {
		req.Header[k] = v
	}
	rec := httptest.NewRecorder()
	c.h.ServeHTTP(rec, req)
	return rec
}

func (c *client) get(path string) *httptest.ResponseRecorder { return c.do(http.MethodGet, path, nil) }

// page gets path and requires status.
func (c *client) page(path string, status int) string {
	c.t.Helper()
	rec := c.get(path)
	require.Equal(c.t, status, rec.Code, "GET %s: %s", path, rec.Body.String())
	return rec.Body.String()
}

// csrf is the client's CSRF token, as an authenticated page gives it.
func (c *client) csrf() string {
	c.t.Helper()
	rec := c.get("/dlq")
	require.Equal(c.t, http.StatusOK, rec.Code, rec.Body.String())
	tok := rec.Header().Get("X-CSRF-Token")
	require.NotEmpty(c.t, tok)
	return tok
}

// post posts form with the client's CSRF token.
func (c *client) post(path string, form url.Values) *httptest.ResponseRecorder {
	c.t.Helper()
	form.Set("csrf", c.csrf())
	return c.do(http.MethodPost, path, form)
}

// follow resolves a redirect's Location against the URL it answered and
// gets it.
func (c *client) follow(rec *httptest.ResponseRecorder, from string) string {
	c.t.Helper()
	require.Equal(c.t, http.StatusSeeOther, rec.Code, rec.Body.String())
	loc := rec.Header().Get("Location")
	require.NotEmpty(c.t, loc)
	require.False(c.t, strings.HasPrefix(loc, "/"), "relative redirects: %s", loc)
	u, err := url.Parse("http://console.test" + c.prefix + from)
	require.NoError(c.t, err)
	ref, err := url.Parse(loc)
	require.NoError(c.t, err)
	to := u.ResolveReference(ref)
	require.True(c.t, strings.HasPrefix(to.Path, c.prefix+"/"), "the redirect stays under %q: %s", c.prefix, to)
	path := strings.TrimPrefix(to.Path, c.prefix)
	if to.RawQuery != "" {
		path += "?" + to.RawQuery
	}
	return c.page(path, http.StatusOK)
}

// confirm posts the first step of an action on dead letters and returns
// the summary and the confirm form's fields.
func (c *client) confirm(form url.Values) (string, url.Values) {
	c.t.Helper()
	return c.confirmAt("/dlq/confirm", form)
}

// confirmAt posts the first step of an action to path and returns the
// summary and the confirm form's fields.
func (c *client) confirmAt(path string, form url.Values) (string, url.Values) {
	c.t.Helper()
	rec := c.post(path, form)
	require.Equal(c.t, http.StatusOK, rec.Code, rec.Body.String())
	body := rec.Body.String()
	m := regexp.MustCompile(`(?s)id="confirm-summary"[^>]*>(.*?)</p>`).FindStringSubmatch(body)
	require.NotNil(c.t, m, body)
	i := strings.Index(body, `id="confirm-form"`)
	if i < 0 {
		return html.UnescapeString(m[1]), nil
	}
	fields := url.Values{}
	end := strings.Index(body[i:], "</form>")
	for _, h := range regexp.MustCompile(`<input type="hidden" name="(\w+)" value="([^"]*)">`).FindAllStringSubmatch(body[i:i+end], -1) {
		fields.Set(h[1], html.UnescapeString(h[2]))
	}
	require.Equal(c.t, "1", fields.Get("confirm"))
	require.Contains(c.t, body[i:i+end], `id="confirm-button"`)
	return html.UnescapeString(m[1]), fields
}

// rowIDs are the ids of the list's rows, in order.
func rowIDs(body string) []int64 {
	ids := []int64{}
	for _, m := range regexp.MustCompile(`<tr data-id="(\d+)">`).FindAllStringSubmatch(body, -1) {
		id, _ := strconv.ParseInt(m[1], 10, 64)
		ids = append(ids, id)
	}
	return ids
}

// flashOf is the flash message of a page, "" when none.
func flashOf(body string) string {
	m := regexp.MustCompile(`(?s)<div id="flash" class="flash (ok|error)"[^>]*>(.*?)</div>`).FindStringSubmatch(body)
	if m == nil {
		return ""
	}
	return m[1] + ": " + html.UnescapeString(m[2])
}

func TestConfigValidate(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t, 1)
	for name, tc := range map[string]struct {
		cfg   console.Config
		field string
	}{
		"no pool":                {console.Config{Token: testToken}, "Pool"},
		"no token":               {console.Config{Pool: pool}, "Token"},
		"short token":            {console.Config{Pool: pool, Token: "hunter2"}, "Token must be at least 16 characters, got 7"},
		"negative page":          {console.Config{Pool: pool, Token: testToken, PageSize: -1}, "PageSize"},
		"page too large":         {console.Config{Pool: pool, Token: testToken, PageSize: 5000}, "PageSize"},
		"negative payload":       {console.Config{Pool: pool, Token: testToken, MaxPayload: -1}, "MaxPayload"},
		"bad schema":             {console.Config{Pool: pool, Token: testToken, Schema: sqlschema.Config{Schema: "x;y"}}, "Schema"},
		"payload too large":      {console.Config{Pool: pool, Token: testToken, MaxPayload: 1 << 30}, "MaxPayload"},
		"check without consumer": {console.Config{Pool: pool, Token: testToken, Reconcile: []reconcile.Config{{Consumer: "charge"}, {Topics: []string{"orders"}}}}, "Reconcile[1]: reconcile: invalid config: Consumer"},
		"check window":           {console.Config{Pool: pool, Token: testToken, Reconcile: []reconcile.Config{{Consumer: "charge", Since: time.Minute}}}, "Reconcile[0]: reconcile: invalid config: Since"},
	} {
		err := tc.cfg.Validate()
		require.ErrorIs(t, err, console.ErrInvalidConfig, name)
		require.ErrorContains(t, err, tc.field, name)
		_, err = console.New(tc.cfg)
		require.ErrorIs(t, err, console.ErrInvalidConfig, name)
	}
	require.NoError(t, console.Config{Pool: pool, Token: testToken}.Validate())
	require.NoError(t, console.Config{Pool: pool, DisableAuth: true}.Validate(), "no token behind the caller's auth")
}

// TestAuth: every page needs the token; /login and /static/ do not.
func TestAuth(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	ids := f.seedErrors("boom")
	c := f.console(nil)
	anon := &client{t: t, h: c}
	// The console's address, opened with no credential, leads to the login
	// page, whatever the client accepts.
	for _, accept := range []string{"text/html", "*/*", ""} {
		rec := (&client{t: t, h: c, header: http.Header{"Accept": {accept}}}).get("/")
		require.Equal(t, http.StatusSeeOther, rec.Code, "Accept %q", accept)
		require.Equal(t, "login", rec.Header().Get("Location"))
		require.NotContains(t, rec.Body.String(), "boom")
	}
	require.Contains(t, anon.page("/login", http.StatusOK), `id="login-form"`)
	require.Equal(t, http.StatusUnauthorized, (&client{t: t, h: c, bearer: "wrong-token-0123456789"}).get("/").Code,
		"a wrong token is refused, not sent to the login page")

	for _, path := range []string{"/dlq", "/dlq/" + strconv.FormatInt(ids[0], 10), "/inbox?consumer=charge&key=k", "/no-such-page"} {
		rec := anon.get(path)
		require.Equal(t, http.StatusUnauthorized, rec.Code, path)
		require.Contains(t, rec.Header().Get("WWW-Authenticate"), "Bearer")
		require.Contains(t, rec.Body.String(), `id="login-form"`, "a browser gets the login form: %s", path)
		require.NotContains(t, rec.Body.String(), "boom", path)
	}
	rec := anon.do(http.MethodPost, "/dlq/confirm", url.Values{"action": {"purge"}, "ids": {strconv.FormatInt(ids[0], 10)}, "confirm": {"1"}})
	require.Equal(t, http.StatusUnauthorized, rec.Code)
	require.Len(t, f.ids(), 1)

	anon.page("/login", http.StatusOK)
	css := anon.get("/static/console.css")
	require.Equal(t, http.StatusOK, css.Code)
	require.Contains(t, css.Header().Get("Content-Type"), "text/css")
	require.Equal(t, http.StatusOK, anon.get("/static/console.js").Code)
	require.Equal(t, http.StatusNotFound, anon.get("/static/").Code, "no listing")

	ok := bearer(t, c)
	for _, path := range []string{"/", "/dlq", "/dlq/" + strconv.FormatInt(ids[0], 10), "/inbox"} {
		ok.page(path, http.StatusOK)
	}
	rec = ok.post("/dlq", url.Values{})
	require.Equal(t, http.StatusMethodNotAllowed, rec.Code)
	require.Equal(t, "GET, HEAD", rec.Header().Get("Allow"))
	lower := &client{t: t, h: c, header: http.Header{"Authorization": {"bearer " + testToken}}}
	lower.page("/", http.StatusOK)

	wrong := &client{t: t, h: c, bearer: testToken + "x"}
	rec = wrong.get("/")
	require.Equal(t, http.StatusUnauthorized, rec.Code)
	script := &client{t: t, h: c, bearer: "nope", header: http.Header{"Accept": {"application/json"}}}
	rec = script.get("/dlq")
	require.Equal(t, http.StatusUnauthorized, rec.Code)
	require.Contains(t, rec.Body.String(), "The token is wrong")
	require.NotContains(t, rec.Body.String(), `id="login-form"`)
}

// TestLogin: the login form sets a cookie that is not the token, and that
// cookie authenticates until it expires or the browser logs out.
func TestLogin(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	now := testNow
	c := f.console(func(cfg *console.Config) { cfg.Now = func() time.Time { return now } })
	anon := &client{t: t, h: c}

	body := anon.page("/login?next=dlq%3Ftopic%3Dorders", http.StatusOK)
	require.Contains(t, body, `id="login-form"`)
	require.Contains(t, body, `name="token"`)
	require.Contains(t, body, `name="next" value="dlq?topic=orders"`)

	rec := anon.do(http.MethodPost, "/login", url.Values{"token": {"wrong"}})
	require.Equal(t, http.StatusUnauthorized, rec.Code)
	require.Contains(t, rec.Body.String(), `id="login-error"`)
	require.Empty(t, rec.Result().Cookies())

	rec = anon.do(http.MethodPost, "/login", url.Values{"token": {testToken}, "next": {"dlq?topic=orders"}})
	require.Equal(t, http.StatusSeeOther, rec.Code)
	require.Equal(t, "./dlq?topic=orders", rec.Header().Get("Location"))
	cookies := rec.Result().Cookies()
	require.Len(t, cookies, 1)
	ck := cookies[0]
	require.True(t, ck.HttpOnly)
	require.Equal(t, http.SameSiteStrictMode, ck.SameSite)
	require.False(t, ck.Secure, "no TLS here")
	require.Empty(t, ck.Path, "the path of /login: the console's root")
	require.NotContains(t, ck.Value, testToken, "the cookie is not the token")

	browser := &client{t: t, h: c, cookie: &http.Cookie{Name: ck.Name, Value: ck.Value}}
	body = browser.page("/", http.StatusOK)
	require.Contains(t, body, "Log out")

	for _, next := range []string{"https://evil.test/", "//evil.test/x", "/etc", `\evil`} {
		rec = anon.do(http.MethodPost, "/login", url.Values{"token": {testToken}, "next": {next}})
		require.Equal(t, http.StatusSeeOther, rec.Code)
		require.Equal(t, "./", rec.Header().Get("Location"), "no redirect out of the console: %s", next)
	}

	tampered := &client{t: t, h: c, cookie: &http.Cookie{Name: ck.Name, Value: ck.Value[:len(ck.Value)-2] + "xx"}}
	require.Equal(t, http.StatusUnauthorized, tampered.get("/").Code)
	other := f.console(func(cfg *console.Config) { cfg.Token = "another-token-0123456789" })
	require.Equal(t, http.StatusUnauthorized, (&client{t: t, h: other, cookie: browser.cookie}).get("/").Code,
		"a cookie of another token")

	// Over TLS the cookie is Secure.
	req := httptest.NewRequest(http.MethodPost, "https://console.test/login", strings.NewReader(url.Values{"token": {testToken}}.Encode()))
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	req.TLS = &tls.ConnectionState{}
	tlsRec := httptest.NewRecorder()
	c.ServeHTTP(tlsRec, req)
	require.Equal(t, http.StatusSeeOther, tlsRec.Code)
	require.True(t, tlsRec.Result().Cookies()[0].Secure)

	// A login posted from another site is refused.
	cross := &client{t: t, h: c, header: http.Header{"Origin": {"https://evil.test"}}}
	require.Equal(t, http.StatusForbidden, cross.do(http.MethodPost, "/login", url.Values{"token": {testToken}}).Code)

	// Logout clears the cookie.
	rec = browser.post("/logout", url.Values{})
	require.Equal(t, http.StatusSeeOther, rec.Code)
	require.Equal(t, "login", rec.Header().Get("Location"))
	require.Negative(t, rec.Result().Cookies()[0].MaxAge)

	// 12 hours later the cookie has expired.
	now = now.Add(12*time.Hour + time.Second)
	require.Equal(t, http.StatusUnauthorized, browser.get("/").Code)
}

// TestCSRF: a POST without the session's CSRF token, or from another
// origin, is refused and changes nothing.
func TestCSRF(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	ids := f.seedErrors("boom", "bang")
	c := f.console(nil)
	cl := bearer(t, c)
	require.Contains(t, cl.page("/dlq", http.StatusOK), `name="csrf" value="`+cl.csrf()+`"`, "the forms carry the CSRF token")
	purge := func() url.Values {
		return url.Values{"action": {"purge"}, "scope": {"selection"}, "ids": {strconv.FormatInt(ids[0], 10) + "-" + strconv.FormatInt(ids[1], 10)}, "confirm": {"1"}}
	}

	require.Equal(t, http.StatusForbidden, cl.do(http.MethodPost, "/dlq/confirm", purge()).Code, "no CSRF token")
	form := purge()
	form.Set("csrf", "forged")
	require.Equal(t, http.StatusForbidden, cl.do(http.MethodPost, "/dlq/confirm", form).Code, "a wrong one")

	// The token of a cookie session does not work for the bearer, nor
	// the other way round.
	rec := (&client{t: t, h: c}).do(http.MethodPost, "/login", url.Values{"token": {testToken}})
	browser := &client{t: t, h: c, cookie: rec.Result().Cookies()[0]}
	form = purge()
	form.Set("csrf", browser.csrf())
	require.Equal(t, http.StatusForbidden, cl.do(http.MethodPost, "/dlq/confirm", form).Code, "another session's")
	form.Set("csrf", cl.csrf())
	require.Equal(t, http.StatusForbidden, browser.do(http.MethodPost, "/dlq/confirm", form).Code, "another session's")
	// Another console's token (another random key).
	form.Set("csrf", bearer(t, f.console(nil)).csrf())
	require.Equal(t, http.StatusForbidden, cl.do(http.MethodPost, "/dlq/confirm", form).Code, "another console's")

	for name, h := range map[string]http.Header{
		"origin":         {"Origin": {"https://evil.test"}},
		"sec-fetch-site": {"Sec-Fetch-Site": {"cross-site"}},
		"referer":        {"Referer": {"https://evil.test/page"}},
	} {
		cross := &client{t: t, h: c, bearer: testToken, header: h}
		rec := cross.post("/dlq/confirm", purge())
		require.Equal(t, http.StatusForbidden, rec.Code, name)
	}
	require.Equal(t, ids, f.ids(), "nothing purged")

	same := &client{t: t, h: c, bearer: testToken, header: http.Header{"Origin": {"http://console.test"}, "Referer": {"http://console.test/dlq"}}}
	require.Equal(t, http.StatusSeeOther, same.post("/dlq/confirm", purge()).Code, "the right token, from the console's own page")
	require.Empty(t, f.ids())

	// The header carries it as well as the field.
	more := f.seedErrors("again")
	hdr := &client{t: t, h: c, bearer: testToken, header: http.Header{"X-Csrf-Token": {cl.csrf()}}}
	rec = hdr.do(http.MethodPost, "/dlq/confirm", url.Values{"action": {"purge"}, "ids": {strconv.FormatInt(more[0], 10)}, "confirm": {"1"}})
	require.Equal(t, http.StatusSeeOther, rec.Code, rec.Body.String())
	require.Empty(t, f.ids())
}

// TestSecurityHeaders: every answer carries them, errors included.
func TestSecurityHeaders(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	c := f.console(nil)
	cl := bearer(t, c)
	anon := &client{t: t, h: c}
	for name, rec := range map[string]*httptest.ResponseRecorder{
		"page":   cl.get("/"),
		"login":  anon.get("/login"),
		"static": anon.get("/static/console.css"),
		"401":    anon.get("/dlq"),
		"403":    cl.do(http.MethodPost, "/dlq/confirm", url.Values{}),
		"404":    cl.get("/dlq/999999"),
	} {
		h := rec.Header()
		require.Contains(t, h.Get("Content-Security-Policy"), "default-src 'self'", name)
		require.NotContains(t, h.Get("Content-Security-Policy"), "unsafe-inline", name)
		require.Equal(t, "nosniff", h.Get("X-Content-Type-Options"), name)
		require.Equal(t, "DENY", h.Get("X-Frame-Options"), name)
		require.Equal(t, "same-origin", h.Get("Referrer-Policy"), name)
	}
	body := cl.page("/dlq", http.StatusOK)
	require.NotContains(t, body, "<script>", "no inline script")
	require.NotContains(t, body, "style=", "no inline style")
	require.Contains(t, body, `<script src="./static/console.js" defer></script>`)
	require.NotRegexp(t, `(?i)(src|href)="(https?:)?//`, body, "nothing from the network")
}

// TestStripPrefix: under http.StripPrefix every link, form and redirect
// stays under the prefix.
func TestStripPrefix(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	ids := f.seedErrors("order 1 not found", "order 2 not found")
	c := f.console(nil)
	for _, strip := range []string{"/ops", "/ops/"} {
		mux := http.NewServeMux()
		mux.Handle("/ops/", http.StripPrefix(strip, c))
		mux.HandleFunc("/", func(w http.ResponseWriter, _ *http.Request) { http.Error(w, "outside the console", http.StatusTeapot) })

		anon := &client{t: t, h: mux, prefix: "/ops"}
		rec := anon.get("/dlq/" + strconv.FormatInt(ids[0], 10))
		require.Equal(t, http.StatusUnauthorized, rec.Code, strip)
		require.Contains(t, rec.Body.String(), `action="../login"`, "the login form posts to /ops/login")
		require.Contains(t, rec.Body.String(), `name="next" value="dlq/`+strconv.FormatInt(ids[0], 10)+`"`)

		rec = anon.do(http.MethodPost, "/login", url.Values{"token": {testToken}, "next": {"dlq"}})
		require.Equal(t, http.StatusSeeOther, rec.Code, strip)
		browser := &client{t: t, h: mux, prefix: "/ops", cookie: rec.Result().Cookies()[0]}
		body := browser.follow(rec, "/login")
		require.Contains(t, body, `id="dlq-table"`)

		body = browser.page("/", http.StatusOK)
		require.Contains(t, body, `href="./dlq"`)
		require.Contains(t, body, `href="./static/console.css"`)
		body = browser.page("/dlq/"+strconv.FormatInt(ids[0], 10), http.StatusOK)
		require.Contains(t, body, `href="../dlq"`)
		require.Contains(t, body, `action="../dlq/confirm"`)
		require.Contains(t, body, `href="../static/console.css"`)
		require.Equal(t, http.StatusOK, browser.get("/static/console.js").Code)
	}

	mux := http.NewServeMux()
	mux.Handle("/ops/", http.StripPrefix("/ops", c))
	cl := &client{t: t, h: mux, prefix: "/ops", bearer: testToken}
	summary, next := cl.confirm(url.Values{"action": {"purge"}, "scope": {"group"}, "group": {"order <n> not found"}})
	require.Equal(t, "Purge 2 entries: they are deleted for good, never delivered again.", summary)
	body := cl.follow(cl.post("/dlq/confirm", next), "/dlq/confirm")
	require.Equal(t, "ok: Purged 2 entries.", flashOf(body))
	require.Empty(t, f.ids())
}

// TestEscaping: what the tables hold is text, never markup.
func TestEscaping(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	const evil = `<script>alert(1)</script>`
	m := f.deadLetter(evil, evil, evil, []byte(evil))
	m.Metadata.Set(evil, evil)
	ids := f.seed(m)
	_, err := f.pool.Exec(context.Background(), `INSERT INTO `+f.table("inbox")+` (consumer, key, status, result, expires_at)
VALUES ($1, $1, 'failed', $2, now() + interval '1 day')`, evil, []byte(evil))
	require.NoError(t, err)
	_, err = f.pool.Exec(context.Background(), `INSERT INTO `+f.table("inbox_failures")+` (consumer, key, last_error)
VALUES ($1, $1, $1)`, evil)
	require.NoError(t, err)

	cl := bearer(t, f.console(nil))
	for _, path := range []string{
		"/", "/dlq", "/dlq?error=" + url.QueryEscape(evil), "/dlq/" + strconv.FormatInt(ids[0], 10),
		"/inbox?" + url.Values{"consumer": {evil}, "key": {evil}}.Encode(),
		"/inbox?" + url.Values{"consumer": {evil}, "key": {"missing" + evil}}.Encode(),
	} {
		rec := cl.get(path)
		require.Less(t, rec.Code, 500, path)
		body := rec.Body.String()
		require.NotContains(t, body, evil, path)
		require.NotContains(t, body, "<script>alert", path)
		require.Contains(t, body, "&lt;script&gt;alert(1)&lt;/script&gt;", path)
	}
	_, next := cl.confirm(url.Values{"action": {"replay-consumer"}, "scope": {"entry"}, "id": {strconv.FormatInt(ids[0], 10)}})
	body := cl.post("/dlq/confirm", next)
	require.Equal(t, http.StatusSeeOther, body.Code)
	rec := cl.post("/dlq/confirm", url.Values{"action": {"purge"}, "scope": {"filter"}, "topic": {evil}})
	require.NotContains(t, rec.Body.String(), evil)
}
