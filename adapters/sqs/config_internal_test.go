package sqs

import (
	"net/http"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	awshttp "github.com/aws/aws-sdk-go-v2/aws/transport/http"
	"github.com/aws/aws-sdk-go-v2/credentials"
	"github.com/stretchr/testify/require"
)

// TestClientConnectTimeout checks which transports get the connect
// timeout: the SDK's own client the default or ConnectTimeout, a
// caller's buildable client only an explicit ConnectTimeout.
func TestClientConnectTimeout(t *testing.T) {
	t.Parallel()
	creds := credentials.NewStaticCredentialsProvider("test", "test", "")
	callers := func() *aws.Config {
		return &aws.Config{Region: "us-east-1", Credentials: creds, HTTPClient: awshttp.NewBuildableClient().WithTransportOptions(func(tr *http.Transport) {
			tr.TLSHandshakeTimeout = 25 * time.Second
		})}
	}
	for _, tc := range []struct {
		name string
		cfg  Config
		want time.Duration
	}{
		{"default", Config{Region: "us-east-1", Credentials: creds}, DefaultConnectTimeout},
		{"set", Config{Region: "us-east-1", Credentials: creds, ConnectTimeout: 3 * time.Second}, 3 * time.Second},
		{"caller's client", Config{AWSConfig: callers()}, 25 * time.Second},
		{"caller's client, set", Config{AWSConfig: callers(), ConnectTimeout: 2 * time.Second}, 2 * time.Second},
	} {
		cfg := tc.cfg
		cfg.setDefaults()
		c, err := newClient(cfg)
		require.NoError(t, err, tc.name)
		require.Equal(t, tc.want, c.transport.TLSHandshakeTimeout, tc.name)
		c.close()
	}
}
