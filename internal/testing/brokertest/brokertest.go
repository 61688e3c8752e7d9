// Package brokertest reads what a broker still holds for a consumer, for
// the tests that check from outside that nothing was left unacknowledged:
// a Kafka group's lag, a RabbitMQ queue's ready messages, an SQS queue's
// visible and in-flight messages.
package brokertest

import (
	"context"
	"net/http"
	"strconv"
	"testing"

	"github.com/IBM/sarama"
	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/credentials"
	awssqs "github.com/aws/aws-sdk-go-v2/service/sqs"
	"github.com/aws/aws-sdk-go-v2/service/sqs/types"
	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/adapters/amqp"
	"github.com/oncemill/oncemill/adapters/sqs"
)

// KafkaLag is group's lag on topic: the records after its committed
// offsets (a partition without a committed offset counts from 0).
func KafkaLag(t testing.TB, brokers []string, topic, group string) int {
	t.Helper()
	cfg := sarama.NewConfig()
	cfg.Version = sarama.V2_3_0_0 // what the adapter speaks (see adapters/kafka)
	client, err := sarama.NewClient(brokers, cfg)
	require.NoError(t, err)
	defer client.Close()
	admin, err := sarama.NewClusterAdminFromClient(client)
	require.NoError(t, err)
	partitions, err := client.Partitions(topic)
	require.NoError(t, err)
	committed, err := admin.ListConsumerGroupOffsets(group, map[string][]int32{topic: partitions})
	require.NoError(t, err)
	lag := 0
	for _, p := range partitions {
		end, err := client.GetOffset(topic, p, sarama.OffsetNewest)
		require.NoError(t, err)
		at := int64(0)
		if b := committed.GetBlock(topic, p); b != nil && b.Offset >= 0 {
			at = b.Offset
		}
		lag += int(end - at)
	}
	return lag
}

// CreateKafkaTopic creates topic with partitions partitions.
func CreateKafkaTopic(t testing.TB, brokers []string, topic string, partitions int32) {
	t.Helper()
	cfg := sarama.NewConfig()
	cfg.Version = sarama.V2_3_0_0
	admin, err := sarama.NewClusterAdmin(brokers, cfg)
	require.NoError(t, err)
	defer admin.Close()
	require.NoError(t, admin.CreateTopic(topic, &sarama.TopicDetail{NumPartitions: partitions, ReplicationFactor: 1}, false))
}

// amqpChannel is a channel on a connection of its own to the RabbitMQ
// at url, and what closes both: the callers poll, so nothing waits for
// t's end.
func amqpChannel(t testing.TB, url string) (*amqp091.Channel, func()) {
	t.Helper()
	conn, err := amqp091.Dial(url)
	require.NoError(t, err)
	ch, err := conn.Channel()
	if err != nil {
		_ = conn.Close()
	}
	require.NoError(t, err)
	return ch, func() { _ = ch.Close(); _ = conn.Close() }
}

// AMQPReady is the ready messages of group's queue for topic on the
// RabbitMQ at url. What a running consumer holds unacked is left out (AMQP
// does not report it): read it again once the consumers stopped, which
// returns whatever they still held.
func AMQPReady(t testing.TB, url, topic, group string) int {
	t.Helper()
	ch, closeCh := amqpChannel(t, url)
	defer closeCh()
	q, err := ch.QueueDeclarePassive(amqp.Config{ConsumerGroup: group}.QueueName(topic), true, false, false, false, amqp.Config{}.QueueArguments())
	require.NoError(t, err)
	return q.Messages
}

// SQS reads and deletes the queues of an SQS endpoint (the emulator's
// credentials, region us-east-1).
type SQS struct {
	client *awssqs.Client
}

// NewSQS returns a client of endpoint whose connections close when the test
// ends.
func NewSQS(t testing.TB, endpoint string) *SQS {
	httpClient := &http.Client{Transport: &http.Transport{}}
	t.Cleanup(httpClient.CloseIdleConnections)
	return &SQS{client: awssqs.New(awssqs.Options{
		Region:       "us-east-1",
		BaseEndpoint: aws.String(endpoint),
		Credentials:  credentials.NewStaticCredentialsProvider("test", "test", ""),
		HTTPClient:   httpClient,
	})}
}

func (s *SQS) queueURL(t testing.TB, topic string) string {
	t.Helper()
	out, err := s.client.GetQueueUrl(context.Background(), &awssqs.GetQueueUrlInput{QueueName: aws.String(sqs.DefaultQueueName(topic))})
	require.NoError(t, err)
	return *out.QueueUrl
}

// Backlog is the visible and in-flight messages of topic's queue.
func (s *SQS) Backlog(t testing.TB, topic string) int {
	t.Helper()
	out, err := s.client.GetQueueAttributes(context.Background(), &awssqs.GetQueueAttributesInput{
		QueueUrl: aws.String(s.queueURL(t, topic)),
		AttributeNames: []types.QueueAttributeName{
			types.QueueAttributeNameApproximateNumberOfMessages,
			types.QueueAttributeNameApproximateNumberOfMessagesNotVisible,
		},
	})
	require.NoError(t, err)
	n := 0
	for _, v := range out.Attributes {
		c, err := strconv.Atoi(v)
		require.NoError(t, err)
		n += c
	}
	return n
}

// DeleteQueue deletes topic's queue.
func (s *SQS) DeleteQueue(t testing.TB, topic string) {
	t.Helper()
	_, err := s.client.DeleteQueue(context.Background(), &awssqs.DeleteQueueInput{QueueUrl: aws.String(s.queueURL(t, topic))})
	require.NoError(t, err)
}

// CreateQueueWithRedrive creates topic's queue with a redrive policy that
// moves a message received maxReceiveCount times to a dead-letter queue of
// its own (topic + "-redrive"), as an operator's queue would be set up
// before the consumer starts; the test's cleanup deletes both. It returns
// the dead-letter queue's topic, whose backlog counts what the broker
// moved aside.
func (s *SQS) CreateQueueWithRedrive(t testing.TB, topic string, maxReceiveCount int) string {
	t.Helper()
	ctx := context.Background()
	dead := topic + "-redrive"
	out, err := s.client.CreateQueue(ctx, &awssqs.CreateQueueInput{QueueName: aws.String(sqs.DefaultQueueName(dead))})
	require.NoError(t, err)
	t.Cleanup(func() { s.DeleteQueue(t, dead) })
	attrs, err := s.client.GetQueueAttributes(ctx, &awssqs.GetQueueAttributesInput{
		QueueUrl: out.QueueUrl, AttributeNames: []types.QueueAttributeName{types.QueueAttributeNameQueueArn},
	})
	require.NoError(t, err)
	policy, err := sqs.RedrivePolicy(attrs.Attributes[string(types.QueueAttributeNameQueueArn)], maxReceiveCount)
	require.NoError(t, err)
	_, err = s.client.CreateQueue(ctx, &awssqs.CreateQueueInput{
		QueueName:  aws.String(sqs.DefaultQueueName(topic)),
		Attributes: map[string]string{string(types.QueueAttributeNameRedrivePolicy): policy},
	})
	require.NoError(t, err)
	t.Cleanup(func() { s.DeleteQueue(t, topic) })
	return dead
}

// DeclareAMQPQueue declares group's quorum queue for topic on the
// RabbitMQ at url by hand, with args added to x-queue-type quorum, and
// binds it to the topic's fanout exchange, as an operator would before
// the consumer starts.
func DeclareAMQPQueue(t testing.TB, url, topic, group string, args amqp091.Table) {
	t.Helper()
	ch, closeCh := amqpChannel(t, url)
	defer closeCh()
	cfg := amqp.Config{ConsumerGroup: group}
	table := amqp091.Table{"x-queue-type": "quorum"}
	for k, v := range args {
		table[k] = v
	}
	require.NoError(t, ch.ExchangeDeclare(cfg.ExchangeName(topic), amqp091.ExchangeFanout, true, false, false, false, nil))
	_, err := ch.QueueDeclare(cfg.QueueName(topic), true, false, false, false, table)
	require.NoError(t, err)
	require.NoError(t, ch.QueueBind(cfg.QueueName(topic), "", cfg.ExchangeName(topic), false, nil))
}
