// Package proctest runs the test binary again as child processes (a
// consumer, a broker) for the tests that kill and restart real processes.
//
// A child is the same binary, told its role and configuration through the
// environment. A role is [NewRole]'s: a function of its configuration,
// sent as JSON, and of the SIGTERM channel; TestMain hands every role of
// its package to [Main] first, which runs the one a child was started in
// and exits with the code its error maps to ([ExitCode]). The parent
// starts a child with [Role.Start], which waits for its ready line, and
// ends it with [Process.Kill] (SIGKILL) or [Process.Stop] (SIGTERM, a
// clean exit within a bound, and the [Stats] it printed).
//
// A consumer role is mostly its handler: [Consumer] is the standard stack
// (adapters.Open, Poison, Bloom, Inbox on a Watermill router), [DB] the
// test's schema that its children write to, [DB.Stream] a paced producer,
// and [StartKafka] the embedded Kafka broker in a process of its own.
package proctest

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
)

// Buffer collects a child's output; it is safe for concurrent use.
type Buffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

// Write appends p.
func (b *Buffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

// String returns everything written so far.
func (b *Buffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// Line returns the rest of the first line that starts with prefix.
func (b *Buffer) Line(prefix string) (string, bool) {
	sc := bufio.NewScanner(strings.NewReader(b.String()))
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		if rest, ok := strings.CutPrefix(sc.Text(), prefix); ok {
			return rest, true
		}
	}
	return "", false
}

// Process is a running child.
type Process struct {
	// Cmd is the child's command; its output goes to Out.
	Cmd *exec.Cmd
	// Out holds the child's stdout and stderr.
	Out  *Buffer
	done chan struct{}
	code int
}

// Start runs the test binary (os.Args[0], running no test) with env added
// to this process's environment, and waits up to timeout for it to print a
// line starting with ready. A child that exits first, or does not get
// there in time (it is killed), is an error that carries its output.
func Start(env []string, ready string, timeout time.Duration) (*Process, error) {
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), env...)
	p := &Process{Cmd: cmd, Out: &Buffer{}, done: make(chan struct{})}
	cmd.Stdout, cmd.Stderr = p.Out, p.Out
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	go func() {
		defer close(p.done)
		err := cmd.Wait()
		var exit *exec.ExitError
		switch {
		case err == nil:
		case errors.As(err, &exit):
			p.code = exit.ExitCode()
		default:
			p.code = -1
		}
	}()
	deadline := time.After(timeout)
	for {
		if _, ok := p.Out.Line(ready); ok {
			return p, nil
		}
		select {
		case <-p.done:
			if _, ok := p.Out.Line(ready); ok {
				return p, nil
			}
			return nil, fmt.Errorf("child exited with %d before it was ready; output:\n%s", p.code, p.Out.String())
		case <-deadline:
			p.Kill()
			return nil, fmt.Errorf("child not ready after %s; output:\n%s", timeout, p.Out.String())
		case <-time.After(10 * time.Millisecond):
		}
	}
}

// Done is closed once the child has exited.
func (p *Process) Done() <-chan struct{} { return p.done }

// Exited reports whether the child has exited.
func (p *Process) Exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// Code is the child's exit code, once it has exited (-1 if it could not
// be read, the signal's death included).
func (p *Process) Code() int {
	<-p.done
	return p.code
}

// Kill SIGKILLs the child and waits until it is gone.
func (p *Process) Kill() {
	_ = p.Cmd.Process.Kill()
	<-p.done
}

// Terminate sends SIGTERM and waits up to bound for the child to exit; a
// child still running then is killed, and that is an error.
func (p *Process) Terminate(bound time.Duration) error {
	if err := p.Cmd.Process.Signal(syscall.SIGTERM); err != nil && !p.Exited() {
		return err
	}
	select {
	case <-p.done:
		return nil
	case <-time.After(bound):
		p.Kill()
		return fmt.Errorf("still running %s after SIGTERM; output:\n%s", bound, p.Out.String())
	}
}

// ErrRouterNotStarted and ErrRouterStopped are what [RunRouter] returns
// when the router stopped before it ran, or by itself before term.
var (
	ErrRouterNotStarted = errors.New("proctest: router stopped at start")
	ErrRouterStopped    = errors.New("proctest: router stopped by itself")
)

// RunRouter is a child consumer's life: it runs r, prints the ready line
// once the router runs (see [Ready]), and closes r when term receives, as
// a process does on SIGTERM. It returns nil after a clean
// close; an error wrapping ErrRouterNotStarted or ErrRouterStopped, with
// the router's own error, when the router stopped without being told; and
// the close's errors otherwise.
func RunRouter(ctx context.Context, r *message.Router, term <-chan os.Signal) error {
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	select {
	case <-r.Running():
	case err := <-done:
		return fmt.Errorf("%w: %w", ErrRouterNotStarted, err)
	}
	Ready("")
	select {
	case <-term:
		return errors.Join(r.Close(), <-done)
	case err := <-done:
		return fmt.Errorf("%w: %w", ErrRouterStopped, err)
	}
}
