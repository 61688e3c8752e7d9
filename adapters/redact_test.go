package adapters_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/adapters"
)

// TestOpenErrorsHideCredentials: Open's errors name the URL without any
// credential, in each form a URL carries one: a user-only token, a
// password in the query, the user info of a URL nested in a parameter,
// and the value of a parameter the scheme does not know.
func TestOpenErrorsHideCredentials(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	for _, tc := range []struct {
		url    string
		secret string
		want   string
	}{
		{"nats://TOKEN123@127.0.0.1:1?group=g&connect_timeout=1s", "TOKEN123", "adapters: open nats://xxxxx@127.0.0.1:1?group=g"},
		{"postgres://app@127.0.0.1:1/db?password=hunter2&connect_timeout=1s", "hunter2", "adapters: open postgres://xxxxx@127.0.0.1:1/db?password=xxxxx"},
		{"sqs://AKIAKEYID:wJalrSECRET@us-east-1?endpoint=http://u:s3cr3t@127.0.0.1:1&connect_timeout=1s", "s3cr3t", "endpoint=http://u:xxxxx@127.0.0.1:1"},
		{"sqs://AKIAKEYID:wJalrSECRET@us-east-1?endpoint=http://127.0.0.1:1&connect_timeout=1s", "wJalrSECRET", "sqs://AKIAKEYID:xxxxx@us-east-1"},
		{"kafka://127.0.0.1:1?group=g&sasl_password=mystery-value", "mystery-value", `"sasl_password"`},
		{"amqp://guest:hunter2@127.0.0.1:1/?auth_token=TOKEN123&connect_timeout=1s", "TOKEN123", "auth_token"},
	} {
		_, err := adapters.Open(ctx, tc.url, adapters.Options{})
		require.Error(t, err, tc.url)
		require.NotContains(t, err.Error(), tc.secret, tc.url)
		require.Contains(t, err.Error(), tc.want, tc.url)
	}
}
