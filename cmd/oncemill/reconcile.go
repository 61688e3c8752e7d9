package main

import (
	"context"
	"fmt"
	"io"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/oncemill/oncemill/reconcile"
	"github.com/oncemill/oncemill/sqlschema"
)

// reconcileHelp is reconcile's help before its flags.
const reconcileHelp = `Compares the relay's ledger (forwarder.RelayConfig.Ledger) with one
consumer's inbox: every event the relay published more than --grace ago
and within --since, on the topics the consumer reads (--topic), must be
done in the inbox, or dead (the inbox's dead state, or an entry of the
consumer in the dead-letter table, as 'oncemill dlq list --consumer NAME'
shows). Each other event is listed: lost (the inbox has no row for its
key) or stuck (the key is processing or failed), with its uuid, topic,
key and publish time. --strict also lists the keys done in the inbox
within the window that no ledger row explains. It is the check of the
Go package reconcile, which the console's overview also runs.

The key compared is the one the inbox's default KeyFunc derives: the
idempotency_key metadata, else the message UUID. A consumer with another
KeyFunc cannot be reconciled so. The ledger is read on --database, the
inbox and the dead-letter table on --inbox-database; either may be
PostgreSQL (postgres://…), MySQL/MariaDB (mysql://…) or a SQLite file
(sqlite:///absolute/path). Keep --since within the ledger's retention and the
inbox's (a done key the inbox already expired is reported lost).

Exit status: 0 nothing missing ("0 missing"), 1 events missing or keys
unexplained (listed), 2 usage error, 3 the check could not run (a
database unreachable, a table missing).`

// exitCannotCheck is reconcile's exit status when the check could not
// run (a database unreachable, a table missing): a job must not read it
// as "events lost".
const exitCannotCheck = 3

// codedError is a failure with an exit status of its own.
type codedError struct {
	code int
	err  error
}

func (e codedError) Error() string { return e.err.Error() }
func (e codedError) Unwrap() error { return e.err }

// reconcileOptions are reconcile's flags.
type reconcileOptions struct {
	database, inboxDatabase      string
	consumer                     string
	topics                       []string
	schema, inboxSchema          string
	ledgerTable, inboxTable, dlq string
	grace, since                 time.Duration
	strict                       bool
	limit                        int
}

func (c *cmd) reconcile(ctx context.Context, args []string) error {
	fs := newFlags(c.name)
	o := reconcileOptions{grace: 5 * time.Minute, since: 24 * time.Hour}
	fs.StringVar(&o.database, "database", "", "`URL` of the database holding the relay's ledger: "+databaseURLs+" (default $DATABASE_URL)")
	fs.StringVar(&o.inboxDatabase, "inbox-database", "", "`URL` of the database holding the consumer's inbox and dead-letter tables, as --database (default: --database)")
	fs.StringVar(&o.consumer, "consumer", "", "`NAME` of the consumer whose inbox is checked, as its inbox's Consumer (required)")
	fs.Func("grace", "`DURATION` an event may take from its publish to its consumer's commit: younger events are not checked (default 5m)", func(s string) (err error) {
		o.grace, err = parseAgo(s)
		return err
	})
	fs.Func("since", "`DURATION` back from now to check: events published before are not checked; keep it within the ledger's and the inbox's retention (default 24h)", func(s string) (err error) {
		o.since, err = parseAgo(s)
		return err
	})
	fs.Func("topic", "`TOPIC` the consumer reads, repeated or comma-separated: only its events are checked (default: every topic of the ledger, which reports the events of topics the consumer does not read as lost)", func(s string) error {
		for _, topic := range strings.Split(s, ",") {
			if topic = strings.TrimSpace(topic); topic == "" {
				return fmt.Errorf("%q holds an empty topic", s)
			}
			o.topics = append(o.topics, strings.TrimSpace(topic))
		}
		return nil
	})
	fs.IntVar(&o.limit, "limit", reconcile.DefaultLimit, "the most events (and keys) `N` listed, oldest first; the counts count them all")
	fs.BoolVar(&o.strict, "strict", false, "also report the keys done in the inbox within the window that no ledger row explains")
	fs.StringVar(&o.schema, "schema", sqlschema.DefaultSchema, "`NAME` of the ledger's schema (on MySQL: its database; SQLite has none)")
	fs.StringVar(&o.inboxSchema, "inbox-schema", "", "`NAME` of the inbox's and the dead-letter table's schema (default: --schema)")
	fs.StringVar(&o.ledgerTable, "ledger-table", sqlschema.DefaultLedgerTable, "`NAME` of the ledger table")
	fs.StringVar(&o.inboxTable, "inbox-table", sqlschema.DefaultInboxTable, "`NAME` of the inbox table")
	fs.StringVar(&o.dlq, "dlq-table", sqlschema.DefaultDLQTable, "`NAME` of the dead-letter table")
	rest, err := parse(fs, args)
	if err != nil {
		return err
	}
	if len(rest) > 0 {
		return usagef("unexpected argument %q", rest[0])
	}
	ledger, inbox, err := o.check(c.env)
	if err != nil {
		return err
	}
	cfg := reconcile.Config{
		Consumer: o.consumer,
		Topics:   o.topics,
		Grace:    o.grace,
		Since:    o.since,
		Strict:   o.strict,
		Limit:    o.limit,
	}
	if cfg.Ledger, err = tables(ctx, ledger, sqlschema.Config{Schema: o.schema, LedgerTable: o.ledgerTable}); err != nil {
		return err
	}
	defer closeTables(cfg.Ledger)
	inboxSchema := sqlschema.Config{Schema: o.inboxSchema, InboxTable: o.inboxTable, DLQTable: o.dlq}
	if inbox == nil {
		cfg.Inbox = cfg.Ledger
		cfg.Inbox.Schema = inboxSchema
	} else {
		if cfg.Inbox, err = tables(ctx, inbox, inboxSchema); err != nil {
			return err
		}
		defer closeTables(cfg.Inbox)
	}
	rep, err := reconcile.Check(ctx, cfg)
	if err != nil {
		return codedError{exitCannotCheck, err}
	}
	writeReport(c.stdout, rep, o.strict)
	if !rep.OK() {
		if o.strict {
			return fmt.Errorf("%d missing, %d unexplained", rep.MissingEvents(), rep.UnexplainedKeys)
		}
		return fmt.Errorf("%d missing", rep.MissingEvents())
	}
	return nil
}

// parseAgo reads a positive duration: Go syntax, or whole days as "7d".
func parseAgo(s string) (time.Duration, error) {
	if days, ok := strings.CutSuffix(s, "d"); ok {
		n, err := strconv.Atoi(days)
		if err != nil || n <= 0 || n > 100000 {
			return 0, fmt.Errorf("%q is not a duration like 5m, 2h or 7d", s)
		}
		return time.Duration(n) * 24 * time.Hour, nil
	}
	d, err := time.ParseDuration(s)
	if err != nil || d <= 0 {
		return 0, fmt.Errorf("%q is not a positive duration like 5m, 2h or 7d", s)
	}
	return d, nil
}

// check validates the flags, before anything connects, and returns the
// databases' targets; the inbox's is nil when it is the ledger's.
func (o *reconcileOptions) check(env func(string) string) (ledger, inbox *dbURL, err error) {
	if o.database == "" {
		o.database = env("DATABASE_URL")
	}
	switch {
	case o.database == "":
		return nil, nil, usagef("--database is required (or set DATABASE_URL)")
	case o.consumer == "":
		return nil, nil, usagef("--consumer is required: the inbox's Consumer, whose keys are checked")
	case o.since <= o.grace:
		return nil, nil, usagef("--since (%s) must be longer than --grace (%s): nothing would be checked", o.since, o.grace)
	case o.limit <= 0:
		return nil, nil, usagef("--limit must be at least 1, got %d", o.limit)
	}
	if o.inboxSchema == "" {
		o.inboxSchema = o.schema
	}
	for _, id := range []struct{ flag, value string }{
		{"--schema", o.schema}, {"--inbox-schema", o.inboxSchema},
		{"--ledger-table", o.ledgerTable}, {"--inbox-table", o.inboxTable}, {"--dlq-table", o.dlq},
	} {
		if err := sqlschema.ValidateIdentifier(id.flag, id.value); err != nil {
			return nil, nil, usageError{msg: err.Error()}
		}
	}
	if ledger, err = parseDatabase("--database", o.database, false); err != nil {
		return nil, nil, err
	}
	if o.inboxDatabase != "" && o.inboxDatabase != o.database {
		if inbox, err = parseDatabase("--inbox-database", o.inboxDatabase, false); err != nil {
			return nil, nil, err
		}
	}
	return ledger, inbox, nil
}

// tables connects to the database u names: a failure is a check that
// could not run.
func tables(ctx context.Context, u *dbURL, schema sqlschema.Config) (reconcile.Tables, error) {
	db, err := u.connect(ctx, 2)
	if err != nil {
		return reconcile.Tables{}, codedError{exitCannotCheck, fmt.Errorf("%s: %w", u.flag, err)}
	}
	return reconcile.Tables{Pool: db.Pool, DB: db.DB, Dialect: db.Dialect, Schema: schema}, nil
}

func closeTables(t reconcile.Tables) {
	database{Pool: t.Pool, DB: t.DB}.Close()
}

// writeReport prints rep: one line per finding listed, then the counts.
func writeReport(w io.Writer, rep reconcile.Report, strict bool) {
	if len(rep.Missing) > 0 {
		tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
		fmt.Fprintln(tw, "STATE\tUUID\tTOPIC\tKEY\tPUBLISHED AT\tINBOX")
		for _, m := range rep.Missing {
			state, inbox := "lost", m.Inbox
			if !m.Lost() {
				state = "stuck"
			} else {
				inbox = "-"
			}
			fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\n", state, m.UUID, m.Topic, m.Key, m.PublishedAt.UTC().Format(time.RFC3339), inbox)
		}
		tw.Flush() //nolint:errcheck // nowhere to report it
		if n := rep.MissingEvents(); n > len(rep.Missing) {
			fmt.Fprintf(w, "(the oldest %d of %d listed: --limit)\n", len(rep.Missing), n)
		}
	}
	if len(rep.Unexplained) > 0 {
		tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
		fmt.Fprintln(tw, "UNEXPLAINED KEY\tDONE AT")
		for _, u := range rep.Unexplained {
			fmt.Fprintf(tw, "%s\t%s\n", u.Key, u.DoneAt.UTC().Format(time.RFC3339))
		}
		tw.Flush() //nolint:errcheck // nowhere to report it
		if rep.UnexplainedKeys > len(rep.Unexplained) {
			fmt.Fprintf(w, "(the first %d of %d listed: --limit)\n", len(rep.Unexplained), rep.UnexplainedKeys)
		}
	}
	window := fmt.Sprintf("of %d events published from %s to %s", rep.Checked, rep.From.UTC().Format(time.RFC3339), rep.To.UTC().Format(time.RFC3339))
	if strict {
		fmt.Fprintf(w, "%d missing (%d lost, %d stuck) %s, %d unexplained done keys\n", rep.MissingEvents(), rep.Lost, rep.Stuck, window, rep.UnexplainedKeys)
		return
	}
	fmt.Fprintf(w, "%d missing (%d lost, %d stuck) %s\n", rep.MissingEvents(), rep.Lost, rep.Stuck, window)
}
