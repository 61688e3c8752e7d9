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

const usage = `Usage:
  oncemill dlq list   [filter flags] [--json]
  oncemill dlq show   ID [--json]
  oncemill dlq replay [ID ...] [filter flags] [--all] [--broker URL]
                      [--inbox URL] [--force] [--json]
  oncemill dlq purge  [ID ...] [filter flags] [--all] [--json]
  oncemill amqp declare --topic T [--topic T ...] [--group G] [--url URL]
                        [--delivery-limit N] [--dead-letter-exchange X]
  oncemill console [--addr HOST:PORT] [--token T] [--read-only] [--broker URL]
                   [--inbox URL]

Filter flags (they combine with each other and with IDs):
  --topic T       original topic the message was consumed from
  --consumer C    consumer (handler) that gave up on it
  --error TEXT    last error contains TEXT, ignoring case
  --since TIME    dead-lettered at or after TIME
  --until TIME    dead-lettered at or before TIME
  --limit N       first N matching entries, by id (default 0: all)
TIME is RFC 3339 (2026-03-01T10:00:00Z) or a duration ago (90m, 2h, 7d).

Common flags:
  --database URL  PostgreSQL or MySQL holding the table (default $DATABASE_URL):
                  postgres://… or mysql://user:password@host:3306/db
  --schema NAME   schema of the table, on MySQL its database (default "oncemill")
  --table NAME    dead-letter table (default "dlq")
  --json          print JSON instead of a table

replay publishes each entry to its original topic, with its original UUID,
payload and metadata (without the oncemill_* facts of the failed delivery), through --broker URL
(default $BROKER_URL: kafka://, amqp://, sqs://, nats://, postgres://), then deletes it.
gochannel:// is refused: it has no durable subscribers, so the replayed
messages would be lost when the command exits. replay and purge need IDs,
a filter flag or --all.

Before publishing an entry, replay writes a replay grant on its key's dead
record, which lets the copy reopen the key once. It writes it on the inbox
table beside the dead-letter table, unless --inbox URL names the consumers'
inbox store: redis://[:PASSWORD@]HOST:PORT[/DB][?prefix=P],
sqlite:PATH[?table=T], postgres://...[?schema=S&table=T] or
mysql://...[?schema=DB&table=T]. An entry whose
key has no record there is refused and stays (the inbox is elsewhere: give
--inbox); --force replays it anyway, as a new key (its record expired).

amqp declare creates on RabbitMQ, for each --topic, what a subscriber of
consumer group --group declares: the topic's durable fanout exchange (named
after the topic), the durable quorum queue "<topic>.<group>" ("<topic>"
without a group) and the binding between them. Run it before producers
start: RabbitMQ drops messages published while no queue is bound.
  --url URL                 amqp:// or amqps:// broker (default $BROKER_URL);
                            its group, delivery_limit, dead_letter_exchange
                            and connect_timeout parameters are read as
                            adapters.Open reads them
  --group G                 consumer group (or the URL's group)
  --delivery-limit N        queue argument x-delivery-limit (or delivery_limit)
  --dead-letter-exchange X  queue argument x-dead-letter-exchange (or
                            dead_letter_exchange)
A flag and the URL's parameter must not differ.
Queue arguments must be those the consumers use: the broker refuses to
declare an existing queue with other arguments.

console serves the operator console, a web UI over oncemill's tables: the
inbox, the outbox and the dead letters, which it filters, groups by error,
replays and purges, each after a confirmation page. It takes --database
and --schema as above, --table for the dead-letter table, and
  --addr HOST:PORT     where to listen (default 127.0.0.1:8080)
  --token T            access token, at least 16 characters (default
                       $ONCEMILL_CONSOLE_TOKEN, which stays out of the
                       process list; without either, one is generated and
                       printed once); sent as "Authorization: Bearer T" or
                       entered on the login page
  --read-only          refuse replays and purges
  --broker URL         offer the replay to the original topic too, through
                       this broker (never $BROKER_URL; gochannel:// is
                       refused); without it a replay goes only to the
                       entry's consumer, through the dlq.ReplaySubscriber
                       it runs
  --inbox URL          where replays to the topic write their grants, as
                       for dlq replay (needs --broker)
  --inbox-table NAME   inbox table (default "inbox")
  --outbox-table NAME  outbox table (default "outbox")
It serves plain HTTP until interrupted (SIGINT, SIGTERM), then lets the
requests in flight finish; beyond 127.0.0.1, put it behind a TLS proxy.

Exit status: 0 success (also when nothing matched), 1 failure, 2 usage error.
`

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
		fmt.Fprintln(stderr, "oncemill: missing command; run 'oncemill -h' for usage")
		return exitUsage
	}
	switch args[0] {
	case "-h", "-help", "--help", "help":
		fmt.Fprint(stdout, usage)
		return exitOK
	case "dlq":
		return runDLQ(ctx, args[1:], env, stdout, stderr)
	case "amqp":
		return runAMQP(ctx, args[1:], env, stdout, stderr)
	case "console":
		return runConsole(ctx, args[1:], env, stdout, stderr)
	default:
		fmt.Fprintf(stderr, "oncemill: unknown command %q (want dlq, amqp or console); run 'oncemill -h' for usage\n", args[0])
		return exitUsage
	}
}

// runDLQ runs "oncemill dlq": args start with the subcommand.
func runDLQ(ctx context.Context, args []string, env func(string) string, stdout, stderr io.Writer) int {
	if len(args) < 1 {
		fmt.Fprintln(stderr, "oncemill dlq: missing subcommand (list, show, replay or purge); run 'oncemill -h' for usage")
		return exitUsage
	}
	c := &cmd{
		name:   "oncemill dlq " + args[0],
		env:    env,
		stdout: stdout,
		stderr: stderr,
		now:    time.Now(),
	}
	var do func(context.Context, []string) error
	switch args[0] {
	case "list":
		do = c.list
	case "show":
		do = c.show
	case "replay":
		do = c.replay
	case "purge":
		do = c.purge
	case "-h", "-help", "--help", "help":
		fmt.Fprint(stdout, usage)
		return exitOK
	default:
		fmt.Fprintf(stderr, "oncemill dlq: unknown subcommand %q (want list, show, replay or purge); run 'oncemill -h' for usage\n", args[0])
		return exitUsage
	}
	return exit(c.name, do(ctx, args[1:]), stdout, stderr)
}

// exit reports err, from the command called name, and returns the exit
// status.
func exit(name string, err error, stdout, stderr io.Writer) int {
	var uerr usageError
	switch {
	case err == nil:
		return exitOK
	case errors.Is(err, flag.ErrHelp):
		fmt.Fprint(stdout, usage)
		return exitOK
	case errors.As(err, &uerr):
		fmt.Fprintf(stderr, "%s: %s; run 'oncemill -h' for usage\n", name, oneLine(uerr.msg))
		return exitUsage
	default:
		fmt.Fprintf(stderr, "%s: %s\n", name, oneLine(err.Error()))
		return exitFailure
	}
}

// oneLine keeps an error message on one line.
func oneLine(s string) string {
	return strings.Join(strings.Fields(s), " ")
}

// parse parses args with fs, letting flags and positional arguments
// interleave (the flag package stops at the first positional argument),
// and returns the positional ones. "--" ends the flags.
func parse(fs *flag.FlagSet, args []string) ([]string, error) {
	var positional []string
	for {
		if err := fs.Parse(args); err != nil {
			if errors.Is(err, flag.ErrHelp) {
				return nil, err
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
