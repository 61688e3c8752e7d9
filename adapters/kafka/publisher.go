package kafka

import (
	"errors"
	"fmt"
	"sync"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
)

// Publisher publishes to Kafka through one idempotent Sarama producer. A
// Publish of several messages sends them as one batch, so a relay draining
// an outbox pays one round trip per batch instead of one per message.
type Publisher struct {
	producer sarama.SyncProducer
	marshal  Marshaler
	logger   watermill.LoggerAdapter

	mu     sync.RWMutex
	closed bool
}

// NewPublisher returns a publisher with an idempotent producer configured
// by cfg (see [PublisherConfig.WatermillConfig]); a nil logger logs
// nothing. It connects to the brokers before it returns, and fails if none
// answers, and it starts Sarama's producer goroutines, which Close stops.
func NewPublisher(cfg PublisherConfig, logger watermill.LoggerAdapter) (*Publisher, error) {
	wcfg, err := cfg.WatermillConfig()
	if err != nil {
		return nil, err
	}
	if logger == nil {
		logger = watermill.NopLogger{}
	}
	producer, err := sarama.NewSyncProducer(wcfg.Brokers, wcfg.OverwriteSaramaConfig)
	if err != nil {
		return nil, fmt.Errorf("kafka: new publisher: %w", err)
	}
	return &Publisher{producer: producer, logger: logger}, nil
}

// Publish sends msgs to topic and returns once every one of them is
// acknowledged by all in-sync replicas of its partition. Several messages
// go out as one batch; within a partition they keep their order (the
// producer is idempotent with one request in flight). If any fails,
// Publish fails, and some of the others may have been written: publishing
// is at least once, and a caller that retries sends them with the same
// UUIDs for the consumer's inbox to drop. A message that subscribers could
// not decode fails with [ErrInvalidMessage] before anything is sent.
func (p *Publisher) Publish(topic string, msgs ...*message.Message) error {
	p.mu.RLock()
	defer p.mu.RUnlock()
	if p.closed {
		return ErrPublisherClosed
	}
	if len(msgs) == 0 {
		return nil
	}
	batch := make([]*sarama.ProducerMessage, len(msgs))
	for i, msg := range msgs {
		km, err := p.marshal.Marshal(topic, msg)
		if err != nil {
			return fmt.Errorf("kafka: publish message %s to %q: %w", msg.UUID, topic, err)
		}
		batch[i] = km
	}
	if len(batch) == 1 {
		if _, _, err := p.producer.SendMessage(batch[0]); err != nil {
			return fmt.Errorf("kafka: publish message %s to %q: %w", msgs[0].UUID, topic, err)
		}
		return nil
	}
	if err := p.producer.SendMessages(batch); err != nil {
		var perrs sarama.ProducerErrors
		if errors.As(err, &perrs) && len(perrs) > 0 {
			return fmt.Errorf("kafka: publish %d messages to %q: %d failed, first: %w", len(msgs), topic, len(perrs), perrs[0].Err)
		}
		return fmt.Errorf("kafka: publish %d messages to %q: %w", len(msgs), topic, err)
	}
	p.logger.Trace("Messages sent to Kafka", watermill.LogFields{"topic": topic, "messages": len(msgs)})
	return nil
}

// Close flushes and stops the producer. It is safe to call more than once.
func (p *Publisher) Close() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return nil
	}
	p.closed = true
	if err := p.producer.Close(); err != nil {
		return fmt.Errorf("kafka: close publisher: %w", err)
	}
	return nil
}

// ErrInvalidTopic is wrapped by the error [Publisher.ValidateTopic]
// returns for a name Kafka refuses as a topic.
var ErrInvalidTopic = errors.New("kafka: invalid topic")

// maxTopicLength is the longest topic name Kafka accepts.
const maxTopicLength = 249

// ValidateTopic returns why Kafka would refuse topic as a topic name, or
// nil: it must be 1 to 249 characters of ASCII letters, digits, '.', '_'
// and '-', and not "." or "..". The error wraps [ErrInvalidTopic].
// forwarder.Relay asks it before publishing a row
// (forwarder.TopicValidator) and dead-letters a row whose topic it
// refuses instead of retrying it forever.
func (p *Publisher) ValidateTopic(topic string) error {
	switch {
	case topic == "" || topic == "." || topic == "..":
		return fmt.Errorf("%w: %q is not a topic name", ErrInvalidTopic, topic)
	case len(topic) > maxTopicLength:
		return fmt.Errorf("%w: topic %q is %d bytes long, Kafka allows at most %d", ErrInvalidTopic, topic, len(topic), maxTopicLength)
	}
	for _, c := range []byte(topic) {
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '.' || c == '_' || c == '-') {
			return fmt.Errorf("%w: topic %q has a character other than ASCII letters, digits, '.', '_' and '-'", ErrInvalidTopic, topic)
		}
	}
	return nil
}
