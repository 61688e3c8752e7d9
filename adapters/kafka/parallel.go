package kafka

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	wkafka "github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/oncemill/oncemill/adapters"
	"github.com/oncemill/oncemill/adapters/internal/lifecycle"
)

// ErrSubscriberClosed is returned by Subscribe after Close, and wrapped
// by the error of Backlog after Close.
var ErrSubscriberClosed = errors.New("kafka: subscriber closed")

// minBuffered is the least number of records a partition reads ahead of
// its lowest unacked offset; see bufferFor.
const minBuffered = 256

// bufferFor is how many records a partition with the given in-flight limit
// holds, received and not yet acked, before it stops reading from the
// broker: enough that a slow key does not starve the others at once, and
// a bound on memory.
func bufferFor(maxInFlight int) int {
	return max(minBuffered, 4*maxInFlight)
}

// parallelSubscriber is the key-parallel subscriber: a Sarama consumer
// group whose claims hand out messages of different record keys
// concurrently; see the package doc.
type parallelSubscriber struct {
	cfg    SubscriberConfig // with defaults
	sc     *sarama.Config
	logger watermill.LoggerAdapter
	// init creates topics for SubscribeInitialize, as the one-at-a-time
	// subscriber does; it connects to nothing otherwise.
	init *wkafka.Subscriber
	// backlog reads the group's lag, on a client of its own.
	backlog *backlogReader

	// life is Close and the subscriptions it waits for; its context
	// ends when Close begins.
	life *lifecycle.Closer
}

var (
	_ message.Subscriber           = (*parallelSubscriber)(nil)
	_ message.SubscribeInitializer = (*parallelSubscriber)(nil)
)

func newParallelSubscriber(cfg SubscriberConfig, wcfg wkafka.SubscriberConfig, logger watermill.LoggerAdapter) (*parallelSubscriber, error) {
	revokeDefault := cfg.RevokeTimeout == 0
	cfg = cfg.withDefaults()
	sc := wcfg.OverwriteSaramaConfig
	if revokeDefault {
		// Within the rebalance timeout the Sarama hook may have changed,
		// so that a revoked partition's handlers cannot keep the whole
		// group waiting.
		cfg.RevokeTimeout = min(DefaultRevokeTimeout, sc.Consumer.Group.Rebalance.Timeout/2)
	}
	init, err := wkafka.NewSubscriber(wcfg, logger)
	if err != nil {
		return nil, fmt.Errorf("kafka: new subscriber: %w", err)
	}
	return &parallelSubscriber{
		cfg:     cfg,
		sc:      sc,
		logger:  logger.With(watermill.LogFields{"subscriber_uuid": watermill.NewShortUUID()}),
		init:    init,
		backlog: newBacklogReader(cfg.Brokers, sc, cfg.ConsumerGroup),
		life:    lifecycle.New(),
	}, nil
}

// SubscribeInitialize creates topic, if missing, with the configured
// partitions and replication factor.
func (s *parallelSubscriber) SubscribeInitialize(topic string) error {
	return s.init.SubscribeInitialize(topic)
}

// Close stops every subscription: it hands out no more messages, waits up
// to [SubscriberConfig.DrainTimeout] for the handlers of the messages in
// flight to ack or nack, marking each acked offset as it comes, then
// cancels the contexts of the messages still in flight, commits what was
// acked, leaves the group and closes the clients. It does not cancel a
// message's context before the drain timeout (a router that closes
// cancels the Subscribe context, and with it the message contexts,
// itself). It returns once every goroutine the subscriber started has
// stopped (a handler that outlives the drain timeout runs on, in the
// router). It is idempotent and safe for concurrent use.
func (s *parallelSubscriber) Close() error {
	return s.life.Close(func() error {
		return errors.Join(s.init.Close(), s.backlog.close())
	})
}

// Backlog returns the group's lag on topic: per partition, the high
// watermark minus the group's committed offset, which counts the messages
// in flight too (their offsets are not committed yet). It asks on a
// Sarama client of its own, opened on first use and closed by Close,
// whether or not the subscriber has subscribed to topic. See
// adapters.PartitionBacklog.
func (s *parallelSubscriber) Backlog(ctx context.Context, topic string) (adapters.Backlog, error) {
	return s.backlog.Backlog(ctx, topic)
}

// Subscribe joins the consumer group for topic and returns the messages
// of the partitions assigned to this member; the channel is closed once
// ctx is done or the subscriber closed and everything has stopped.
func (s *parallelSubscriber) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	if !s.life.Enter() {
		return nil, ErrSubscriberClosed
	}

	fields := watermill.LogFields{
		"provider":            "kafka",
		"topic":               topic,
		"consumer_group":      s.cfg.ConsumerGroup,
		"kafka_consumer_uuid": watermill.NewShortUUID(),
		"max_in_flight":       s.cfg.MaxInFlightPerPartition,
	}
	client, group, err := s.connect()
	if err != nil {
		s.life.Leave()
		return nil, err
	}
	consumeCtx, cancelConsume := context.WithCancel(context.WithoutCancel(ctx))
	sub := &subscription{
		s:             s,
		ctx:           ctx,
		topic:         topic,
		output:        make(chan *message.Message),
		stop:          make(chan struct{}),
		slots:         newSlots(s.cfg.MaxInFlight),
		consumeCtx:    consumeCtx,
		cancelConsume: cancelConsume,
		fields:        fields,
	}
	s.logger.Info("Subscribing to Kafka topic", fields)
	// Both goroutines are the subscriber's: Close returns once they have
	// stopped. The second holds the place Subscribe entered.
	s.life.Go(func() {
		select {
		case <-s.life.Context().Done():
		case <-ctx.Done():
		}
		sub.halt()
	})
	go func() {
		defer s.life.Leave()
		defer close(sub.output)
		sub.run(client, group)
	}()
	return sub.output, nil
}

// connect starts a Sarama client and a consumer group on it.
func (s *parallelSubscriber) connect() (sarama.Client, sarama.ConsumerGroup, error) {
	client, err := sarama.NewClient(s.cfg.Brokers, s.sc)
	if err != nil {
		return nil, nil, fmt.Errorf("kafka: new client: %w", err)
	}
	group, err := sarama.NewConsumerGroupFromClient(s.cfg.ConsumerGroup, client)
	if err != nil {
		return nil, nil, errors.Join(fmt.Errorf("kafka: new consumer group: %w", err), client.Close())
	}
	return client, group, nil
}

// subscription is one Subscribe call.
type subscription struct {
	s      *parallelSubscriber
	ctx    context.Context // Subscribe's; message contexts derive from it
	topic  string
	output chan *message.Message
	fields watermill.LogFields

	// stop is closed when the subscriber closes or ctx is done.
	stop chan struct{}
	// slots, when MaxInFlight is set, holds a token per message in flight
	// across the subscription's partitions; nil for no such limit.
	slots chan struct{}
	// consumeCtx is the context of the group's sessions. It is cancelled
	// only after stop and after every claim has drained and committed,
	// so that stopping does not look like a rebalance to the claims.
	consumeCtx    context.Context
	cancelConsume context.CancelFunc

	mu      sync.Mutex
	stopped bool
	active  int // claims in ConsumeClaim
}

// halt starts stopping: claims drain, and the sessions end once no claim
// is left.
func (sub *subscription) halt() {
	sub.mu.Lock()
	defer sub.mu.Unlock()
	if sub.stopped {
		return
	}
	sub.stopped = true
	close(sub.stop)
	if sub.active == 0 {
		sub.cancelConsume()
	}
}

func (sub *subscription) isStopped() bool {
	sub.mu.Lock()
	defer sub.mu.Unlock()
	return sub.stopped
}

// enter registers a claim; false once stopping.
func (sub *subscription) enter() bool {
	sub.mu.Lock()
	defer sub.mu.Unlock()
	if sub.stopped {
		return false
	}
	sub.active++
	return true
}

func (sub *subscription) leave() {
	sub.mu.Lock()
	defer sub.mu.Unlock()
	sub.active--
	if sub.stopped && sub.active == 0 {
		sub.cancelConsume()
	}
}

// run consumes until stopped, reconnecting after errors.
func (sub *subscription) run(client sarama.Client, group sarama.ConsumerGroup) {
	s := sub.s
	for {
		if client == nil {
			var err error
			if client, group, err = s.connect(); err != nil {
				s.logger.Error("Cannot reconnect to Kafka", err, sub.fields)
				if !sub.sleep(s.cfg.ReconnectRetrySleep) {
					return
				}
				continue
			}
		}
		errsDone := make(chan struct{})
		go func() {
			defer close(errsDone)
			for err := range group.Errors() {
				s.logger.Error("Sarama consumer group error", err, sub.fields)
			}
		}()
		var failed error
		for sub.consumeCtx.Err() == nil {
			if err := group.Consume(sub.consumeCtx, []string{sub.topic}, handler{sub}); err != nil {
				if sub.consumeCtx.Err() == nil {
					failed = err
				}
				break
			}
		}
		if err := group.Close(); err != nil {
			s.logger.Info("Consumer group closed with error", sub.fields.Add(watermill.LogFields{"err": err.Error()}))
		}
		<-errsDone
		if err := client.Close(); err != nil && !errors.Is(err, sarama.ErrClosedClient) {
			s.logger.Error("Cannot close Kafka client", err, sub.fields)
		}
		client, group = nil, nil
		if failed == nil {
			s.logger.Info("Consuming done", sub.fields)
			return
		}
		s.logger.Error("Consumer group failed, reconnecting", failed, sub.fields)
		if !sub.sleep(s.cfg.ReconnectRetrySleep) {
			return
		}
	}
}

// sleep waits d, or less if stopping; false if stopping.
func (sub *subscription) sleep(d time.Duration) bool {
	if d == NoSleep {
		d = 0
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return sub.consumeCtx.Err() == nil
	case <-sub.consumeCtx.Done():
		return false
	}
}

// handler is the subscription's sarama.ConsumerGroupHandler.
type handler struct{ sub *subscription }

// Setup does nothing.
func (handler) Setup(sarama.ConsumerGroupSession) error { return nil }

// Cleanup commits what the claims marked, before the group rebalances or
// the subscription stops; the claims mark only acked offsets.
func (handler) Cleanup(sess sarama.ConsumerGroupSession) error {
	sess.Commit()
	return nil
}

// ConsumeClaim runs one partition until it is revoked or the subscription
// stops.
func (h handler) ConsumeClaim(sess sarama.ConsumerGroupSession, claim sarama.ConsumerGroupClaim) error {
	if !h.sub.enter() {
		return nil
	}
	defer h.sub.leave()
	p := newPartition(h.sub, sess, claim)
	defer p.cancel()
	p.run()
	return nil
}
