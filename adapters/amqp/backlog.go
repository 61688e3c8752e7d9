package amqp

import (
	"context"
	"errors"
	"fmt"

	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/oncemill/oncemill/adapters"
)

// ErrQueueNotFound is wrapped by the error of [Subscriber.Backlog] for a
// topic whose queue does not exist: nothing has declared it, so the
// broker keeps nothing for the group, and drops what is published to the
// topic.
var ErrQueueNotFound = errors.New("amqp: queue not found")

var _ adapters.Backlogger = (*Subscriber)(nil)

// Backlog returns the number of ready messages in the queue the
// subscriber consumes topic from ([Config.QueueName]), which it reads
// with a passive queue declaration on a channel of its own connection.
// Messages delivered to a consumer and not yet acknowledged (up to
// [Config.Prefetch] per subscription, of every instance of the group)
// are not counted: AMQP does not report them, and they return to ready
// when their consumer closes or nacks them. Backlog may be called whether
// or not the subscriber has subscribed to topic; for a queue that does
// not exist the error wraps [ErrQueueNotFound].
//
// The call returns when ctx ends; the channel it opened is closed then,
// or, if the broker has not opened it yet, by Close at the latest.
func (s *Subscriber) Backlog(ctx context.Context, topic string) (adapters.Backlog, error) {
	queue := s.queueName(topic)
	fail := func(err error) (adapters.Backlog, error) {
		return adapters.Backlog{}, redactErr(fmt.Errorf("amqp: backlog of queue %q (topic %q): %w", queue, topic, err), s.url)
	}
	if err := ctx.Err(); err != nil {
		return fail(err)
	}
	// amqp091 calls take no context: the read runs on a worker, which
	// Close waits for before it closes the connection.
	if !s.life.Enter() {
		return fail(ErrSubscriberClosed)
	}
	type result struct {
		ready int
		err   error
	}
	done := make(chan result, 1)
	go func() {
		defer s.life.Leave()
		ready, err := s.ready(ctx, queue)
		done <- result{ready, err}
	}()
	select {
	case r := <-done:
		if r.err != nil {
			return fail(r.err)
		}
		return adapters.Backlog{Messages: int64(r.ready)}, nil
	case <-ctx.Done():
		return fail(ctx.Err())
	}
}

// ready declares queue passively on a new channel of the subscriber's
// connection and returns its ready messages. The channel is closed when
// ctx ends, which fails a declaration still waiting for its answer.
func (s *Subscriber) ready(ctx context.Context, queue string) (int, error) {
	conn := s.sub.Connection()
	if conn == nil || conn.IsClosed() {
		return 0, fmt.Errorf("%w: not connected (the subscriber reconnects)", ErrConnect)
	}
	ch, err := conn.Channel()
	if err != nil {
		return 0, fmt.Errorf("open channel: %w", err)
	}
	stop := context.AfterFunc(ctx, func() { _ = ch.Close() })
	defer func() {
		if stop() {
			_ = ch.Close() // a refused declaration has closed it already
		}
	}()
	q, err := ch.QueueDeclarePassive(queue, true, false, false, false, nil)
	var aerr *amqp091.Error
	switch {
	case errors.As(err, &aerr) && aerr.Code == amqp091.NotFound:
		return 0, fmt.Errorf("%w: declare it (amqp.Declare, or oncemill amqp declare) or subscribe: %w", ErrQueueNotFound, err)
	case err != nil:
		return 0, errors.Join(err, ctx.Err())
	}
	return q.Messages, nil
}
