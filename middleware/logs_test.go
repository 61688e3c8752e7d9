package middleware_test

import (
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/internal/testing/msgtest"
	"github.com/oncemill/oncemill/middleware"
)

// logCapture records every line, for tests that read the log while the
// middlewares still write it (watermill's CaptureLoggerAdapter hands out
// its map unguarded).
type logCapture struct {
	mu     sync.Mutex
	fields watermill.LogFields
	lines  *[]watermill.CapturedMessage
}

func newLogCapture() *logCapture {
	return &logCapture{lines: new([]watermill.CapturedMessage)}
}

func (c *logCapture) add(level watermill.LogLevel, msg string, err error, fields watermill.LogFields) {
	c.mu.Lock()
	defer c.mu.Unlock()
	*c.lines = append(*c.lines, watermill.CapturedMessage{Level: level, Msg: msg, Err: err, Fields: c.fields.Add(fields)})
}

func (c *logCapture) Error(msg string, err error, fields watermill.LogFields) {
	c.add(watermill.ErrorLogLevel, msg, err, fields)
}
func (c *logCapture) Info(msg string, fields watermill.LogFields) {
	c.add(watermill.InfoLogLevel, msg, nil, fields)
}
func (c *logCapture) Debug(msg string, fields watermill.LogFields) {
	c.add(watermill.DebugLogLevel, msg, nil, fields)
}
func (c *logCapture) Trace(msg string, fields watermill.LogFields) {
	c.add(watermill.TraceLogLevel, msg, nil, fields)
}

// With shares the lines with c; fields are added to each.
func (c *logCapture) With(fields watermill.LogFields) watermill.LoggerAdapter {
	return &logCapture{fields: c.fields.Add(fields), lines: c.lines}
}

// named are the lines at level whose message is msg.
func (c *logCapture) named(level watermill.LogLevel, msg string) []watermill.CapturedMessage {
	c.mu.Lock()
	defer c.mu.Unlock()
	var lines []watermill.CapturedMessage
	for _, l := range *c.lines {
		if l.Level == level && l.Msg == msg {
			lines = append(lines, l)
		}
	}
	return lines
}

// String is every line, for a failure's message.
func (c *logCapture) String() string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return fmt.Sprint(*c.lines)
}

// An operator reads in the consumer's log one Info line per dead letter,
// with its UUID, key and reason, and one Info line per copy of the dead
// key dropped; a duplicate of a done key stays at Debug.
func TestLogsDeadLettersAndDeadCopies(t *testing.T) {
	t.Parallel()
	txBackends(t, 4, func(t *testing.T, b txBackend) {
		logs := newLogCapture()
		rig := startPoisonRigWith(t, b, middleware.PoisonConfig{MaxAttempts: 3, Logger: logs}, middleware.InboxConfig{Logger: logs},
			func(_ int32, msg *message.Message) error {
				if string(msg.Payload) == "charge order-bad" {
					return middleware.Permanent(errors.New("card number unreadable"))
				}
				return nil
			})
		bad := rig.publish(t, "order-bad")
		msgtest.Receive(t, rig.dead, 30*time.Second).Ack()
		copyOfBad := rig.publish(t, "order-bad")
		rig.publish(t, "order-ok")
		rig.publish(t, "order-ok")
		require.Eventually(t, func() bool {
			return len(logs.named(watermill.InfoLogLevel, "Copy of a dead-lettered key acked without running")) == 1 &&
				len(logs.named(watermill.DebugLogLevel, "Duplicate message dropped")) == 1
		}, 30*time.Second, 10*time.Millisecond, "%v", logs)

		dead := logs.named(watermill.InfoLogLevel, "Message dead-lettered")
		require.Len(t, dead, 1, "one line per dead letter: %+v", logs)
		require.Equal(t, bad.UUID, dead[0].Fields["message_uuid"])
		require.Equal(t, "order-bad", dead[0].Fields["key"])
		require.Contains(t, dead[0].Fields["error"], "card number unreadable")

		copies := logs.named(watermill.InfoLogLevel, "Copy of a dead-lettered key acked without running")
		require.Len(t, copies, 1, "%+v", logs)
		require.Equal(t, copyOfBad.UUID, copies[0].Fields["message_uuid"])
		require.Equal(t, "order-bad", copies[0].Fields["key"])

		require.Len(t, logs.named(watermill.DebugLogLevel, "Duplicate message dropped"), 1)
		require.Empty(t, logs.named(watermill.InfoLogLevel, "Duplicate message dropped"), "a duplicate is not news")
	})
}

// Poison built from an inbox speaks through the inbox's logger: one
// setting silences or redirects both.
func TestPoisonTakesTheInboxLogger(t *testing.T) {
	t.Parallel()
	txBackends(t, 4, func(t *testing.T, b txBackend) {
		logs := newLogCapture()
		inbox := newInbox(t, middleware.InboxConfig{TxStore: b.store, Logger: logs})
		dead := &lateDLQ{}
		poison, err := middleware.NewPoison(middleware.PoisonConfig{Inbox: inbox, Publisher: dead, Topic: deadTopic})
		require.NoError(t, err)
		c := startChain(t, func(*message.Message) error {
			return middleware.Permanent(errors.New("card number unreadable"))
		}, poison.Middleware, inbox.Middleware)
		dead.pub.Store(c.pubSub)
		msg := delivery("order-bad", "charge order-bad")
		require.NoError(t, c.pubSub.Publish(poisonTopic, msg))
		msgtest.Receive(t, c.dead, 30*time.Second).Ack()
		require.Eventually(t, func() bool {
			return len(logs.named(watermill.InfoLogLevel, "Message dead-lettered")) == 1
		}, 10*time.Second, 10*time.Millisecond, "%+v", logs)
		require.Equal(t, msg.UUID, logs.named(watermill.InfoLogLevel, "Message dead-lettered")[0].Fields["message_uuid"])
	})
}
