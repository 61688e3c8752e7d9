package deduptest_test

import (
	"bufio"
	"io"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/oncemill/oncemill/dedup/deduptest"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// echo serves a line echo on a random loopback port until the test ends.
func echo(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	var wg sync.WaitGroup
	var mu sync.Mutex
	var conns []net.Conn
	wg.Go(func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns = append(conns, c)
			mu.Unlock()
			wg.Go(func() { _, _ = io.Copy(c, c) })
		}
	})
	t.Cleanup(func() {
		require.NoError(t, l.Close())
		mu.Lock()
		for _, c := range conns {
			_ = c.Close()
		}
		mu.Unlock()
		wg.Wait()
	})
	return l.Addr().String()
}

// roundTrip sends a line on c and reads it back.
func roundTrip(c net.Conn, r *bufio.Reader, line string) (string, error) {
	if err := c.SetDeadline(time.Now().Add(10 * time.Second)); err != nil {
		return "", err
	}
	if _, err := io.WriteString(c, line+"\n"); err != nil {
		return "", err
	}
	got, err := r.ReadString('\n')
	return got, err
}

func TestProxyPassesThroughUntilCut(t *testing.T) {
	t.Parallel()
	p := deduptest.NewProxy(t, echo(t))
	conns := make([]net.Conn, 3)
	readers := make([]*bufio.Reader, 3)
	for i := range conns {
		c, err := net.Dial("tcp", p.Addr())
		require.NoError(t, err)
		t.Cleanup(func() { _ = c.Close() })
		conns[i], readers[i] = c, bufio.NewReader(c)
		got, err := roundTrip(c, readers[i], "hello")
		require.NoError(t, err)
		require.Equal(t, "hello\n", got, "bytes pass through unchanged")
	}

	p.Cut()
	for i, c := range conns {
		_, err := roundTrip(c, readers[i], "after the cut")
		require.Error(t, err, "connection %d is broken", i)
	}
	_, err := net.DialTimeout("tcp", p.Addr(), time.Second)
	require.Error(t, err, "new connections are refused")
	p.Cut() // a second cut does nothing
}

func TestProxyToNothingClosesTheClient(t *testing.T) {
	t.Parallel()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	gone := l.Addr().String()
	require.NoError(t, l.Close())

	p := deduptest.NewProxy(t, gone)
	c, err := net.Dial("tcp", p.Addr())
	require.NoError(t, err)
	defer c.Close()
	require.NoError(t, c.SetDeadline(time.Now().Add(10*time.Second)))
	_, err = c.Read(make([]byte, 1))
	require.ErrorIs(t, err, io.EOF, "an upstream that refuses closes the client's connection")
}
