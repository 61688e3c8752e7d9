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
