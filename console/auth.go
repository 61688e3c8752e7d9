package console

import (
	"context"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/base64"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill"
)

const (
	// sessionCookie holds a login: "v1.<issued, unix seconds>.<MAC>".
	sessionCookie = "oncemill_console_session"
	// anonCookie holds a random value that CSRF tokens are bound to when
	// DisableAuth leaves no session of the console's own.
	anonCookie = "oncemill_console_csrf"
	// sessionTTL is how long a login lasts.
	sessionTTL = 12 * time.Hour
	// clockSkew is how far in the future a cookie's issue time may be.
	clockSkew = time.Minute
)

// session is who a request is, as far as CSRF tokens go.
type session struct {
	// id is what the request's CSRF token is bound to: the cookie's
	// value, "bearer", or the anonymous cookie's value.
	id string
	// cookie is true for a login cookie (logout makes sense).
	cookie bool
}

type sessionKey struct{}

func withSession(ctx context.Context, s session) context.Context {
	return context.WithValue(ctx, sessionKey{}, s)
}

func sessionFrom(ctx context.Context) (session, bool) {
	s, ok := ctx.Value(sessionKey{}).(session)
	return s, ok
}

// session authenticates r. A Bearer header is the whole answer: a wrong
// one does not fall back to the cookie. With DisableAuth every request is
// let in, and gets an anonymous cookie for its CSRF tokens when it has
// none.
func (c *Console) session(w http.ResponseWriter, r *http.Request) (session, bool) {
	if c.cfg.DisableAuth {
		if ck, err := r.Cookie(anonCookie); err == nil && len(ck.Value) >= 16 {
			return session{id: "anon." + ck.Value}, true
		}
		var b [18]byte
		if _, err := rand.Read(b[:]); err != nil {
			return session{}, false
		}
		v := base64.RawURLEncoding.EncodeToString(b[:])
		// Path=/: the console cannot know its prefix behind a proxy,
		// and the value is no secret of its own, only a binding.
		http.SetCookie(w, &http.Cookie{Name: anonCookie, Value: v, Path: "/", HttpOnly: true,
			SameSite: http.SameSiteStrictMode, Secure: isTLS(r)})
		return session{id: "anon." + v}, true
	}
	if h := r.Header.Get("Authorization"); h != "" {
		scheme, tok, ok := strings.Cut(h, " ")
		if ok && strings.EqualFold(scheme, "Bearer") && c.tokenMatches(strings.TrimSpace(tok)) {
			return session{id: "bearer"}, true
		}
		return session{}, false
	}
	if ck, err := r.Cookie(sessionCookie); err == nil && c.validSessionCookie(ck.Value) {
		return session{id: "cookie." + ck.Value, cookie: true}, true
	}
	return session{}, false
}

// tokenMatches compares tok with the token in constant time (of their
// hashes, so that not even the length shows).
func (c *Console) tokenMatches(tok string) bool {
	h := sha256.Sum256([]byte(tok))
	return subtle.ConstantTimeCompare(h[:], c.tokenHash[:]) == 1
}

// sessionMAC is the MAC of a session cookie issued at unix second issued.
func (c *Console) sessionMAC(issued int64) string {
	mac := hmac.New(sha256.New, c.sessionKey)
	fmt.Fprintf(mac, "oncemill console session|%d", issued)
	return base64.RawURLEncoding.EncodeToString(mac.Sum(nil))
}

// newSessionCookie returns the value of a cookie issued now.
func (c *Console) newSessionCookie() string {
	issued := c.cfg.Now().Unix()
	return "v1." + strconv.FormatInt(issued, 10) + "." + c.sessionMAC(issued)
}

// validSessionCookie checks v's MAC, in constant time, and its age.
func (c *Console) validSessionCookie(v string) bool {
	parts := strings.Split(v, ".")
	if len(parts) != 3 || parts[0] != "v1" {
		return false
	}
	issued, err := strconv.ParseInt(parts[1], 10, 64)
	if err != nil {
		return false
	}
	if !hmac.Equal([]byte(parts[2]), []byte(c.sessionMAC(issued))) {
		return false
	}
	at := time.Unix(issued, 0)
	now := c.cfg.Now()
	return !at.After(now.Add(clockSkew)) && now.Sub(at) < sessionTTL
}

// csrfToken is the CSRF token of s: a MAC of its id under this Console's
// random key.
func (c *Console) csrfToken(s session) string {
	mac := hmac.New(sha256.New, c.csrfKey)
	mac.Write([]byte("csrf|" + s.id))
	return base64.RawURLEncoding.EncodeToString(mac.Sum(nil))
}

// validCSRF checks the POST's CSRF token (form field csrf, or the
// X-CSRF-Token header) against s, in constant time.
func (c *Console) validCSRF(r *http.Request, s session) bool {
	got := r.Header.Get("X-CSRF-Token")
	if got == "" {
		got = r.PostFormValue("csrf")
	}
	return got != "" && hmac.Equal([]byte(got), []byte(c.csrfToken(s)))
}

// sameOrigin refuses a request that a browser sent from another origin:
// Sec-Fetch-Site or Origin (http.CrossOriginProtection), else a Referer of
// another host.
func (c *Console) sameOrigin(r *http.Request) error {
	if err := c.cross.Check(r); err != nil {
		return errors.New("the request comes from another origin")
	}
	if r.Header.Get("Sec-Fetch-Site") != "" || r.Header.Get("Origin") != "" {
		return nil
	}
	if ref := r.Header.Get("Referer"); ref != "" {
		u, err := url.Parse(ref)
		if err != nil || u.Host != r.Host {
			return errors.New("the request's Referer is another host")
		}
	}
	return nil
}

// isTLS reports whether the browser reached r over HTTPS, directly or
// through a proxy that says so.
func isTLS(r *http.Request) bool {
	return r.TLS != nil || strings.EqualFold(r.Header.Get("X-Forwarded-Proto"), "https")
}

// loginData is the login page's.
type loginData struct {
	Next, Error string
}

// unauthorized answers a request without a valid token: the console's
// root, asked for with no credential at all (someone opening the
// console's address, whatever their client accepts), is sent to the login
// page; any other request gets 401, with the login form for a browser's
// page, so that it can come back to the page it asked for.
func (c *Console) unauthorized(w http.ResponseWriter, r *http.Request) {
	if r.URL.Path == "/" && (r.Method == http.MethodGet || r.Method == http.MethodHead) &&
		r.Header.Get("Authorization") == "" && !hasCookie(r, sessionCookie) {
		w.Header().Set("Cache-Control", "no-store")
		seeOther(w, "login")
		return
	}
	w.Header().Set("WWW-Authenticate", `Bearer realm="oncemill console"`)
	w.Header().Set("Cache-Control", "no-store")
	if (r.Method == http.MethodGet || r.Method == http.MethodHead) && strings.Contains(r.Header.Get("Accept"), "text/html") {
		next := strings.TrimPrefix(r.URL.Path, "/")
		if r.URL.RawQuery != "" {
			next += "?" + r.URL.RawQuery
		}
		c.render(w, r, http.StatusUnauthorized, "login", c.newPage(r, "Log in", "", loginData{Next: next}))
		return
	}
	msg := "Log in with the console's token: send Authorization: Bearer <token>, or use the form at login."
	if r.Header.Get("Authorization") != "" {
		msg = "The token is wrong."
	}
	c.fail(w, r, http.StatusUnauthorized, msg)
}

// hasCookie reports whether r carries a cookie called name.
func hasCookie(r *http.Request, name string) bool {
	_, err := r.Cookie(name)
	return err == nil
}

// loginPage renders the login form; with DisableAuth there is nothing to
// log in to, and it leads to the overview.
func (c *Console) loginPage(w http.ResponseWriter, r *http.Request, status int, msg string) {
	if c.cfg.DisableAuth {
		seeOther(w, "./")
		return
	}
	w.Header().Set("Cache-Control", "no-store")
	next := r.FormValue("next")
	if _, ok := localNext(next); !ok {
		next = ""
	}
	c.render(w, r, status, "login", c.newPage(r, "Log in", "", loginData{Next: next, Error: msg}))
}

// login checks the form's token and sets the session cookie: its value is
// a MAC, not the token, and it expires after 12 hours.
func (c *Console) login(w http.ResponseWriter, r *http.Request) {
	if c.cfg.DisableAuth {
		seeOther(w, "./")
		return
	}
	tok := r.PostFormValue("token")
	if tok == "" || !c.tokenMatches(tok) {
		c.cfg.Logger.Info("Console login failed", watermill.LogFields{"remote": r.RemoteAddr})
		c.loginPage(w, r, http.StatusUnauthorized, "That is not the console's token.")
		return
	}
	// No Path: the cookie's path is the directory of /login, which is
	// the console's root under any prefix.
	http.SetCookie(w, &http.Cookie{Name: sessionCookie, Value: c.newSessionCookie(), HttpOnly: true,
		SameSite: http.SameSiteStrictMode, Secure: isTLS(r), MaxAge: int(sessionTTL / time.Second)})
	to := "./"
	if next, ok := localNext(r.PostFormValue("next")); ok {
		to = "./" + next
	}
	seeOther(w, to)
}

// localNext returns next if it is a path inside the console, relative to
// its root: no scheme, no host, no leading slash or backslash.
func localNext(next string) (string, bool) {
	if next == "" || strings.ContainsAny(next, "\\\r\n") || strings.HasPrefix(next, "/") {
		return "", false
	}
	u, err := url.Parse(next)
	if err != nil || u.Scheme != "" || u.Host != "" || u.User != nil || u.Opaque != "" || strings.HasPrefix(u.Path, ".") {
		return "", false
	}
	return u.String(), true
}

// logout clears the session cookie. The cookie is a bearer credential
// until it expires: logout makes the browser forget it, and changing the
// token revokes every cookie at once.
func (c *Console) logout(w http.ResponseWriter, r *http.Request) {
	http.SetCookie(w, &http.Cookie{Name: sessionCookie, Value: "", HttpOnly: true,
		SameSite: http.SameSiteStrictMode, Secure: isTLS(r), MaxAge: -1})
	seeOther(w, "login")
}

// flash is the message an action leaves for the page it redirects to.
type flash struct {
	// OK is false for a failure.
	OK   bool
	Text string
}

// flashMAC signs a flash message, so that a link cannot make the console
// say what it did not do.
func (c *Console) flashMAC(f flash) string {
	mac := hmac.New(sha256.New, c.csrfKey)
	fmt.Fprintf(mac, "flash|%t|%s", f.OK, f.Text)
	return base64.RawURLEncoding.EncodeToString(mac.Sum(nil)[:16])
}

// setFlash adds f to the query q of a redirect.
func (c *Console) setFlash(q url.Values, f flash) {
	q.Set("flash", f.Text)
	if f.OK {
		q.Set("flash_ok", "1")
	}
	q.Set("flash_sig", c.flashMAC(f))
}

// flashOf returns the flash of r's query, if it carries one signed by this
// Console.
func (c *Console) flashOf(r *http.Request) *flash {
	q := r.URL.Query()
	f := flash{Text: q.Get("flash"), OK: q.Get("flash_ok") == "1"}
	if f.Text == "" || !hmac.Equal([]byte(q.Get("flash_sig")), []byte(c.flashMAC(f))) {
		return nil
	}
	return &f
}
