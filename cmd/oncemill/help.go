package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"slices"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/oncemill/oncemill/retry"
)

// command is one of oncemill's commands: what runs it and what its --help
// says. Its flags are those its run defines; its help lists them from the
// flag set, so that a flag cannot be missing from it.
type command struct {
	// path is the command's words after "oncemill": "dlq replay".
	path string
	// args is the synopsis after the path.
	args string
	// short is the global help's line for it.
	short string
	// about is what its own help says before the flags.
	about string
	// example is one typical command line, printed after the flags; its
	// flags must be the command's own (help_test checks it).
	example string
	// run runs it with the arguments after the path.
	run func(c *cmd, ctx context.Context, args []string) error
}

// filterHelp explains the filter flags, for the commands that take them.
const filterHelp = `Filter flags (--topic, --consumer, --error, --since, --until, --limit)
combine with each other and with IDs. TIME is RFC 3339
(2026-03-01T10:00:00Z) or a duration ago (90m, 2h, 7d).`

// databaseHelp is what the flags that name the dead-letter table do not
// say: their usage lists the URLs --database takes.
const databaseHelp = `A SQLite --database must exist; --schema and --table name the table
sqlschema.Migrate created.`

// retryFilterHelp explains the filter flags of the retries group.
const retryFilterHelp = `Filter flags (--consumer, --topic, --uuid, --key, --order-key, --limit)
combine with each other and with IDs; --limit keeps the first N in the
order the messages go out.`

// retryDatabaseHelp is what the flags that name the table of parked
// messages do not say.
const retryDatabaseHelp = `A SQLite --database must exist; --schema and --table name the table
sqlschema.Migrate created (RetryTable).`

// commands are oncemill's commands, in the order the global help lists
// them.
var commands = []command{
	{
		path: "dlq list", args: "[filter flags] [--json]",
		short: "list dead letters, one line each",
		about: `Lists the dead letters that match the filter flags, by id. COUNTED BY
says who counted ATTEMPTS: inbox (failed handler attempts, counted
durably), broker (the broker's count of deliveries, which also grows with
deliveries that did not fail), process (failures counted in the consumer's
memory since it started) or - (not recorded).
` + filterHelp + "\n\n" + databaseHelp,
		example: "oncemill dlq list --database postgres://app@db:5432/shop --topic payments --since 2h",
		run:     dlqCommand((*cmd).list),
	},
	{
		path: "dlq show", args: "ID [--json]",
		short: "show one dead letter in full: facts, metadata, payload",
		about: `Shows every fact of one dead letter, its metadata and its payload. The
attempt count is labelled with what it counts and who counted it: "Failed
attempts" (the inbox, or the consumer's memory) or "Broker deliveries"
(RabbitMQ x-delivery-count, SQS ApproximateReceiveCount, JetStream
NumDelivered). The broker's place of the original is shown when the entry
has it: Kafka partition and offset, JetStream stream and sequence.

` + databaseHelp,
		example: "oncemill dlq show 42 --database postgres://app@db:5432/shop",
		run:     dlqCommand((*cmd).show),
	},
	{
		path: "dlq replay", args: "[ID ...] [filter flags] [--all] [--broker URL] [--inbox URL]\n       [--force] [--to-consumer] [--json]",
		short: "publish dead letters to their original topic again, or to their consumer",
		about: `Publishes each selected entry to its original topic, with its original
UUID, payload and metadata (without the oncemill_* facts of the failed
delivery), through --broker, then deletes it. It stops at the first entry
the broker refuses; that entry and the rest stay. --broker refuses a
broker inside this process: nothing else subscribes to it, so the replayed
messages would be lost when the command exits. Give IDs, a filter flag or
--all; named IDs must all exist, or nothing is done.

Before publishing an entry, replay writes a replay grant on its key's dead
record, which lets the copy reopen the key once: on the inbox table beside
the dead-letter table, unless --inbox names the consumers' inbox store. An
entry whose key has no record there is refused and stays; --force replays
it anyway, as a new key (its record expired).

--to-consumer publishes nothing: it marks the entries for their own
consumer's dlq.ReplaySubscriber, which delivers and deletes them. It
requests nothing when a consumer's replay subscriber has not announced
itself lately: replay to the topic with --broker instead.

An entry that cannot succeed as it is (no key, a permanent error) is
named in a warning before anything is sent; for corrected data, see
dlq reopen.

` + filterHelp + "\n\n" + databaseHelp,
		example: "oncemill dlq replay --database postgres://app@db:5432/shop --broker kafka://10.0.0.5:9092 --topic payments --since 2h",
		run:     dlqCommand((*cmd).replay),
	},
	{
		path: "dlq reopen", args: "ID [--json]",
		short: "let the next copy of a dead key run once, whatever its payload",
		about: `Reopens the dead key of one entry for its next copy, whichever payload
it carries, and deletes the entry: for corrected data, where the producer
sends the message again with the data fixed (a replay would run the old
payload). The next copy of the key to reach the consumer runs once; the
copies after it are duplicates. It works on the inbox table beside the
dead-letter table; an entry whose key is not dead there, or that has no
key, is refused and stays.

` + databaseHelp,
		example: "oncemill dlq reopen 42 --database postgres://app@db:5432/shop",
		run:     dlqCommand((*cmd).reopen),
	},
	{
		path: "dlq purge", args: "[ID ...] [filter flags] [--all] [--json]",
		short: "delete dead letters",
		about: `Deletes the selected entries. Give IDs, a filter flag or --all; named IDs
must all exist, or nothing is done.

` + filterHelp + "\n\n" + databaseHelp,
		example: "oncemill dlq purge 42 43 --database postgres://app@db:5432/shop",
		run:     dlqCommand((*cmd).purge),
	},
	{
		path: "retries list", args: "[filter flags] [--json]",
		short: "list parked messages, waiting for a delayed retry, in the order they go out",
		about: `Lists the messages the poison middleware parked for a delayed retry
(middleware.PoisonConfig.Retries), in the order the consumer's retry
subscriber hands them back: by due time, then id. STATE is one of:
waiting (for DUE AT), due (the subscriber takes it at its next read),
overdue (due more than a minute ago and not taken: no retry subscriber of
its consumer and topic runs, or it is far behind), out (handed back, its
handler runs), or "behind N" (it waits for message N of its ordering key,
whatever its due time).
` + retryFilterHelp + "\n\n" + retryDatabaseHelp,
		example: "oncemill retries list --database postgres://app@db:5432/shop --consumer charge-orders",
		run:     (*cmd).retriesList,
	},
	{
		path: "retries show", args: "ID [--json]",
		short: "show one parked message in full: state, failures, metadata, payload",
		about: `Shows every fact of one parked message, its metadata and its payload.

` + retryDatabaseHelp,
		example: "oncemill retries show 7 --database postgres://app@db:5432/shop",
		run:     (*cmd).retriesShow,
	},
	{
		path: "retries now", args: "[ID ...] [filter flags] [--all] [--json]",
		short: "make parked messages due now, so that their consumer retries them at once",
		about: `Makes the selected parked messages due now: their consumer's retry
subscriber hands them back at its next read (every second by default),
to the same handler. A message that is due already is left as it is: one
behind another of its ordering key goes out right after that one, so
retry the first of the key. A message out to its consumer is left to its
handler. Give IDs, a filter flag or --all; named IDs must all be parked,
or nothing is done.

` + retryFilterHelp + "\n\n" + retryDatabaseHelp,
		example: "oncemill retries now --database postgres://app@db:5432/shop --order-key customer-17",
		run:     (*cmd).retriesNow,
	},
	{
		path: "retries cancel", args: "[ID ...] [filter flags] [--all] [--dlq-table NAME] [--json]",
		short: "stop retrying parked messages: move them to the dead-letter table",
		about: `Moves the selected parked messages to the dead-letter table of the same
database and schema (--dlq-table), with the facts of their failures and
an error that starts "` + retry.CancelReason + `" and ends with the last
error, and deletes them from the table of parked messages, in one
transaction: a message is never dropped. From there "oncemill dlq replay" sends one again, or
"oncemill dlq purge" drops it for good. A message out to its consumer is
left to its handler. The messages of an ordering key that waited behind a
cancelled one go out next. Give IDs, a filter flag or --all; named IDs
must all be parked, or nothing is done.

` + retryFilterHelp + "\n\n" + retryDatabaseHelp,
		example: "oncemill retries cancel 7 --database postgres://app@db:5432/shop",
		run:     (*cmd).retriesCancel,
	},
	{
		path: "amqp declare", args: "--topic T [--topic T ...] [--group G] [--url URL]\n       [--delivery-limit N] [--dead-letter-exchange X]",
		short: "declare on RabbitMQ the exchange, queue and binding of topics",
		about: `Creates on RabbitMQ, for each --topic, what a subscriber of consumer group
--group declares: the topic's durable fanout exchange (named after the
topic), the durable quorum queue "<topic>.<group>" ("<topic>" without a
group) and the binding between them. Run it before producers start:
RabbitMQ drops messages published while no queue is bound.

A flag and the URL's parameter (see --url) must not differ. Queue arguments
must be those the consumers use: the broker refuses to declare an existing
queue with other arguments.`,
		example: "oncemill amqp declare --url amqp://guest:guest@rabbit:5672/ --topic payments --group billing",
		run:     (*cmd).amqpDeclare,
	},
	{
		path: "console", args: "[--addr HOST:PORT] [--token T] [--read-only] [--broker URL]\n       [--inbox URL]",
		short: "serve the operator console, a web UI over the inbox, outbox, dead letters and retries",
		about: `Serves the operator console: the inbox, the outbox and the dead letters,
which it filters, groups by error, replays and purges, and the messages
parked for a delayed retry, which it retries now or cancels into the
dead-letter table; each action after a confirmation page. Every request
needs the token, sent as "Authorization: Bearer T" or entered on the
login page. It serves plain HTTP until interrupted (SIGINT, SIGTERM),
then lets the requests in flight finish; beyond 127.0.0.1, put it behind
a TLS proxy.

` + databaseHelp + ` --inbox-table, --outbox-table and
--retry-table name the others.`,
		example: "oncemill console --database postgres://app@db:5432/shop --addr 127.0.0.1:8080 --read-only",
		run:     (*cmd).serveConsole,
	},
	{
		path: "publish", args: "--topic T [--broker URL] [--uuid U] [--key K] [--partition-key K]\n       [--meta NAME=VALUE ...] [PAYLOAD ...]",
		short:   "publish messages, from arguments or JSON lines on standard input",
		about:   publishHelp,
		example: `oncemill publish --broker amqp://guest:guest@rabbit:5672/ --topic orders --key A-42 '{"orderId":"A-42","amountCents":1999}'`,
		run:     (*cmd).publish,
	},
	{
		path: "relay", args: "--database URL --broker URL [--schema NAME] [--table NAME]\n       [--batch-size N] [--lanes-per-batch N] [--poll-interval DURATION]\n       [--drain-timeout DURATION] [--lock-ordered-writers] [--listen HOST:PORT]\n       [--migrate] [--ledger] [--ledger-retention DURATION]",
		short:   "relay a service's outbox table to the broker, as a process of its own",
		about:   relayHelp,
		example: "oncemill relay --database postgres://app@db:5432/shop --broker kafka://10.0.0.5:9092 --listen :9090",
		run:     (*cmd).relay,
	},
	{
		path: "reconcile", args: "--database URL --consumer NAME [--inbox-database URL] [--grace DURATION]\n       [--since DURATION] [--strict] [--schema NAME] [--inbox-schema NAME]\n       [--ledger-table NAME] [--inbox-table NAME] [--dlq-table NAME]",
		short:   "check that every event the relay published reached a consumer exactly once",
		about:   reconcileHelp,
		example: "oncemill reconcile --database postgres://app@db:5432/shop --consumer charge-orders --since 24h",
		run:     (*cmd).reconcile,
	},
}

// lookup returns the command at path, or nil.
func lookup(path string) *command {
	for i := range commands {
		if commands[i].path == path {
			return &commands[i]
		}
	}
	return nil
}

// wordsAfter are the first words of the commands whose path starts with
// prefix, after it: "dlq", "amqp", "console", … for "", "list", "show", …
// for "dlq ".
func wordsAfter(prefix string) []string {
	var words []string
	for _, c := range commands {
		if rest, ok := strings.CutPrefix(c.path, prefix); ok {
			if w, _, _ := strings.Cut(rest, " "); !slices.Contains(words, w) {
				words = append(words, w)
			}
		}
	}
	return words
}

// usage is the help of oncemill (prefix "") or of a command group (prefix
// "dlq "): its commands, and where their flags are.
func usage(prefix string) string {
	var b strings.Builder
	fmt.Fprintf(&b, "Usage: oncemill %s<command> [arguments] [flags]\n\nCommands:\n", prefix)
	tw := tabwriter.NewWriter(&b, 0, 0, 2, ' ', 0)
	for _, c := range commands {
		if rest, ok := strings.CutPrefix(c.path, prefix); ok {
			fmt.Fprintf(tw, "  %s\t%s\n", rest, c.short)
		}
	}
	tw.Flush() //nolint:errcheck // a strings.Builder does not fail
	fmt.Fprintf(&b, "\nRun 'oncemill %s<command> --help' for a command's arguments and every\nflag it takes.\n", prefix)
	if prefix == "" {
		b.WriteString(`
Exit status: 0 success (also when nothing matched), 1 failure, 2 usage error;
reconcile exits 3 when its check could not run.
`)
	}
	return b.String()
}

// helpRequest is what parse returns for -h or --help: the command's flag
// set, whose flags its help lists.
type helpRequest struct{ fs *flag.FlagSet }

func (helpRequest) Error() string { return "help requested" }

func (helpRequest) Is(target error) bool { return target == flag.ErrHelp }

// writeHelp prints the help of c, whose flags are fs.
func writeHelp(w io.Writer, c *command, fs *flag.FlagSet) {
	var b strings.Builder
	fmt.Fprintf(&b, "Usage: oncemill %s %s\n\n%s\n\nFlags:\n", c.path, c.args, c.about)
	fs.VisitAll(func(f *flag.Flag) {
		name, text := flag.UnquoteUsage(f)
		if name == "value" {
			name = "VALUE"
		}
		fmt.Fprintf(&b, "  --%s", f.Name)
		if name != "" {
			fmt.Fprintf(&b, " %s", name)
		}
		b.WriteString("\n")
		if d := f.DefValue; d != "" && d != "0" && d != "false" && !strings.Contains(text, "(default") {
			text += fmt.Sprintf(" (default %q)", d)
		}
		for _, line := range wrap(text, 70) {
			fmt.Fprintf(&b, "      %s\n", line)
		}
	})
	if c.example != "" {
		fmt.Fprintf(&b, "\nExample:\n  %s\n", c.example)
	}
	io.WriteString(w, b.String()) //nolint:errcheck // nowhere to report it
}

// wrap breaks s into lines of at most width characters, at spaces.
func wrap(s string, width int) []string {
	var lines []string
	line := ""
	for _, word := range strings.Fields(s) {
		switch {
		case line == "":
			line = word
		case len(line)+1+len(word) > width:
			lines = append(lines, line)
			line = word
		default:
			line += " " + word
		}
	}
	if line != "" {
		lines = append(lines, line)
	}
	return lines
}

// runCommand runs c with args, the arguments after its path.
func runCommand(ctx context.Context, c *command, args []string, env func(string) string, stdout, stderr io.Writer) int {
	x := &cmd{
		name:   "oncemill " + c.path,
		env:    env,
		stdout: stdout,
		stderr: stderr,
		now:    time.Now(),
	}
	err := c.run(x, ctx, args)
	var help helpRequest
	if errors.As(err, &help) {
		writeHelp(stdout, c, help.fs)
		return exitOK
	}
	return exit(x.name, err, stderr)
}
