package brokertest

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/adapters/nats"
)

// NATSPending is what group's durable consumer of topic, on js, has not
// had acked: its messages not yet delivered and those delivered and not
// acked (all of the stream's before the consumer exists).
func NATSPending(t testing.TB, js jetstream.JetStream, topic, group string) int {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	stream := nats.Config{}.StreamName(topic)
	cons, err := js.Consumer(ctx, stream, nats.SubscriberConfig{ConsumerGroup: group}.ConsumerName(topic))
	if errors.Is(err, jetstream.ErrConsumerNotFound) {
		s, err := js.Stream(ctx, stream)
		require.NoError(t, err)
		return int(s.CachedInfo().State.Msgs)
	}
	require.NoError(t, err, "consumer of group %s in stream %s", group, stream)
	info, err := cons.Info(ctx)
	require.NoError(t, err)
	return int(info.NumPending) + info.NumAckPending
}
