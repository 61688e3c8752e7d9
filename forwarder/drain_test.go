package forwarder_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/forwarder"
)

// stuckPublisher is a broker that never takes a message: Publish blocks
// until the messages' context is done (or the test gives up and closes
// release) and fails.
type stuckPublisher struct {
	once             sync.Once
	entered, release chan struct{}
	mu               sync.Mutex
	errs             []error
}

func (p *stuckPublisher) Publish(_ string, msgs ...*message.Message) error {
	p.once.Do(func() { close(p.entered) })
	ctx := msgs[0].Context()
	err := errors.New("released by the test")
	select {
	case <-ctx.Done():
		err = ctx.Err()
	case <-p.release:
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	p.errs = append(p.errs, err)
	return err
}

func (p *stuckPublisher) Close() error { return nil }

// TestDrainTimeoutBoundsTheStop: stopped while its publisher hangs, the
// relay gives the batch in flight DrainTimeout, then cancels its messages'
// context and returns; the batch rolls back, so its rows are still in the
// outbox and a later relay publishes them.
func TestDrainTimeoutBoundsTheStop(t *testing.T) {
	t.Parallel()
	const drain = 300 * time.Millisecond
	for name, start := range map[string]func(t *testing.T, r *forwarder.Relay) (stop func() error){
		"as a router plugin": func(t *testing.T, r *forwarder.Relay) func() error {
			router, err := message.NewRouter(message.RouterConfig{CloseTimeout: time.Minute}, watermill.NopLogger{})
			require.NoError(t, err)
			router.AddPlugin(r.Plugin)
			done := make(chan error, 1)
			go func() { done <- router.Run(context.Background()) }()
			<-router.Running()
			return func() error {
				if err := router.Close(); err != nil {
					return err
				}
				return <-done
			}
		},
		"with Run and Close": func(t *testing.T, r *forwarder.Relay) func() error {
			done := make(chan error, 1)
			go func() { done <- r.Run(context.Background()) }()
			return func() error {
				if err := r.Close(); err != nil {
					return err
				}
				return <-done
			}
		},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			b := setup(t, 4)
			b.write(t, "payments", event("k", 1), event("k", 2), event("k", 3))
			p := &stuckPublisher{entered: make(chan struct{}), release: make(chan struct{})}
			stop := start(t, newRelay(t, b, p, func(c *forwarder.RelayConfig) { c.DrainTimeout = drain }))
			select {
			case <-p.entered:
			case <-time.After(30 * time.Second):
				stop() //nolint:errcheck // failing anyway
				t.Fatal("the relay never published")
			}

			began := time.Now()
			stopped := make(chan error, 1)
			go func() { stopped <- stop() }()
			select {
			case err := <-stopped:
				require.NoError(t, err)
			case <-time.After(drain + 10*time.Second):
				close(p.release) // let it stop, so that the test's pool can close
				<-stopped
				t.Fatalf("the relay did not stop within DrainTimeout (%s) + 10s", drain)
			}
			took := time.Since(began)
			require.GreaterOrEqual(t, took, drain, "the batch in flight had DrainTimeout to finish")
			p.mu.Lock()
			require.Len(t, p.errs, 1, "one publish, cut short")
			require.ErrorIs(t, p.errs[0], context.Canceled)
			p.mu.Unlock()

			require.Equal(t, 3, b.count(t, "outbox"), "the unfinished batch's rows stay")
			s := &sink{}
			relayAll(t, newRelay(t, b, s, nil), 3)
			require.Len(t, s.snapshot(), 3, "and go out with the next relay")
		})
	}
}
