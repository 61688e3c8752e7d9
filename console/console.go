package console

import (
	"bytes"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"database/sql"
	"embed"
	"errors"
	"fmt"
	"html/template"
	"io/fs"
	"net/http"
	"slices"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/oncemill/oncemill/adapters"
	"github.com/oncemill/oncemill/dlq"
	"github.com/oncemill/oncemill/internal/sqldb"
	"github.com/oncemill/oncemill/reconcile"
	"github.com/oncemill/oncemill/retry"
	"github.com/oncemill/oncemill/sqlschema"
)

//go:embed templates/*.html
var templateFiles embed.FS

//go:embed static/*
var staticFiles embed.FS

// ErrInvalidConfig is returned, wrapped, by [Config.Validate] and [New] for
// a Config that is missing a field or has one out of range; the message
// names the field.
var ErrInvalidConfig = errors.New("console: invalid config")

const (
	defaultPageSize   = 50
	maxPageSize       = 1000
	defaultMaxPayload = 64 << 10
	maxMaxPayload     = 16 << 20
	// maxAction is the most entries one replay or purge acts on; a larger
	// selection is acted on in turns, oldest first.
	maxAction = 10000
	// maxForm bounds the body of a POST.
	maxForm = 1 << 20
	// groupsShown is how many error groups the dead-letter page lists.
	groupsShown = 25
	// topGroups is how many error groups the overview lists.
	topGroups = 10
	// maxErrorShown is the most characters of an error an entry's page
	// shows, and maxErrorListed the most a list row holds (in its title).
	maxErrorShown  = 64 << 10
	maxErrorListed = 1000
	// maxConsumers is the most consumers the inbox lookup offers.
	maxConsumers = 1000
)

// MinTokenLength is the shortest Config.Token that New accepts, and
// the command's --token.
const MinTokenLength = 16

// Config configures New. Pool or DB is required.
type Config struct {
	// Pool is the PostgreSQL database of the tables, through pgx. Set
	// either Pool or DB. It stays the caller's.
	Pool *pgxpool.Pool
	// DB is the database of the tables through database/sql, with
	// Dialect naming its family, on the tables sqlschema.MigrateSQL
	// creates for it: PostgreSQL (pgx's stdlib or lib/pq), MySQL 8.0 or
	// newer and MariaDB 10.6 or newer (go-sql-driver/mysql), or SQLite
	// (modernc.org/sqlite). Set either Pool or DB. It stays the caller's.
	DB *sql.DB
	// Dialect is the database family of DB: sqlschema.Postgres,
	// sqlschema.MySQL or sqlschema.SQLite. Required with DB, ignored with
	// Pool.
	Dialect sqlschema.Dialect
	// Schema names the tables to read (defaults as sqlschema's): the
	// inbox, the outbox, the dead-letter table and the table of parked
	// messages (RetryTable), whose cancelled messages move to the
	// dead-letter table.
	Schema sqlschema.Config
	// Token is the secret every request must carry: "Authorization: Bearer
	// <token>", or the cookie set by the login form at /login. Required
	// unless DisableAuth, at least 16 characters; ignored with it. Use a
	// long random value (32 bytes from a CSPRNG, say).
	Token string
	// DisableAuth serves every request without the token, for mounting
	// behind the caller's own auth. POSTs still need the CSRF field and a
	// same-origin Origin.
	DisableAuth bool
	// ReadOnly refuses every mutation (replay, purge, retry now, cancel)
	// with 403 and hides their buttons.
	ReadOnly bool
	// Publisher, when set, lets an operator also replay entries to their
	// original topic (every consumer group of it receives them), as
	// `oncemill dlq replay --broker` does; give it a durable broker, the
	// one the consumers read from: one that lives inside this process is
	// refused (adapters.CheckDurable). Without it, replay is only to the
	// entry's consumer (dlq.Store.RequestReplay), which that consumer's
	// dlq.ReplaySubscriber delivers.
	Publisher message.Publisher
	// Granter writes the replay grants of replays to the topic on the
	// consumers' dead keys (see dlq.Granter); set it to the consumers'
	// inbox store when that is not the inbox table of Schema (Redis,
	// SQLite, another schema). Defaults to the inbox table of Schema.
	Granter dlq.Granter
	// Reconcile are the checks the overview runs, on every load, one
	// after the other: what each consumer misses of the events the relay
	// published, by its ledger (package reconcile, as `oncemill reconcile`
	// runs it). A check's Ledger defaults to this database and Schema, and
	// its Limit to 10, the events the overview lists. A check reads its
	// window of the ledger a page at a time: keep Since short on a busy
	// ledger. Defaults to none.
	Reconcile []reconcile.Config
	// PageSize is the dead letters per page; default 50, at most 1000.
	PageSize int
	// MaxPayload caps the payload (and stored result) bytes shown on an
	// entry's (a key's) page, and read from the database; default 64 KiB,
	// at most 16 MiB.
	MaxPayload int
	// Logger receives the failures behind a 500 and, at Info, every
	// replay, purge and failed login. Defaults to watermill.NopLogger.
	Logger watermill.LoggerAdapter
	// Now returns the time (tests); default time.Now.
	Now func() time.Time
}

// Validate reports the first field of c that is missing or out of range;
// the error wraps [ErrInvalidConfig] and names the field.
func (c Config) Validate() error {
	if _, err := sqldb.FromConfig("", c.Pool, c.DB, c.Dialect); err != nil {
		return fmt.Errorf("%w: %w", ErrInvalidConfig, err)
	}
	switch {
	case c.Token == "" && !c.DisableAuth:
		return fmt.Errorf("%w: Token is required (or set DisableAuth to serve behind your own authentication)", ErrInvalidConfig)
	case len(c.Token) < MinTokenLength && !c.DisableAuth:
		return fmt.Errorf("%w: Token must be at least %d characters, got %d: use a long random value (32 bytes from a CSPRNG, say)", ErrInvalidConfig, MinTokenLength, len(c.Token))
	case c.PageSize < 0 || c.PageSize > maxPageSize:
		return fmt.Errorf("%w: PageSize must be 0 (default %d) to %d, got %d", ErrInvalidConfig, defaultPageSize, maxPageSize, c.PageSize)
	case c.MaxPayload < 0 || c.MaxPayload > maxMaxPayload:
		return fmt.Errorf("%w: MaxPayload must be 0 (default %d) to %d bytes, got %d", ErrInvalidConfig, defaultMaxPayload, maxMaxPayload, c.MaxPayload)
	}
	if c.Publisher != nil {
		if err := adapters.CheckDurable(c.Publisher); err != nil {
			return fmt.Errorf("%w: Publisher would lose the entries it replays, which are deleted once published: %w", ErrInvalidConfig, err)
		}
	}
	if err := c.Schema.WithDefaults().Validate(); err != nil {
		return fmt.Errorf("%w: Schema: %w", ErrInvalidConfig, err)
	}
	for i, rc := range c.Reconcile {
		if err := c.reconcileCheck(rc).Validate(); err != nil {
			return fmt.Errorf("%w: Reconcile[%d]: %w", ErrInvalidConfig, i, err)
		}
	}
	return nil
}

// Console is the operator console: an http.Handler serving the overview,
// the dead letters, the inbox lookup and the login form. It is safe for
// concurrent use and starts no goroutines; it keeps no state between
// requests but its keys.
type Console struct {
	cfg Config
	// db is the database of the tables, names their names in its dialect.
	db    sqldb.DB
	names sqlschema.Names
	// dlq is the dead-letter table: its counts, copies and every action.
	dlq *dlq.Store
	// retryStore is the table of parked messages; deadPublisher writes
	// the dead letters of those an operator cancels, in the dead-letter
	// table of the same database.
	retryStore    *retry.Store
	deadPublisher *dlq.Publisher
	pages         map[string]*template.Template
	static        http.Handler
	cross         *http.CrossOriginProtection

	// tokenHash is the SHA-256 of the token, compared in constant time.
	tokenHash [sha256.Size]byte
	// sessionKey signs session cookies; derived from the token, so that
	// a cookie outlives a restart and works on every replica, and dies
	// with the token.
	sessionKey []byte
	// csrfKey binds CSRF tokens to sessions and signs flash messages;
	// random, this Console's own.
	csrfKey []byte
}

var _ http.Handler = (*Console)(nil)

// pageNames are the templates, each parsed with the layout.
var pageNames = []string{"overview", "dlq", "entry", "confirm", "retries", "retries-confirm", "inbox", "login", "error"}

// New returns a console on cfg's tables. cfg is copied, defaulted and
// validated; nothing is read from the database until a request comes.
func New(cfg Config) (*Console, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg.Schema = cfg.Schema.WithDefaults()
	if cfg.PageSize == 0 {
		cfg.PageSize = defaultPageSize
	}
	if cfg.MaxPayload == 0 {
		cfg.MaxPayload = defaultMaxPayload
	}
	if cfg.Logger == nil {
		cfg.Logger = watermill.NopLogger{}
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	if cfg.DisableAuth {
		cfg.Token = ""
	}
	checks := make([]reconcile.Config, len(cfg.Reconcile))
	for i, rc := range cfg.Reconcile {
		checks[i] = cfg.reconcileCheck(rc)
	}
	cfg.Reconcile = checks
	db, _ := sqldb.FromConfig("", cfg.Pool, cfg.DB, cfg.Dialect) // Validate checked it
	c := &Console{
		cfg:   cfg,
		db:    db,
		names: db.Dialect().Names(cfg.Schema),
		pages: map[string]*template.Template{},
		cross: http.NewCrossOriginProtection(),
	}
	c.csrfKey = make([]byte, 32)
	if _, err := rand.Read(c.csrfKey); err != nil {
		return nil, fmt.Errorf("console: random key: %w", err)
	}
	if cfg.Token != "" {
		c.tokenHash = sha256.Sum256([]byte(cfg.Token))
		mac := hmac.New(sha256.New, []byte(cfg.Token))
		mac.Write([]byte("oncemill console session key v1"))
		c.sessionKey = mac.Sum(nil)
	}
	funcs := c.funcs()
	for _, name := range pageNames {
		t, err := template.New(name).Funcs(funcs).ParseFS(templateFiles, "templates/layout.html", "templates/"+name+".html")
		if err != nil {
			return nil, fmt.Errorf("console: parse template %s: %w", name, err)
		}
		c.pages[name] = t
	}
	static, err := fs.Sub(staticFiles, "static")
	if err != nil {
		return nil, fmt.Errorf("console: static files: %w", err)
	}
	c.static = http.StripPrefix("/static/", http.FileServerFS(static))
	if cfg.DB != nil {
		c.dlq, err = dlq.NewSQLStore(cfg.DB, cfg.Dialect, cfg.Schema)
		if err == nil {
			c.retryStore, err = retry.NewSQLStore(cfg.DB, cfg.Dialect, cfg.Schema)
		}
		if err == nil {
			c.deadPublisher, err = dlq.NewSQLPublisher(cfg.DB, cfg.Dialect, cfg.Schema)
		}
	} else {
		c.dlq, err = dlq.NewStore(cfg.Pool, cfg.Schema)
		if err == nil {
			c.retryStore, err = retry.NewStore(cfg.Pool, cfg.Schema)
		}
		if err == nil {
			c.deadPublisher, err = dlq.NewPublisher(cfg.Pool, cfg.Schema)
		}
	}
	if err == nil && cfg.Granter != nil {
		c.dlq, err = c.dlq.WithGranter(cfg.Granter)
	}
	if err != nil {
		return nil, fmt.Errorf("console: %w", err)
	}
	return c, nil
}

// ServeHTTP serves the console. Every request but /login and /static/
// needs the token (Authorization: Bearer, or the login cookie); every POST
// needs the CSRF field and must not come from another origin.
func (c *Console) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	h := w.Header()
	h.Set("Content-Security-Policy", "default-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'")
	h.Set("X-Content-Type-Options", "nosniff")
	h.Set("X-Frame-Options", "DENY")
	h.Set("Referrer-Policy", "same-origin")
	if !strings.HasPrefix(r.URL.Path, "/") {
		// Mounted with http.StripPrefix("/ops/", …): the rest has no
		// leading slash.
		r2 := *r
		u := *r.URL
		u.Path = "/" + u.Path
		if u.RawPath != "" {
			u.RawPath = "/" + u.RawPath
		}
		r2.URL = &u
		r = &r2
	}
	path := r.URL.Path

	if strings.HasPrefix(path, "/static/") {
		if r.Method != http.MethodGet && r.Method != http.MethodHead {
			c.notAllowed(w, r, "GET, HEAD")
			return
		}
		if strings.HasSuffix(path, "/") {
			c.fail(w, r, http.StatusNotFound, "No such file.")
			return
		}
		h.Set("Cache-Control", "max-age=300")
		c.static.ServeHTTP(w, r)
		return
	}
	if r.Method == http.MethodPost {
		r.Body = http.MaxBytesReader(w, r.Body, maxForm)
		if err := c.sameOrigin(r); err != nil {
			c.fail(w, r, http.StatusForbidden, "Refused: "+err.Error()+".")
			return
		}
		// Read now, so that a body over the limit is said as such, not
		// as the CSRF field it cut off. Other errors keep what parsed,
		// as the handlers' PostFormValue would.
		var tooLarge *http.MaxBytesError
		if err := r.ParseForm(); errors.As(err, &tooLarge) {
			c.fail(w, r, http.StatusRequestEntityTooLarge, "Refused: form too large (limit 1 MiB).")
			return
		}
	}
	if path == "/login" {
		switch r.Method {
		case http.MethodGet, http.MethodHead:
			c.loginPage(w, r, http.StatusOK, "")
		case http.MethodPost:
			c.login(w, r)
		default:
			c.notAllowed(w, r, "GET, HEAD, POST")
		}
		return
	}
	sess, ok := c.session(w, r)
	if !ok {
		c.unauthorized(w, r)
		return
	}
	if r.Method == http.MethodPost && !c.validCSRF(r, sess) {
		c.fail(w, r, http.StatusForbidden, "Refused: the form's CSRF token is missing or does not belong to this session. Reload the page and try again.")
		return
	}
	r = r.WithContext(withSession(r.Context(), sess))
	h.Set("X-CSRF-Token", c.csrfToken(sess))
	h.Set("Cache-Control", "no-store")
	c.route(w, r)
}

// route dispatches an authenticated request: each page with the methods
// it takes.
func (c *Console) route(w http.ResponseWriter, r *http.Request) {
	const get, post = "GET, HEAD", "POST"
	var (
		path  = r.URL.Path
		allow string
		serve func()
	)
	switch {
	case path == "/":
		allow, serve = get, func() { c.overview(w, r) }
	case path == "/dlq":
		allow, serve = get, func() { c.deadLetters(w, r) }
	case path == "/dlq/confirm":
		allow, serve = post, func() { c.confirm(w, r) }
	case strings.HasPrefix(path, "/dlq/") && !strings.Contains(path[len("/dlq/"):], "/"):
		allow, serve = get, func() { c.entry(w, r, path[len("/dlq/"):]) }
	case path == "/retries":
		allow, serve = get, func() { c.retries(w, r) }
	case path == "/retries/confirm":
		allow, serve = post, func() { c.retryConfirm(w, r) }
	case path == "/inbox":
		allow, serve = get, func() { c.inbox(w, r) }
	case path == "/logout":
		allow, serve = post, func() { c.logout(w, r) }
	default:
		c.fail(w, r, http.StatusNotFound, "No such page.")
		return
	}
	if !slices.Contains(strings.Split(allow, ", "), r.Method) {
		c.notAllowed(w, r, allow)
		return
	}
	serve()
}

// page is what every template gets.
type page struct {
	// Title is the page's title, Nav the active item of the top nav.
	Title, Nav string
	// Base leads from the page to the console's root: "./" or "../",
	// so that every link is relative and the console works under any
	// prefix.
	Base string
	// CSRF is the session's CSRF token, for every form that posts.
	CSRF string
	// Authed is true for an authenticated page (the nav is shown),
	// CanLogout when the session is the login cookie.
	Authed, CanLogout bool
	// ReadOnly hides the buttons that change entries; CanReplayTopic is
	// true when a Publisher is configured.
	ReadOnly, CanReplayTopic bool
	// Flash is the message of the last action, if any.
	Flash *flash
	// Data is the page's own.
	Data any
}

// newPage returns the page frame for r.
func (c *Console) newPage(r *http.Request, title, nav string, data any) page {
	p := page{
		Title: title, Nav: nav, Base: base(r.URL.Path),
		ReadOnly: c.cfg.ReadOnly, CanReplayTopic: c.cfg.Publisher != nil && !c.cfg.ReadOnly,
		Data: data,
	}
	if sess, ok := sessionFrom(r.Context()); ok {
		p.Authed = true
		p.CanLogout = sess.cookie
		p.CSRF = c.csrfToken(sess)
	}
	return p
}

// base returns the relative path from path to the console's root.
func base(path string) string {
	n := strings.Count(strings.TrimPrefix(path, "/"), "/")
	if n == 0 {
		return "./"
	}
	return strings.Repeat("../", n)
}

// render writes the page name with status; a template that fails is a
// 500, with nothing of the page sent.
func (c *Console) render(w http.ResponseWriter, r *http.Request, status int, name string, p page) {
	var b bytes.Buffer
	if err := c.pages[name].ExecuteTemplate(&b, "layout", p); err != nil {
		c.cfg.Logger.Error("Console page failed", err, watermill.LogFields{"page": name})
		http.Error(w, "500 internal error: the page failed to render", http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	w.WriteHeader(status)
	if r.Method != http.MethodHead {
		w.Write(b.Bytes()) //nolint:errcheck // the client went away
	}
}

// errorData is the error page's.
type errorData struct {
	Status  int
	Message string
}

// fail renders the error page with status and message.
func (c *Console) fail(w http.ResponseWriter, r *http.Request, status int, msg string) {
	c.render(w, r, status, "error", c.newPage(r, http.StatusText(status), "", errorData{Status: status, Message: msg}))
}

// notAllowed answers 405 for a method that path does not take.
func (c *Console) notAllowed(w http.ResponseWriter, r *http.Request, allow string) {
	w.Header().Set("Allow", allow)
	c.fail(w, r, http.StatusMethodNotAllowed, "This page takes "+allow+".")
}

// internal logs err and renders a 500 that names what failed.
func (c *Console) internal(w http.ResponseWriter, r *http.Request, what string, err error) {
	c.cfg.Logger.Error("Console request failed", err, watermill.LogFields{"path": r.URL.Path, "what": what})
	c.fail(w, r, http.StatusInternalServerError, what+": "+err.Error())
}

// seeOther redirects to the relative URL to, which browsers resolve
// against the URL they asked for, prefix included (http.Redirect would
// make it absolute from the path the prefix was stripped from).
func seeOther(w http.ResponseWriter, to string) {
	w.Header().Set("Location", to)
	w.WriteHeader(http.StatusSeeOther)
}
