// Package embedded runs an in-process NATS server with JetStream, for
// development and tests, on the nats-server module itself.
//
// The server listens on a loopback port, so any NATS client, in this
// process or another, connects to [Server.URL] as it would to a real
// server. It is a real nats-server with JetStream; what it lacks for
// production is only what one process cannot give: clustering, and, with
// the default temporary store, durability past [Server.Close].
package embedded

import (
	"errors"
	"fmt"
	"os"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/nats-io/nats-server/v2/server"
)

// startTimeout bounds how long Start waits for the server to accept
// connections.
const startTimeout = 10 * time.Second

// ErrInvalidConfig is wrapped by every error of [Config.Validate].
var ErrInvalidConfig = errors.New("embedded: invalid config")

// Config configures [Start]. The zero value is a server on a free
// loopback port whose JetStream store is a temporary directory that Close
// removes.
type Config struct {
	// Port is the loopback port the server listens on. Defaults to 0, a
	// free port; URL reports it.
	Port int
	// StoreDir, when set, is the directory JetStream keeps its streams
	// and consumers in, kept after Close, and a later Start with the same
	// directory finds them again. Defaults to a temporary directory that
	// Close removes.
	StoreDir string
	// Logger receives the server's errors and warnings (Error), notices
	// (Info) and debug lines (Debug). Defaults to watermill.NopLogger.
	Logger watermill.LoggerAdapter
}

// Validate reports the first invalid field of c. Zero values, which take
// defaults, are valid.
func (c Config) Validate() error {
	if c.Port < 0 || c.Port > 65535 {
		return fmt.Errorf("%w: Config.Port is %d, want 0..65535", ErrInvalidConfig, c.Port)
	}
	return nil
}

// Server is a running embedded NATS server with JetStream. Its methods
// are safe for concurrent use.
type Server struct {
	ns      *server.Server
	url     string
	tempDir string

	once sync.Once
	err  error
}

// Start starts a server configured by cfg and returns once it accepts
// connections. The server's goroutines run until [Server.Close].
func Start(cfg Config) (*Server, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if cfg.Logger == nil {
		cfg.Logger = watermill.NopLogger{}
	}
	dir, tempDir := cfg.StoreDir, ""
	if dir == "" {
		d, err := os.MkdirTemp("", "oncemill-nats-")
		if err != nil {
			return nil, fmt.Errorf("embedded: store directory: %w", err)
		}
		dir, tempDir = d, d
	}
	port := cfg.Port
	if port == 0 {
		port = server.RANDOM_PORT
	}
	ns, err := server.NewServer(&server.Options{
		ServerName: "oncemill-embedded",
		Host:       "127.0.0.1",
		Port:       port,
		JetStream:  true,
		StoreDir:   dir,
		NoSigs:     true,
	})
	if err != nil {
		removeTemp(tempDir)
		return nil, fmt.Errorf("embedded: %w", err)
	}
	if _, nop := cfg.Logger.(watermill.NopLogger); !nop {
		ns.SetLoggerV2(serverLogger{cfg.Logger}, false, false, false)
	}
	ns.Start()
	if !ns.ReadyForConnections(startTimeout) {
		ns.Shutdown()
		ns.WaitForShutdown()
		removeTemp(tempDir)
		return nil, fmt.Errorf("embedded: the server did not accept connections within %s", startTimeout)
	}
	s := &Server{ns: ns, url: ns.ClientURL(), tempDir: tempDir}
	cfg.Logger.Info("Embedded NATS started", watermill.LogFields{"url": s.url, "store_dir": dir})
	return s, nil
}

// URL returns the server's client URL, nats://127.0.0.1:port.
func (s *Server) URL() string { return s.url }

// Close shuts the server down, waits for it to stop and removes the
// temporary store directory, if Start made one. Close is idempotent;
// every call returns the first one's result.
func (s *Server) Close() error {
	s.once.Do(func() {
		s.ns.Shutdown()
		s.ns.WaitForShutdown()
		if s.tempDir != "" {
			if err := os.RemoveAll(s.tempDir); err != nil {
				s.err = fmt.Errorf("embedded: remove store directory: %w", err)
			}
		}
	})
	return s.err
}

func removeTemp(dir string) {
	if dir != "" {
		_ = os.RemoveAll(dir) // best effort: the start failed already
	}
}

// serverLogger writes the server's log lines to a Watermill logger.
type serverLogger struct{ l watermill.LoggerAdapter }

func (l serverLogger) Noticef(format string, v ...any) { l.l.Info(fmt.Sprintf(format, v...), nil) }
func (l serverLogger) Warnf(format string, v ...any) {
	l.l.Error(fmt.Sprintf(format, v...), nil, nil)
}
func (l serverLogger) Fatalf(format string, v ...any) {
	l.l.Error(fmt.Sprintf(format, v...), nil, nil)
}
func (l serverLogger) Errorf(format string, v ...any) {
	l.l.Error(fmt.Sprintf(format, v...), nil, nil)
}
func (l serverLogger) Debugf(format string, v ...any) { l.l.Debug(fmt.Sprintf(format, v...), nil) }
func (l serverLogger) Tracef(format string, v ...any) { l.l.Trace(fmt.Sprintf(format, v...), nil) }
