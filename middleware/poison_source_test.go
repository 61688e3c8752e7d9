package middleware_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/stretchr/testify/require"

	dlv "github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/internal/testing/msgtest"
	"github.com/oncemill/oncemill/middleware"
)

// TestPoisonRecordsWhoCountedAndWhere: a dead letter says who counted its
// attempts (the broker, or the consumer's memory on a broker without a
// count) and keeps the broker's place of the original: Kafka partition and
// offset, JetStream stream and sequence.
func TestPoisonRecordsWhoCountedAndWhere(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name   string
		facts  map[string]string
		source string
		place  map[string]string
	}{
		{"rabbitmq", map[string]string{dlv.Attempts: "5", dlv.Redelivered: "true"}, dlv.AttemptsFromBroker, nil},
		{"nats", map[string]string{dlv.Attempts: "5", dlv.Stream: "ORDERS", dlv.StreamSequence: "77"}, dlv.AttemptsFromBroker,
			map[string]string{dlv.DeadStream: "ORDERS", dlv.DeadStreamSequence: "77"}},
		{"kafka", map[string]string{dlv.Partition: "2", dlv.Offset: "1234"}, dlv.AttemptsFromProcess,
			map[string]string{dlv.DeadPartition: "2", dlv.DeadOffset: "1234"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			dead := gochannel.NewGoChannel(gochannel.Config{Persistent: true}, watermill.NopLogger{})
			t.Cleanup(func() { require.NoError(t, dead.Close()) })
			poison, err := middleware.NewPoison(middleware.PoisonConfig{
				Publisher: dead, Topic: deadTopic, MaxAttempts: 1, Consumer: "charge",
				InitialBackoff: time.Millisecond, MaxBackoff: time.Millisecond,
			})
			require.NoError(t, err)
			msg := delivery("order-"+tc.name, "x")
			for k, v := range tc.facts {
				msg.Metadata.Set(k, v)
			}
			_, err = poison.Middleware(func(*message.Message) ([]*message.Message, error) {
				return nil, errors.New("boom")
			})(msg)
			require.NoError(t, err)
			msgs, err := dead.Subscribe(context.Background(), deadTopic)
			require.NoError(t, err)
			got := msgtest.Receive(t, msgs, 10*time.Second)
			got.Ack()
			require.Equal(t, tc.source, got.Metadata.Get(dlv.DeadAttemptsSource))
			for _, k := range []string{dlv.DeadPartition, dlv.DeadOffset, dlv.DeadStream, dlv.DeadStreamSequence} {
				require.Equal(t, tc.place[k], got.Metadata.Get(k), k)
			}
		})
	}
}
