package nats

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	natsgo "github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// requestTimeout bounds one JetStream API request, ack or heartbeat that
// no other setting bounds.
const requestTimeout = 10 * time.Second

// client is one connection to NATS and the streams of the topics it has
// used.
type client struct {
	cfg    Config
	nc     *natsgo.Conn
	js     jetstream.JetStream
	logger watermill.LoggerAdapter

	mu      sync.Mutex
	streams map[string]jetstream.Stream // by topic
}

// connect opens a connection named name and checks that the account has
// JetStream, all within ctx and cfg.ConnectTimeout.
func connect(ctx context.Context, cfg Config, name string) (*client, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	timeout := cfg.ConnectTimeout
	if dl, ok := ctx.Deadline(); ok {
		timeout = max(min(timeout, time.Until(dl)), time.Millisecond)
	}
	logger := cfg.Logger
	opts := append([]natsgo.Option{
		natsgo.Name(name),
		natsgo.Timeout(timeout),
		// A subscriber outlives outages: it reconnects for as long as it
		// runs, and its heartbeats cancel the messages it cannot keep.
		natsgo.MaxReconnects(-1),
		natsgo.DisconnectErrHandler(func(_ *natsgo.Conn, err error) {
			if err != nil {
				logger.Error("Disconnected from NATS, reconnecting", err, nil)
			}
		}),
		natsgo.ReconnectHandler(func(nc *natsgo.Conn) {
			logger.Info("Reconnected to NATS", watermill.LogFields{"server": nc.ConnectedAddr()})
		}),
	}, cfg.Options...)
	safe := redactURL(cfg.URL)
	nc, err := natsgo.Connect(cfg.URL, opts...)
	if err != nil {
		if isTimeout(err) {
			return nil, fmt.Errorf("nats: connect to %s: no answer within %s: %w", safe, timeout.Round(time.Millisecond), err)
		}
		return nil, fmt.Errorf("nats: connect to %s: %w", safe, err)
	}
	js, err := jetstream.New(nc)
	if err != nil {
		nc.Close()
		return nil, fmt.Errorf("nats: %w", err)
	}
	actx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	if _, err := js.AccountInfo(actx); err != nil {
		nc.Close()
		switch {
		case errors.Is(err, jetstream.ErrJetStreamNotEnabled), errors.Is(err, jetstream.ErrJetStreamNotEnabledForAccount):
			return nil, fmt.Errorf("%w on %s: start nats-server with -js, or enable JetStream for the account: %w", ErrNoJetStream, safe, err)
		case errors.Is(err, natsgo.ErrNoResponders):
			return nil, fmt.Errorf("%w on %s (no JetStream API answers): start nats-server with -js: %w", ErrNoJetStream, safe, err)
		}
		return nil, fmt.Errorf("nats: JetStream account info from %s: %w", safe, err)
	}
	return &client{cfg: cfg, nc: nc, js: js, logger: logger, streams: map[string]jetstream.Stream{}}, nil
}

// isTimeout reports whether err says that a server did not answer in
// time.
func isTimeout(err error) bool {
	var nerr net.Error
	return errors.Is(err, natsgo.ErrTimeout) || errors.Is(err, os.ErrDeadlineExceeded) ||
		errors.Is(err, context.DeadlineExceeded) || (errors.As(err, &nerr) && nerr.Timeout())
}

// stream returns topic's stream after checking that it exists and that its
// subjects hold topic; it creates a missing stream when create is set and
// the topic has a stream of its own. The stream is looked up once per
// topic.
func (c *client) stream(ctx context.Context, topic string, create bool) (jetstream.Stream, error) {
	if why := invalidTopic(topic); why != "" {
		return nil, fmt.Errorf("%w: topic %q %s", ErrInvalidTopic, topic, why)
	}
	c.mu.Lock()
	s, ok := c.streams[topic]
	c.mu.Unlock()
	if ok {
		return s, nil
	}
	name := c.cfg.StreamName(topic)
	if why := invalidName(name); why != "" {
		return nil, fmt.Errorf("%w: topic %q makes stream name %q, which %s", ErrInvalidTopic, topic, name, why)
	}
	ctx, cancel := context.WithTimeout(ctx, requestTimeout)
	defer cancel()
	s, err := c.js.Stream(ctx, name)
	switch {
	case errors.Is(err, jetstream.ErrStreamNotFound) && create && !c.cfg.shared():
		s, err = c.js.CreateStream(ctx, jetstream.StreamConfig{
			Name:        name,
			Description: "Topic " + topic + ", created by oncemill",
			Subjects:    []string{topic},
			Retention:   jetstream.LimitsPolicy,
			Storage:     jetstream.FileStorage,
			Replicas:    c.cfg.Replicas,
			Duplicates:  c.cfg.DuplicateWindow,
		})
		if errors.Is(err, jetstream.ErrStreamNameAlreadyInUse) {
			// Created meanwhile by another process, maybe with
			// another config: check its subjects below.
			s, err = c.js.Stream(ctx, name)
		}
		if err != nil {
			return nil, fmt.Errorf("nats: create stream %q for topic %q: %w", name, topic, err)
		}
		c.logger.Info("Created JetStream stream", watermill.LogFields{"stream": name, "topic": topic})
	case errors.Is(err, jetstream.ErrStreamNotFound):
		hint := "set CreateStreams (create=true in a URL), or create it: nats stream add " + name + " --subjects '" + topic + "'"
		if c.cfg.shared() {
			hint = "create it with subjects that hold the topics, such as: nats stream add " + name + " --subjects '" + topic + "'"
		}
		return nil, fmt.Errorf("%w: stream %q for topic %q; %s", ErrStreamNotFound, name, topic, hint)
	case err != nil:
		return nil, fmt.Errorf("nats: look up stream %q for topic %q: %w", name, topic, err)
	}
	subjects := s.CachedInfo().Config.Subjects
	if !slices.ContainsFunc(subjects, func(p string) bool { return subjectMatches(p, topic) }) {
		return nil, fmt.Errorf("%w: stream %q holds subjects %s, not topic %q", ErrTopicNotInStream, name, strings.Join(subjects, ", "), topic)
	}
	c.mu.Lock()
	c.streams[topic] = s
	c.mu.Unlock()
	return s, nil
}

// forget drops topic's stream from the cache, after an error that says it
// may be gone, so that the next call looks it up (or creates it) again.
func (c *client) forget(topic string) {
	c.mu.Lock()
	delete(c.streams, topic)
	c.mu.Unlock()
}

// close closes the connection, sending what it buffered first.
func (c *client) close() {
	if err := c.nc.FlushTimeout(requestTimeout); err != nil && !errors.Is(err, natsgo.ErrConnectionClosed) {
		c.logger.Info("Cannot flush the NATS connection before closing it", watermill.LogFields{"err": err.Error()})
	}
	c.nc.Close()
}
