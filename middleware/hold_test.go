package middleware_test

import (
	"context"
	"errors"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/dedup"
	dlv "github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/middleware"
)

// brokerMsg is a delivery whose broker counted it attempts times, of at
// most maxDeliveries (0: no limit).
func brokerMsg(key string, attempts, maxDeliveries int) *message.Message {
	m := hookMsg(key)
	m.Metadata.Set(dlv.Attempts, strconv.Itoa(attempts))
	if maxDeliveries > 0 {
		m.Metadata.Set(dlv.MaxDeliveries, strconv.Itoa(maxDeliveries))
	}
	return m
}

func holdPoison(t *testing.T, sink *deadSink, cfg middleware.PoisonConfig) *middleware.Poison {
	t.Helper()
	cfg.Publisher, cfg.Topic, cfg.Consumer = sink, "dlq", "charge"
	if cfg.InitialBackoff == 0 {
		cfg.InitialBackoff, cfg.MaxBackoff = time.Millisecond, 20*time.Millisecond
	}
	p, err := middleware.NewPoison(cfg)
	require.NoError(t, err)
	return p
}

// TestOutageIsHeldNotNacked: a delivery whose dependency is down
// (Unavailable) is held and tried again in process, uncounted, until the
// dependency answers, then acked: no nack spends a broker delivery. Past
// OutageHold it is nacked once.
func TestOutageIsHeldNotNacked(t *testing.T) {
	t.Parallel()
	sink := &deadSink{}
	p := holdPoison(t, sink, middleware.PoisonConfig{MaxAttempts: 2})
	var runs atomic.Int32
	back := time.Now().Add(300 * time.Millisecond)
	_, err := p.Middleware(func(*message.Message) ([]*message.Message, error) {
		runs.Add(1)
		if time.Now().Before(back) {
			return nil, middleware.Unavailable(errors.New("payment API: 503"))
		}
		return nil, nil
	})(brokerMsg("order-1", 1, 0))
	require.NoError(t, err, "held through the outage, then acked")
	require.Greater(t, runs.Load(), int32(2), "tried again in process")
	st := p.Stats()
	require.Zero(t, st.Retried, "no attempt counted")
	require.Zero(t, st.DeadLettered)
	require.Positive(t, st.Infrastructure)
	require.Empty(t, sink.msgs)

	short := holdPoison(t, sink, middleware.PoisonConfig{MaxAttempts: 2, OutageHold: 100 * time.Millisecond})
	began := time.Now()
	_, err = short.Middleware(func(*message.Message) ([]*message.Message, error) {
		return nil, middleware.Unavailable(errors.New("payment API: 503"))
	})(brokerMsg("order-2", 1, 0))
	require.ErrorIs(t, err, dedup.ErrUnavailable, "nacked once the hold ended")
	require.True(t, middleware.IsInfrastructure(err))
	require.GreaterOrEqual(t, time.Since(began), 100*time.Millisecond, "held for OutageHold first")
	require.Zero(t, short.Stats().Retried)
	require.Empty(t, sink.msgs)
}

// TestLastDeliveryIsEndedHere: at the broker's last delivery of a message
// (delivery.Attempts reached delivery.MaxDeliveries) a failure that would
// be nacked for redelivery is dead-lettered with ErrDeliveryLimit; an
// outage is held past OutageHold, as long as the consumer runs; and a
// consumer that stops at the last delivery dead-letters it (no retries
// store to park it in) instead of nacking it, which would have the broker
// drop it.
func TestLastDeliveryIsEndedHere(t *testing.T) {
	t.Parallel()
	t.Run("failure", func(t *testing.T) {
		t.Parallel()
		sink := &deadSink{}
		p := holdPoison(t, sink, middleware.PoisonConfig{MaxAttempts: 10, InProcessRetries: middleware.NoInProcessRetries})
		fail := func(*message.Message) ([]*message.Message, error) { return nil, errors.New("ledger refuses") }
		_, err := p.Middleware(fail)(brokerMsg("order-1", 2, 3))
		require.Error(t, err, "not the last delivery: nacked for redelivery")
		require.Empty(t, sink.msgs)
		_, err = p.Middleware(fail)(brokerMsg("order-1", 3, 3))
		require.NoError(t, err, "the last delivery: acked once dead-lettered")
		require.Len(t, sink.msgs, 1)
		reason := sink.msgs[0].Metadata.Get(dlv.DeadError)
		require.Contains(t, reason, "the broker's delivery limit is reached (3 deliveries")
		require.Contains(t, reason, "ledger refuses")
		require.Equal(t, "3", sink.msgs[0].Metadata.Get(dlv.DeadAttempts))
	})
	t.Run("outage", func(t *testing.T) {
		t.Parallel()
		sink := &deadSink{}
		p := holdPoison(t, sink, middleware.PoisonConfig{MaxAttempts: 2, OutageHold: 50 * time.Millisecond})
		back := time.Now().Add(400 * time.Millisecond)
		_, err := p.Middleware(func(*message.Message) ([]*message.Message, error) {
			if time.Now().Before(back) {
				return nil, middleware.Unavailable(errors.New("payment API: 503"))
			}
			return nil, nil
		})(brokerMsg("order-2", 3, 3))
		require.NoError(t, err, "held past OutageHold: the last delivery is never nacked while the consumer runs")
		require.Empty(t, sink.msgs)
	})
	t.Run("shutdown", func(t *testing.T) {
		t.Parallel()
		sink := &deadSink{}
		p := holdPoison(t, sink, middleware.PoisonConfig{MaxAttempts: 2})
		msg := brokerMsg("order-3", 3, 3)
		ctx, cancel := context.WithCancel(context.Background())
		msg.SetContext(ctx)
		var runs atomic.Int32
		_, err := p.Middleware(func(*message.Message) ([]*message.Message, error) {
			if runs.Add(1) == 3 {
				cancel() // the router closes while the delivery is held
			}
			return nil, middleware.Unavailable(errors.New("payment API: 503"))
		})(msg)
		require.NoError(t, err, "dead-lettered, not nacked")
		require.Len(t, sink.msgs, 1)
		reason := sink.msgs[0].Metadata.Get(dlv.DeadError)
		require.Contains(t, reason, "the broker's delivery limit is reached")
		require.Contains(t, reason, "payment API: 503")
	})
	t.Run("not_last", func(t *testing.T) {
		t.Parallel()
		sink := &deadSink{}
		p := holdPoison(t, sink, middleware.PoisonConfig{MaxAttempts: 2})
		msg := brokerMsg("order-4", 2, 3)
		ctx, cancel := context.WithCancel(context.Background())
		msg.SetContext(ctx)
		var runs atomic.Int32
		_, err := p.Middleware(func(*message.Message) ([]*message.Message, error) {
			if runs.Add(1) == 3 {
				cancel()
			}
			return nil, middleware.Unavailable(errors.New("payment API: 503"))
		})(msg)
		require.Error(t, err, "a delivery the broker makes again is nacked at shutdown")
		require.Empty(t, sink.msgs)
	})
}

// TestLogsOneLinePerStateChange: a consumer's log says each change of a
// delivery's state once, with its key, ordering key and what comes next:
// the first failure at Info (the later ones of the delivery at Debug),
// an outage at Error once per delivery however many tries it holds for,
// the apply after it at Info; never a line per try above Debug.
func TestLogsOneLinePerStateChange(t *testing.T) {
	t.Parallel()
	logs := watermill.NewCaptureLogger()
	sink := &deadSink{}
	p := holdPoison(t, sink, middleware.PoisonConfig{MaxAttempts: 5, Logger: logs})
	var runs atomic.Int32
	msg := brokerMsg("order-1", 1, 0)
	msg.Metadata.Set(dlv.PartitionKey, "acct-1")
	_, err := p.Middleware(func(*message.Message) ([]*message.Message, error) {
		switch r := runs.Add(1); {
		case r <= 3:
			return nil, errors.New("ledger busy")
		case r <= 8:
			return nil, middleware.Unavailable(errors.New("payment API: 503"))
		}
		return nil, nil
	})(msg)
	require.NoError(t, err)
	lines := map[watermill.LogLevel][]string{}
	for level, msgs := range logs.Captured() {
		for _, m := range msgs {
			lines[level] = append(lines[level], m.Msg)
			if m.Msg == "Message failed" || m.Msg == "Message applied after an outage" {
				require.Equal(t, "order-1", m.Fields["key"], m.Msg)
				require.Equal(t, "acct-1", m.Fields["order_key"], m.Msg)
			}
		}
	}
	require.Equal(t, []string{"Message failed", "Message applied after an outage"}, lines[watermill.InfoLogLevel])
	require.Equal(t, []string{"Dependency unavailable (the handler said so): message held, not counted"}, lines[watermill.ErrorLogLevel])
	require.Len(t, lines[watermill.DebugLogLevel], 2+4, "the later failures and tries, at Debug")
}
