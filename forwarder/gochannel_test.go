package forwarder_test

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/adapters"
	"github.com/oncemill/oncemill/forwarder"
	"github.com/oncemill/oncemill/internal/testing/pgtest"
)

// decorated is a publisher decorator, as a metrics or health wrapper is.
type decorated struct{ message.Publisher }

// receive reads n messages from msgs, acking each, and returns their UUIDs.
func receive(t *testing.T, msgs <-chan *message.Message, n int) []string {
	t.Helper()
	var got []string
	for len(got) < n {
		select {
		case m := <-msgs:
			m.Ack()
			got = append(got, m.UUID)
		case <-time.After(30 * time.Second):
			t.Fatalf("received %d of %d messages", len(got), n)
		}
	}
	return got
}

func uuids(msgs ...*message.Message) []string {
	out := make([]string, len(msgs))
	for i, m := range msgs {
		out[i] = m.UUID
	}
	return out
}

// TestRelayRefusesNonPersistentGoChannel: a raw non-persistent GoChannel
// returns nil for messages nobody subscribes to, so NewRelay refuses it.
func TestRelayRefusesNonPersistentGoChannel(t *testing.T) {
	t.Parallel()
	b := setup(t, 2)
	gc := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})
	t.Cleanup(func() { _ = gc.Close() })
	_, err := forwarder.NewRelay(forwarder.RelayConfig{Pool: b.pool, Publisher: gc, Schema: b.schema})
	require.ErrorIs(t, err, forwarder.ErrLossyPublisher)
	require.ErrorContains(t, err, "RelayConfig.Publisher")
}

// TestRelayOverPersistentGoChannel: a persistent GoChannel keeps the
// messages for a later subscriber, so the relay may delete the rows.
func TestRelayOverPersistentGoChannel(t *testing.T) {
	t.Parallel()
	b := setup(t, 2)
	topic := pgtest.Name(t)
	gc := gochannel.NewGoChannel(gochannel.Config{Persistent: true, OutputChannelBuffer: 16}, watermill.NopLogger{})
	t.Cleanup(func() { _ = gc.Close() })
	r := newRelay(t, b, gc, nil)
	events := []*message.Message{event("k", 1), event("k", 2), event("k", 3)}
	b.write(t, topic, events...)
	relayAll(t, r, len(events))
	require.Zero(t, b.count(t, "outbox"))

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	msgs, err := gc.Subscribe(ctx, topic)
	require.NoError(t, err)
	require.ElementsMatch(t, uuids(events...), receive(t, msgs, len(events)), "the subscriber that came later has them")
}

// TestRelayKeepsRowsWhileNothingSubscribesToGoChannel: the GoChannel of
// gochannel:// fails a publish that nobody would receive, through a
// decorator too, and the relay keeps the rows until a subscriber comes.
func TestRelayKeepsRowsWhileNothingSubscribesToGoChannel(t *testing.T) {
	t.Parallel()
	b := setup(t, 2)
	topic := pgtest.Name(t)
	ctx := context.Background()
	ps, err := adapters.Open(ctx, "gochannel://", adapters.Options{})
	require.NoError(t, err)
	t.Cleanup(func() { _ = ps.Close() })
	r := newRelay(t, b, decorated{ps.Publisher}, nil)
	events := []*message.Message{event("k", 1), event("k", 2)}
	b.write(t, topic, events...)

	// The rows come due once every older transaction on the server has
	// ended; until then a batch takes nothing.
	var batchErr error
	require.Eventually(t, func() bool {
		_, batchErr = r.RelayBatch(ctx)
		return batchErr != nil
	}, 30*time.Second, 10*time.Millisecond)
	require.ErrorIs(t, batchErr, adapters.ErrNoSubscribers)
	require.Equal(t, len(events), b.count(t, "outbox"), "the rows stay while nothing subscribes")

	// A subscriber that came and went does not count either.
	gone, cancelGone := context.WithCancel(ctx)
	_, err = ps.Subscriber.Subscribe(gone, topic)
	require.NoError(t, err)
	cancelGone()
	_, err = r.RelayBatch(ctx)
	require.ErrorIs(t, err, adapters.ErrNoSubscribers)
	require.Equal(t, len(events), b.count(t, "outbox"))

	subCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	msgs, err := ps.Subscriber.Subscribe(subCtx, topic)
	require.NoError(t, err)
	relayAll(t, r, len(events))
	require.ElementsMatch(t, uuids(events...), receive(t, msgs, len(events)))
	require.Zero(t, b.count(t, "outbox"))
}
