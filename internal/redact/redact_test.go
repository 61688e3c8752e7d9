package redact_test

import (
	"errors"
	"fmt"
	"io"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/internal/redact"
)

// secrets are the texts no redacted form may contain. A user name beside
// a password stays (AKIAKEYID), as url.URL.Redacted leaves it.
var secrets = []string{"hunter2", "s3cr3t", "TOKEN123", "wJalrSECRET", "pwd42", "sessTOKEN", "keyfile-secret", "mystery-value"}

func TestURL(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct{ in, want string }{
		// user info
		{"amqp://guest:hunter2@127.0.0.1:5672/vhost", "amqp://guest:xxxxx@127.0.0.1:5672/vhost"},
		{"nats://TOKEN123@nats.example:4222", "nats://xxxxx@nats.example:4222"},
		{"nats://user:s3cr3t@a:4222", "nats://user:xxxxx@a:4222"},
		{"sqs://AKIAKEYID:wJalrSECRET@us-east-1?create=true", "sqs://AKIAKEYID:xxxxx@us-east-1?create=true"},
		// query secrets, by name and unknown
		{"postgres://app@db:5432/orders?password=hunter2&sslmode=disable", "postgres://xxxxx@db:5432/orders?password=xxxxx&sslmode=disable"},
		{"postgres://db/orders?sslpassword=s3cr3t&pass=pwd42&pwd=pwd42", "postgres://db/orders?sslpassword=xxxxx&pass=xxxxx&pwd=xxxxx"},
		{"sqs://eu-west-1?access_key=AKIAKEYID&secret_access_key=wJalrSECRET&session_token=sessTOKEN", "sqs://eu-west-1?access_key=xxxxx&secret_access_key=xxxxx&session_token=xxxxx"},
		{"kafka://b:9092?group=g&sasl_token=TOKEN123&auth=s3cr3t", "kafka://b:9092?group=g&sasl_token=xxxxx&auth=xxxxx"},
		{"amqp://h/?keyfile=keyfile-secret&heartbeat=10s", "amqp://h/?keyfile=xxxxx&heartbeat=10s"},
		{"kafka://b:9092?grop=mystery-value", "kafka://b:9092?grop=xxxxx"},
		// a URL nested in a value
		{"sqs://us-east-1?endpoint=http://u:hunter2@127.0.0.1:4566&create=true", "sqs://us-east-1?endpoint=http://u:xxxxx@127.0.0.1:4566&create=true"},
		{"sqs://us-east-1?endpoint=http%3A%2F%2Fu%3As3cr3t%40127.0.0.1%3A4566", "sqs://us-east-1?endpoint=http://u:xxxxx@127.0.0.1:4566"},
		{"sqs://us-east-1?endpoint=http://TOKEN123@h", "sqs://us-east-1?endpoint=http://xxxxx@h"},
		// MySQL: URL and DSN
		{"mysql://root:hunter2@127.0.0.1:3306/test?timeout=3s", "mysql://root:xxxxx@127.0.0.1:3306/test?timeout=3s"},
		{"?0://u:hunter2@h?a&b=1", "?0://u:xxxxx@h?a&b=xxxxx"},
		{"?://0:hunter2@0?=&=&0=hunter2", "?://0:xxxxx@0?=xxxxx&=xxxxx&0=xxxxx"},
		{"?://0:hunt&er2@0?0&0=hunter2", "?://0:xxxxx@0?0&0=xxxxx"},
		{"root:hunter2@tcp(127.0.0.1:3306)/test?parseTime=true", "root:xxxxx@tcp(127.0.0.1:3306)/test?parseTime=true"},
		{"root:hunter2@unix(/tmp/mysql.sock)/test", "root:xxxxx@unix(/tmp/mysql.sock)/test"},
		{"mysql:root:hunter2@tcp(h:3306)/test", "mysql:root:xxxxx@tcp(h:3306)/test"},
		// does not parse
		{"postgres://u:hunter2@h:notaport/db", "postgres://u:xxxxx@h:notaport/db"},
		{"amqp://u:hunter2@[::1/x", "amqp://u:xxxxx@[::1/x"},
		// nothing to hide
		{"kafka://b1:9092,b2:9092?group=billing&connect_timeout=5s", "kafka://b1:9092,b2:9092?group=billing&connect_timeout=5s"},
		{"gochannel://?persistent=true", "gochannel://?persistent=true"},
		{"kafka://?group=g", "kafka://?group=g"},
		{"nats://", "nats://"},
		{"sqlite:/var/lib/x.db?table=inbox", "sqlite:/var/lib/x.db?table=inbox"},
		{"127.0.0.1:9092", "127.0.0.1:9092"},
		{"", ""},
	} {
		got := redact.URL(tc.in)
		require.Equal(t, tc.want, got, tc.in)
		for _, s := range secrets {
			require.NotContains(t, got, s, tc.in)
		}
	}
}

// TestError: what a driver quoted of the URL, whole or in part, is
// scrubbed, and the error still unwraps.
func TestError(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct{ raw, quoted string }{
		{"amqp://guest:hunter2@h:5672/", `dial amqp://guest:hunter2@h:5672/: refused`},
		{"amqp://guest:hunter%32@h:5672/", `parse "guest:hunter2@": bad`},
		{"nats://TOKEN123@h:4222", `nats: auth failed for TOKEN123@h:4222`},
		{"postgres://h/db?password=hunter2", `cannot parse "password=hunter2"`},
		{"sqs://us-east-1?endpoint=http://u:s3cr3t@h:4566", `Post "http://u:s3cr3t@h:4566/": refused`},
		{"root:hunter2@tcp(h:3306)/db", `Error 1045: Access denied for root:hunter2@tcp(h:3306)/db`},
	} {
		err := redact.Error(fmt.Errorf("open: %w", io.EOF), tc.raw)
		require.ErrorIs(t, err, io.EOF)
		err = redact.Error(fmt.Errorf("%s: %w", tc.quoted, io.EOF), tc.raw)
		require.ErrorIs(t, err, io.EOF, tc.raw)
		for _, s := range secrets {
			require.NotContains(t, err.Error(), s, tc.raw)
		}
		require.Contains(t, err.Error(), redact.Mask, tc.raw)
	}
	require.NoError(t, redact.Error(nil, "amqp://u:p@h/"))
	plain := errors.New("password a was wrong")
	require.Equal(t, plain, redact.Error(plain, "amqp://u:a@h/"), "a bare password text is left alone")
	require.False(t, strings.Contains(redact.Text("x amqp://u:a@h/ y", "amqp://u:a@h/"), ":a@"))
}

// TestTextKeepsPasswordText: the user info is replaced in each spelling
// a driver may quote it, and the password's text elsewhere is left alone:
// with the password "e", the rest of the message is kept letter for
// letter.
func TestTextKeepsPasswordText(t *testing.T) {
	t.Parallel()
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
		{"sqs://KEY:e@us-east-1", "the request was refused", "the request was refused"},
		{"gochannel://u:e@?persistent=yes", `bad broker URL: parameter persistent="yes" is not a boolean`, `bad broker URL: parameter persistent="yes" is not a boolean`},
	} {
		require.Equal(t, tc.want, redact.Text(tc.quoted, tc.raw), tc.raw)
	}
}
