package netfault

import (
	"io"
	"net"
	"sync"
	"testing"
)

// Freezer is a TCP proxy that forwards both directions unchanged until
// [Freezer.Freeze], and from then on forwards nothing, in either
// direction, on the connections it has and on new ones, while keeping
// them all open: the server seems to have stopped answering mid-session
// (a frozen host, a network partition without resets).
//
// Its goroutines end with Close, which the constructor also registers with
// the test's cleanup.
type Freezer struct {
	t        testing.TB
	l        net.Listener
	upstream string
	frozen   chan struct{}
	freeze   sync.Once

	mu     sync.Mutex
	conns  []net.Conn
	closed bool

	wg        sync.WaitGroup
	closeOnce sync.Once
}

// FreezeProxy starts a [Freezer] on a random loopback port that forwards
// to upstream (host:port). It is closed when the test ends.
func FreezeProxy(t testing.TB, upstream string) *Freezer {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("netfault: listen: %v", err)
	}
	p := &Freezer{t: t, l: l, upstream: upstream, frozen: make(chan struct{})}
	p.wg.Add(1)
	go p.accept()
	t.Cleanup(p.Close)
	return p
}

// Addr is the proxy's host:port.
func (p *Freezer) Addr() string { return p.l.Addr().String() }

// Freeze stops all forwarding; the connections stay open. It is safe to
// call more than once and from any goroutine.
func (p *Freezer) Freeze() { p.freeze.Do(func() { close(p.frozen) }) }

// Close stops accepting, closes every connection and waits for the
// proxy's goroutines.
func (p *Freezer) Close() {
	p.closeOnce.Do(func() {
		_ = p.l.Close()
		p.mu.Lock()
		p.closed = true
		for _, c := range p.conns {
			_ = c.Close()
		}
		p.mu.Unlock()
		p.wg.Wait()
	})
}

// track records c so that Close closes it; it reports false (and closes
// c) once the proxy is closed.
func (p *Freezer) track(c net.Conn) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		_ = c.Close()
		return false
	}
	p.conns = append(p.conns, c)
	return true
}

func (p *Freezer) accept() {
	defer p.wg.Done()
	for {
		client, err := p.l.Accept()
		if err != nil {
			return
		}
		if !p.track(client) {
			return
		}
		p.wg.Add(1)
		go p.serve(client)
	}
}

func (p *Freezer) serve(client net.Conn) {
	defer p.wg.Done()
	if p.isFrozen() {
		// A new connection meets the frozen server: read and drop.
		_, _ = io.Copy(io.Discard, client)
		return
	}
	server, err := net.Dial("tcp", p.upstream)
	if err != nil {
		_ = client.Close()
		return
	}
	if !p.track(server) {
		return
	}
	p.wg.Add(2)
	go p.pipe(server, client)
	go p.pipe(client, server)
}

// pipe copies from src to dst until the proxy freezes, then reads and
// drops what src sends, until src is closed. Before the freeze, the end
// of src closes dst, as a direct connection would end; after it, the
// other side sees nothing.
func (p *Freezer) pipe(dst, src net.Conn) {
	defer p.wg.Done()
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 && !p.isFrozen() {
			if _, werr := dst.Write(buf[:n]); werr != nil {
				_ = src.Close()
				return
			}
		}
		if err != nil {
			if !p.isFrozen() {
				_ = dst.Close()
			}
			return
		}
	}
}

func (p *Freezer) isFrozen() bool {
	select {
	case <-p.frozen:
		return true
	default:
		return false
	}
}
