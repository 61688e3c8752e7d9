package amqp

import (
	"context"
	"errors"
	"fmt"
	"net"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	amqp091 "github.com/rabbitmq/amqp091-go"
)

var (
	// ErrDeclare is wrapped by the error [Declare] returns when the broker
	// refuses a declaration, for instance PRECONDITION_FAILED for a queue
	// that exists with other arguments; the message names the topic.
	ErrDeclare = errors.New("amqp: cannot declare topology")
	// ErrInvalidTopic is wrapped by the error [Declare] returns for a topic
	// that names no valid exchange or queue.
	ErrInvalidTopic = errors.New("amqp: invalid topic")
)

// defaultHandshakeTimeout bounds the TCP and AMQP handshake of [Declare]
// when neither the URL nor ctx sets an earlier bound; it is amqp091's.
const defaultHandshakeTimeout = 30 * time.Second

// maxNameLength is the longest exchange or queue name AMQP 0.9.1 allows.
const maxNameLength = 255

// Declare creates, for each topic, the topology a subscriber with cfg
// declares when it subscribes: the topic's durable fanout exchange
// ([Config.ExchangeName]), the durable quorum queue [Config.QueueName] with
// [Config.QueueArguments], and the binding between them. Run it before
// producers start, at deployment: until the queue is bound, the broker
// drops (or, to a [Publisher], returns as [ErrUnroutable]) every message
// published to the topic, including those of producers that are not Go.
//
// Declaring what exists with the same settings changes nothing, so Declare
// may run on every deployment. It opens its own connection, closed before
// it returns; ctx bounds the whole call, and the connect timeout of cfg (if
// any) the connection attempt.
//
// The error wraps [ErrInvalidConfig] for a bad cfg, [ErrInvalidTopic] for an
// empty or too long topic, [ErrConnect] when the broker cannot be reached
// and [ErrDeclare] when it refuses a declaration (the *amqp091.Error is in
// the chain); it never contains the URL's password.
func Declare(ctx context.Context, cfg Config, topics ...string) error {
	wcfg, err := cfg.WatermillConfig()
	if err != nil {
		return err
	}
	if len(topics) == 0 {
		return fmt.Errorf("%w: no topic given", ErrInvalidTopic)
	}
	for _, topic := range topics {
		if err := checkTopic(cfg, topic); err != nil {
			return err
		}
	}

	return withConnection(ctx, cfg, wcfg, "declare", func(conn *amqp091.Connection) error {
		for _, topic := range topics {
			// The subscriber's own settling, so that the subscriber's
			// later declarations match these exactly.
			if _, _, err := settleQueue(conn, cfg, wcfg, topic, watermill.NopLogger{}); err != nil {
				return err
			}
		}
		return nil
	})
}

// withConnection runs fn on a connection of its own to the broker of cfg,
// closed before it returns; ctx bounds the whole call, and the connect
// timeout of cfg (if any) the connection attempt. Errors never contain
// the URL's password.
func withConnection(ctx context.Context, cfg Config, wcfg wamqp.Config, what string, fn func(*amqp091.Connection) error) (err error) {
	conn, err := dial(ctx, wcfg)
	if err != nil {
		return connectError(what, cfg.URL, errors.Join(err, ctx.Err()))
	}
	defer func() {
		if cerr := conn.Close(); cerr != nil && !errors.Is(cerr, amqp091.ErrClosed) {
			err = errors.Join(err, redactErr(fmt.Errorf("amqp: %s: close connection: %w", what, cerr), cfg.URL))
		}
	}()
	// The client's calls take no context: closing the connection when ctx
	// ends makes the pending one fail.
	closed := make(chan struct{})
	stop := context.AfterFunc(ctx, func() {
		defer close(closed)
		_ = conn.Close()
	})
	defer func() {
		if !stop() {
			<-closed
		}
	}()
	if err := fn(conn); err != nil {
		return redactErr(errors.Join(err, ctx.Err()), cfg.URL)
	}
	return nil
}

// dial connects to the URL the subscriber dials, within ctx and the
// connect timeout it applies.
func dial(ctx context.Context, wcfg wamqp.Config) (*amqp091.Connection, error) {
	uri := wcfg.Connection.AmqpURI
	timeout := defaultHandshakeTimeout
	if parsed, err := amqp091.ParseURI(uri); err == nil && parsed.ConnectionTimeout > 0 {
		timeout = time.Duration(parsed.ConnectionTimeout) * time.Millisecond
	}
	return amqp091.DialConfig(uri, amqp091.Config{Dial: dialContext(ctx, timeout)})
}

// checkTopic reports a topic whose exchange or queue name AMQP cannot carry.
func checkTopic(cfg Config, topic string) error {
	if topic == "" {
		return fmt.Errorf("%w: topic is empty", ErrInvalidTopic)
	}
	for _, n := range []struct{ what, name string }{
		{"exchange", cfg.ExchangeName(topic)},
		{"queue", cfg.QueueName(topic)},
	} {
		if len(n.name) > maxNameLength {
			return fmt.Errorf("%w: the %s name of topic %q is %d bytes long, AMQP allows at most %d",
				ErrInvalidTopic, n.what, topic, len(n.name), maxNameLength)
		}
	}
	return nil
}

// dialContext returns an amqp091 dial function that connects within ctx and
// timeout and sets a deadline for the handshake, as amqp091.DefaultDial does
// (the client clears it once the connection is open).
func dialContext(ctx context.Context, timeout time.Duration) func(network, addr string) (net.Conn, error) {
	return func(network, addr string) (net.Conn, error) {
		deadline := time.Now().Add(timeout)
		if d, ok := ctx.Deadline(); ok && d.Before(deadline) {
			deadline = d
		}
		d := net.Dialer{Deadline: deadline}
		conn, err := d.DialContext(ctx, network, addr)
		if err != nil {
			return nil, err
		}
		if err := conn.SetDeadline(deadline); err != nil {
			_ = conn.Close()
			return nil, err
		}
		return conn, nil
	}
}
