package amqp_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"net/url"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/adapters/amqp"
)

// defaultTestURL is the broker the tests use when ONCEMILL_AMQP_URL is unset.
const defaultTestURL = "amqp://guest:guest@127.0.0.1:5672/"

// testURL returns the broker URL the tests use.
func testURL() string {
	if u := os.Getenv("ONCEMILL_AMQP_URL"); u != "" {
		return u
	}
	return defaultTestURL
}

// redacted returns u without its password, for test messages.
func redacted(u string) string {
	p, err := url.Parse(u)
	if err != nil {
		return "<unparsable URL>"
	}
	return p.Redacted()
}

// admin is a direct amqp091 connection for setting up, inspecting and
// cleaning up what a test declares.
type admin struct {
	t    testing.TB
	conn *amqp091.Connection

	mu        sync.Mutex
	queues    map[string]bool
	exchanges map[string]bool
}

// newAdmin connects to the test broker, or skips the test (fails it under
// CI) when the broker is unreachable. It deletes every queue and exchange
// registered with it when the test ends, then closes the connection.
func newAdmin(t testing.TB) *admin {
	t.Helper()
	conn, err := amqp091.DialConfig(testURL(), amqp091.Config{Dial: amqp091.DefaultDial(3 * time.Second)})
	if err != nil {
		unavailable(t, err)
	}
	a := &admin{t: t, conn: conn, queues: map[string]bool{}, exchanges: map[string]bool{}}
	t.Cleanup(a.cleanup)
	return a
}

// unavailable fails the test under CI and skips it, loudly, elsewhere.
func unavailable(t testing.TB, err error) {
	t.Helper()
	if os.Getenv("CI") != "" {
		t.Fatalf("RabbitMQ is required under CI but %s is unreachable: %v (run scripts/services.sh rabbitmq)", redacted(testURL()), err)
	}
	t.Skipf("SKIPPED: RabbitMQ at %s is unreachable: %v (run scripts/services.sh rabbitmq; set ONCEMILL_AMQP_URL for another broker; CI=true makes this a failure)", redacted(testURL()), err)
}

// track registers the exchange and queue that cfg uses for topic, for
// deletion when the test ends.
func (a *admin) track(cfg amqp.Config, topic string) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.exchanges[cfg.ExchangeName(topic)] = true
	a.queues[cfg.QueueName(topic)] = true
}

func (a *admin) cleanup() {
	ch, err := a.conn.Channel()
	if err == nil {
		a.mu.Lock()
		for q := range a.queues {
			if _, err := ch.QueueDelete(q, false, false, false); err != nil {
				a.t.Logf("cleanup: delete queue %q: %v", q, err)
				if ch, err = a.conn.Channel(); err != nil {
					break
				}
			}
		}
		for x := range a.exchanges {
			if err := ch.ExchangeDelete(x, false, false); err != nil {
				a.t.Logf("cleanup: delete exchange %q: %v", x, err)
				if ch, err = a.conn.Channel(); err != nil {
					break
				}
			}
		}
		a.mu.Unlock()
		if ch != nil {
			_ = ch.Close()
		}
	}
	if err := a.conn.Close(); err != nil {
		a.t.Logf("cleanup: close admin connection: %v", err)
	}
}

// inspect returns the number of ready messages and consumers of queue,
// with a passive declare on a fresh channel.
func (a *admin) inspect(queue string) (ready, consumers int) {
	a.t.Helper()
	ch, err := a.conn.Channel()
	require.NoError(a.t, err)
	defer ch.Close()
	q, err := ch.QueueDeclarePassive(queue, true, false, false, false, nil)
	require.NoError(a.t, err, "passive declare of %q", queue)
	return q.Messages, q.Consumers
}

// publish publishes p to exchange with routing key, waiting for the
// publisher confirm.
func (a *admin) publish(exchange, key string, p amqp091.Publishing) {
	a.t.Helper()
	ch, err := a.conn.Channel()
	require.NoError(a.t, err)
	defer ch.Close()
	require.NoError(a.t, ch.Confirm(false))
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	conf, err := ch.PublishWithDeferredConfirmWithContext(ctx, exchange, key, false, false, p)
	require.NoError(a.t, err)
	ok, err := conf.WaitContext(ctx)
	require.NoError(a.t, err)
	require.True(a.t, ok, "publish to %q not confirmed", exchange)
}

// uniqueName returns prefix followed by a random suffix, so that tests that
// run in parallel, or again after a crash, never share a queue.
func uniqueName(prefix string) string {
	var b [6]byte
	_, _ = rand.Read(b[:])
	return "oncemill-test-" + prefix + "-" + hex.EncodeToString(b[:])
}

// testConfig returns a Config for the test broker.
func testConfig() amqp.Config {
	return amqp.Config{URL: testURL()}
}

// testLogger logs errors and infos only when the test fails verbosely
// enough to matter; Watermill's stdlib logger is too chatty for -race runs.
func testLogger() watermill.LoggerAdapter {
	if os.Getenv("ONCEMILL_TEST_DEBUG") != "" {
		return watermill.NewStdLogger(true, false)
	}
	return watermill.NopLogger{}
}

// newSubscriber returns a subscriber for cfg that the test closes, with its
// queue and exchange for topic registered for deletion.
func newSubscriber(t *testing.T, a *admin, cfg amqp.Config, topic string) message.Subscriber {
	t.Helper()
	a.track(cfg, topic)
	sub, err := amqp.NewSubscriber(cfg, testLogger())
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, sub.Close()) })
	return sub
}

// newPublisher returns a publisher for cfg that the test closes.
func newPublisher(t *testing.T, cfg amqp.Config) message.Publisher {
	t.Helper()
	pub, err := amqp.NewPublisher(cfg, testLogger())
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, pub.Close()) })
	return pub
}

// eventually polls cond until it holds or timeout passes.
func eventually(t *testing.T, timeout time.Duration, cond func() bool, format string, args ...any) {
	t.Helper()
	require.Eventually(t, cond, timeout, 20*time.Millisecond, append([]any{format}, args...)...)
}

// trackExchange registers exchange for deletion when the test ends.
func (a *admin) trackExchange(exchange string) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.exchanges[exchange] = true
}
