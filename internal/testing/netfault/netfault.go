// Package netfault gives tests network peers that misbehave: a host that
// accepts and never answers ([Silent]), for proving that every connect
// gives up in time, a proxy that loses the answer to a COMMIT
// ([CutAtCommit]), for proving what happens when a commit's outcome is
// unknown, and a proxy that stops forwarding on cue ([FreezeProxy]), for
// proving that a server which stops answering mid-session holds nothing
// forever.
package netfault

import (
	"io"
	"net"
	"sync"
	"testing"
)

// Silent listens on a random loopback port and accepts every connection,
// reads what the client sends and never answers, like a host whose service
// hangs. It returns host:port; the listener and its connections close when
// the test ends.
func Silent(t testing.TB) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("netfault: listen: %v", err)
	}
	var (
		mu      sync.Mutex
		conns   []net.Conn
		readers sync.WaitGroup
	)
	accepted := make(chan struct{})
	go func() {
		defer close(accepted)
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns = append(conns, c)
			mu.Unlock()
			readers.Add(1)
			go func() {
				defer readers.Done()
				_, _ = io.Copy(io.Discard, c)
			}()
		}
	}()
	t.Cleanup(func() {
		if err := l.Close(); err != nil {
			t.Errorf("netfault: close listener: %v", err)
		}
		<-accepted
		mu.Lock()
		for _, c := range conns {
			_ = c.Close()
		}
		mu.Unlock()
		readers.Wait()
	})
	return l.Addr().String()
}
