package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"time"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := run(ctx, os.Args[1:], os.Getenv, os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

const (
	exitOK      = 0
	exitFailure = 1
	exitUsage   = 2
)

// usageError is a mistake in the command line: exit status 2.
type usageError struct{ msg string }

func (e usageError) Error() string { return e.msg }

func usagef(format string, args ...any) error {
	return usageError{msg: fmt.Sprintf(format, args...)}
}

// run is the whole command: args without the program name, env for the
// environment. It returns the exit status.
func run(ctx context.Context, args []string, env func(string) string, stdout, stderr io.Writer) int {
	if len(args) == 0 {
		fmt.Fprintln(stderr, "oncemill: missing command; run 'oncemill --help' for usage")
		return exitUsage
	}
	switch args[0] {
	case "-h", "-help", "--help", "help":
		fmt.Fprint(stdout, usage())
		return exitOK
	case "dlq", "amqp":
		return runGroup(ctx, args[0], args[1:], env, stdout, stderr)
	case "console", "relay", "reconcile":
		return runCommand(ctx, lookup(args[0]), args[1:], env, stdout, stderr)
	default:
		fmt.Fprintf(stderr, "oncemill: unknown command %q (want dlq, amqp, console, relay or reconcile); run 'oncemill --help' for usage\n", args[0])
		return exitUsage
	}
}

// runGroup runs "oncemill dlq" or "oncemill amqp": args start with the
// subcommand.
func runGroup(ctx context.Context, group string, args []string, env func(string) string, stdout, stderr io.Writer) int {
	var subs []string
	for _, c := range commands {
		if sub, ok := strings.CutPrefix(c.path, group+" "); ok {
			subs = append(subs, sub)
		}
	}
	want := strings.Join(subs, ", ")
	if i := strings.LastIndex(want, ", "); i >= 0 {
		want = want[:i] + " or " + want[i+2:]
	}
	if len(args) < 1 {
		fmt.Fprintf(stderr, "oncemill %s: missing subcommand (%s); run 'oncemill %s --help' for usage\n", group, want, group)
		return exitUsage
	}
	switch args[0] {
	case "-h", "-help", "--help", "help":
		fmt.Fprint(stdout, groupUsage(group))
		return exitOK
	}
	c := lookup(group + " " + args[0])
	if c == nil {
		fmt.Fprintf(stderr, "oncemill %s: unknown subcommand %q (want %s); run 'oncemill %s --help' for usage\n", group, args[0], want, group)
		return exitUsage
	}
	return runCommand(ctx, c, args[1:], env, stdout, stderr)
}

// exit reports err, from the command called name, and returns the exit
// status.
func exit(name string, err error, stderr io.Writer) int {
	var (
		uerr  usageError
		coded codedError
	)
	switch {
	case err == nil:
		return exitOK
	case errors.As(err, &coded):
		fmt.Fprintf(stderr, "%s: %s\n", name, errorText(name, err.Error()))
		return coded.code
	case errors.As(err, &uerr):
		fmt.Fprintf(stderr, "%s: %s; run '%s --help' for usage\n", name, errorText(name, uerr.msg), name)
		return exitUsage
	default:
		fmt.Fprintf(stderr, "%s: %s\n", name, errorText(name, err.Error()))
		return exitFailure
	}
}

// errorText is msg on one line, without the prefixes that repeat the
// command's name: a library's error starts with its package
// ("reconcile: read the ledger …", "dlq: no such entry"), which the
// command's own prefix ("oncemill reconcile: ") already says.
func errorText(name, msg string) string {
	msg = oneLine(msg)
	words := strings.Fields(name)
	for trimmed := true; trimmed; {
		trimmed = false
		for _, w := range words[min(1, len(words)):] {
			if rest, ok := strings.CutPrefix(msg, w+": "); ok {
				msg, trimmed = rest, true
			}
		}
	}
	return msg
}

// oneLine keeps an error message on one line.
func oneLine(s string) string {
	return strings.Join(strings.Fields(s), " ")
}

// newFlags returns the empty flag set of the command called name. It
// prints nothing: run reports parse errors in one line.
func newFlags(name string) *flag.FlagSet {
	fs := flag.NewFlagSet(name, flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	fs.Usage = func() {}
	return fs
}

// parse parses args with fs, letting flags and positional arguments
// interleave (the flag package stops at the first positional argument),
// and returns the positional ones. "--" ends the flags.
func parse(fs *flag.FlagSet, args []string) ([]string, error) {
	var positional []string
	for {
		if err := fs.Parse(args); err != nil {
			if errors.Is(err, flag.ErrHelp) {
				return nil, helpRequest{fs}
			}
			return nil, usageError{msg: err.Error()}
		}
		rest := fs.Args()
		if len(rest) == 0 {
			return positional, nil
		}
		if consumed := len(args) - len(rest); consumed > 0 && args[consumed-1] == "--" {
			return append(positional, rest...), nil
		}
		positional = append(positional, rest[0])
		args = rest[1:]
	}
}

// parseIDs reads entry IDs: positive integers.
func parseIDs(args []string) ([]int64, error) {
	ids := make([]int64, 0, len(args))
	for _, a := range args {
		id, err := strconv.ParseInt(a, 10, 64)
		if err != nil || id <= 0 {
			return nil, usagef("ID %q is not a positive integer", a)
		}
		ids = append(ids, id)
	}
	return ids, nil
}

// parseTime reads a --since or --until value: RFC 3339, or a positive
// duration (Go syntax, or whole days as "7d") before now.
func parseTime(s string, now time.Time) (time.Time, error) {
	if t, err := time.Parse(time.RFC3339Nano, s); err == nil {
		return t, nil
	}
	var d time.Duration
	if days, ok := strings.CutSuffix(s, "d"); ok {
		n, err := strconv.Atoi(days)
		if err != nil || n < 0 || n > 100000 {
			return time.Time{}, fmt.Errorf("%q is neither RFC 3339 nor a duration ago like 2h or 7d", s)
		}
		d = time.Duration(n) * 24 * time.Hour
	} else {
		var err error
		if d, err = time.ParseDuration(s); err != nil || d < 0 {
			return time.Time{}, fmt.Errorf("%q is neither RFC 3339 nor a duration ago like 2h or 7d", s)
		}
	}
	return now.Add(-d), nil
}
