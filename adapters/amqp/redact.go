package amqp

import (
	"net/url"
	"strings"
)

// redacted is an error whose text has the broker URL's password removed.
// Unwrap returns the original error, so errors.Is and errors.As still see
// the cause; callers that print only the returned error never see the
// password.
type redacted struct {
	msg string
	err error
}

func (e *redacted) Error() string { return e.msg }
func (e *redacted) Unwrap() error { return e.err }

// redactErr returns err with every occurrence of rawURL and of its user
// info removed from its text.
func redactErr(err error, rawURL string) error {
	if err == nil {
		return nil
	}
	return &redacted{msg: scrub(err.Error(), rawURL), err: err}
}

// scrub removes rawURL, and its user info (user name and password) in the
// spellings a client may quote it (as written, re-escaped, and decoded),
// from s. Only the user info followed by its '@' is replaced, never the
// password's text alone, which may be a common word or a single letter.
func scrub(s, rawURL string) string {
	if rawURL == "" {
		return s
	}
	s = strings.ReplaceAll(s, rawURL, redactURL(rawURL))
	u, err := url.Parse(rawURL)
	if err != nil || u.User == nil {
		return s
	}
	pw, ok := u.User.Password()
	if !ok {
		return s
	}
	safe := url.UserPassword(u.User.Username(), "xxxxx").String() + "@"
	forms := []string{u.User.String() + "@", u.User.Username() + ":" + pw + "@"}
	if _, rest, ok := strings.Cut(rawURL, "://"); ok {
		if end := strings.IndexAny(rest, "/?#"); end >= 0 {
			rest = rest[:end]
		}
		if at := strings.LastIndex(rest, "@"); at >= 0 {
			forms = append(forms, rest[:at+1])
		}
	}
	for _, f := range forms {
		s = strings.ReplaceAll(s, f, safe)
	}
	return s
}
