package mysqltest

import (
	"bytes"
	"encoding/binary"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"testing"
)

// CommitCutter is a TCP proxy in front of a MySQL server that loses the
// answer to the first COMMIT: it forwards both directions packet by packet
// until the client sends a COM_QUERY whose text is COMMIT (go-sql-driver
// sends Tx.Commit that way), forwards it, waits for the server's answer
// (proof that the server ran it), drops the answer and closes both sides.
// The client sees its connection break while COMMIT was in flight; the
// server has committed. Other connections go on.
//
// It forwards the handshake as it is, so the client must not use TLS or
// compression (go-sql-driver's defaults against a server without TLS).
// It is closed when the test ends.
type CommitCutter struct {
	l        net.Listener
	upstream string
	cut      chan struct{}
	cutOnce  sync.Once
	fired    atomic.Bool
	wg       sync.WaitGroup

	mu    sync.Mutex
	conns []net.Conn
}

// CutAtCommit starts a [CommitCutter] on a random loopback port in front
// of upstream (host:port).
func CutAtCommit(t testing.TB, upstream string) *CommitCutter {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("commit cutter: %v", err)
	}
	p := &CommitCutter{l: l, upstream: upstream, cut: make(chan struct{})}
	p.wg.Add(1)
	go p.accept()
	t.Cleanup(p.close)
	return p
}

// Addr is the proxy's host:port.
func (p *CommitCutter) Addr() string { return p.l.Addr().String() }

// Cut is closed once a COMMIT's answer was dropped.
func (p *CommitCutter) Cut() <-chan struct{} { return p.cut }

func (p *CommitCutter) close() {
	_ = p.l.Close()
	p.mu.Lock()
	for _, c := range p.conns {
		_ = c.Close()
	}
	p.mu.Unlock()
	p.wg.Wait()
}

func (p *CommitCutter) track(c net.Conn) {
	p.mu.Lock()
	p.conns = append(p.conns, c)
	p.mu.Unlock()
}

func (p *CommitCutter) accept() {
	defer p.wg.Done()
	for {
		client, err := p.l.Accept()
		if err != nil {
			return
		}
		server, err := net.Dial("tcp", p.upstream)
		if err != nil {
			_ = client.Close()
			continue
		}
		p.track(client)
		p.track(server)
		armed := make(chan struct{})
		var once sync.Once
		stop := func() {
			_ = client.Close()
			_ = server.Close()
		}
		p.wg.Add(2)
		go func() {
			defer p.wg.Done()
			defer stop()
			for {
				pkt, err := readPacket(client)
				if err != nil {
					return
				}
				if !p.fired.Load() && isCommit(pkt[4:]) && p.fired.CompareAndSwap(false, true) {
					once.Do(func() { close(armed) })
				}
				if _, err := server.Write(pkt); err != nil {
					return
				}
			}
		}()
		go func() {
			defer p.wg.Done()
			defer stop()
			for {
				pkt, err := readPacket(server)
				if err != nil {
					return
				}
				select {
				case <-armed:
					// The server's answer to COMMIT: lose it.
					p.cutOnce.Do(func() { close(p.cut) })
					return
				default:
				}
				if _, err := client.Write(pkt); err != nil {
					return
				}
			}
		}()
	}
}

// readPacket reads one MySQL packet, header included.
func readPacket(r io.Reader) ([]byte, error) {
	var h [4]byte
	if _, err := io.ReadFull(r, h[:]); err != nil {
		return nil, err
	}
	n := int(binary.LittleEndian.Uint32(append(h[:3:3], 0)))
	pkt := make([]byte, 4+n)
	copy(pkt, h[:])
	if _, err := io.ReadFull(r, pkt[4:]); err != nil {
		return nil, err
	}
	return pkt, nil
}

// isCommit reports whether payload is a COM_QUERY of COMMIT.
func isCommit(payload []byte) bool {
	return len(payload) > 1 && payload[0] == 0x03 && bytes.EqualFold(bytes.TrimSpace(payload[1:]), []byte("COMMIT"))
}
