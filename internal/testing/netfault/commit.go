package netfault

import (
	"bufio"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"sync"
	"testing"
	"time"
)

// The codes of the PostgreSQL protocol's untyped first messages.
const (
	sslRequest    = 80877103
	gssEncRequest = 80877104
	cancelRequest = 80877102
)

// maxMessage bounds a protocol message the proxy buffers (PostgreSQL's own
// limit for most messages is 1 GB; tests send far less).
const maxMessage = 64 << 20

// CommitCutter is a TCP proxy in front of a PostgreSQL server that loses the
// answer to every COMMIT: it forwards both directions unchanged until the
// client sends a simple-query message ('Q') whose text is COMMIT (pgx sends
// pgx.Tx.Commit that way), forwards that too, waits for the server's answer
// to it (CommandComplete or ErrorResponse, proof that the server ran it),
// drops the answer and closes both sides. The client sees its connection
// break while COMMIT was in flight; the server has committed. Other
// connections through the proxy go on.
//
// It answers a TLS or GSSAPI encryption request itself with 'N' (not
// supported), so that clients with sslmode=prefer fall back to plain
// connections it can read.
//
// Its goroutines end with Close, which the constructor also registers with
// the test's cleanup.
type CommitCutter struct {
	t        testing.TB
	l        net.Listener
	upstream string
	cut      chan struct{}
	cutOnce  sync.Once

	mu     sync.Mutex
	conns  map[net.Conn]struct{}
	closed bool

	wg        sync.WaitGroup
	closeOnce sync.Once
}

// CutAtCommit starts a [CommitCutter] on a random loopback port that
// forwards to upstream (host:port of a PostgreSQL server). It is closed
// when the test ends.
func CutAtCommit(t testing.TB, upstream string) *CommitCutter {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("netfault: listen: %v", err)
	}
	p := &CommitCutter{t: t, l: l, upstream: upstream, cut: make(chan struct{}), conns: map[net.Conn]struct{}{}}
	p.wg.Add(1)
	go p.accept()
	t.Cleanup(p.Close)
	return p
}

// Addr is the proxy's host:port.
func (p *CommitCutter) Addr() string { return p.l.Addr().String() }

// Cut is closed once the proxy has dropped the answer to a COMMIT and
// closed its connection.
func (p *CommitCutter) Cut() <-chan struct{} { return p.cut }

// Close stops accepting, closes every connection and waits for the
// proxy's goroutines to end.
func (p *CommitCutter) Close() {
	p.closeOnce.Do(func() {
		p.mu.Lock()
		p.closed = true
		for c := range p.conns {
			_ = c.Close()
		}
		p.mu.Unlock()
		if err := p.l.Close(); err != nil {
			p.t.Errorf("netfault: close listener: %v", err)
		}
		p.wg.Wait()
	})
}

// track registers c so that Close closes it; it reports false, having
// closed c, when the proxy is closed already.
func (p *CommitCutter) track(c net.Conn) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		_ = c.Close()
		return false
	}
	p.conns[c] = struct{}{}
	return true
}

func (p *CommitCutter) untrack(c net.Conn) {
	p.mu.Lock()
	delete(p.conns, c)
	p.mu.Unlock()
	_ = c.Close()
}

func (p *CommitCutter) accept() {
	defer p.wg.Done()
	for {
		c, err := p.l.Accept()
		if err != nil {
			return
		}
		if !p.track(c) {
			continue
		}
		p.wg.Add(1)
		go p.serve(c)
	}
}

// serve relays one client connection: this goroutine reads the client's
// messages, another the server's.
func (p *CommitCutter) serve(client net.Conn) {
	defer p.wg.Done()
	defer p.untrack(client)
	d := net.Dialer{Timeout: 10 * time.Second}
	server, err := d.Dial("tcp", p.upstream)
	if err != nil {
		return
	}
	if !p.track(server) {
		return
	}
	defer p.untrack(server)

	// armed is closed just before a COMMIT is forwarded: the server's
	// next answer is not relayed.
	armed := make(chan struct{})
	answers := make(chan struct{})
	go func() {
		defer close(answers)
		if p.relayAnswers(server, client, armed) {
			p.cutOnce.Do(func() { close(p.cut) })
		}
		// Whatever ended the server's side ends the client's.
		_ = client.Close()
		_ = server.Close()
	}()
	p.relayClient(client, server, armed)
	_ = client.Close()
	_ = server.Close()
	<-answers
}

// relayClient forwards the client's messages to server until either side
// closes, closing armed before it forwards a COMMIT.
func (p *CommitCutter) relayClient(client, server net.Conn, armed chan struct{}) {
	r := bufio.NewReader(client)
	for startup := false; !startup; {
		msg, err := readUntyped(r)
		if err != nil {
			return
		}
		switch binary.BigEndian.Uint32(msg[4:8]) {
		case sslRequest, gssEncRequest:
			if _, err := client.Write([]byte{'N'}); err != nil {
				return
			}
			continue
		case cancelRequest:
			_, _ = server.Write(msg)
			return
		}
		if _, err := server.Write(msg); err != nil {
			return
		}
		startup = true
	}
	isArmed := false
	for {
		msg, err := readTyped(r)
		if err != nil {
			return
		}
		if !isArmed && msg[0] == 'Q' && isCommit(msg[5:]) {
			// Armed before the server can answer.
			close(armed)
			isArmed = true
		}
		if _, err := server.Write(msg); err != nil {
			return
		}
	}
}

// relayAnswers forwards the server's messages to client until either side
// closes or, once armed is closed, the server answers the COMMIT: that
// answer and anything before it are dropped, and it reports true.
func (p *CommitCutter) relayAnswers(server, client net.Conn, armed <-chan struct{}) bool {
	r := bufio.NewReader(server)
	for {
		msg, err := readTyped(r)
		if err != nil {
			return false
		}
		select {
		case <-armed:
			if msg[0] == 'C' || msg[0] == 'E' { // CommandComplete, ErrorResponse
				return true
			}
			continue // a notice or parameter status before the answer
		default:
		}
		if _, err := client.Write(msg); err != nil {
			return false
		}
	}
}

// isCommit reports whether body, a simple query's text with its NUL,
// is COMMIT.
func isCommit(body []byte) bool {
	text := strings.TrimSpace(strings.TrimSuffix(string(body), "\x00"))
	text = strings.TrimSpace(strings.TrimSuffix(text, ";"))
	return strings.EqualFold(text, "commit")
}

// readUntyped reads one of the messages that open a connection, which
// have a length and no type byte: the whole message, length included.
func readUntyped(r *bufio.Reader) ([]byte, error) {
	var head [4]byte
	if _, err := io.ReadFull(r, head[:]); err != nil {
		return nil, err
	}
	n := binary.BigEndian.Uint32(head[:])
	if n < 8 || n > maxMessage {
		return nil, fmt.Errorf("netfault: startup message of %d bytes", n)
	}
	msg := make([]byte, n)
	copy(msg, head[:])
	if _, err := io.ReadFull(r, msg[4:]); err != nil {
		return nil, err
	}
	return msg, nil
}

// readTyped reads one typed protocol message: the whole message, type
// byte and length included.
func readTyped(r *bufio.Reader) ([]byte, error) {
	var head [5]byte
	if _, err := io.ReadFull(r, head[:]); err != nil {
		return nil, err
	}
	n := binary.BigEndian.Uint32(head[1:])
	if n < 4 || n > maxMessage {
		return nil, errors.New("netfault: message of a bad length")
	}
	msg := make([]byte, 1+n)
	copy(msg, head[:])
	if _, err := io.ReadFull(r, msg[5:]); err != nil {
		return nil, err
	}
	return msg, nil
}
