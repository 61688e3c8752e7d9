package sqs_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"net/http"
	"os"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/aws/aws-sdk-go-v2/aws"
	awshttp "github.com/aws/aws-sdk-go-v2/aws/transport/http"
	"github.com/aws/aws-sdk-go-v2/credentials"
	awssqs "github.com/aws/aws-sdk-go-v2/service/sqs"
	"github.com/aws/aws-sdk-go-v2/service/sqs/types"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/adapters/sqs"
)

// defaultEndpoint is the SQS emulator the tests use when
// ONCEMILL_SQS_ENDPOINT is unset.
const defaultEndpoint = "http://127.0.0.1:4566"

// testRegion is the region of the test clients; emulators accept any.
const testRegion = "us-east-1"

// testEndpoint returns the SQS endpoint the tests use.
func testEndpoint() string {
	if e := os.Getenv("ONCEMILL_SQS_ENDPOINT"); e != "" {
		return e
	}
	return defaultEndpoint
}

// testCredentials are the static credentials emulators accept.
func testCredentials() aws.CredentialsProvider {
	return credentials.NewStaticCredentialsProvider("test", "test", "")
}

// admin is a plain SQS client for setting up, inspecting and deleting the
// queues a test uses, without the adapter.
type admin struct {
	t         testing.TB
	api       *awssqs.Client
	transport *http.Transport

	mu     sync.Mutex
	queues map[string]bool
}

// endpoint returns the SQS endpoint after checking that it answers, or
// skips the test, loudly, when it does not; under CI (CI non-empty) it
// fails the test instead.
func endpoint(t testing.TB) string {
	t.Helper()
	api, transport := rawClient()
	defer transport.CloseIdleConnections()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	if _, err := api.ListQueues(ctx, &awssqs.ListQueuesInput{MaxResults: aws.Int32(1)}); err != nil {
		if os.Getenv("CI") != "" {
			t.Fatalf("the SQS emulator is required under CI but %s does not answer: %v (run scripts/services.sh sqs)", testEndpoint(), err)
		}
		t.Skipf("SKIPPED: the SQS emulator at %s does not answer: %v (run scripts/services.sh sqs; set ONCEMILL_SQS_ENDPOINT for another endpoint; CI=true makes this a failure)", testEndpoint(), err)
	}
	return testEndpoint()
}

// rawClient returns a plain SDK client for the test endpoint and its
// transport, whose idle connections the caller closes.
func rawClient() (*awssqs.Client, *http.Transport) {
	transport := awshttp.NewBuildableClient().GetTransport()
	api := awssqs.New(awssqs.Options{
		Region:       testRegion,
		BaseEndpoint: aws.String(testEndpoint()),
		Credentials:  testCredentials(),
		HTTPClient:   &http.Client{Transport: transport},
	})
	return api, transport
}

// newAdmin returns an admin client for the test endpoint, or skips the
// test (fails it under CI) when the endpoint does not answer. When the test
// ends it deletes every queue registered with track, then releases its
// connections.
func newAdmin(t testing.TB) *admin {
	t.Helper()
	endpoint(t)
	api, transport := rawClient()
	a := &admin{t: t, api: api, transport: transport, queues: map[string]bool{}}
	t.Cleanup(a.cleanup)
	return a
}

// track registers queue for deletion when the test ends.
func (a *admin) track(queue string) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.queues[queue] = true
}

// trackTopic registers the queue of topic, named by the default mapping.
func (a *admin) trackTopic(topic string) { a.track(sqs.DefaultQueueName(topic)) }

func (a *admin) cleanup() {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	a.mu.Lock()
	defer a.mu.Unlock()
	for q := range a.queues {
		out, err := a.api.GetQueueUrl(ctx, &awssqs.GetQueueUrlInput{QueueName: aws.String(q)})
		if err != nil {
			continue // never created
		}
		if _, err := a.api.DeleteQueue(ctx, &awssqs.DeleteQueueInput{QueueUrl: out.QueueUrl}); err != nil {
			a.t.Logf("cleanup: delete queue %q: %v", q, err)
		}
	}
	a.transport.CloseIdleConnections()
}

// createQueue creates queue with attrs and returns its URL.
func (a *admin) createQueue(queue string, attrs map[string]string) string {
	a.t.Helper()
	a.track(queue)
	if attrs == nil && len(queue) > 5 && queue[len(queue)-5:] == ".fifo" {
		attrs = map[string]string{"FifoQueue": "true"}
	}
	out, err := a.api.CreateQueue(context.Background(), &awssqs.CreateQueueInput{QueueName: aws.String(queue), Attributes: attrs})
	require.NoError(a.t, err, "create queue %q", queue)
	return aws.ToString(out.QueueUrl)
}

// url returns the URL of queue.
func (a *admin) url(queue string) string {
	a.t.Helper()
	out, err := a.api.GetQueueUrl(context.Background(), &awssqs.GetQueueUrlInput{QueueName: aws.String(queue)})
	require.NoError(a.t, err, "get URL of queue %q", queue)
	return aws.ToString(out.QueueUrl)
}

// arn returns the ARN of queue.
func (a *admin) arn(queue string) string {
	a.t.Helper()
	out, err := a.api.GetQueueAttributes(context.Background(), &awssqs.GetQueueAttributesInput{
		QueueUrl:       aws.String(a.url(queue)),
		AttributeNames: []types.QueueAttributeName{types.QueueAttributeNameQueueArn},
	})
	require.NoError(a.t, err)
	return out.Attributes[string(types.QueueAttributeNameQueueArn)]
}

// counts returns the ApproximateNumberOfMessages (visible) and
// ApproximateNumberOfMessagesNotVisible (in flight) of queue.
func (a *admin) counts(queue string) (visible, inFlight int) {
	a.t.Helper()
	out, err := a.api.GetQueueAttributes(context.Background(), &awssqs.GetQueueAttributesInput{
		QueueUrl: aws.String(a.url(queue)),
		AttributeNames: []types.QueueAttributeName{
			types.QueueAttributeNameApproximateNumberOfMessages,
			types.QueueAttributeNameApproximateNumberOfMessagesNotVisible,
		},
	})
	require.NoError(a.t, err)
	visible, err = strconv.Atoi(out.Attributes[string(types.QueueAttributeNameApproximateNumberOfMessages)])
	require.NoError(a.t, err)
	inFlight, err = strconv.Atoi(out.Attributes[string(types.QueueAttributeNameApproximateNumberOfMessagesNotVisible)])
	require.NoError(a.t, err)
	return visible, inFlight
}

// send sends a raw message to queue with the SDK, bypassing the adapter.
func (a *admin) send(queue, body string, attrs map[string]types.MessageAttributeValue) string {
	a.t.Helper()
	out, err := a.api.SendMessage(context.Background(), &awssqs.SendMessageInput{
		QueueUrl:          aws.String(a.url(queue)),
		MessageBody:       aws.String(body),
		MessageAttributes: attrs,
	})
	require.NoError(a.t, err)
	return aws.ToString(out.MessageId)
}

// receiveRaw receives up to n messages of queue with the SDK, with all
// attributes, hiding them for visibility.
func (a *admin) receiveRaw(queue string, n int32, visibility time.Duration) []types.Message {
	a.t.Helper()
	out, err := a.api.ReceiveMessage(context.Background(), &awssqs.ReceiveMessageInput{
		QueueUrl:                    aws.String(a.url(queue)),
		MaxNumberOfMessages:         n,
		WaitTimeSeconds:             2,
		VisibilityTimeout:           int32(visibility / time.Second),
		MessageAttributeNames:       []string{"All"},
		MessageSystemAttributeNames: []types.MessageSystemAttributeName{types.MessageSystemAttributeNameAll},
	})
	require.NoError(a.t, err)
	return out.Messages
}

// release makes raw messages of queue visible again.
func (a *admin) release(queue string, msgs ...types.Message) {
	a.t.Helper()
	for _, m := range msgs {
		_, err := a.api.ChangeMessageVisibility(context.Background(), &awssqs.ChangeMessageVisibilityInput{
			QueueUrl:          aws.String(a.url(queue)),
			ReceiptHandle:     m.ReceiptHandle,
			VisibilityTimeout: 0,
		})
		require.NoError(a.t, err)
	}
}

// uniqueName returns prefix followed by a random suffix, so that tests that
// run in parallel, or again after a crash, never share a queue.
func uniqueName(prefix string) string {
	var b [6]byte
	_, _ = rand.Read(b[:])
	return "oncemill-test-" + prefix + "-" + hex.EncodeToString(b[:])
}

// testLogger is quiet unless ONCEMILL_TEST_DEBUG is set.
func testLogger() watermill.LoggerAdapter {
	if os.Getenv("ONCEMILL_TEST_DEBUG") != "" {
		return watermill.NewStdLogger(true, false)
	}
	return watermill.NopLogger{}
}

// testConfig returns a Config for the test endpoint that creates queues.
func testConfig() sqs.Config {
	return sqs.Config{
		Region:               testRegion,
		Endpoint:             testEndpoint(),
		Credentials:          testCredentials(),
		CreateQueueIfMissing: true,
		Logger:               testLogger(),
	}
}

// testSubscriberConfig returns a SubscriberConfig with short polls and a
// short visibility timeout, so that what a closed subscriber held comes
// back quickly.
func testSubscriberConfig() sqs.SubscriberConfig {
	return sqs.SubscriberConfig{
		Config:            testConfig(),
		WaitTime:          time.Second,
		VisibilityTimeout: 4 * time.Second,
	}
}

// newPublisher returns a publisher for cfg that the test closes.
func newPublisher(t *testing.T, cfg sqs.PublisherConfig) *sqs.Publisher {
	t.Helper()
	pub, err := sqs.NewPublisher(cfg)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, pub.Close()) })
	return pub
}

// newSubscriber returns a subscriber for cfg that the test closes.
func newSubscriber(t *testing.T, cfg sqs.SubscriberConfig) *sqs.Subscriber {
	t.Helper()
	sub, err := sqs.NewSubscriber(cfg)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, sub.Close()) })
	return sub
}
