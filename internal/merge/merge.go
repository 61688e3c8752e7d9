// Package merge joins Watermill subscribers: one subscription that
// delivers what each of them delivers for the topic, for the subscribers
// that hand a consumer its own messages back (the dead-letter replays, the
// parked retries) through the consumer's own handler.
package merge

import (
	"context"
	"errors"
	"sync"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/oncemill/oncemill/delivery"
)

// Subscribers returns a subscriber whose Subscribe(ctx, topic) delivers
// the messages of every one of subs for topic, on one channel that closes
// once all of theirs closed. A message taken from one of them that cannot
// be handed on because ctx ended is nacked. Close closes each of subs and
// waits for the subscriptions' goroutines.
func Subscribers(subs ...message.Subscriber) message.Subscriber {
	return &merged{subs: subs}
}

type merged struct {
	subs []message.Subscriber
	wg   sync.WaitGroup
}

func (m *merged) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	ins := make([]<-chan *message.Message, 0, len(m.subs))
	for _, s := range m.subs {
		in, err := s.Subscribe(ctx, topic)
		if err != nil {
			return nil, err
		}
		ins = append(ins, in)
	}
	out := make(chan *message.Message)
	var forwarders sync.WaitGroup
	forward := func(in <-chan *message.Message) {
		defer forwarders.Done()
		for msg := range in {
			select {
			case out <- msg:
			case <-ctx.Done():
				msg.Nack()
			}
		}
	}
	forwarders.Add(len(ins))
	for _, in := range ins {
		go forward(in)
	}
	m.wg.Add(1)
	go func() {
		defer m.wg.Done()
		forwarders.Wait()
		close(out)
	}()
	return out, nil
}

func (m *merged) Close() error {
	var errs []error
	for _, s := range m.subs {
		errs = append(errs, s.Close())
	}
	m.wg.Wait()
	return errors.Join(errs...)
}

// DeliveryLimit forwards the question to the first of the merged
// subscribers that can answer it (delivery.Limiter): the broker's; the
// subscribers that hand messages back from a table set no limit.
func (m *merged) DeliveryLimit(ctx context.Context, topic string) (delivery.Limit, error) {
	for _, s := range m.subs {
		if l, ok := s.(delivery.Limiter); ok {
			return l.DeliveryLimit(ctx, topic)
		}
	}
	return delivery.Limit{}, nil
}
