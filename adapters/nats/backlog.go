package nats

import (
	"context"
	"errors"
	"fmt"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/oncemill/oncemill/adapters"
)

var _ adapters.Backlogger = (*Subscriber)(nil)

// Backlog returns what JetStream holds for the group's durable consumer
// of topic ([SubscriberConfig.ConsumerName]): its messages not yet
// delivered (NumPending) plus those delivered to any subscriber of the
// group and not yet acknowledged (NumAckPending), a nacked message among
// them until JetStream delivers it again. Before the consumer exists,
// which Subscribe creates, it is the stream's messages of topic, which
// the consumer, delivering from the start of the stream, will deliver.
// It asks on the subscriber's connection, within ctx and at most 10s,
// whether or not the subscriber has subscribed to topic, and creates
// nothing: a missing stream is an error wrapping [ErrStreamNotFound].
func (s *Subscriber) Backlog(ctx context.Context, topic string) (adapters.Backlog, error) {
	fail := func(err error) (adapters.Backlog, error) {
		return adapters.Backlog{}, fmt.Errorf("nats: backlog of group %q on topic %q: %w", s.cfg.ConsumerGroup, topic, err)
	}
	if s.life.Closed() {
		return fail(ErrClosed)
	}
	stream, err := s.client.stream(ctx, topic, false)
	if err != nil {
		return fail(err)
	}
	ctx, cancel := context.WithTimeout(ctx, requestTimeout)
	defer cancel()
	name := s.cfg.ConsumerName(topic)
	cons, err := stream.Consumer(ctx, name)
	if errors.Is(err, jetstream.ErrConsumerNotFound) {
		info, err := stream.Info(ctx, jetstream.WithSubjectFilter(topic))
		if err != nil {
			return fail(fmt.Errorf("stream %q: %w", stream.CachedInfo().Config.Name, err))
		}
		return adapters.Backlog{Messages: int64(info.State.Subjects[topic])}, nil
	}
	if err != nil {
		if errors.Is(err, jetstream.ErrStreamNotFound) {
			s.client.forget(topic)
		}
		return fail(fmt.Errorf("durable consumer %q: %w", name, err))
	}
	// Consumer has just fetched the info; CachedInfo is that answer.
	info := cons.CachedInfo()
	return adapters.Backlog{Messages: int64(info.NumPending) + int64(info.NumAckPending)}, nil
}
