package main

import (
	"context"
	"log/slog"

	"github.com/ThreeDotsLabs/watermill/message"
)

// runWithRouter returns a router plugin that starts a background task
// when the router runs and stops it when the router closes, as
// forwarder.Relay.Plugin does for the relay: the task is a handler of its
// own, with no messages, whose subscription starts it on the router's
// context. When the router closes, that context ends, stop runs and the
// subscription's channel closes once it has returned, which Close waits
// for within the router's CloseTimeout.
//
// start returns the task's stop function. A start that fails makes the
// router's Run fail, naming the task.
func runWithRouter(name string, start func() (stop func() error, err error)) message.RouterPlugin {
	return func(r *message.Router) error {
		r.AddNoPublisherHandler(name, name, taskSubscriber{name: name, start: start},
			func(*message.Message) error { return nil })
		return nil
	}
}

type taskSubscriber struct {
	name  string
	start func() (func() error, error)
}

func (s taskSubscriber) Subscribe(ctx context.Context, _ string) (<-chan *message.Message, error) {
	stop, err := s.start()
	if err != nil {
		return nil, err
	}
	out := make(chan *message.Message)
	go func() {
		defer close(out)
		<-ctx.Done()
		if err := stop(); err != nil {
			slog.Error("stopping "+s.name, "error", err)
		}
	}()
	return out, nil
}

// Close is called by the router as it closes; the task stops with the
// subscription's context.
func (s taskSubscriber) Close() error { return nil }
