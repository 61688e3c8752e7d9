// Package natstest runs a private nats-server process with JetStream,
// owned by one test, for the tests that stop or restart NATS in the middle
// of a run and must not disturb the shared server other tests use.
//
// The server is the nats-server binary on PATH, else /usr/sbin/nats-server
// (Debian's package). When it is missing the test fails under CI=true and
// is skipped, loudly, elsewhere (the rule of [pgtest.Unavailable]).
package natstest

import (
	"errors"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/oncemill/oncemill/internal/testing/pgtest"
)

// stopTimeout bounds how long Stop waits for the server to exit after
// SIGTERM before it kills it.
const stopTimeout = 30 * time.Second

// Server is a private nats-server with JetStream on a free port of
// 127.0.0.1, its store in the test's temporary directory. Stop, Start and
// Restart keep the port and the store, so streams, consumers and their
// acknowledged positions survive them. Its methods are safe for
// concurrent use.
type Server struct {
	t    testing.TB
	bin  string
	dir  string
	port int

	mu   sync.Mutex
	cmd  *exec.Cmd
	done chan struct{} // closed when cmd has exited
	log  *os.File
}

// StartServer starts a private server, stopped when the test ends.
func StartServer(t testing.TB) *Server {
	t.Helper()
	bin := serverBin()
	if bin == "" {
		pgtest.Unavailable(t, "nats-server (for a private NATS server)", errors.New("not on PATH nor at /usr/sbin/nats-server"))
	}
	dir := t.TempDir()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("natstest: free port: %v", err)
	}
	port := l.Addr().(*net.TCPAddr).Port
	if err := l.Close(); err != nil {
		t.Fatalf("natstest: free port: %v", err)
	}
	s := &Server{t: t, bin: bin, dir: dir, port: port}
	s.Start()
	t.Cleanup(func() {
		s.mu.Lock()
		running := s.cmd != nil
		s.mu.Unlock()
		if running {
			s.Stop()
		}
	})
	return s
}

// URL is the server's client URL.
func (s *Server) URL() string { return "nats://127.0.0.1:" + strconv.Itoa(s.port) }

// Start starts the server on its port and store, and waits until it
// accepts connections.
func (s *Server) Start() {
	s.t.Helper()
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.cmd != nil {
		s.t.Fatalf("natstest: Start while the server runs")
	}
	log, err := os.OpenFile(filepath.Join(s.dir, "nats-server.log"), os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o644)
	if err != nil {
		s.t.Fatalf("natstest: %v", err)
	}
	cmd := exec.Command(s.bin, "-a", "127.0.0.1", "-p", strconv.Itoa(s.port), "-js", "-sd", filepath.Join(s.dir, "store"))
	cmd.Stdout, cmd.Stderr = log, log
	if err := cmd.Start(); err != nil {
		_ = log.Close()
		s.t.Fatalf("natstest: start %s: %v", s.bin, err)
	}
	done := make(chan struct{})
	go func() {
		_ = cmd.Wait() // its exit status is the log's to explain
		close(done)
	}()
	s.cmd, s.done, s.log = cmd, done, log
	deadline := time.Now().Add(30 * time.Second)
	for {
		c, err := net.DialTimeout("tcp", "127.0.0.1:"+strconv.Itoa(s.port), time.Second)
		if err == nil {
			_ = c.Close()
			return
		}
		select {
		case <-done:
			s.t.Fatalf("natstest: nats-server exited at start:\n%s", s.tail())
		default:
		}
		if time.Now().After(deadline) {
			s.t.Fatalf("natstest: nats-server does not listen on %d: %v\n%s", s.port, err, s.tail())
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// Stop stops the server with SIGTERM, which makes it close every client
// connection and flush its store, and waits until it has exited.
func (s *Server) Stop() {
	s.t.Helper()
	s.stop(syscall.SIGTERM)
}

// Kill stops the server with SIGKILL, as a crash would: what JetStream
// acknowledged but had not yet written out of the process is lost.
func (s *Server) Kill() {
	s.t.Helper()
	s.stop(syscall.SIGKILL)
}

// Restart stops the server (SIGTERM), waits down, and starts it again.
func (s *Server) Restart(down time.Duration) {
	s.t.Helper()
	s.Stop()
	time.Sleep(down)
	s.Start()
}

func (s *Server) stop(sig syscall.Signal) {
	s.t.Helper()
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.cmd == nil {
		s.t.Fatalf("natstest: stop while the server is stopped")
	}
	if err := s.cmd.Process.Signal(sig); err != nil && !errors.Is(err, os.ErrProcessDone) {
		s.t.Fatalf("natstest: signal nats-server: %v", err)
	}
	select {
	case <-s.done:
	case <-time.After(stopTimeout):
		_ = s.cmd.Process.Kill()
		<-s.done
		s.t.Errorf("natstest: nats-server did not exit within %s of %s; killed", stopTimeout, sig)
	}
	_ = s.log.Close()
	s.cmd, s.done, s.log = nil, nil, nil
}

// tail is the end of the server's log.
func (s *Server) tail() string {
	b, _ := os.ReadFile(filepath.Join(s.dir, "nats-server.log"))
	if len(b) > 4000 {
		b = b[len(b)-4000:]
	}
	return strings.TrimSpace(string(b))
}

// serverBin finds nats-server.
func serverBin() string {
	if p, err := exec.LookPath("nats-server"); err == nil {
		return p
	}
	if _, err := os.Stat("/usr/sbin/nats-server"); err == nil {
		return "/usr/sbin/nats-server"
	}
	return ""
}
