package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/oncemill/oncemill/sqlschema"
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
	return runGroup(ctx, "", args, env, stdout, stderr)
}

// runGroup runs one of oncemill's commands (group "") or of a command
// group's ("dlq", "amqp"): args start with its word.
func runGroup(ctx context.Context, group string, args []string, env func(string) string, stdout, stderr io.Writer) int {
	name, kind, prefix := "oncemill", "command", ""
	if group != "" {
		name, kind, prefix = "oncemill "+group, "subcommand", group+" "
	}
	words := wordsAfter(prefix)
	want := strings.Join(words, ", ")
	if i := strings.LastIndex(want, ", "); i >= 0 {
		want = want[:i] + " or " + want[i+2:]
	}
	if len(args) < 1 {
		fmt.Fprintf(stderr, "%s: missing %s (%s); run '%s --help' for usage\n", name, kind, want, name)
		return exitUsage
	}
	switch args[0] {
	case "-h", "-help", "--help", "help":
		fmt.Fprint(stdout, usage(prefix))
		return exitOK
	}
	if c := lookup(prefix + args[0]); c != nil {
		return runCommand(ctx, c, args[1:], env, stdout, stderr)
	}
	if group == "" && slices.Contains(words, args[0]) {
		return runGroup(ctx, args[0], args[1:], env, stdout, stderr)
	}
	fmt.Fprintf(stderr, "%s: unknown %s %q (want %s); run '%s --help' for usage\n", name, kind, args[0], want, name)
	return exitUsage
}

// exit reports err, from the command called name, and returns the exit
// status.
func exit(name string, err error, stderr io.Writer) int {
	var (
		uerr  usageError
		coded codedError
	)
	code := exitFailure
	switch {
	case err == nil:
		return exitOK
	case errors.As(err, &coded):
		code = coded.code
	case errors.As(err, &uerr):
		fmt.Fprintf(stderr, "%s: %s; run '%s --help' for usage\n", name, errorText(name, uerr.msg), name)
		return exitUsage
	}
	fmt.Fprintf(stderr, "%s: %s\n", name, errorText(name, err.Error()))
	return code
}

// errorText is msg on one line, without the prefixes that repeat the
// command's name: a library's error starts with its package
// ("reconcile: read the ledger …", "dlq: no such entry", "retry: no such
// parked message"), which the command's own prefix ("oncemill
// reconcile: ") already says.
func errorText(name, msg string) string {
	msg = oneLine(msg)
	words := strings.Fields(name)
	for trimmed := true; trimmed; {
		trimmed = false
		for _, w := range words[min(1, len(words)):] {
			for _, prefix := range []string{w, packageOf[w]} {
				if rest, ok := strings.CutPrefix(msg, prefix+": "); prefix != "" && ok {
					msg, trimmed = rest, true
				}
			}
		}
	}
	return msg
}

// packageOf is the package behind a command group whose word is not the
// package's name.
var packageOf = map[string]string{"retries": "retry"}

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

// required is value, else the environment variable's: a usage error
// naming flag and variable when neither is set.
func (c *cmd) required(flag, value, variable string) (string, error) {
	if value == "" {
		value = c.env(variable)
	}
	if value == "" {
		return "", usagef("%s is required (or set %s)", flag, variable)
	}
	return value, nil
}

// checkNames checks the table and schema names given as flag, name pairs,
// before anything connects.
func checkNames(flagNames ...string) error {
	for i := 0; i+1 < len(flagNames); i += 2 {
		if err := sqlschema.ValidateIdentifier(flagNames[i], flagNames[i+1]); err != nil {
			return usageError{msg: err.Error()}
		}
	}
	return nil
}

// onlyFlags parses args with fs and refuses a positional argument, saying
// why: what the command takes instead.
func onlyFlags(fs *flag.FlagSet, args []string, why string) error {
	pos, err := parse(fs, args)
	if err == nil && len(pos) > 0 {
		err = usagef("unexpected argument %q: %s", pos[0], why)
	}
	return err
}

// parsedFlag defines flag name, whose value parse reads into *dst.
func parsedFlag[T any](fs *flag.FlagSet, name, usage string, dst *T, parse func(string) (T, error)) {
	fs.Func(name, usage, func(s string) (err error) {
		*dst, err = parse(s)
		return err
	})
}

// ago reads a duration of zero or more: Go syntax, or whole days as "7d".
func ago(s string) (time.Duration, bool) {
	if days, ok := strings.CutSuffix(s, "d"); ok {
		n, err := strconv.Atoi(days)
		return time.Duration(n) * 24 * time.Hour, err == nil && n >= 0 && n <= 100000
	}
	d, err := time.ParseDuration(s)
	return d, err == nil && d >= 0
}

// parseAgo reads a positive duration: Go syntax, or whole days as "7d".
func parseAgo(s string) (time.Duration, error) {
	if d, ok := ago(s); ok && d > 0 {
		return d, nil
	}
	return 0, fmt.Errorf("%q is not a positive duration like 5m, 2h or 7d", s)
}

// parseTime reads a --since or --until value: RFC 3339, or a duration
// before now (see [ago]).
func parseTime(s string, now time.Time) (time.Time, error) {
	if t, err := time.Parse(time.RFC3339Nano, s); err == nil {
		return t, nil
	}
	if d, ok := ago(s); ok {
		return now.Add(-d), nil
	}
	return time.Time{}, fmt.Errorf("%q is neither RFC 3339 nor a duration ago like 2h or 7d", s)
}

// splitTopics reads list, comma-separated topics, none empty, from a
// flag's value s.
func splitTopics(s, list string) ([]string, error) {
	var topics []string
	for _, topic := range strings.Split(list, ",") {
		if topic = strings.TrimSpace(topic); topic == "" {
			return nil, fmt.Errorf("%q holds an empty topic", s)
		}
		topics = append(topics, topic)
	}
	return topics, nil
}
