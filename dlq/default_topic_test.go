package dlq_test

import (
	"context"
	"errors"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/dlq"
	"github.com/oncemill/oncemill/middleware"
)

// TestPoisonTopicDefaultsWithTheTable: with the dead-letter table as its
// publisher the poison middleware needs no Topic; the entry is filed under
// dlq.DefaultTopic. Another publisher still needs one.
func TestPoisonTopicDefaultsWithTheTable(t *testing.T) {
	t.Parallel()
	e := setup(t)
	poison, err := middleware.NewPoison(middleware.PoisonConfig{Publisher: e.pub, Consumer: "charge"})
	require.NoError(t, err)
	msg := message.NewMessage(watermill.NewUUID(), []byte(`{}`))
	msg.SetContext(context.Background())
	_, err = poison.Middleware(func(*message.Message) ([]*message.Message, error) {
		return nil, middleware.Permanent(errors.New("unknown currency"))
	})(msg)
	require.NoError(t, err, "dead-lettered and acked")
	entries, err := e.store.List(context.Background(), dlq.Filter{Consumer: "charge"})
	require.NoError(t, err)
	require.Len(t, entries, 1)
	require.Equal(t, dlq.DefaultTopic, entries[0].DLQTopic)
	require.Equal(t, msg.UUID, entries[0].UUID)

	_, err = middleware.NewPoison(middleware.PoisonConfig{Publisher: discard{}})
	require.ErrorContains(t, err, "PoisonConfig.Topic")
}

type discard struct{}

func (discard) Publish(string, ...*message.Message) error { return nil }
func (discard) Close() error                              { return nil }
