package amqp

import (
	"context"
	"errors"
	"fmt"
	"regexp"
	"strconv"
	"strings"
	"sync"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/oncemill/oncemill/delivery"
)

// deliveryLimitArg is the quorum queue argument that bounds deliveries.
const deliveryLimitArg = "x-delivery-limit"

// defaultLimit4 is the delivery limit RabbitMQ 4.0 and later apply to a
// quorum queue declared without x-delivery-limit.
const defaultLimit4 = 20

// serverVersion is the major version of a RabbitMQ server, from the
// "version" property it sends when a connection opens; 0 when unknown.
func serverVersion(conn *amqp091.Connection) int {
	v, _ := conn.Properties["version"].(string)
	major, _, _ := strings.Cut(v, ".")
	n, err := strconv.Atoi(major)
	if err != nil {
		return 0
	}
	return n
}

// queueArguments are the arguments a queue is declared with on a server
// of the given major version: x-delivery-limit as DeliveryLimit asks,
// with "no limit" (0 or -1) spelt the way the server reads it: -1 since
// RabbitMQ 4.0, whose quorum queues default to 20; before 4.0 the
// argument left out, since there -1 drops a message at its first return
// and no argument is no limit.
func (c Config) queueArguments(version int) amqp091.Table {
	args := c.QueueArguments()
	if c.DeliveryLimit <= 0 {
		delete(args, deliveryLimitArg)
		if version >= 4 {
			args[deliveryLimitArg] = int64(-1)
		}
	}
	return args
}

// inequivalentLimit matches the broker's PRECONDITION_FAILED reason for a
// queue declared with another x-delivery-limit than it has, and captures
// the current value ("none", or the number). AMQP 0.9.1 has no other way
// to read a queue's arguments: a passive declare returns only counts.
var inequivalentLimit = regexp.MustCompile(`inequivalent arg 'x-delivery-limit' for queue .* but current is (?:(none)|(?:the value )?'(-?\d+)')`)

// currentLimit reads, from the error of a declaration refused for its
// x-delivery-limit, the limit the queue has: set false when it has none.
func currentLimit(err error) (limit int64, set, ok bool) {
	var aerr *amqp091.Error
	if !errors.As(err, &aerr) || aerr.Code != amqp091.PreconditionFailed {
		return 0, false, false
	}
	m := inequivalentLimit.FindStringSubmatch(aerr.Reason)
	if m == nil {
		return 0, false, false
	}
	if m[1] == "none" {
		return 0, false, true
	}
	n, err := strconv.ParseInt(m[2], 10, 64)
	return n, true, err == nil
}

// limitOf is the delivery limit that a quorum queue with args applies on
// a server of the given major version.
func limitOf(queue string, args amqp091.Table, version int) delivery.Limit {
	raise := fmt.Sprintf("raise it with a policy (rabbitmqctl set_policy %s-limit '^%s$' '{\"delivery-limit\":-1}' --apply-to quorum_queues; "+
		"-1 is no limit on RabbitMQ 4.0 and later, a large number before), or delete the queue and let the subscriber declare it anew "+
		"(without delivery_limit: no limit)", queue, regexp.QuoteMeta(queue))
	v, set := args[deliveryLimitArg]
	if !set {
		if version >= 4 {
			return delivery.Limit{Deliveries: defaultLimit4 + 1, Raise: raise,
				Where: fmt.Sprintf("RabbitMQ queue %q (no x-delivery-limit: RabbitMQ %d's default of %d)", queue, version, defaultLimit4)}
		}
		return delivery.Limit{}
	}
	n, _ := toInt64(v)
	if n < 0 && version >= 4 {
		return delivery.Limit{}
	}
	// A message returned more than n times is dropped: n+1 deliveries,
	// one for -1 before RabbitMQ 4.0.
	return delivery.Limit{Deliveries: int(max(n, 0)) + 1, Raise: raise,
		Where: fmt.Sprintf("RabbitMQ queue %q (x-delivery-limit %d)", queue, n)}
}

func toInt64(v any) (int64, bool) {
	switch n := v.(type) {
	case int64:
		return n, true
	case int32:
		return int64(n), true
	case int16:
		return int64(n), true
	case int8:
		return int64(n), true
	case int:
		return int64(n), true
	case uint8:
		return int64(n), true
	case uint16:
		return int64(n), true
	case uint32:
		return int64(n), true
	}
	return 0, false
}

// queues holds the arguments each queue was declared with, as settled
// against the broker, for the topology builder that watermill-amqp runs
// on every (re)subscription, and each topic's delivery limit.
type queues struct {
	mu     sync.Mutex
	args   map[string]amqp091.Table  // by queue
	limits map[string]delivery.Limit // by topic
}

func (q *queues) set(topic, queue string, args amqp091.Table, limit delivery.Limit) {
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.args == nil {
		q.args, q.limits = map[string]amqp091.Table{}, map[string]delivery.Limit{}
	}
	q.args[queue], q.limits[topic] = args, limit
}

func (q *queues) argsOf(queue string) (amqp091.Table, bool) {
	q.mu.Lock()
	defer q.mu.Unlock()
	a, ok := q.args[queue]
	return a, ok
}

func (q *queues) limitOf(topic string) (delivery.Limit, bool) {
	q.mu.Lock()
	defer q.mu.Unlock()
	l, ok := q.limits[topic]
	return l, ok
}

// topology is watermill-amqp's default topology builder, declaring each
// queue with the arguments settled for it.
type topology struct {
	wamqp.DefaultTopologyBuilder
	queues *queues
}

func (t *topology) BuildTopology(ch *amqp091.Channel, params wamqp.BuildTopologyParams, config wamqp.Config, logger watermill.LoggerAdapter) error {
	if args, ok := t.queues.argsOf(params.QueueName); ok {
		config.Queue.Arguments = args
	}
	return t.DefaultTopologyBuilder.BuildTopology(ch, params, config, logger)
}

// settleQueue declares the exchange and queue of topic on conn, as the
// subscriber will, and returns the arguments the queue has and its
// delivery limit. A queue that exists with another x-delivery-limit is
// taken as it is when the config leaves the limit to the poison
// middleware (DeliveryLimit 0), with a line that says so; with a limit
// asked for, it is an error naming the queue, both values and the fix.
func settleQueue(conn *amqp091.Connection, cfg Config, wcfg wamqp.Config, topic string, logger watermill.LoggerAdapter) (amqp091.Table, delivery.Limit, error) {
	version := serverVersion(conn)
	queue := cfg.QueueName(topic)
	args := cfg.queueArguments(version)
	declare := func(args amqp091.Table) error {
		ch, err := conn.Channel()
		if err != nil {
			return fmt.Errorf("open channel: %w", err)
		}
		params := wamqp.BuildTopologyParams{
			Topic:        topic,
			QueueName:    queue,
			ExchangeName: wcfg.Exchange.GenerateName(topic),
			RoutingKey:   wcfg.QueueBind.GenerateRoutingKey(topic),
		}
		c := wcfg
		c.Queue.Arguments = args
		err = (&wamqp.DefaultTopologyBuilder{}).BuildTopology(ch, params, c, watermill.NopLogger{})
		if cerr := ch.Close(); err == nil && cerr != nil && !errors.Is(cerr, amqp091.ErrClosed) {
			err = fmt.Errorf("close channel: %w", cerr)
		}
		return err
	}
	err := declare(args)
	if err == nil {
		return args, limitOf(queue, args, version), nil
	}
	current, set, ok := currentLimit(err)
	if !ok {
		return nil, delivery.Limit{}, fmt.Errorf("%w: topic %q (queue %q): %w", ErrDeclare, topic, queue, err)
	}
	existing := cfg.QueueArguments()
	delete(existing, deliveryLimitArg)
	if set {
		existing[deliveryLimitArg] = current
	}
	if cfg.DeliveryLimit != 0 {
		have := "none"
		if set {
			have = strconv.FormatInt(current, 10)
		}
		return nil, delivery.Limit{}, fmt.Errorf("%w: topic %q (queue %q): the queue exists with x-delivery-limit %s, and the config asks for %d: "+
			"a queue's arguments are fixed when it is first declared; set delivery_limit to its value, leave it out (the queue is taken as it is), "+
			"or change the queue's limit with a policy (rabbitmqctl set_policy … '{\"delivery-limit\":N}' --apply-to quorum_queues): %w",
			ErrDeclare, topic, queue, have, cfg.DeliveryLimit, err)
	}
	if err := declare(existing); err != nil {
		return nil, delivery.Limit{}, fmt.Errorf("%w: topic %q (queue %q): %w", ErrDeclare, topic, queue, err)
	}
	limit := limitOf(queue, existing, version)
	logger.Info("AMQP queue exists with another delivery limit than the default: taken as it is", watermill.LogFields{
		"queue": queue, "limit": limit.Where, "max_deliveries": limit.Deliveries})
	return existing, limit, nil
}

// DeliveryLimit declares the exchange and queue of topic as Subscribe
// does (settling the queue's x-delivery-limit, see [Config.DeliveryLimit])
// on a connection of its own, closed before it returns, and reports the
// queue's delivery limit: a quorum queue drops a message returned more
// than x-delivery-limit times (RabbitMQ 4.0 and later: 20 when the
// argument is left out), and the poison middleware ends a message at its
// last delivery and refuses to start below what its policy needs
// (middleware.Poison.Subscriber). A limit set by a policy cannot be read
// over AMQP and is not seen. It implements delivery.Limiter; a Limit of 0
// deliveries is no limit.
func (s *Subscriber) DeliveryLimit(ctx context.Context, topic string) (delivery.Limit, error) {
	if l, ok := s.queues.limitOf(topic); ok {
		return l, nil
	}
	if err := s.settle(ctx, topic); err != nil {
		return delivery.Limit{}, err
	}
	l, _ := s.queues.limitOf(topic)
	return l, nil
}

// settle settles topic's queue (see settleQueue) on a connection of its
// own and keeps its arguments and limit.
func (s *Subscriber) settle(ctx context.Context, topic string) error {
	if err := checkTopic(s.cfg, topic); err != nil {
		return err
	}
	wcfg, err := s.cfg.WatermillConfig()
	if err != nil {
		return err
	}
	return withConnection(ctx, s.cfg, wcfg, "settle queue", func(conn *amqp091.Connection) error {
		args, limit, err := settleQueue(conn, s.cfg, wcfg, topic, s.logger)
		if err != nil {
			return err
		}
		s.queues.set(topic, s.cfg.QueueName(topic), args, limit)
		return nil
	})
}
