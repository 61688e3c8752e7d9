package proctest

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// The environment that makes the test binary a child: the role's name and
// its configuration as JSON.
const (
	roleEnv   = "ONCEMILL_TEST_ROLE"
	configEnv = "ONCEMILL_TEST_ROLE_CONFIG"
)

// Exit codes of a child that [Main] runs.
const (
	// ExitKilled is for a child that killed itself on purpose (a handler
	// calling os.Exit, as an OOM kill would end it).
	ExitKilled = 3
	// ExitBadSetup: the child could not start.
	ExitBadSetup = 4
	// ExitBadClose: the child did not close cleanly.
	ExitBadClose = 5
	// ExitStopped: the child's router stopped by itself.
	ExitStopped = 6
)

// ReadyLine starts the line a child prints once it is ready, which
// [Role.Start] waits for; see [Ready].
const ReadyLine = "PROCTEST READY"

// ErrSetup marks the errors of a child that could not start.
var ErrSetup = errors.New("proctest: setup")

// Setup marks err, if not nil, as a failure to start: [ExitCode] maps it
// to ExitBadSetup.
func Setup(err error) error {
	if err == nil {
		return nil
	}
	return fmt.Errorf("%w: %w", ErrSetup, err)
}

// ExitCode is the exit code of a role that returned err: 0 for nil,
// ExitStopped for a router that stopped by itself, ExitBadSetup for a
// setup error, ExitBadClose otherwise.
func ExitCode(err error) int {
	switch {
	case err == nil:
		return 0
	case errors.Is(err, ErrRouterStopped):
		return ExitStopped
	case errors.Is(err, ErrSetup), errors.Is(err, ErrRouterNotStarted):
		return ExitBadSetup
	default:
		return ExitBadClose
	}
}

// Ready prints the ready line, followed by info (such as an address) that
// the parent reads with [Process.Ready].
func Ready(info string) {
	fmt.Println(strings.TrimSpace(ReadyLine + " " + info))
}

// Player is a role that [Main] can run; [NewRole] makes one.
type Player interface {
	roleName() string
	play(raw string, term <-chan os.Signal) error
}

// Role is a part the test binary plays as a child process, configured by
// a C that the parent sends as JSON.
type Role[C any] struct {
	name string
	run  func(cfg C, term <-chan os.Signal) error
}

// NewRole is the role name, whose run gets its configuration and a
// channel that receives SIGTERM; it prints the ready line once ready (the
// standard consumer's [Consumer.Run] does), runs until told to stop, and
// returns the error that decides the exit code (see [ExitCode]).
func NewRole[C any](name string, run func(cfg C, term <-chan os.Signal) error) Role[C] {
	return Role[C]{name: name, run: run}
}

func (r Role[C]) roleName() string { return r.name }

func (r Role[C]) play(raw string, term <-chan os.Signal) error {
	var cfg C
	if err := json.Unmarshal([]byte(raw), &cfg); err != nil {
		return Setup(fmt.Errorf("bad config: %w", err))
	}
	return r.run(cfg, term)
}

// Main runs the role the environment names, if it does, and exits with
// its code; in the tests' own process it returns at once. TestMain calls
// it first, with every role of its package; the Kafka broker role of
// [StartKafka] is always there.
func Main(roles ...Player) {
	name := os.Getenv(roleEnv)
	if name == "" {
		return
	}
	// Registered first: a SIGTERM that comes while the child starts is
	// handled once it runs.
	term := make(chan os.Signal, 1)
	signal.Notify(term, syscall.SIGTERM)
	err := fmt.Errorf("%w: unknown role %q", ErrSetup, name)
	for _, r := range append([]Player{kafkaRole}, roles...) {
		if r.roleName() == name {
			err = r.play(os.Getenv(configEnv), term)
			break
		}
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "%s: %v\n", name, err)
	}
	os.Exit(ExitCode(err))
}

// TryStart runs the test binary in role r with cfg and waits up to a
// minute for it to be ready, for goroutines other than the test's.
func (r Role[C]) TryStart(cfg C) (*Process, error) {
	raw, err := json.Marshal(cfg)
	if err != nil {
		return nil, err
	}
	p, err := Start([]string{roleEnv + "=" + r.name, configEnv + "=" + string(raw)}, ReadyLine, time.Minute)
	if err != nil {
		return nil, fmt.Errorf("%s process: %w", r.name, err)
	}
	return p, nil
}

// Start is TryStart for the test's goroutine. When the test ends, a child
// still running is killed, and the output of one that was killed so or
// of any child of a failed test is logged.
func (r Role[C]) Start(t testing.TB, cfg C) *Process {
	t.Helper()
	p, err := r.TryStart(cfg)
	require.NoError(t, err)
	t.Cleanup(func() {
		switch {
		case !p.Exited():
			p.Kill()
			t.Logf("%s %d killed at the end of the test; output:\n%s", r.name, p.Cmd.Process.Pid, p.Out.String())
		case t.Failed():
			t.Logf("%s %d exited with %d; output:\n%s", r.name, p.Cmd.Process.Pid, p.Code(), p.Out.String())
		}
	})
	return p
}

// Ready is the info the child printed on its ready line.
func (p *Process) Ready() string {
	info, _ := p.Out.Line(ReadyLine)
	return strings.TrimSpace(info)
}

// StatsLine starts the line on which a consumer prints its [Stats] as it
// exits cleanly.
const StatsLine = "PROCTEST STATS "

// Shutdown sends SIGTERM and waits up to bound for the child to exit with
// code 0, having printed its stats, which it returns with Took set. A
// child still running after bound is killed. Any other end is an error
// that carries the child's output.
func (p *Process) Shutdown(bound time.Duration) (Stats, error) {
	start := time.Now()
	if err := p.Terminate(bound); err != nil {
		return Stats{}, err
	}
	took := time.Since(start)
	if p.Code() != 0 {
		return Stats{}, fmt.Errorf("exit code %d after SIGTERM; output:\n%s", p.Code(), p.Out.String())
	}
	line, ok := p.Out.Line(StatsLine)
	if !ok {
		return Stats{}, fmt.Errorf("no stats printed; output:\n%s", p.Out.String())
	}
	var s Stats
	if err := json.Unmarshal([]byte(line), &s); err != nil {
		return Stats{}, err
	}
	s.Took = took
	return s, nil
}

// Stop is Shutdown for the test's goroutine: any other end fails t.
func (p *Process) Stop(t testing.TB, bound time.Duration) Stats {
	t.Helper()
	s, err := p.Shutdown(bound)
	require.NoError(t, err)
	return s
}
