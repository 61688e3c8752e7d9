package sqs

import (
	"context"
	"fmt"
	"strconv"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/sqs"
	"github.com/aws/aws-sdk-go-v2/service/sqs/types"

	"github.com/oncemill/oncemill/adapters"
)

var _ adapters.Backlogger = (*Subscriber)(nil)

// backlogAttributes are the queue attributes whose sum is the backlog.
var backlogAttributes = []types.QueueAttributeName{
	types.QueueAttributeNameApproximateNumberOfMessages,
	types.QueueAttributeNameApproximateNumberOfMessagesNotVisible,
	types.QueueAttributeNameApproximateNumberOfMessagesDelayed,
}

// Backlog returns the messages in topic's queue: visible, in flight
// (received by a consumer and not yet deleted, a nacked one among them
// until its visibility timeout passes) and delayed, as SQS reports them
// (ApproximateNumberOfMessages, ApproximateNumberOfMessagesNotVisible and
// ApproximateNumberOfMessagesDelayed). SQS computes these figures
// asynchronously: they are eventually consistent, and may trail a send or
// a deletion for a while (up to a minute, by AWS's documentation). It asks
// with the subscriber's client, within ctx, whether or not the subscriber
// has subscribed to topic, and creates nothing: a missing queue is an
// error wrapping [ErrQueueNotFound].
func (s *Subscriber) Backlog(ctx context.Context, topic string) (adapters.Backlog, error) {
	fail := func(err error) (adapters.Backlog, error) {
		return adapters.Backlog{}, fmt.Errorf("sqs: backlog of topic %q: %w", topic, err)
	}
	if s.life.Closed() {
		return fail(ErrClosed)
	}
	ctx, cancel := context.WithTimeout(ctx, requestTimeout)
	defer cancel()
	name, url, err := s.client.queueURL(ctx, topic, false)
	if err != nil {
		return fail(err)
	}
	out, err := s.client.api.GetQueueAttributes(ctx, &sqs.GetQueueAttributesInput{
		QueueUrl:       aws.String(url),
		AttributeNames: backlogAttributes,
	})
	if err != nil {
		if isQueueNotFound(err) {
			s.client.forget(name)
			return fail(fmt.Errorf("%w: %q: %w", ErrQueueNotFound, name, err))
		}
		return fail(fmt.Errorf("queue %q: %w", name, err))
	}
	var b adapters.Backlog
	for _, a := range backlogAttributes {
		v, ok := out.Attributes[string(a)]
		if !ok {
			return fail(fmt.Errorf("queue %q: SQS did not return attribute %s", name, a))
		}
		n, err := strconv.ParseInt(v, 10, 64)
		if err != nil {
			return fail(fmt.Errorf("queue %q: attribute %s is %q, not a count", name, a, v))
		}
		b.Messages += n
	}
	return b, nil
}
