package dlq_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/dlq"
	"github.com/oncemill/oncemill/internal/testing/msgtest"
	"github.com/oncemill/oncemill/internal/testing/sqltest"
)

// TestWithdrawnReplayOfMessageDeadAgain: an entry whose replay to its
// consumer was requested, whose message was dead-lettered again meanwhile
// (the request takes the entry out of the one-entry rule, so a second
// entry was written), and whose key has no record in the inbox, so the
// replay subscriber withdraws the request. The message is left with one
// entry: the one the replay was requested for (its id, when it first
// failed and when it died), carrying the newer failure (error, attempts,
// last failure), its request withdrawn, and the withdrawal logs its
// refusal once rather than failing at every poll.
func TestWithdrawnReplayOfMessageDeadAgain(t *testing.T) {
	t.Parallel()
	for _, be := range sqltest.Backends {
		for _, both := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/twin requested too=%t", be.Name, both), func(t *testing.T) {
				t.Parallel()
				withdrawTwins(t, func(t *testing.T, logger watermill.LoggerAdapter) (*dlq.Store, message.Publisher, *dlq.ReplaySubscriber) {
					b := open(t, be)
					sub, err := b.replays(dlq.ReplaySubscriberConfig{Consumer: "charge", PollInterval: 10 * time.Millisecond, Logger: logger})
					require.NoError(t, err)
					return b.store, b.pub, sub
				}, both)
			})
		}
	}
}

// withdrawBackend opens a dead-letter table with the store, publisher and
// replay subscriber (consumer "charge", logging to logger) on it.
type withdrawBackend func(t *testing.T, logger watermill.LoggerAdapter) (*dlq.Store, message.Publisher, *dlq.ReplaySubscriber)

// withdrawTwins runs TestWithdrawnReplayOfMessageDeadAgain on the backend
// open makes; both says that the replay of the second entry is requested
// too (an operator asking again for every entry of the consumer), so that
// the first one's request is withdrawn alone and the second's meets it.
func withdrawTwins(t *testing.T, open withdrawBackend, both bool) {
	ctx := context.Background()
	logger := watermill.NewCaptureLogger()
	store, pub, sub := open(t, logger)

	// Dead-lettered, with no record of its key in the inbox table
	// (the consumer's inbox is elsewhere, or the record expired).
	older := dead("orders", "charge", "card declined")
	require.NoError(t, pub.Publish("orders.dlq", older))
	entries, err := store.List(ctx, dlq.Filter{})
	require.NoError(t, err)
	require.Len(t, entries, 1)
	first := entries[0]
	n, err := store.RequestReplay(ctx, dlq.Filter{IDs: []int64{first.ID}})
	require.NoError(t, err)
	require.Equal(t, 1, n)

	// The same message dead-lettered again, with a newer failure,
	// while the replay is requested.
	newer := message.NewMessage(older.UUID, older.Payload)
	for k, v := range older.Metadata {
		newer.Metadata.Set(k, v)
	}
	newer.Metadata.Set(delivery.DeadError, "gateway timeout")
	newer.Metadata.Set(delivery.DeadAttempts, "3")
	newer.Metadata.Set(delivery.DeadFirstFailedAt, "2026-03-02T09:00:00Z")
	newer.Metadata.Set(delivery.DeadLastFailedAt, "2026-03-02T09:01:00Z")
	require.NoError(t, pub.Publish("orders.dlq", newer))
	entries, err = store.List(ctx, dlq.Filter{})
	require.NoError(t, err)
	require.Len(t, entries, 2, "a requested entry is outside the one-entry rule")
	refusals := 1
	if both {
		n, err := store.RequestReplay(ctx, dlq.Filter{Consumer: "charge"})
		require.NoError(t, err)
		require.Equal(t, 1, n)
		refusals = 2
	}

	msgs, err := sub.Subscribe(ctx, "orders")
	require.NoError(t, err)
	// A second of polls (about a hundred at 10 ms): nothing is
	// delivered, the key having no record to grant on.
	msgtest.Nothing(t, msgs, time.Second)
	require.NoError(t, sub.Close())

	captured := logger.Captured()[watermill.ErrorLogLevel]
	var refused, failed int
	for _, c := range captured {
		switch c.Msg {
		case "Replay refused, its request withdrawn; the entry stays":
			refused++
		default:
			failed++
		}
	}
	entries, err = store.List(ctx, dlq.Filter{})
	require.NoError(t, err)
	t.Logf("after 1 s of polls: %d entries, %d refusals logged, %d other errors logged", len(entries), refused, failed)
	require.LessOrEqual(t, failed, 1, "errors logged in a second of polls: %v", captured)
	require.Equal(t, refusals, refused, "each refusal is logged once")

	require.Len(t, entries, 1, "one entry for the message")
	kept := entries[0]
	require.Equal(t, first.ID, kept.ID, "the entry the replay was requested for stays")
	require.Equal(t, older.UUID, kept.UUID)
	require.Equal(t, "gateway timeout", kept.Error, "with the newest failure")
	require.Equal(t, 3, kept.Attempts)
	require.Equal(t, time.Date(2026, 3, 2, 9, 1, 0, 0, time.UTC), kept.LastFailedAt.UTC())
	require.Equal(t, "gateway timeout", kept.Metadata[delivery.DeadError], "its metadata is the newest failure's")
	require.Equal(t, first.FirstFailedAt, kept.FirstFailedAt, "and the time of its first failure")
	require.Equal(t, first.DeadAt, kept.DeadAt, "and the time it first died")
	require.Equal(t, older.Payload, message.Payload(kept.Payload))

	n, err = store.RequestReplay(ctx, dlq.Filter{IDs: []int64{kept.ID}})
	require.NoError(t, err)
	require.Equal(t, 1, n, "its request was withdrawn: it can be asked again")
}
