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

// noRespondersRetryMin and noRespondersRetryMax bound the pause before a
// request answered "no responders" is sent again (see client.request).
const (
	noRespondersRetryMin = 50 * time.Millisecond
	noRespondersRetryMax = time.Second
)

// client is one connection to NATS and the streams of the topics it has
// used.
type client struct {
	cfg    Config
	nc     *natsgo.Conn
	js     jetstream.JetStream
	logger watermill.LoggerAdapter

	mu      sync.Mutex
	streams map[string]jetstream.Stream // by topic

	// The state of the connection, for the requests that must not wait
	// for an answer that a dropped connection lost (see link).
	linkMu    sync.Mutex
	connected bool
	lost      context.Context    // done once the current connection drops
	drop      context.CancelFunc // ends lost
	up        chan struct{}      // closed while connected
	statuses  chan natsgo.Status
	watched   chan struct{} // closed when watch has returned
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
	c := &client{cfg: cfg, nc: nc, js: js, logger: logger, streams: map[string]jetstream.Stream{},
		up: make(chan struct{}), statuses: nc.StatusChanged(), watched: make(chan struct{})}
	c.setLink(nc.Status() == natsgo.CONNECTED)
	go c.watch()
	return c, nil
}

// watch follows the connection's status until it closes. It reads the
// status afresh on every event rather than trusting the event, which
// nats.go drops when the channel is full.
func (c *client) watch() {
	defer close(c.watched)
	for range c.statuses {
		c.setLink(c.nc.Status() == natsgo.CONNECTED)
	}
}

// setLink records whether the connection is up: a drop ends the lost
// context of the connection that was up, and the next connection gets a
// lost context of its own.
func (c *client) setLink(connected bool) {
	c.linkMu.Lock()
	defer c.linkMu.Unlock()
	switch {
	case connected && !c.connected:
		c.lost, c.drop = context.WithCancel(context.Background())
		close(c.up)
	case !connected && c.connected:
		c.drop()
		c.up = make(chan struct{})
	}
	c.connected = connected
}

// link waits until the client is connected, or ctx ends, and returns a
// context that ends when that connection drops. A request sent on a
// connection that drops before the server answers it is lost with the
// connection, and nats.go would wait for the answer until the request's
// own timeout: a publish or a pull that stops waiting when the context
// ends can be sent again at once on the next connection.
func (c *client) link(ctx context.Context) (context.Context, error) {
	for {
		c.linkMu.Lock()
		connected, lost, up := c.connected, c.lost, c.up
		c.linkMu.Unlock()
		if connected {
			return lost, nil
		}
		select {
		case <-up:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
}

// request sends body to subject as a request and waits for the answer
// within ctx, on the current connection or the next one: a request whose
// connection drops before the answer came is sent again, so body must be
// one that the receiver can take twice.
//
// A request answered "no responders" is sent again too, after a pause
// that doubles from noRespondersRetryMin to noRespondersRetryMax, or at
// once on the next connection if this one drops meanwhile. The subjects
// request serves are a JetStream consumer's reply subjects, which have no
// responder only for a while: a server shutting down stops JetStream
// before it closes the connections, and a clustered consumer may have
// none while it changes leader. An ack given up on would have its message
// delivered again after the ack wait. When ctx ends first, request
// returns [natsgo.ErrNoResponders].
func (c *client) request(ctx context.Context, subject string, body []byte) error {
	pause := noRespondersRetryMin
	for {
		lost, err := c.link(ctx)
		if err != nil {
			return fmt.Errorf("not connected to NATS: %w", err)
		}
		rctx, cancel := context.WithCancel(ctx)
		stop := context.AfterFunc(lost, cancel)
		_, err = c.nc.RequestWithContext(rctx, subject, body)
		stop()
		cancel()
		switch {
		case err == nil || ctx.Err() != nil:
			return err
		case lost.Err() != nil:
			continue
		case errors.Is(err, natsgo.ErrNoResponders):
			t := time.NewTimer(pause)
			select {
			case <-t.C:
			case <-lost.Done():
			case <-ctx.Done():
				t.Stop()
				return err
			}
			t.Stop()
			pause = min(2*pause, noRespondersRetryMax)
			continue
		}
		return err
	}
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
	c.nc.RemoveStatusListener(c.statuses)
	<-c.watched
	c.setLink(false)
}
