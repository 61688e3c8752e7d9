package proctest

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/adapters"
	"github.com/oncemill/oncemill/delivery"
)

// Stream publishes one message to topic on the broker at brokerURL every
// tick until the returned stop is called (or the test ends), each its own
// key pay-00000, pay-00001… (the payload and the idempotency key), and
// records each key as a row of the test's table published (key) once the
// broker has it. Stop fails t if a publish or a record failed; calling it
// again does nothing. The publisher is closed when the test ends.
func (db *DB) Stream(t testing.TB, brokerURL, topic string, every time.Duration) (stop func()) {
	t.Helper()
	// Kafka asks for a group, which a publisher does not use.
	producer, err := adapters.Open(context.Background(), brokerURL, adapters.Options{ConsumerGroup: "producer_" + topic})
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, producer.Close()) })
	pub := producer.Publisher
	var (
		done    = make(chan struct{})
		stopped sync.WaitGroup
		once    sync.Once
	)
	insert := db.Q(`INSERT INTO {S}.published (key) VALUES ($1)`)
	stopped.Add(1)
	go func() {
		defer stopped.Done()
		tick := time.NewTicker(every)
		defer tick.Stop()
		for n := 0; ; n++ {
			select {
			case <-done:
				return
			case <-tick.C:
			}
			key := fmt.Sprintf("pay-%05d", n)
			msg := message.NewMessage(watermill.NewUUID(), []byte(key))
			msg.Metadata.Set(delivery.IdempotencyKey, key)
			if perr := pub.Publish(topic, msg); perr != nil {
				err = fmt.Errorf("publish %s: %w", key, perr)
				return
			}
			if _, ierr := db.Pool.Exec(context.Background(), insert, key); ierr != nil {
				err = fmt.Errorf("record %s: %w", key, ierr)
				return
			}
		}
	}()
	stop = func() {
		t.Helper()
		once.Do(func() { close(done) })
		stopped.Wait()
		require.NoError(t, err)
	}
	t.Cleanup(stop)
	return stop
}
