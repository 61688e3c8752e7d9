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

// redactErr returns err with every occurrence of rawURL and of its password
// removed from its text.
func redactErr(err error, rawURL string) error {
	if err == nil {
		return nil
	}
	return &redacted{msg: scrub(err.Error(), rawURL), err: err}
}

// scrub removes rawURL, and the password it contains in raw and decoded
// form, from s.
func scrub(s, rawURL string) string {
	if rawURL == "" {
		return s
	}
	s = strings.ReplaceAll(s, rawURL, redactURL(rawURL))
	if u, err := url.Parse(rawURL); err == nil && u.User != nil {
		if pw, ok := u.User.Password(); ok && pw != "" {
			s = strings.ReplaceAll(s, pw, "xxxxx")
			if esc := url.PathEscape(pw); esc != pw {
				s = strings.ReplaceAll(s, esc, "xxxxx")
			}
		}
	}
	return s
}
