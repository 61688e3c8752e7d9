package main

import (
	"context"
	"fmt"
	"io"
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
KeyFunc cannot be reconciled so. Keep --since within the ledger's
retention and the inbox's (a done key the inbox already expired is
reported lost).

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
	parsedFlag(fs, "grace", "`DURATION` an event may take from its publish to its consumer's commit: younger events are not checked (default 5m)", &o.grace, parseAgo)
	parsedFlag(fs, "since", "`DURATION` back from now to check: events published before are not checked; keep it within the ledger's and the inbox's retention (default 24h)", &o.since, parseAgo)
	fs.Func("topic", "`TOPIC` the consumer reads, repeated or comma-separated: only its events are checked (default: every topic of the ledger, which reports the events of topics the consumer does not read as lost)", func(s string) error {
		topics, err := splitTopics(s, s)
		o.topics = append(o.topics, topics...)
		return err
	})
	fs.IntVar(&o.limit, "limit", reconcile.DefaultLimit, "the most events (and keys) `N` listed, oldest first; the counts count them all")
	fs.BoolVar(&o.strict, "strict", false, "also report the keys done in the inbox within the window that no ledger row explains")
	fs.StringVar(&o.schema, "schema", sqlschema.DefaultSchema, "`NAME` of the ledger's schema (on MySQL: its database; SQLite has none)")
	fs.StringVar(&o.inboxSchema, "inbox-schema", "", "`NAME` of the inbox's and the dead-letter table's schema (default: --schema)")
	fs.StringVar(&o.ledgerTable, "ledger-table", sqlschema.DefaultLedgerTable, "`NAME` of the ledger table")
	fs.StringVar(&o.inboxTable, "inbox-table", sqlschema.DefaultInboxTable, "`NAME` of the inbox table")
	fs.StringVar(&o.dlq, "dlq-table", sqlschema.DefaultDLQTable, "`NAME` of the dead-letter table")
	if err := onlyFlags(fs, args, "reconcile takes only flags"); err != nil {
		return err
	}
	ledger, inbox, err := o.check(c)
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

// check validates the flags, before anything connects, and returns the
// databases' targets; the inbox's is nil when it is the ledger's.
func (o *reconcileOptions) check(c *cmd) (ledger, inbox *dbURL, err error) {
	if o.database, err = c.required("--database", o.database, "DATABASE_URL"); err != nil {
		return nil, nil, err
	}
	switch {
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
	if err := checkNames("--schema", o.schema, "--inbox-schema", o.inboxSchema, "--ledger-table", o.ledgerTable,
		"--inbox-table", o.inboxTable, "--dlq-table", o.dlq); err != nil {
		return nil, nil, err
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
