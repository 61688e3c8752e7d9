package sqs_test

import (
	"context"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	awssqs "github.com/aws/aws-sdk-go-v2/service/sqs"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/adapters"
	"github.com/oncemill/oncemill/adapters/sqs"
	"github.com/oncemill/oncemill/internal/testing/msgtest"
)

// TestBacklog: a topic's backlog is its queue's visible, in-flight and
// delayed messages: 3 sent, one of them received and not deleted, and one
// sent with a delay make 4, never more at any read while SQS's counts
// settle (they are eventually consistent). A missing queue is an error
// wrapping ErrQueueNotFound, even with CreateQueueIfMissing: Backlog
// creates nothing.
func TestBacklog(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	a := newAdmin(t)
	topic := uniqueName("backlog")
	queue := sqs.DefaultQueueName(topic)
	a.track(queue)
	scfg := testSubscriberConfig()
	scfg.CreateQueueIfMissing = true
	sub := newSubscriber(t, scfg)
	var _ adapters.Backlogger = sub

	_, err := sub.Backlog(ctx, topic)
	require.ErrorIs(t, err, sqs.ErrQueueNotFound)
	_, err = a.api.GetQueueUrl(ctx, &awssqs.GetQueueUrlInput{QueueName: aws.String(queue)})
	require.Error(t, err, "the queue was not created")

	a.createQueue(queue, nil)
	for _, body := range []string{"a", "b", "c"} {
		a.send(queue, body, nil)
	}
	_, err = a.api.SendMessage(ctx, &awssqs.SendMessageInput{QueueUrl: aws.String(a.url(queue)), MessageBody: aws.String("later"), DelaySeconds: 900})
	require.NoError(t, err)
	require.Len(t, a.receiveRaw(queue, 1, 5*time.Minute), 1) // in flight

	msgtest.WaitFor(t, "backlog 4", func() bool {
		b, err := sub.Backlog(ctx, topic)
		require.NoError(t, err)
		require.LessOrEqual(t, b.Messages, int64(4))
		return b.Messages == 4
	})
	visible, inFlight := a.counts(queue)
	require.Equal(t, 2, visible)
	require.Equal(t, 1, inFlight)

	require.NoError(t, sub.Close())
	_, err = sub.Backlog(ctx, topic)
	require.ErrorIs(t, err, sqs.ErrClosed)
}
