package middleware_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	dlv "github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/dlq"
	"github.com/oncemill/oncemill/internal/testing/pgtest"
	"github.com/oncemill/oncemill/middleware"
	"github.com/oncemill/oncemill/sqlschema"
)

// TestUnkeyableMessageIsDeadLetteredOnce: a message whose key cannot be
// read, through Poison (MaxAttempts 3, the PostgreSQL dlq table) and the
// PostgreSQL inbox on a router, is dead-lettered once, on its first
// delivery, with its reason, and acked; the key function runs once; the
// healthy message behind it is applied. Two such messages: one with a 1 MB
// UUID and no key (the UUID is too long for a key, and the dead letter
// stores it bounded, the whole UUID in its metadata), one whose key
// function panics. Issue 31, case 9: before, the 1 MB UUID's dead-letter
// insert failed its index on every delivery (the message was never acked,
// redelivered in a loop), and the panicking key function ran again in the
// poison middleware outside any recover, a loop of recovered panics.
func TestUnkeyableMessageIsDeadLetteredOnce(t *testing.T) {
	t.Parallel()
	huge := make([]byte, 512*1024)
	_, _ = rand.Read(huge)
	hugeUUID := hex.EncodeToString(huge) // 1 MB of random text

	for _, tc := range []struct {
		name   string
		msg    *message.Message
		key    func(calls *atomic.Int32) middleware.KeyFunc
		reason string
	}{{
		name: "1MB UUID",
		msg:  message.NewMessage(hugeUUID, []byte("charge ?")),
		key: func(calls *atomic.Int32) middleware.KeyFunc {
			return func(m *message.Message) (string, error) {
				calls.Add(1)
				return middleware.DefaultKey(m)
			}
		},
		reason: "more than 512",
	}, {
		name: "key function panics",
		msg:  message.NewMessage(watermill.NewUUID(), []byte("charge ?")),
		key: func(calls *atomic.Int32) middleware.KeyFunc {
			return func(m *message.Message) (string, error) {
				calls.Add(1)
				if string(m.Payload) == "charge ?" {
					panic("no key in this payload")
				}
				return middleware.DefaultKey(m)
			}
		},
		reason: "key function panicked: no key in this payload",
	}} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			pool := pgtest.Pool(t, 4)
			schema := pgtest.Schema(t, pool)
			b := postgresBackendIn(t, pool, schema)
			dlqPub, err := dlq.NewPublisher(pool, sqlschema.Config{Schema: schema})
			require.NoError(t, err)
			dead, err := dlq.NewStore(pool, sqlschema.Config{Schema: schema})
			require.NoError(t, err)
			var keyCalls atomic.Int32
			inbox := newInbox(t, middleware.InboxConfig{TxStore: b.store, Key: tc.key(&keyCalls)})
			logs := watermill.NewCaptureLogger()
			poison, err := middleware.NewPoison(middleware.PoisonConfig{
				Inbox: inbox, Publisher: dlqPub, Topic: "payments.dlq", MaxAttempts: 3,
				InitialBackoff: time.Millisecond, MaxBackoff: 5 * time.Millisecond, Logger: logs,
			})
			require.NoError(t, err)

			r := runChargeRouter(t, ctx, b, poison.Middleware, inbox.Middleware)
			publish := func(msg *message.Message) {
				t.Helper()
				if !r.publish(t, msg, 10*time.Second) {
					t.Fatalf("message not acked in 10 s: %d deliveries, %d key calls, %+v", r.deliveries()[msg.UUID], keyCalls.Load(), poison.Stats())
				}
			}
			good := delivery("order-good", "charge good")
			publish(tc.msg)
			publish(good)

			require.Equal(t, 1, r.deliveries()[tc.msg.UUID], "the unkeyable message was settled on its first delivery")
			require.Equal(t, int32(2), keyCalls.Load(), "the key function ran once per delivery (one each)")
			entries, err := dead.List(ctx, dlq.Filter{})
			require.NoError(t, err)
			require.Equal(t, 1, len(entries), "exactly one dead letter")
			e := entries[0]
			require.True(t, e.Permanent, "a key error is permanent")
			require.Contains(t, e.Error, middleware.ErrKey.Error())
			require.Contains(t, e.Error, tc.reason)
			require.Empty(t, e.Key, "no key was derived")
			require.Equal(t, tc.msg.UUID, e.Message("").UUID, "a replay gets the whole UUID back")
			require.Equal(t, dlv.Bound(tc.msg.UUID), e.UUID)

			require.Equal(t, int32(1), r.calls.Load(), "the handler ran for the good message only")
			require.Equal(t, 1, b.effects(t))
			require.Equal(t, middleware.PoisonStats{DeadLettered: 1}, poison.Stats(), "no failed dead-lettering, no panic")
			require.Equal(t, middleware.InboxStats{Applied: 1}, inbox.Stats())
			for _, lines := range logs.Captured() {
				for _, l := range lines {
					for k, v := range l.Fields {
						if s, ok := v.(string); ok {
							require.LessOrEqual(t, len(s), dlv.MaxBoundBytes, "log field %s of %q is bounded", k, l.Msg)
						}
					}
				}
			}
		})
	}
}
