package nats_test

import (
	"bytes"
	"context"
	"net"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/nats-io/nats-server/v2/server"
	natsgo "github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/adapters/nats"
)

// jsServer is an in-process nats-server with JetStream on a fixed port and
// store directory, which a test can stop JetStream on, as a server that
// is shutting down does before it closes its connections, and start
// again on the same port and store.
type jsServer struct {
	t    *testing.T
	dir  string
	port int
	ns   *server.Server
}

func startJSServer(t *testing.T) *jsServer {
	t.Helper()
	s := &jsServer{t: t, dir: t.TempDir(), port: server.RANDOM_PORT}
	s.start()
	s.port = s.ns.Addr().(*net.TCPAddr).Port
	t.Cleanup(s.shutdown)
	return s
}

func (s *jsServer) url() string { return "nats://127.0.0.1:" + strconv.Itoa(s.port) }

func (s *jsServer) start() {
	s.t.Helper()
	ns, err := server.NewServer(&server.Options{Host: "127.0.0.1", Port: s.port, JetStream: true, StoreDir: s.dir, NoSigs: true, NoLog: true})
	require.NoError(s.t, err)
	ns.Start()
	require.True(s.t, ns.ReadyForConnections(10*time.Second), "the server accepts connections")
	s.ns = ns
}

func (s *jsServer) shutdown() {
	s.ns.Shutdown()
	s.ns.WaitForShutdown()
}

// ackCounter is a dialer whose connections count the acks (+ACK bodies)
// they send and the answers to them they receive, so that a test knows
// when JetStream has answered one.
type ackCounter struct {
	mu       sync.Mutex
	acks     int
	answered int
	replies  map[string]bool // the reply subjects of the acks sent
}

func (d *ackCounter) Dial(network, address string) (net.Conn, error) {
	c, err := (&net.Dialer{Timeout: 5 * time.Second}).Dial(network, address)
	if err != nil {
		return nil, err
	}
	return &countingConn{Conn: c, d: d}, nil
}

// counts returns how many acks were sent and how many answers to them
// came back.
func (d *ackCounter) counts() (acks, answered int) {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.acks, d.answered
}

type countingConn struct {
	net.Conn
	d *ackCounter
}

// Write counts each "PUB <subject> <reply> 4\r\n+ACK\r\n" in b and notes
// its reply subject.
func (c *countingConn) Write(b []byte) (int, error) {
	c.d.mu.Lock()
	for rest := b; ; {
		i := bytes.Index(rest, []byte("\r\n+ACK\r\n"))
		if i < 0 {
			break
		}
		line := rest[bytes.LastIndex(rest[:i], []byte("PUB ")):i]
		if f := strings.Fields(string(line)); len(f) == 4 {
			if c.d.replies == nil {
				c.d.replies = map[string]bool{}
			}
			c.d.replies[f[2]] = true
		}
		c.d.acks++
		rest = rest[i+1:]
	}
	c.d.mu.Unlock()
	return c.Conn.Write(b)
}

// Read counts the answers to the acks sent.
func (c *countingConn) Read(b []byte) (int, error) {
	n, err := c.Conn.Read(b)
	c.d.mu.Lock()
	for reply := range c.d.replies {
		if bytes.Contains(b[:n], []byte("MSG "+reply+" ")) {
			c.d.answered++
		}
	}
	c.d.mu.Unlock()
	return n, err
}

// TestAckWithoutResponders: the handler finishes a message while
// JetStream's ack subject has no responders: in a server shutting down,
// which stopped JetStream and has not yet closed the connections
// ("restart": it then starts again on the same port and store), or
// while JetStream stops and starts again on a connection that stays up
// ("same connection", as while a clustered consumer changes leader).
// The ack is sent again once JetStream answers: the message is delivered
// once, and the consumer has nothing pending, well before the message's
// ack wait would have brought it back.
func TestAckWithoutResponders(t *testing.T) {
	t.Parallel()
	t.Run("restart", func(t *testing.T) {
		t.Parallel()
		ackWithoutResponders(t, func(srv *jsServer) {
			srv.shutdown()
			srv.start()
		})
	})
	t.Run("same connection", func(t *testing.T) {
		t.Parallel()
		ackWithoutResponders(t, func(srv *jsServer) {
			require.NoError(t, srv.ns.EnableJetStream(&server.JetStreamConfig{StoreDir: srv.dir}))
		})
	})
}

// ackWithoutResponders acks a message while JetStream is stopped, then
// has back bring it back, and checks that the ack reached it.
func ackWithoutResponders(t *testing.T, back func(*jsServer)) {
	srv := startJSServer(t)
	dialer := &ackCounter{}
	// A reconnect well within the ack wait, so that only a lost ack, not
	// a slow reconnect, lets JetStream deliver the message again.
	cfg := nats.Config{URL: srv.url(), CreateStreams: true, Logger: testLogger(),
		Options: []natsgo.Option{natsgo.SetCustomDialer(dialer), natsgo.ReconnectWait(50 * time.Millisecond)}}
	const topic, group, ackWait = "shutdown.acks", "billing", 2 * time.Second
	pub := publisher(t, cfg)
	sub := subscriber(t, nats.SubscriberConfig{Config: cfg, ConsumerGroup: group, AckWait: ackWait})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	msgs, err := sub.Subscribe(ctx, topic)
	require.NoError(t, err)
	require.NoError(t, pub.Publish(topic, message.NewMessage("m1", []byte("x"))))

	first := <-msgs
	require.Equal(t, "m1", first.UUID)
	require.NoError(t, srv.ns.DisableJetStream(), "JetStream stops first in a shutdown")
	acked := time.Now()
	first.Ack()
	require.Eventually(t, func() bool {
		_, answered := dialer.counts()
		return answered >= 1
	}, 10*time.Second, 5*time.Millisecond, "the ack is answered while JetStream is stopped: no responders")
	back(srv)

	var (
		mu         sync.Mutex
		deliveries = 1
	)
	consumed := make(chan struct{})
	go func() {
		defer close(consumed)
		for m := range msgs {
			mu.Lock()
			deliveries++
			mu.Unlock()
			m.Ack()
		}
	}()

	a := newAdminOf(t, srv.url())
	stream := cfg.StreamName(topic)
	require.Eventually(t, func() bool {
		ci := a.consumer(stream, group)
		return ci.NumPending == 0 && ci.NumAckPending == 0
	}, 30*time.Second, 20*time.Millisecond, "the consumer has the ack")
	took := time.Since(acked)
	cancel()
	<-consumed
	mu.Lock()
	defer mu.Unlock()
	acks, _ := dialer.counts()
	t.Logf("delivered %d times; acked %s after the handler finished (ack wait %s), %d acks sent", deliveries, took.Round(time.Millisecond), ackWait, acks)
	require.Equal(t, 1, deliveries, "the message is delivered once: the ack is sent again after the restart")
}
