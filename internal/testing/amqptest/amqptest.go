// Package amqptest runs a private RabbitMQ node for the tests that stop
// the broker in the middle of a run, so that the shared node other tests
// use is never disturbed.
//
// The node runs from the installed rabbitmq-server, with its own node name,
// ports, database and logs in the test's temporary directory. Under CI=true
// a missing installation fails the test; elsewhere it is skipped (the rule
// of [pgtest.Unavailable]).
package amqptest

import (
	"fmt"
	"net"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/oncemill/oncemill/internal/testing/pgtest"
)

// Server is a private RabbitMQ node.
type Server struct {
	t        testing.TB
	dir      string
	node     string
	port     int
	distPort int
	env      []string
}

// StartServer starts a private node on free ports of 127.0.0.1, waits until
// it accepts AMQP connections, and stops it when the test ends. A node
// takes some seconds to boot.
func StartServer(t testing.TB) *Server {
	t.Helper()
	if _, err := exec.LookPath("rabbitmq-server"); err != nil {
		pgtest.Unavailable(t, "a RabbitMQ installation (rabbitmq-server) for a private node", err)
	}
	dir, err := os.MkdirTemp("", "oncemill-amqp-")
	if err != nil {
		t.Fatalf("amqptest: %v", err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	s := &Server{t: t, dir: dir, port: freePort(t), distPort: freePort(t)}
	s.node = fmt.Sprintf("oncemill%d@localhost", s.port)
	conf := filepath.Join(dir, "rabbitmq.conf")
	// loopback_users = none lets guest in over 127.0.0.1 whatever the
	// installation's defaults say.
	if err := os.WriteFile(conf, []byte(fmt.Sprintf("listeners.tcp.default = 127.0.0.1:%d\nloopback_users = none\n", s.port)), 0o644); err != nil {
		t.Fatalf("amqptest: %v", err)
	}
	// As root, rabbitmq-server drops to the rabbitmq user, which must own
	// the node's directory.
	if os.Geteuid() == 0 {
		if u, err := user.Lookup("rabbitmq"); err == nil {
			uid, _ := strconv.Atoi(u.Uid)
			gid, _ := strconv.Atoi(u.Gid)
			_ = filepath.Walk(dir, func(p string, _ os.FileInfo, _ error) error { return os.Chown(p, uid, gid) })
		}
	}
	s.env = append(os.Environ(),
		"RABBITMQ_NODENAME="+s.node,
		"RABBITMQ_CONFIG_FILE="+conf,
		"RABBITMQ_DIST_PORT="+strconv.Itoa(s.distPort),
		"RABBITMQ_MNESIA_BASE="+filepath.Join(dir, "mnesia"),
		"RABBITMQ_LOG_BASE="+filepath.Join(dir, "log"),
		"RABBITMQ_ENABLED_PLUGINS_FILE="+filepath.Join(dir, "enabled_plugins"),
		"RABBITMQ_PID_FILE="+filepath.Join(dir, "node.pid"),
	)
	t.Cleanup(func() { _ = s.ctl("stop") })
	s.run("rabbitmq-server", "-detached")
	s.waitApp()
	return s
}

// URL is the node's AMQP URL (user guest).
func (s *Server) URL() string {
	return fmt.Sprintf("amqp://guest:guest@127.0.0.1:%d/", s.port)
}

// StopApp stops the RabbitMQ application on the node (rabbitmqctl
// stop_app): every connection drops and the port closes; durable queues
// and persistent messages stay.
func (s *Server) StopApp() {
	s.t.Helper()
	if err := s.ctl("stop_app"); err != nil {
		s.t.Fatalf("amqptest: stop_app: %v", err)
	}
}

// StartApp starts the application again and waits until it accepts
// connections.
func (s *Server) StartApp() {
	s.t.Helper()
	if err := s.ctl("start_app"); err != nil {
		s.t.Fatalf("amqptest: start_app: %v", err)
	}
	s.waitApp()
}

func (s *Server) waitApp() {
	s.t.Helper()
	// A node that has not registered its name yet fails await_startup at
	// once: try again until it boots or a minute and a half has passed.
	deadline := time.Now().Add(90 * time.Second)
	for {
		err := s.ctl("await_startup", "--timeout", "60")
		if err == nil {
			break
		}
		if time.Now().After(deadline) {
			log, _ := os.ReadFile(filepath.Join(s.dir, "log", s.node+".log"))
			s.t.Fatalf("amqptest: node %s did not start: %v\n%s", s.node, err, tail(string(log), 4000))
		}
		time.Sleep(500 * time.Millisecond)
	}
	deadline = time.Now().Add(30 * time.Second)
	for {
		c, err := net.DialTimeout("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(s.port)), time.Second)
		if err == nil {
			_ = c.Close()
			return
		}
		if time.Now().After(deadline) {
			s.t.Fatalf("amqptest: node %s does not listen on %d: %v", s.node, s.port, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func (s *Server) ctl(args ...string) error {
	cmd := exec.Command("rabbitmqctl", append([]string{"-n", s.node}, args...)...)
	cmd.Env = s.env
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("rabbitmqctl %s: %w\n%s", strings.Join(args, " "), err, out)
	}
	return nil
}

func (s *Server) run(name string, args ...string) {
	s.t.Helper()
	cmd := exec.Command(name, args...)
	cmd.Env = s.env
	if out, err := cmd.CombinedOutput(); err != nil {
		s.t.Fatalf("amqptest: %s: %v\n%s", name, err, out)
	}
}

func tail(s string, n int) string {
	if len(s) > n {
		return s[len(s)-n:]
	}
	return s
}

func freePort(t testing.TB) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("amqptest: free port: %v", err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

// URL is the shared RabbitMQ node the tests use that do not stop it:
// $ONCEMILL_AMQP_URL, else the guest account on 127.0.0.1:5672.
func URL() string {
	if u := os.Getenv("ONCEMILL_AMQP_URL"); u != "" {
		return u
	}
	return "amqp://guest:guest@127.0.0.1:5672/"
}
