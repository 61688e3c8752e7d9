package kafka

import (
	"fmt"
	"os"
	"strings"

	"github.com/ThreeDotsLabs/watermill"
	wkafka "github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
)

// BrokersEnv is the environment variable that [BrokersFromEnv] reads:
// comma-separated host:port seed brokers of a real cluster for tests.
const BrokersEnv = "ONCEMILL_KAFKA_BROKERS"

// NewSubscriber returns a subscriber configured by cfg; a nil logger logs
// nothing. With a ConsumerGroup and [SubscriberConfig.MaxInFlightPerPartition]
// above 1 (the default is 64) it is the key-parallel subscriber, built on
// a Sarama consumer group with the Sarama config of
// [SubscriberConfig.WatermillConfig]; otherwise it is watermill-kafka's
// subscriber with that config, one message per partition at a time
// (wrapped, with a ConsumerGroup, to report the group's backlog). See the
// package doc for both.
//
// It connects to nothing and starts no goroutine until Subscribe or
// Backlog; each
// Subscribe starts a Sarama client and goroutines that the subscriber's
// Close stops, after it has committed what was acked. The subscriber also
// implements message.SubscribeInitializer and, with a ConsumerGroup,
// adapters.Backlogger: its Backlog reports the group's lag per partition,
// on a Sarama client of its own that it opens on first use and Close
// closes. Without a ConsumerGroup nothing is committed, so there is no
// lag to report, and the subscriber is watermill-kafka's own.
func NewSubscriber(cfg SubscriberConfig, logger watermill.LoggerAdapter) (message.Subscriber, error) {
	wcfg, err := cfg.WatermillConfig()
	if err != nil {
		return nil, err
	}
	if logger == nil {
		logger = watermill.NopLogger{}
	}
	if cfg.ConsumerGroup != "" && cfg.withDefaults().MaxInFlightPerPartition > 1 {
		return newParallelSubscriber(cfg, wcfg, logger)
	}
	sub, err := wkafka.NewSubscriber(wcfg, logger)
	if err != nil {
		return nil, fmt.Errorf("kafka: new subscriber: %w", err)
	}
	if cfg.ConsumerGroup == "" {
		return sub, nil
	}
	return &groupSubscriber{Subscriber: sub, backlog: newBacklogReader(wcfg.Brokers, wcfg.OverwriteSaramaConfig, cfg.ConsumerGroup)}, nil
}

// BrokersFromEnv returns the seed brokers in the [BrokersEnv] environment
// variable, or nil if it is unset or empty. Tests use it to run against a
// real cluster instead of an embedded one.
func BrokersFromEnv() []string {
	var brokers []string
	for _, b := range strings.Split(os.Getenv(BrokersEnv), ",") {
		if b = strings.TrimSpace(b); b != "" {
			brokers = append(brokers, b)
		}
	}
	return brokers
}
