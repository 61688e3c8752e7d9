package nats_test

import (
	"context"
	"errors"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	natsgo "github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/oncemill/oncemill/adapters/nats"
	"github.com/oncemill/oncemill/internal/testing/pgtest"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m,
		// The universal tests' subscriber multiplier forwards messages
		// to a channel that the test stops reading once it has what it
		// wants, and never closes; a forwarder holding a surplus message
		// blocks forever, and so does the goroutine waiting for the
		// forwarders. Both belong to the test suite, not to this package.
		goleak.IgnoreAnyFunction("github.com/ThreeDotsLabs/watermill/internal/subscriber.(*multiplier).Subscribe.func2"),
		goleak.IgnoreAnyFunction("github.com/ThreeDotsLabs/watermill/internal/subscriber.(*multiplier).Subscribe.func3"),
	)
}

// defaultURL is the NATS server the tests use when ONCEMILL_NATS_URL is
// unset: one with JetStream (nats-server -js).
const defaultURL = "nats://127.0.0.1:4222"

// serverURL returns the NATS server the tests use after checking that it
// answers with JetStream, or skips the test, loudly, when it does not;
// under CI (CI non-empty) it fails the test instead.
func serverURL(t testing.TB) string {
	t.Helper()
	u := os.Getenv("ONCEMILL_NATS_URL")
	if u == "" {
		u = defaultURL
	}
	nc, err := natsgo.Connect(u, natsgo.Timeout(5*time.Second))
	if err == nil {
		defer nc.Close()
		var js jetstream.JetStream
		if js, err = jetstream.New(nc); err == nil {
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			_, err = js.AccountInfo(ctx)
		}
	}
	if err != nil {
		pgtest.Unavailable(t, "NATS with JetStream at "+u, err)
	}
	return u
}

// testLogger logs only when ONCEMILL_TEST_LOG is set (to "trace" for
// everything).
func testLogger() watermill.LoggerAdapter {
	switch os.Getenv("ONCEMILL_TEST_LOG") {
	case "":
		return watermill.NopLogger{}
	case "trace":
		return watermill.NewStdLogger(true, true)
	default:
		return watermill.NewStdLogger(true, false)
	}
}

// admin is a plain JetStream client for inspecting and deleting the
// streams a test uses, without the adapter. Every stream of a topic it
// tracks is deleted when the test ends.
type admin struct {
	t   testing.TB
	url string
	nc  *natsgo.Conn
	js  jetstream.JetStream

	mu      sync.Mutex
	streams map[string]bool
}

func newAdmin(t testing.TB) *admin {
	t.Helper()
	return newAdminOf(t, serverURL(t))
}

// newAdminOf is an admin of the server at url.
func newAdminOf(t testing.TB, url string) *admin {
	t.Helper()
	nc, err := natsgo.Connect(url)
	require.NoError(t, err)
	js, err := jetstream.New(nc)
	require.NoError(t, err)
	a := &admin{t: t, url: url, nc: nc, js: js, streams: map[string]bool{}}
	t.Cleanup(func() {
		a.mu.Lock()
		defer a.mu.Unlock()
		for name := range a.streams {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			err := js.DeleteStream(ctx, name)
			cancel()
			if err != nil && !errors.Is(err, jetstream.ErrStreamNotFound) {
				t.Errorf("delete stream %s: %v", name, err)
			}
		}
		nc.Close()
	})
	return a
}

// config is a Config for the admin's server that creates streams.
func (a *admin) config() nats.Config {
	return nats.Config{URL: a.url, CreateStreams: true, Logger: testLogger()}
}

// topic returns a topic unique to the test, tracked.
func (a *admin) topic(suffix string) string {
	topic := pgtest.Name(a.t) + suffix
	a.track(topic)
	return topic
}

// track has topic's stream deleted when the test ends.
func (a *admin) track(topic string) {
	a.mu.Lock()
	a.streams[nats.Config{}.StreamName(topic)] = true
	a.mu.Unlock()
}

// trackStream has the stream named name deleted when the test ends.
func (a *admin) trackStream(name string) {
	a.mu.Lock()
	a.streams[name] = true
	a.mu.Unlock()
}

// consumer returns the info of the durable consumer name of stream.
func (a *admin) consumer(stream, name string) *jetstream.ConsumerInfo {
	a.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	info, err := a.js.Consumer(ctx, stream, name)
	require.NoError(a.t, err)
	ci, err := info.Info(ctx)
	require.NoError(a.t, err)
	return ci
}

// publisher returns a publisher of cfg that the test's cleanup closes.
func publisher(t testing.TB, cfg nats.Config) *nats.Publisher {
	t.Helper()
	p, err := nats.NewPublisher(context.Background(), nats.PublisherConfig{Config: cfg})
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, p.Close()) })
	return p
}

// subscriber returns a subscriber of cfg that the test's cleanup closes.
func subscriber(t testing.TB, cfg nats.SubscriberConfig) *nats.Subscriber {
	t.Helper()
	s, err := nats.NewSubscriber(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, s.Close()) })
	return s
}

// safe is s as a name part: no dots.
func safe(s string) string { return strings.ReplaceAll(s, ".", "_") }
