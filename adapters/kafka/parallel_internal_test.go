package kafka

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"
)

// blockingSession is a sarama.ConsumerGroupSession whose first MarkOffset
// reports on marking and then waits for proceed, so that a test can end
// the session while the partition is busy committing.
type blockingSession struct {
	ctx     context.Context
	marking chan struct{}
	proceed chan struct{}

	mu      sync.Mutex
	marked  []int64
	commits int
}

func (s *blockingSession) Claims() map[string][]int32 { return nil }
func (s *blockingSession) MemberID() string           { return "member" }
func (s *blockingSession) GenerationID() int32        { return 1 }
func (s *blockingSession) Context() context.Context   { return s.ctx }

func (s *blockingSession) MarkOffset(_ string, _ int32, offset int64, _ string) {
	s.mu.Lock()
	s.marked = append(s.marked, offset)
	first := len(s.marked) == 1
	s.mu.Unlock()
	if first {
		s.marking <- struct{}{}
		<-s.proceed
	}
}

func (s *blockingSession) MarkMessage(msg *sarama.ConsumerMessage, metadata string) {
	s.MarkOffset(msg.Topic, msg.Partition, msg.Offset+1, metadata)
}

func (s *blockingSession) ResetOffset(string, int32, int64, string) {}

func (s *blockingSession) Commit() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.commits++
}

// chanClaim is a sarama.ConsumerGroupClaim fed by a test.
type chanClaim struct{ records chan *sarama.ConsumerMessage }

func (chanClaim) Topic() string                              { return "t" }
func (chanClaim) Partition() int32                           { return 0 }
func (chanClaim) InitialOffset() int64                       { return 0 }
func (chanClaim) HighWaterMarkOffset() int64                 { return 0 }
func (c chanClaim) Messages() <-chan *sarama.ConsumerMessage { return c.records }

// TestParallelNoHandOutAfterSessionEnd: with MaxInFlight 1, a partition
// whose next record waits for the subscription's one slot, while the
// slot's holder is acked and its offset marked, loses its session (a
// revocation) or sees the subscriber close. The slot is then free and the
// end has come at once, and the partition must take the end: the waiting
// record is never delivered, nothing more is marked, and the slot is
// left free for the subscription's other partitions. Each case runs many
// times, as the partition's select picks at random among ready cases.
func TestParallelNoHandOutAfterSessionEnd(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name    string
		closing bool // the subscriber closes, instead of a revocation
	}{{"revoked", false}, {"closing", true}} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			for range 100 {
				noHandOutAfterEnd(t, tc.closing)
			}
		})
	}
}

func noHandOutAfterEnd(t *testing.T, closing bool) {
	cfg := SubscriberConfig{MaxInFlight: 1, DrainTimeout: 50 * time.Millisecond, RevokeTimeout: 50 * time.Millisecond}.withDefaults()
	s := &parallelSubscriber{cfg: cfg, logger: watermill.NopLogger{}}
	consumeCtx, cancelConsume := context.WithCancel(context.Background())
	defer cancelConsume()
	sub := &subscription{
		s:             s,
		ctx:           context.Background(),
		topic:         "t",
		output:        make(chan *message.Message, 4),
		stop:          make(chan struct{}),
		slots:         newSlots(cfg.MaxInFlight),
		consumeCtx:    consumeCtx,
		cancelConsume: cancelConsume,
		fields:        watermill.LogFields{},
	}
	sessCtx, endSession := context.WithCancel(context.Background())
	defer endSession()
	sess := &blockingSession{ctx: sessCtx, marking: make(chan struct{}), proceed: make(chan struct{})}
	claim := chanClaim{records: make(chan *sarama.ConsumerMessage)}
	p := newPartition(sub, sess, claim)
	defer p.cancel()
	ran := make(chan struct{})
	go func() {
		defer close(ran)
		p.run()
	}()

	record := func(offset int64, key string) *sarama.ConsumerMessage {
		return &sarama.ConsumerMessage{Topic: "t", Partition: 0, Offset: offset, Key: []byte(key), Value: []byte(key)}
	}
	claim.records <- record(0, "a")
	first := <-sub.output
	require.Equal(t, "a", string(first.Payload))
	// Received by run, which queues it before it takes any result: b
	// waits for the slot that a holds.
	claim.records <- record(1, "b")
	require.True(t, first.Ack())
	// a's result frees the slot; run is marking offset 1 when the end
	// comes.
	<-sess.marking
	if closing {
		sub.halt()
	} else {
		endSession()
	}
	close(sess.proceed)
	<-ran

	select {
	case msg := <-sub.output:
		t.Fatalf("record %s delivered after the end", msg.Payload)
	default:
	}
	held, ok := p.keys.Next()
	require.True(t, ok, "b still queued, never handed out")
	require.Equal(t, "b", string(held.Key))
	require.Zero(t, p.inFlight)
	sess.mu.Lock()
	defer sess.mu.Unlock()
	require.Equal(t, []int64{1}, sess.marked, "only a's offset marked, before the end")
	if closing {
		require.Equal(t, 1, sess.commits, "closing commits what was marked")
	} else {
		require.Zero(t, sess.commits, "a revoked partition commits nothing more")
	}
	require.Empty(t, sub.slots, "the slot is free again")
}
