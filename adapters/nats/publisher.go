package nats

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	natsgo "github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// Publisher publishes Watermill messages to JetStream, the topic as
// subject. It is safe for concurrent use. It has a connection of its own
// and starts no goroutines besides the connection's.
type Publisher struct {
	cfg    PublisherConfig
	client *client
	logger watermill.LoggerAdapter

	mu       sync.RWMutex
	closed   bool
	inflight sync.WaitGroup
	done     chan struct{} // closed when Close has finished
}

var _ message.Publisher = (*Publisher)(nil)

// NewPublisher validates a copy of cfg with its defaults applied, connects
// to NATS within ctx and [Config.ConnectTimeout], and checks that the
// account has JetStream.
func NewPublisher(ctx context.Context, cfg PublisherConfig) (*Publisher, error) {
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	c, err := connect(ctx, cfg.Config, "oncemill publisher")
	if err != nil {
		return nil, err
	}
	return &Publisher{cfg: cfg, client: c, logger: cfg.Logger, done: make(chan struct{})}, nil
}

// Publish publishes msgs to topic, one after the other, and returns once
// JetStream has stored each of them, or at the first that failed: a
// caller that retries publishes the stored ones again, and JetStream
// drops them within its duplicate window (see below). Each publish honours
// the message's context and [PublisherConfig.PublishTimeout], within
// which a dropped connection or a server restart does not fail it: while
// the client is disconnected the publish waits for the next connection,
// and a message whose ack the dropped connection lost is published again
// on it, the stream dropping the copy by its Nats-Msg-Id.
//
// The topic's stream is looked up on the first publish to it (created
// with [Config.CreateStreams]), and every message is published expecting
// that stream, so that a message another stream would take instead fails.
// A topic without a stream fails with [ErrStreamNotFound].
//
// Each message's Nats-Msg-Id header is its idempotency key (metadata
// delivery.IdempotencyKey), else its UUID, so that JetStream drops a
// producer's retry of a message it stored within the stream's duplicate
// window; a replay from the dead-letter queue and a dead-lettered copy
// get an ID of their own (see the package documentation). A dropped
// duplicate is a successful publish.
func (p *Publisher) Publish(topic string, msgs ...*message.Message) error {
	p.mu.RLock()
	if p.closed {
		p.mu.RUnlock()
		return fmt.Errorf("nats: publish to %q: %w", topic, ErrClosed)
	}
	p.inflight.Add(1)
	p.mu.RUnlock()
	defer p.inflight.Done()

	if len(msgs) == 0 {
		return nil
	}
	s, err := p.client.stream(msgs[0].Context(), topic, p.cfg.CreateStreams)
	if err != nil {
		return fmt.Errorf("nats: publish to %q: %w", topic, err)
	}
	stream := s.CachedInfo().Config.Name
	for _, msg := range msgs {
		if err := p.publish(stream, topic, msg); err != nil {
			return fmt.Errorf("nats: publish message %s to %q: %w", msg.UUID, topic, err)
		}
	}
	return nil
}

// publish publishes one message to stream.
func (p *Publisher) publish(stream, topic string, msg *message.Message) error {
	id := msgID(msg, topic, p.cfg.shared())
	m, err := marshal(msg, topic, id)
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(msg.Context(), p.cfg.PublishTimeout)
	defer cancel()
	ack, err := p.send(ctx, m, stream)
	if err != nil {
		if errors.Is(err, jetstream.ErrNoStreamResponse) || errors.Is(err, natsgo.ErrNoResponders) {
			// The stream may have been deleted: look it up again next
			// time, and create it if allowed.
			p.client.forget(topic)
			return fmt.Errorf("no stream took the message (was stream %q deleted?): %w", stream, err)
		}
		return err
	}
	fields := watermill.LogFields{"message_uuid": msg.UUID, "topic": topic, "stream": ack.Stream, "stream_sequence": ack.Sequence, "msg_id": id}
	if ack.Duplicate {
		p.logger.Debug("JetStream dropped a duplicate publish: a message with its Nats-Msg-Id is in the stream's duplicate window", fields)
	} else {
		p.logger.Trace("Published message to JetStream", fields)
	}
	return nil
}

// send publishes m to stream and waits for JetStream's ack, within ctx.
// While the client is disconnected it waits for the next connection
// rather than buffer m. When the connection drops before the ack came,
// the ack is lost with it (m may or may not be stored) and send publishes
// m again on the next connection: the stream drops the copy by its
// Nats-Msg-Id, and the ack says Duplicate.
func (p *Publisher) send(ctx context.Context, m *natsgo.Msg, stream string) (*jetstream.PubAck, error) {
	for {
		lost, err := p.client.link(ctx)
		if err != nil {
			return nil, fmt.Errorf("not connected to NATS: %w", err)
		}
		sctx, cancel := context.WithCancel(ctx)
		stop := context.AfterFunc(lost, cancel)
		ack, err := p.client.js.PublishMsg(sctx, m, jetstream.WithExpectStream(stream))
		stop()
		cancel()
		if err != nil && ctx.Err() == nil && lost.Err() != nil {
			p.logger.Debug("The connection to NATS dropped before JetStream acked a publish; publishing it again on the next connection",
				watermill.LogFields{"subject": m.Subject, "msg_id": m.Header.Get(MsgIDHeader), "err": err.Error()})
			continue
		}
		return ack, err
	}
}

// Close waits for the publishes in flight and closes the connection.
// Publish fails with [ErrClosed] afterwards. Close is idempotent; every
// call returns once the first has finished.
func (p *Publisher) Close() error {
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		<-p.done
		return nil
	}
	p.closed = true
	p.mu.Unlock()
	p.inflight.Wait()
	p.client.close()
	close(p.done)
	return nil
}

// ValidateTopic returns why topic is not a subject a message can be
// published to, or a stream name can be made of, or nil; the error wraps
// [ErrInvalidTopic]. forwarder.Relay asks it before publishing a row
// (forwarder.TopicValidator) and dead-letters a row whose topic it
// refuses instead of retrying it forever.
func (p *Publisher) ValidateTopic(topic string) error {
	if why := invalidTopic(topic); why != "" {
		return fmt.Errorf("%w: topic %q %s", ErrInvalidTopic, topic, why)
	}
	if !utf8.ValidString(topic) {
		return fmt.Errorf("%w: topic %q is not valid UTF-8", ErrInvalidTopic, topic)
	}
	if name := p.cfg.StreamName(topic); invalidName(name) != "" {
		return fmt.Errorf("%w: topic %q makes stream name %q, which %s", ErrInvalidTopic, topic, name, invalidName(name))
	}
	return nil
}
