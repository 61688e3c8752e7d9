package embedded

import (
	"encoding/binary"
	"net"
	"sync"
	"time"
)

// maxHeldEnd is the longest a client connection's end is kept from the
// broker while a request read from it is unanswered: five minutes, the
// Java consumer's default rebalance timeout (max.poll.interval.ms), the
// longest a JoinGroup is usually held. Only a request that gets no
// response at all (a produce with acks=0) waits that long.
const maxHeldEnd = 5 * time.Minute

// listen is kfake's ListenFn: a loopback listener whose connections are
// [heldConn]s.
func listen(network, address string) (net.Listener, error) {
	l, err := net.Listen(network, address)
	if err != nil {
		return nil, err
	}
	return heldListener{l}, nil
}

// heldListener accepts [heldConn]s.
type heldListener struct{ net.Listener }

func (l heldListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	return &heldConn{Conn: c, wake: make(chan struct{}, 1)}, nil
}

// heldConn is a client connection as the broker sees it: the end of the
// client's side (a process killed, a connection dropped) reaches the
// broker only once the broker has answered every request it read from
// the connection, as Kafka, which reads nothing more from a connection
// while one of its requests is held (a JoinGroup waiting for the
// rebalance, a SyncGroup waiting for the leader, a long-polling Fetch),
// notices a client gone only when it answers.
//
// It matters for consumer groups. When kfake cannot deliver a JoinGroup
// response because the connection ended, it never starts the member's
// session timer: the member stays in the group, neither rejoining nor
// expiring, and every later rebalance waits the full rebalance timeout
// for it (which each join, leave or expiry postpones), so a consumer
// killed while its JoinGroup waits stalls its group for minutes. Kafka
// starts every member's session timer when the join completes, delivered
// or not, and drops a member that died in a JoinGroup one session timeout
// later; with the response counted as delivered, kfake does the same.
type heldConn struct {
	net.Conn
	wake chan struct{} // a response was written, or the connection closed

	mu        sync.Mutex
	requests  frames
	responses frames
	closed    bool
}

// Read reads from the client. An error (the client's end) is returned
// once every request read has been answered, the broker has closed the
// connection, or maxHeldEnd has passed.
func (c *heldConn) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	c.mu.Lock()
	c.requests.add(p[:n])
	c.mu.Unlock()
	if err == nil {
		return n, nil
	}
	limit := time.NewTimer(maxHeldEnd)
	defer limit.Stop()
	for {
		c.mu.Lock()
		owed := c.requests.n > c.responses.n && !c.closed
		c.mu.Unlock()
		if !owed {
			return n, err
		}
		select {
		case <-c.wake:
		case <-limit.C:
			return n, err
		}
	}
}

// Write writes a response to the client, and counts it answered whether
// the client got it or not.
func (c *heldConn) Write(p []byte) (int, error) {
	n, err := c.Conn.Write(p)
	c.mu.Lock()
	c.responses.add(p)
	c.mu.Unlock()
	c.notify()
	return n, err
}

// Close closes the connection and lets a held Read return.
func (c *heldConn) Close() error {
	c.mu.Lock()
	c.closed = true
	c.mu.Unlock()
	c.notify()
	return c.Conn.Close()
}

func (c *heldConn) notify() {
	select {
	case c.wake <- struct{}{}:
	default:
	}
}

// frames counts the size-prefixed frames of the Kafka protocol in a byte
// stream: a 4-byte big-endian length, then that many bytes.
type frames struct {
	n    int     // complete frames seen
	size [4]byte // the length being read
	got  int     // bytes of size read
	left int     // bytes of the current frame still to come
}

func (f *frames) add(b []byte) {
	for len(b) > 0 {
		if f.left > 0 {
			k := min(f.left, len(b))
			f.left -= k
			b = b[k:]
			if f.left == 0 {
				f.n++
			}
			continue
		}
		k := copy(f.size[f.got:], b)
		f.got += k
		b = b[k:]
		if f.got == len(f.size) {
			f.got = 0
			f.left = int(binary.BigEndian.Uint32(f.size[:]))
			if f.left == 0 {
				f.n++
			}
		}
	}
}
