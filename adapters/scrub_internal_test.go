package adapters

import (
	"context"
	"errors"
	"net/url"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/adapters/internal/brokerurl"
)

func mustParse(t *testing.T, raw string) *url.URL {
	u, err := url.Parse(raw)
	require.NoError(t, err, raw)
	return u
}

// TestScrubKeepsPasswordText checks that scrubbing replaces the user info,
// in each spelling a driver may quote it, and leaves alone the password's
// text elsewhere: with the password "e", the rest of the message is kept
// letter for letter.
func TestScrubKeepsPasswordText(t *testing.T) {
	for _, tc := range []struct{ raw, quoted, want string }{
		{
			raw:    "postgres://oncemill:e@db.example:5432/test",
			quoted: "server error: password authentication failed for user oncemill (postgres://oncemill:e@db.example:5432/test)",
			want:   "server error: password authentication failed for user oncemill (postgres://oncemill:xxxxx@db.example:5432/test)",
		},
		{
			// As written, re-escaped, and decoded.
			raw:    "amqp://guest:p%40ss%2Fe@rabbit:5672/",
			quoted: "dial amqp://guest:p%40ss%2Fe@rabbit:5672/, then guest:p%40ss%2Fe@rabbit, then guest:p@ss/e@rabbit: the end",
			want:   "dial amqp://guest:xxxxx@rabbit:5672/, then guest:xxxxx@rabbit, then guest:xxxxx@rabbit: the end",
		},
		{
			raw:    "sqs://KEY:e@us-east-1",
			quoted: "the request was refused",
			want:   "the request was refused",
		},
	} {
		u := mustParse(t, tc.raw)
		cause := errors.New(tc.quoted)
		err := scrub(cause, tc.raw, u)
		require.Equal(t, tc.want, err.Error())
		require.ErrorIs(t, err, cause, "the driver's error is still wrapped")
	}

	// The same through Open's own message: the redacted URL and the
	// parameter error keep every "e".
	_, err := openGoChannel(context.Background(), mustParse(t, "gochannel://?persistent=yes"), brokerurl.Options{})
	require.Error(t, err)
	msg := scrub(err, "gochannel://u:e@?persistent=yes", mustParse(t, "gochannel://u:e@?persistent=yes")).Error()
	require.Equal(t, err.Error(), msg)
	require.Contains(t, msg, `bad broker URL: parameter persistent="yes" is not a boolean`)
}
