package amqp

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp091 "github.com/rabbitmq/amqp091-go"
)

var (
	// ErrUnroutable is wrapped by the error [Publisher.Publish] returns for
	// a message the broker could not route to any queue (basic.return of a
	// mandatory publish): no queue is bound to the topic's exchange. The
	// broker did not keep the message. The message names the exchange, the
	// topic and the broker's reply text.
	ErrUnroutable = errors.New("amqp: message unroutable")
	// ErrNotConfirmed is wrapped by the error [Publisher.Publish] returns
	// when the broker negatively acknowledged a message (basic.nack), or the
	// channel or connection closed before the broker confirmed it: the
	// broker may or may not have it.
	ErrNotConfirmed = errors.New("amqp: publish not confirmed by broker")
	// ErrClosed is returned, wrapped, by [Publisher.Publish] after Close.
	ErrClosed = errors.New("amqp: publisher closed")
)

// Publisher publishes Watermill messages to RabbitMQ: each topic to its
// durable fanout exchange ([Config.ExchangeName]), declared on the first
// Publish to the topic, with persistent delivery mode through [Marshaler].
//
// Every message is published with the mandatory flag and publisher
// confirms, and Publish returns nil only once the broker has confirmed it
// and routed it to at least one queue. A message no queue is bound for is
// returned by the broker (basic.return, which RabbitMQ sends before the
// confirm of the same message) and Publish fails with [ErrUnroutable]
// instead of reporting the dropped message as delivered.
//
// Publisher keeps up to [Config.PublishChannels] AMQP channels, opened on
// demand. Each Publish call holds one channel for its messages, publishes
// them one at a time and waits for each confirm, so a return always belongs
// to the message just published; concurrent calls use other channels, and
// wait for one when all are busy. It is safe for concurrent use.
type Publisher struct {
	cfg    Config
	wcfg   wamqp.Config
	conn   *wamqp.ConnectionWrapper
	logger watermill.LoggerAdapter

	// slots holds one entry per channel the publisher may have open: an
	// idle channel, or nil for one not opened (or discarded). A Publish
	// takes an entry for its duration.
	slots chan *pubChannel

	declaredMu sync.RWMutex
	declared   map[string]bool

	mu       sync.RWMutex
	closed   bool
	inflight sync.WaitGroup
}

var _ message.Publisher = (*Publisher)(nil)

// pubChannel is one confirm-mode AMQP channel and its return notifications.
type pubChannel struct {
	ch *amqp091.Channel
	// returns receives the broker's basic.return messages. One message at
	// most is in flight on the channel and it is drained after each
	// confirm, so a buffer of one never blocks the connection's reader.
	returns chan amqp091.Return
	// broken is set when the channel's state is unknown (a publish or a
	// confirm wait failed): it is closed instead of reused.
	broken bool
}

// NewPublisher connects to the broker at cfg.URL and returns a publisher
// that declares each topic's durable fanout exchange on first use, publishes
// persistent messages with the mandatory flag and returns from Publish only
// after the broker has confirmed each message (publisher confirms) and
// routed it to a queue.
//
// The connection is watermill-amqp's: it starts a goroutine that watches
// the connection and reconnects with backoff when it drops; the publisher's
// Close stops it and closes the connection. A nil logger logs nothing.
//
// The error wraps [ErrInvalidConfig] for a bad cfg and [ErrConnect] when the
// broker cannot be reached; it never contains the URL's password.
func NewPublisher(cfg Config, logger watermill.LoggerAdapter) (*Publisher, error) {
	wcfg, err := cfg.WatermillConfig()
	if err != nil {
		return nil, err
	}
	if logger == nil {
		logger = watermill.NopLogger{}
	}
	cfg = cfg.withDefaults()
	conn, err := wamqp.NewConnection(wcfg.Connection, logger)
	if err != nil {
		return nil, connectError("publisher", cfg.URL, err)
	}
	p := &Publisher{
		cfg:      cfg,
		wcfg:     wcfg,
		conn:     conn,
		logger:   logger,
		slots:    make(chan *pubChannel, cfg.PublishChannels),
		declared: map[string]bool{},
	}
	for range cfg.PublishChannels {
		p.slots <- nil
	}
	logger.Debug("AMQP publisher connected", watermill.LogFields{"url": redactURL(cfg.URL)})
	return p, nil
}

// Publish publishes msgs, in order, to topic's exchange and returns once the
// broker has confirmed and routed them all, or at the first that failed:
// the messages before it are delivered, it and those after it are not (a
// message that failed with [ErrNotConfirmed] may be). Each message is
// published and awaited with its own context.
//
// The error wraps [ErrUnroutable] when no queue is bound to the exchange,
// [ErrNotConfirmed] when the broker nacked a message or the channel closed
// before its confirm, [ErrConnect] while the connection is down (it
// reconnects in the background), [ErrClosed] after Close, or the context's
// error.
func (p *Publisher) Publish(topic string, msgs ...*message.Message) error {
	p.mu.RLock()
	if p.closed {
		p.mu.RUnlock()
		return fmt.Errorf("amqp: publish to %q: %w", topic, ErrClosed)
	}
	p.inflight.Add(1)
	p.mu.RUnlock()
	defer p.inflight.Done()

	if len(msgs) == 0 {
		return nil
	}
	exchange := p.cfg.ExchangeName(topic)
	pc, err := p.acquire(msgs[0].Context())
	if err != nil {
		return fmt.Errorf("amqp: publish to %q: %w", topic, err)
	}
	defer p.release(pc)

	if err := p.declareExchange(pc, topic, exchange); err != nil {
		return err
	}
	for _, msg := range msgs {
		if err := p.publishOne(pc, topic, exchange, msg); err != nil {
			if pc.broken || pc.ch.IsClosed() {
				// The exchange may be gone: declare it again next time.
				p.forget(topic)
			}
			return err
		}
	}
	p.logger.Trace("Published messages to AMQP", watermill.LogFields{"topic": topic, "amqp_exchange_name": exchange, "count": len(msgs)})
	return nil
}

// acquire takes a channel slot, waiting while all are in use, and returns
// its channel, opening one when the slot has none or its channel closed.
func (p *Publisher) acquire(ctx context.Context) (*pubChannel, error) {
	var pc *pubChannel
	select {
	case pc = <-p.slots:
	default:
		select {
		case pc = <-p.slots:
		case <-ctx.Done():
			return nil, fmt.Errorf("waiting for a free channel: %w", ctx.Err())
		}
	}
	if pc != nil && !pc.ch.IsClosed() {
		return pc, nil
	}
	pc, err := p.open()
	if err != nil {
		p.slots <- nil
		return nil, err
	}
	return pc, nil
}

// open opens a confirm-mode channel on the current connection.
func (p *Publisher) open() (*pubChannel, error) {
	if !p.conn.IsConnected() {
		return nil, fmt.Errorf("%w at %s: connection lost, reconnecting", ErrConnect, redactURL(p.cfg.URL))
	}
	ch, err := p.conn.Connection().Channel()
	if err != nil {
		return nil, fmt.Errorf("open channel: %w", err)
	}
	if err := ch.Confirm(false); err != nil {
		_ = ch.Close()
		return nil, fmt.Errorf("put channel in confirm mode: %w", err)
	}
	return &pubChannel{ch: ch, returns: ch.NotifyReturn(make(chan amqp091.Return, 1))}, nil
}

// release gives pc's slot back: with pc for the next Publish, or empty
// when pc is closed or broken (which it closes).
func (p *Publisher) release(pc *pubChannel) {
	if pc.broken || pc.ch.IsClosed() {
		if !pc.ch.IsClosed() {
			if err := pc.ch.Close(); err != nil {
				p.logger.Debug("Cannot close AMQP publish channel", watermill.LogFields{"error": err.Error()})
			}
		}
		pc = nil
	}
	p.slots <- pc
}

// declareExchange declares topic's exchange the first time this publisher
// publishes to topic, as the subscriber declares it.
func (p *Publisher) declareExchange(pc *pubChannel, topic, exchange string) error {
	p.declaredMu.RLock()
	done := p.declared[topic]
	p.declaredMu.RUnlock()
	if done {
		return nil
	}
	if err := p.wcfg.TopologyBuilder.ExchangeDeclare(pc.ch, exchange, p.wcfg); err != nil {
		pc.broken = true
		return fmt.Errorf("amqp: publish to %q: declare exchange %q: %w", topic, exchange, err)
	}
	p.declaredMu.Lock()
	p.declared[topic] = true
	p.declaredMu.Unlock()
	return nil
}

// forget makes the next Publish to topic declare its exchange again.
func (p *Publisher) forget(topic string) {
	p.declaredMu.Lock()
	delete(p.declared, topic)
	p.declaredMu.Unlock()
}

// publishOne publishes msg with the mandatory flag on pc and waits for its
// confirm. The broker sends a basic.return before the confirm of the same
// message, and the client hands it to pc.returns before it completes the
// confirm, so once the confirm is in, a return is there or there is none.
func (p *Publisher) publishOne(pc *pubChannel, topic, exchange string, msg *message.Message) error {
	ctx := msg.Context()
	pub, err := Marshaler{}.Marshal(msg)
	if err != nil {
		return fmt.Errorf("amqp: publish message %s to %q: marshal: %w", msg.UUID, topic, err)
	}
	dc, err := pc.ch.PublishWithDeferredConfirmWithContext(ctx, exchange, "", true, false, pub)
	if err != nil {
		pc.broken = true
		return fmt.Errorf("amqp: publish message %s to exchange %q (topic %q): %w", msg.UUID, exchange, topic, err)
	}
	select {
	case <-dc.Done():
	case <-ctx.Done():
		// The confirm (and maybe a return) may still come: do not let it
		// be taken for the next message's.
		pc.broken = true
		return fmt.Errorf("amqp: publish message %s to exchange %q (topic %q): waiting for confirm: %w", msg.UUID, exchange, topic, ctx.Err())
	}
	select {
	case ret, ok := <-pc.returns:
		if ok {
			return fmt.Errorf("%w: message %s to exchange %q (topic %q): no queue is bound: broker replied %d %s; %s",
				ErrUnroutable, msg.UUID, exchange, topic, ret.ReplyCode, ret.ReplyText, p.declareHint(topic))
		}
	default:
	}
	if !dc.Acked() {
		pc.broken = true
		why := "broker nacked it"
		if pc.ch.IsClosed() {
			why = "channel closed before the broker confirmed it"
		}
		return fmt.Errorf("%w: message %s to exchange %q (topic %q): %s", ErrNotConfirmed, msg.UUID, exchange, topic, why)
	}
	p.logger.Trace("Message published and confirmed", watermill.LogFields{"topic": topic, "message_uuid": msg.UUID})
	return nil
}

// declareHint names the command that declares topic's queue, so that an
// unroutable publish says how to fix it. The publisher does not know its
// consumers' groups: with no ConsumerGroup in its own config it leaves a
// placeholder.
func (p *Publisher) declareHint(topic string) string {
	group := "GROUP"
	if p.cfg.ConsumerGroup != "" {
		group = shellQuote(p.cfg.ConsumerGroup)
	}
	return fmt.Sprintf("declare each consumer group's queue before publishing: oncemill amqp declare --topic %s --group %s (or amqp.Declare; a subscriber declares its own when it subscribes)",
		shellQuote(topic), group)
}

// shellQuote returns s as one shell word: unchanged when it holds only
// characters no shell treats specially, else in single quotes.
func shellQuote(s string) string {
	if s != "" && strings.IndexFunc(s, func(r rune) bool {
		return !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || strings.ContainsRune("._-:/@+=,", r))
	}) < 0 {
		return s
	}
	return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
}

// Close waits for the Publish calls in flight (they end when the broker
// confirms, the connection drops or their message's context ends), closes
// the publisher's channels and its connection, and stops the reconnecting
// goroutine. Publish then fails with [ErrClosed]. Close is idempotent.
func (p *Publisher) Close() error {
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return nil
	}
	p.closed = true
	p.mu.Unlock()
	p.inflight.Wait()

	var errs []error
	for range cap(p.slots) {
		if pc := <-p.slots; pc != nil && !pc.ch.IsClosed() {
			if err := pc.ch.Close(); err != nil && !errors.Is(err, amqp091.ErrClosed) {
				errs = append(errs, fmt.Errorf("amqp: close publish channel: %w", err))
			}
		}
	}
	if err := p.conn.Close(); err != nil {
		errs = append(errs, redactErr(fmt.Errorf("amqp: close publisher connection: %w", err), p.cfg.URL))
	}
	return errors.Join(errs...)
}

// ValidateTopic returns why the broker would refuse topic, or nil: an
// empty topic, an exchange name longer than AMQP's 255 bytes, or one that
// is not valid UTF-8 (RabbitMQ closes the connection with FRAME_ERROR on
// such a name). The error wraps [ErrInvalidTopic]. forwarder.Relay asks
// it before publishing a row (forwarder.TopicValidator) and dead-letters
// a row whose topic it refuses instead of retrying it forever.
func (p *Publisher) ValidateTopic(topic string) error {
	if err := checkTopic(p.cfg, topic); err != nil {
		return err
	}
	if !utf8.ValidString(p.cfg.ExchangeName(topic)) {
		return fmt.Errorf("%w: topic %q is not valid UTF-8, which AMQP names must be", ErrInvalidTopic, topic)
	}
	return nil
}
