package sqs

import (
	"context"
	"encoding/json"
	"fmt"
	"strconv"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/sqs"
	"github.com/aws/aws-sdk-go-v2/service/sqs/types"

	"github.com/oncemill/oncemill/delivery"
)

// DeliveryLimit reads the redrive policy of topic's queue (looking the
// queue up, and creating it with [Config.CreateQueueIfMissing], as
// Subscribe does): SQS moves a message that was received maxReceiveCount
// times without being deleted to the policy's dead-letter queue, which
// oncemill does not read. The poison middleware ends a message at its
// last receive and refuses to start below what its policy needs
// (middleware.Poison.Subscriber). It implements delivery.Limiter; a
// Limit of 0 deliveries is no limit (no redrive policy).
func (s *Subscriber) DeliveryLimit(ctx context.Context, topic string) (delivery.Limit, error) {
	name, url, err := s.client.queueURL(ctx, topic, s.cfg.CreateQueueIfMissing)
	if err != nil {
		return delivery.Limit{}, fmt.Errorf("sqs: delivery limit of %q: %w", topic, err)
	}
	return s.client.redriveLimit(ctx, name, url)
}

// redriveLimit reads the maxReceiveCount of the queue's redrive policy.
func (c *client) redriveLimit(ctx context.Context, name, url string) (delivery.Limit, error) {
	ctx, cancel := context.WithTimeout(ctx, requestTimeout)
	defer cancel()
	out, err := c.api.GetQueueAttributes(ctx, &sqs.GetQueueAttributesInput{
		QueueUrl:       aws.String(url),
		AttributeNames: []types.QueueAttributeName{types.QueueAttributeNameRedrivePolicy},
	})
	if err != nil {
		return delivery.Limit{}, fmt.Errorf("sqs: read the redrive policy of queue %q: %w", name, err)
	}
	policy := out.Attributes[string(types.QueueAttributeNameRedrivePolicy)]
	if policy == "" {
		return delivery.Limit{}, nil
	}
	n, err := maxReceiveCount(policy)
	if err != nil {
		return delivery.Limit{}, fmt.Errorf("sqs: the redrive policy of queue %q: %w", name, err)
	}
	return delivery.Limit{
		Deliveries: n,
		Where:      fmt.Sprintf("SQS queue %q (redrive policy maxReceiveCount %d)", name, n),
		Raise: fmt.Sprintf("raise maxReceiveCount in the queue's redrive policy (aws sqs set-queue-attributes --queue-url %s, "+
			"attribute RedrivePolicy; sqs.RedrivePolicy builds it), or remove the policy", url),
	}, nil
}

// maxReceiveCount reads maxReceiveCount from a RedrivePolicy attribute,
// which SQS gives as a number or as a string holding one.
func maxReceiveCount(policy string) (int, error) {
	var p struct {
		MaxReceiveCount json.RawMessage `json:"maxReceiveCount"`
	}
	if err := json.Unmarshal([]byte(policy), &p); err != nil {
		return 0, fmt.Errorf("not JSON: %w", err)
	}
	raw := string(p.MaxReceiveCount)
	if unquoted, err := strconv.Unquote(raw); err == nil {
		raw = unquoted
	}
	n, err := strconv.Atoi(raw)
	if err != nil || n < 1 {
		return 0, fmt.Errorf("maxReceiveCount %s is not a positive number", string(p.MaxReceiveCount))
	}
	return n, nil
}
