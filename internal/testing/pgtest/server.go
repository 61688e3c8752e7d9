package pgtest

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

// Server is a private PostgreSQL server that one test starts, stops and
// restarts, for outage tests that must not disturb the shared server other
// tests use. It runs from a fresh data directory in the test's temporary
// directory, on a free port of 127.0.0.1, with trust authentication.
type Server struct {
	t    testing.TB
	bin  string
	dir  string
	port int
	as   *user.User // the server refuses to run as root
}

// StartServer initialises and starts a private server, stopped when the
// test ends. Each of settings is a postgresql.conf line, such as
// "max_prepared_transactions = 4", added after initdb's defaults (so it
// overrides them) and kept across restarts. Under CI=true a missing
// PostgreSQL installation fails the test; elsewhere it is skipped.
func StartServer(t testing.TB, settings ...string) *Server {
	t.Helper()
	bin := serverBin()
	if bin == "" {
		Unavailable(t, "a PostgreSQL installation (initdb, pg_ctl) for a private server", fmt.Errorf("not found under /usr/lib/postgresql"))
	}
	s := &Server{t: t, bin: bin, dir: filepath.Join(t.TempDir(), "pgdata"), port: freePort(t)}
	if os.Geteuid() == 0 {
		u, err := user.Lookup("postgres")
		if err != nil {
			t.Fatalf("private PostgreSQL: running as root needs the postgres user: %v", err)
		}
		s.as = u
	}
	if err := os.MkdirAll(s.dir, 0o700); err != nil {
		t.Fatalf("private PostgreSQL: %v", err)
	}
	if s.as != nil {
		// The temporary directories are root's; let the server into its own.
		for d := filepath.Dir(s.dir); d != "/" && d != filepath.Clean(os.TempDir()); d = filepath.Dir(d) {
			if err := os.Chmod(d, 0o755); err != nil {
				t.Fatalf("private PostgreSQL: %v", err)
			}
		}
		s.chown(s.dir)
	}
	s.run("initdb", "-D", s.dir, "-A", "trust", "-U", "postgres", "--no-sync", "-E", "UTF8")
	if len(settings) > 0 {
		if err := appendConf(filepath.Join(s.dir, "postgresql.conf"), settings); err != nil {
			t.Fatalf("private PostgreSQL: settings: %v", err)
		}
	}
	s.Start()
	t.Cleanup(func() {
		// Stop it even if the test left it stopped or failed midway.
		_ = s.command("pg_ctl", "-D", s.dir, "-m", "immediate", "-w", "stop").Run()
	})
	return s
}

// URL is the server's connection string (database postgres).
func (s *Server) URL() string {
	return fmt.Sprintf("postgres://postgres@127.0.0.1:%d/postgres?sslmode=disable", s.port)
}

// Start starts the server and waits until it accepts connections.
func (s *Server) Start() {
	s.t.Helper()
	opts := fmt.Sprintf("-p %d -k %s -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=50", s.port, s.dir)
	s.run("pg_ctl", "-D", s.dir, "-l", filepath.Join(s.dir, "server.log"), "-o", opts, "-w", "-t", "60", "start")
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for {
		conn, err := pgx.Connect(ctx, s.URL())
		if err == nil {
			_ = conn.Close(ctx)
			return
		}
		select {
		case <-ctx.Done():
			s.t.Fatalf("private PostgreSQL did not accept connections: %v", err)
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// Stop stops the server at once, dropping every connection, as a crash or
// a failover would.
func (s *Server) Stop() {
	s.t.Helper()
	s.run("pg_ctl", "-D", s.dir, "-m", "immediate", "-w", "stop")
}

func (s *Server) run(name string, args ...string) {
	s.t.Helper()
	if out, err := s.command(name, args...).CombinedOutput(); err != nil {
		s.t.Fatalf("private PostgreSQL: %s: %v\n%s", name, err, out)
	}
}

func (s *Server) command(name string, args ...string) *exec.Cmd {
	cmd := exec.Command(filepath.Join(s.bin, name), args...)
	cmd.Dir = s.dir
	if s.as != nil {
		uid, _ := strconv.Atoi(s.as.Uid)
		gid, _ := strconv.Atoi(s.as.Gid)
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)}}
		cmd.Dir = "/"
	}
	return cmd
}

func (s *Server) chown(path string) {
	if s.as == nil {
		return
	}
	uid, _ := strconv.Atoi(s.as.Uid)
	gid, _ := strconv.Atoi(s.as.Gid)
	if err := os.Chown(path, uid, gid); err != nil {
		s.t.Fatalf("private PostgreSQL: %v", err)
	}
}

// appendConf adds the lines to the configuration file at path.
func appendConf(path string, lines []string) error {
	f, err := os.OpenFile(path, os.O_APPEND|os.O_WRONLY, 0)
	if err != nil {
		return err
	}
	_, err = f.WriteString("\n# pgtest.StartServer settings\n" + strings.Join(lines, "\n") + "\n")
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	return nil
}

// serverBin finds the newest installed PostgreSQL's binaries.
func serverBin() string {
	dirs, _ := filepath.Glob("/usr/lib/postgresql/*/bin")
	sort.Slice(dirs, func(i, j int) bool {
		vi, _ := strconv.Atoi(filepath.Base(filepath.Dir(dirs[i])))
		vj, _ := strconv.Atoi(filepath.Base(filepath.Dir(dirs[j])))
		return vi > vj
	})
	for _, d := range dirs {
		if _, err := os.Stat(filepath.Join(d, "initdb")); err == nil {
			return d
		}
	}
	return ""
}

func freePort(t testing.TB) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("free port: %v", err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}
