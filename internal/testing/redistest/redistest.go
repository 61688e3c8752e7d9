// Package redistest connects tests to Redis: to the shared test server for
// most tests, and to a private redis-server process, owned by one test, for
// the tests that stop Redis in the middle of a run.
//
// The shared server is ONCEMILL_TEST_REDIS_URL, else REDIS_URL, else
// redis://127.0.0.1:6379/0. When it cannot be reached, or redis-server is
// not installed, the test fails under CI=true and is skipped, loudly,
// elsewhere (the rule of [pgtest.Unavailable]).
package redistest

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	goredis "github.com/redis/go-redis/v9"

	"github.com/oncemill/oncemill/internal/testing/pgtest"
)

// DefaultURL is the shared test server when no environment variable names
// one.
const DefaultURL = "redis://127.0.0.1:6379/0"

// URL returns the shared test server's URL.
func URL() string {
	for _, v := range []string{"ONCEMILL_TEST_REDIS_URL", "REDIS_URL"} {
		if u := os.Getenv(v); u != "" {
			return u
		}
	}
	return DefaultURL
}

// Client connects to the shared test server and closes the client when the
// test ends.
func Client(t testing.TB) *goredis.Client {
	t.Helper()
	opts, err := goredis.ParseURL(URL())
	if err != nil {
		t.Fatalf("parse test Redis URL: %v", err)
	}
	c := goredis.NewClient(opts)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := c.Ping(ctx).Err(); err != nil {
		_ = c.Close()
		pgtest.Unavailable(t, "Redis", err)
	}
	t.Cleanup(func() { _ = c.Close() })
	return c
}

// Prefix returns a key prefix unique to the test, made of the test's name
// and random characters (no glob metacharacter, no brace), and deletes
// every key under it from c when the test ends. Register it after the
// client, so that the deletion runs before the client closes.
func Prefix(t testing.TB, c goredis.UniversalClient) string {
	t.Helper()
	prefix := pgtest.Name(t) + ":"
	t.Cleanup(func() {
		if err := DeleteKeys(context.Background(), c, prefix); err != nil {
			t.Errorf("delete test keys under %q: %v", prefix, err)
		}
	})
	return prefix
}

// DeleteKeys deletes every key that starts with prefix, which must hold no
// glob metacharacter, and returns the first error.
func DeleteKeys(ctx context.Context, c goredis.UniversalClient, prefix string) error {
	var cursor uint64
	for {
		keys, next, err := c.Scan(ctx, cursor, prefix+"*", 1000).Result()
		if err != nil {
			return err
		}
		if len(keys) > 0 {
			if err := c.Unlink(ctx, keys...).Err(); err != nil {
				return err
			}
		}
		if next == 0 {
			return nil
		}
		cursor = next
	}
}

// Server is a redis-server process owned by one test, on a port of its
// own, without persistence: a restart starts empty. It is used from the
// test's goroutine only.
type Server struct {
	t    testing.TB
	bin  string
	dir  string
	port int
	cmd  *exec.Cmd
	log  *os.File
}

// StartServer starts a private redis-server on a free port of 127.0.0.1,
// waits until it answers, and stops it when the test ends.
func StartServer(t testing.TB) *Server {
	t.Helper()
	bin, err := exec.LookPath("redis-server")
	if err != nil {
		pgtest.Unavailable(t, "redis-server binary", err)
	}
	port, err := freePort()
	if err != nil {
		t.Fatalf("redistest: find a free port: %v", err)
	}
	s := &Server{t: t, bin: bin, dir: t.TempDir(), port: port}
	t.Cleanup(s.Stop)
	s.Start()
	return s
}

// Addr returns the server's host:port; it stays the same across restarts.
func (s *Server) Addr() string {
	return net.JoinHostPort("127.0.0.1", strconv.Itoa(s.port))
}

// Start starts the server on its port, if it is not running, and waits
// until it answers PING. It fails the test if the server does not come up.
func (s *Server) Start() {
	s.t.Helper()
	if s.cmd != nil {
		return
	}
	log, err := os.OpenFile(filepath.Join(s.dir, "redis.log"), os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o600)
	if err != nil {
		s.t.Fatalf("redistest: open server log: %v", err)
	}
	cmd := exec.Command(s.bin,
		"--port", strconv.Itoa(s.port), "--bind", "127.0.0.1",
		"--save", "", "--appendonly", "no", "--dir", s.dir,
		"--daemonize", "no", "--maxmemory-policy", "noeviction")
	cmd.Stdout, cmd.Stderr = log, log
	if err := cmd.Start(); err != nil {
		_ = log.Close()
		s.t.Fatalf("redistest: start redis-server: %v", err)
	}
	s.cmd, s.log = cmd, log
	if err := s.waitReady(10 * time.Second); err != nil {
		s.Stop()
		out, _ := os.ReadFile(filepath.Join(s.dir, "redis.log"))
		s.t.Fatalf("redistest: redis-server on %s did not answer: %v\n%s", s.Addr(), err, out)
	}
}

// Stop kills the server, as a crash would, and waits for the process to
// end. It does nothing if the server is not running.
func (s *Server) Stop() {
	if s.cmd == nil {
		return
	}
	_ = s.cmd.Process.Kill()
	_ = s.cmd.Wait() // "signal: killed" is the expected outcome
	_ = s.log.Close()
	s.cmd, s.log = nil, nil
}

// Client returns a client of the server that gives up fast while the server
// is down (no retries, short timeouts), and closes it when the test ends.
func (s *Server) Client(t testing.TB) *goredis.Client {
	c := goredis.NewClient(&goredis.Options{
		Addr:         s.Addr(),
		MaxRetries:   -1,
		DialTimeout:  time.Second,
		ReadTimeout:  2 * time.Second,
		WriteTimeout: 2 * time.Second,
		PoolTimeout:  2 * time.Second,
	})
	t.Cleanup(func() { _ = c.Close() })
	return c
}

func (s *Server) waitReady(timeout time.Duration) error {
	c := goredis.NewClient(&goredis.Options{Addr: s.Addr(), MaxRetries: -1, DialTimeout: 200 * time.Millisecond})
	defer c.Close()
	deadline := time.Now().Add(timeout)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
		err := c.Ping(ctx).Err()
		cancel()
		if err == nil {
			return nil
		}
		if time.Now().After(deadline) {
			return err
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	addr, ok := l.Addr().(*net.TCPAddr)
	if !ok {
		return 0, fmt.Errorf("unexpected listener address %v", l.Addr())
	}
	return addr.Port, nil
}

// CallCounter is a go-redis hook that counts the commands a client tries to
// send, those that fail to dial included (a pipeline counts each command).
// Add it with client.AddHook.
type CallCounter struct{ n atomic.Int64 }

// Calls returns how many commands were tried so far.
func (c *CallCounter) Calls() int64 { return c.n.Load() }

// DialHook passes dials through.
func (c *CallCounter) DialHook(next goredis.DialHook) goredis.DialHook { return next }

// ProcessHook counts a command.
func (c *CallCounter) ProcessHook(next goredis.ProcessHook) goredis.ProcessHook {
	return func(ctx context.Context, cmd goredis.Cmder) error {
		c.n.Add(1)
		return next(ctx, cmd)
	}
}

// ProcessPipelineHook counts the commands of a pipeline.
func (c *CallCounter) ProcessPipelineHook(next goredis.ProcessPipelineHook) goredis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []goredis.Cmder) error {
		c.n.Add(int64(len(cmds)))
		return next(ctx, cmds)
	}
}
