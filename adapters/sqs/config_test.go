package sqs_test

import (
	"net/http"
	"path/filepath"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	awshttp "github.com/aws/aws-sdk-go-v2/aws/transport/http"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/adapters/sqs"
)

func TestSubscriberConfigValidate(t *testing.T) {
	t.Parallel()
	valid := func() sqs.SubscriberConfig {
		return sqs.SubscriberConfig{Config: sqs.Config{Region: "us-east-1"}}
	}
	for _, tc := range []struct {
		field  string
		modify func(*sqs.SubscriberConfig)
	}{
		{"Endpoint", func(c *sqs.SubscriberConfig) { c.Endpoint = "127.0.0.1:4566" }},
		{"Endpoint", func(c *sqs.SubscriberConfig) { c.Endpoint = "ftp://127.0.0.1:4566" }},
		{"Endpoint", func(c *sqs.SubscriberConfig) { c.Endpoint = "http://" }},
		{"Region", func(c *sqs.SubscriberConfig) { c.Region = "us east 1" }},
		{"QueueAttributes", func(c *sqs.SubscriberConfig) { c.QueueAttributes = map[string]string{"": "x"} }},
		{"WaitTime", func(c *sqs.SubscriberConfig) { c.WaitTime = 1500 * time.Millisecond }},
		{"WaitTime", func(c *sqs.SubscriberConfig) { c.WaitTime = 21 * time.Second }},
		{"WaitTime", func(c *sqs.SubscriberConfig) { c.WaitTime = -time.Second }},
		{"MaxNumberOfMessages", func(c *sqs.SubscriberConfig) { c.MaxNumberOfMessages = 11 }},
		{"MaxNumberOfMessages", func(c *sqs.SubscriberConfig) { c.MaxNumberOfMessages = -1 }},
		{"VisibilityTimeout", func(c *sqs.SubscriberConfig) { c.VisibilityTimeout = 500 * time.Millisecond }},
		{"VisibilityTimeout", func(c *sqs.SubscriberConfig) { c.VisibilityTimeout = 13 * time.Hour }},
		{"VisibilityTimeout", func(c *sqs.SubscriberConfig) { c.VisibilityTimeout = 2500 * time.Millisecond }},
	} {
		cfg := valid()
		tc.modify(&cfg)
		err := cfg.Validate()
		require.ErrorIs(t, err, sqs.ErrInvalidConfig, tc.field)
		assert.Contains(t, err.Error(), tc.field)

		_, err = sqs.NewSubscriber(cfg)
		require.ErrorIs(t, err, sqs.ErrInvalidConfig, tc.field)
		assert.Contains(t, err.Error(), tc.field)
	}

	cfg := valid()
	require.NoError(t, cfg.Validate())
	assert.Zero(t, cfg.WaitTime, "Validate does not set defaults on the caller's struct")
	assert.Zero(t, cfg.VisibilityTimeout)
	assert.Nil(t, cfg.NackBackoff)
	assert.Nil(t, cfg.QueueNameFromTopic)
	assert.Nil(t, cfg.Logger)

	sub, err := sqs.NewSubscriber(cfg)
	require.NoError(t, err, "NewSubscriber makes no request")
	require.NoError(t, sub.Close())
	assert.Zero(t, cfg.WaitTime, "NewSubscriber does not set defaults on the caller's struct")

	for _, d := range []time.Duration{time.Second, 20 * time.Second} {
		c := valid()
		c.WaitTime = d
		assert.NoError(t, c.Validate(), "WaitTime %s", d)
	}
}

func TestPublisherConfigValidate(t *testing.T) {
	t.Parallel()
	cfg := sqs.PublisherConfig{Config: sqs.Config{Region: "eu-west-1", Endpoint: "not a url"}}
	err := cfg.Validate()
	require.ErrorIs(t, err, sqs.ErrInvalidConfig)
	assert.Contains(t, err.Error(), "Endpoint")
	_, err = sqs.NewPublisher(cfg)
	require.ErrorIs(t, err, sqs.ErrInvalidConfig)

	cfg.Endpoint = "https://sqs.eu-west-1.amazonaws.com"
	require.NoError(t, cfg.Validate())
	pub, err := sqs.NewPublisher(cfg)
	require.NoError(t, err)
	require.NoError(t, pub.Close())
	require.NoError(t, pub.Close(), "Close is idempotent")
}

func TestConfigConnectTimeout(t *testing.T) {
	t.Parallel()
	cfg := sqs.Config{Region: "eu-west-1", ConnectTimeout: -time.Second}
	err := cfg.Validate()
	require.ErrorIs(t, err, sqs.ErrInvalidConfig)
	assert.Contains(t, err.Error(), "ConnectTimeout")

	// A timeout cannot be put into an HTTP client the SDK did not build.
	cfg = sqs.Config{Region: "eu-west-1", ConnectTimeout: time.Second, AWSConfig: &aws.Config{HTTPClient: &http.Client{}}}
	err = cfg.Validate()
	require.ErrorIs(t, err, sqs.ErrInvalidConfig)
	assert.Contains(t, err.Error(), "ConnectTimeout cannot be applied to AWSConfig.HTTPClient of type *http.Client")
	cfg.ConnectTimeout = 0
	require.NoError(t, cfg.Validate(), "without ConnectTimeout, the caller's client is used as it is")
	cfg.ConnectTimeout = time.Second
	cfg.AWSConfig = &aws.Config{HTTPClient: awshttp.NewBuildableClient()}
	require.NoError(t, cfg.Validate())
	pub, err := sqs.NewPublisher(sqs.PublisherConfig{Config: cfg})
	require.NoError(t, err)
	require.NoError(t, pub.Close())
}

// TestNewPublisherWithoutRegion cannot run in parallel: it clears the
// environment's region.
func TestNewPublisherWithoutRegion(t *testing.T) {
	t.Setenv("AWS_REGION", "")
	t.Setenv("AWS_DEFAULT_REGION", "")
	t.Setenv("AWS_PROFILE", "")
	t.Setenv("AWS_CONFIG_FILE", filepath.Join(t.TempDir(), "none"))
	t.Setenv("AWS_SHARED_CREDENTIALS_FILE", filepath.Join(t.TempDir(), "none"))
	_, err := sqs.NewPublisher(sqs.PublisherConfig{})
	require.ErrorIs(t, err, sqs.ErrInvalidConfig)
	assert.Contains(t, err.Error(), "Region")
}

func TestRedrivePolicyValidation(t *testing.T) {
	t.Parallel()
	const arn = "arn:aws:sqs:us-east-1:000000000000:orders-dlq"
	policy, err := sqs.RedrivePolicy(arn, 5)
	require.NoError(t, err)
	assert.JSONEq(t, `{"deadLetterTargetArn":"arn:aws:sqs:us-east-1:000000000000:orders-dlq","maxReceiveCount":5}`, policy)

	for _, n := range []int{0, -1, 1001} {
		_, err := sqs.RedrivePolicy(arn, n)
		require.ErrorIs(t, err, sqs.ErrInvalidConfig)
		assert.Contains(t, err.Error(), "maxReceiveCount")
	}
	for _, n := range []int{1, 1000} {
		_, err := sqs.RedrivePolicy(arn, n)
		require.NoError(t, err)
	}
	_, err = sqs.RedrivePolicy("orders-dlq", 5)
	require.ErrorIs(t, err, sqs.ErrInvalidConfig)
	assert.Contains(t, err.Error(), "deadLetterQueueARN")
}

func TestDefaultQueueName(t *testing.T) {
	t.Parallel()
	for topic, want := range map[string]string{
		"orders":            "orders",
		"orders.created":    "orders-created",
		"billing/invoices":  "billing-invoices",
		"payments.fifo":     "payments.fifo",
		"a.b.fifo":          "a-b.fifo",
		"ünï":               "-n-",
		"Mixed_Case-09":     "Mixed_Case-09",
		"topic with spaces": "topic-with-spaces",
	} {
		assert.Equal(t, want, sqs.DefaultQueueName(topic), "topic %q", topic)
	}

	long := ""
	for range 10 {
		long += "abcdefghij"
	}
	a := sqs.DefaultQueueName(long)
	b := sqs.DefaultQueueName(long + "x")
	assert.Len(t, a, sqs.MaxQueueNameLength)
	assert.NotEqual(t, a, b, "long topics stay distinct")
	fifo := sqs.DefaultQueueName(long + ".fifo")
	assert.Len(t, fifo, sqs.MaxQueueNameLength)
	assert.Equal(t, ".fifo", fifo[len(fifo)-5:])
}
