package amqp

import "github.com/oncemill/oncemill/internal/redact"

// redactErr returns err with rawURL, and each of its credentials, removed
// from its text (see redact.Error); errors.Is and errors.As still see the
// cause.
func redactErr(err error, rawURL string) error { return redact.Error(err, rawURL) }

// scrub removes rawURL, and each of its credentials, from s.
func scrub(s, rawURL string) string { return redact.Text(s, rawURL) }
