package deduptest

import (
	"io"
	"net"
	"sync"
	"testing"
	"time"
)

// Proxy is a TCP proxy in front of a store's server, for a harness's Cut:
// the store dials [Proxy.Addr] instead of the server, and [Proxy.Cut]
// breaks every connection and refuses new ones, as a server that went
// away would. Everything else passes through unchanged.
//
// NewProxy starts a goroutine that accepts connections and two per
// connection that copy its bytes; Cut, or the end of the test, stops them.
type Proxy struct {
	l        net.Listener
	upstream string

	mu    sync.Mutex
	conns map[net.Conn]struct{}
	cut   bool

	wg   sync.WaitGroup
	once sync.Once
}

// NewProxy listens on a random port of 127.0.0.1 and forwards every
// connection to upstream (host:port). It is cut, and its goroutines
// waited for, when the test ends.
func NewProxy(t testing.TB, upstream string) *Proxy {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("deduptest: proxy: listen: %v", err)
	}
	p := &Proxy{l: l, upstream: upstream, conns: map[net.Conn]struct{}{}}
	p.wg.Add(1)
	go p.accept()
	t.Cleanup(func() {
		p.Cut()
		p.wg.Wait()
	})
	return p
}

// Addr is the proxy's host:port, for the store to dial.
func (p *Proxy) Addr() string { return p.l.Addr().String() }

// Cut closes every connection through the proxy and stops listening, so
// that the store's next read or write on a connection fails, and so does
// every new connection (refused). It cannot be undone; calling it again
// does nothing.
func (p *Proxy) Cut() {
	p.once.Do(func() {
		p.mu.Lock()
		p.cut = true
		for c := range p.conns {
			_ = c.Close() // a connection may have closed already
		}
		p.mu.Unlock()
		_ = p.l.Close() // Accept returns, and the accept loop ends
	})
}

func (p *Proxy) accept() {
	defer p.wg.Done()
	for {
		c, err := p.l.Accept()
		if err != nil {
			return // the listener was closed by Cut
		}
		if !p.track(c) {
			return
		}
		p.wg.Add(1)
		go p.forward(c)
	}
}

// track records c so that Cut closes it; it closes c and reports false if
// the proxy was cut meanwhile.
func (p *Proxy) track(c net.Conn) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.cut {
		_ = c.Close()
		return false
	}
	p.conns[c] = struct{}{}
	return true
}

// forward dials upstream for the client connection c and copies both
// ways until either side ends, then closes both.
func (p *Proxy) forward(c net.Conn) {
	defer p.wg.Done()
	u, err := net.DialTimeout("tcp", p.upstream, 10*time.Second)
	if err != nil || !p.track(u) {
		if u != nil {
			_ = u.Close()
		}
		p.close(c)
		return
	}
	var both sync.WaitGroup
	both.Add(2)
	pipe := func(dst, src net.Conn) {
		defer both.Done()
		_, _ = io.Copy(dst, src) // ends when either side closes, or Cut
		p.close(dst)
		p.close(src)
	}
	go pipe(u, c)
	go pipe(c, u)
	both.Wait()
}

func (p *Proxy) close(c net.Conn) {
	p.mu.Lock()
	delete(p.conns, c)
	p.mu.Unlock()
	_ = c.Close() // closing twice is harmless
}
