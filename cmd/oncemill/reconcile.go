package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/oncemill/oncemill/adapters"
	"github.com/oncemill/oncemill/sqlschema"
)

// reconcileHelp is reconcile's help before its flags.
const reconcileHelp = `Compares the relay's ledger (forwarder.RelayConfig.Ledger) with one
consumer's inbox: every event the relay published more than --grace ago
and within --since must be done in the inbox, or dead (the inbox's dead
state, or an entry of the consumer in the dead-letter table, as
'oncemill dlq list --consumer NAME' shows). Each other event is listed:
lost (the inbox has no row for its key) or stuck (the key is processing
or failed), with its uuid, topic, key and publish time. --strict also
lists the keys done in the inbox within the window that no ledger row
explains.

The key compared is the one the inbox's default KeyFunc derives: the
idempotency_key metadata, else the message UUID. A consumer with another
KeyFunc cannot be reconciled so. The inbox and the dead-letter table are
read on --inbox-database; keep --since within the ledger's retention and
the inbox's (a done key the inbox already expired is reported lost).

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

// reconcilePage is how many ledger rows (or inbox keys) one look-up in
// the other database covers.
const reconcilePage = 1000

// reconcileOptions are reconcile's flags.
type reconcileOptions struct {
	database, inboxDatabase      string
	consumer                     string
	schema, inboxSchema          string
	ledgerTable, inboxTable, dlq string
	grace, since                 time.Duration
	strict                       bool
}

// missing is a ledger event the consumer's inbox holds neither as done
// nor as dead.
type missing struct {
	uuid, topic, key string
	publishedAt      time.Time
	// inbox is the key's inbox status ("processing", "failed"), or ""
	// when the inbox has no row for it.
	inbox string
}

// unexplained is a key done in the inbox that no ledger row explains.
type unexplained struct {
	key    string
	doneAt time.Time
}

func (c *cmd) reconcile(ctx context.Context, args []string) error {
	fs := flag.NewFlagSet(c.name, flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	fs.Usage = func() {}
	o := reconcileOptions{grace: 5 * time.Minute, since: 24 * time.Hour}
	fs.StringVar(&o.database, "database", "", "`URL` of the PostgreSQL database holding the relay's ledger (default $DATABASE_URL)")
	fs.StringVar(&o.inboxDatabase, "inbox-database", "", "`URL` of the PostgreSQL database holding the consumer's inbox and dead-letter tables (default: --database)")
	fs.StringVar(&o.consumer, "consumer", "", "`NAME` of the consumer whose inbox is checked, as its inbox's Consumer (required)")
	fs.Func("grace", "`DURATION` an event may take from its publish to its consumer's commit: younger events are not checked (default 5m)", func(s string) (err error) {
		o.grace, err = parseAgo(s)
		return err
	})
	fs.Func("since", "`DURATION` back from now to check: events published before are not checked; keep it within the ledger's and the inbox's retention (default 24h)", func(s string) (err error) {
		o.since, err = parseAgo(s)
		return err
	})
	fs.BoolVar(&o.strict, "strict", false, "also report the keys done in the inbox within the window that no ledger row explains")
	fs.StringVar(&o.schema, "schema", sqlschema.DefaultSchema, "`NAME` of the ledger's schema")
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
	ledgerCfg, inboxCfg, err := o.check(c.env)
	if err != nil {
		return err
	}
	ledgerDB, err := openReconcilePool(ctx, ledgerCfg)
	if err != nil {
		return codedError{exitCannotCheck, fmt.Errorf("--database: %w", err)}
	}
	defer ledgerDB.Close()
	inboxDB := ledgerDB
	if inboxCfg != nil {
		if inboxDB, err = openReconcilePool(ctx, inboxCfg); err != nil {
			return codedError{exitCannotCheck, fmt.Errorf("--inbox-database: %w", err)}
		}
		defer inboxDB.Close()
	}
	r := reconciler{
		opts:    o,
		ledger:  ledgerDB,
		inbox:   inboxDB,
		ledgerT: sqlschema.NamesFor(sqlschema.Postgres, sqlschema.Config{Schema: o.schema, LedgerTable: o.ledgerTable}.WithDefaults()),
		inboxT:  sqlschema.NamesFor(sqlschema.Postgres, sqlschema.Config{Schema: o.inboxSchema, InboxTable: o.inboxTable, DLQTable: o.dlq}.WithDefaults()),
	}
	rep, err := r.run(ctx)
	if err != nil {
		return codedError{exitCannotCheck, err}
	}
	rep.write(c.stdout, o.strict)
	if n := len(rep.missing) + len(rep.unexplained); n > 0 {
		if o.strict {
			return fmt.Errorf("%d missing, %d unexplained", len(rep.missing), len(rep.unexplained))
		}
		return fmt.Errorf("%d missing", len(rep.missing))
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
// databases' configurations; the inbox's is nil when it is the ledger's.
func (o *reconcileOptions) check(env func(string) string) (ledger, inbox *pgxpool.Config, err error) {
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
	if ledger, err = reconcilePoolConfig("--database", o.database); err != nil {
		return nil, nil, err
	}
	if o.inboxDatabase != "" && o.inboxDatabase != o.database {
		if inbox, err = reconcilePoolConfig("--inbox-database", o.inboxDatabase); err != nil {
			return nil, nil, err
		}
	}
	return ledger, inbox, nil
}

func reconcilePoolConfig(flagName, url string) (*pgxpool.Config, error) {
	if isMySQLURL(url) {
		return nil, usagef("%s: reconcile reads PostgreSQL only (the relay keeps its ledger there)", flagName)
	}
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		// pgx leaves the password out of its parse errors.
		return nil, usagef("%s: %v", flagName, err)
	}
	cfg.MaxConns = 2
	if cfg.ConnConfig.ConnectTimeout == 0 {
		cfg.ConnConfig.ConnectTimeout = adapters.DefaultConnectTimeout
	}
	return cfg, nil
}

func openReconcilePool(ctx context.Context, cfg *pgxpool.Config) (*pgxpool.Pool, error) {
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("connect: %w", err)
	}
	if err := pool.Ping(ctx); err != nil {
		pool.Close()
		return nil, fmt.Errorf("connect: %w", err)
	}
	return pool, nil
}

// reconciler compares the ledger with one consumer's inbox.
type reconciler struct {
	opts            reconcileOptions
	ledger, inbox   *pgxpool.Pool
	ledgerT, inboxT sqlschema.Names
}

// report is what reconcile found.
type report struct {
	from, to    time.Time
	checked     int
	missing     []missing
	unexplained []unexplained
}

func (r reconciler) run(ctx context.Context) (report, error) {
	var rep report
	// The window is read from the ledger's server clock, the one that
	// wrote published_at.
	if err := r.ledger.QueryRow(ctx, `SELECT now() - $1::float8 * interval '1 second', now() - $2::float8 * interval '1 second'`,
		r.opts.since.Seconds(), r.opts.grace.Seconds()).Scan(&rep.from, &rep.to); err != nil {
		return rep, fmt.Errorf("read the ledger's clock: %w", err)
	}
	if err := r.checkLedger(ctx, &rep); err != nil {
		return rep, err
	}
	if r.opts.strict {
		if err := r.checkInbox(ctx, &rep); err != nil {
			return rep, err
		}
	}
	return rep, nil
}

// checkLedger walks the ledger's window by (published_at, uuid), a page
// at a time, and looks each page's keys up in the inbox and the
// dead-letter table.
func (r reconciler) checkLedger(ctx context.Context, rep *report) error {
	q := `SELECT uuid, topic, idempotency_key, published_at FROM ` + r.ledgerT.Ledger + `
WHERE published_at >= $1 AND published_at < $2 AND (published_at, uuid) > ($3, $4)
ORDER BY published_at, uuid LIMIT $5`
	after, afterUUID := rep.from.Add(-time.Microsecond), ""
	for {
		rows, err := r.ledger.Query(ctx, q, rep.from, rep.to, after, afterUUID, reconcilePage)
		if err != nil {
			return fmt.Errorf("read the ledger %s: %w", r.ledgerT.Ledger, err)
		}
		page, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (missing, error) {
			var m missing
			err := row.Scan(&m.uuid, &m.topic, &m.key, &m.publishedAt)
			return m, err
		})
		if err != nil {
			return fmt.Errorf("read the ledger %s: %w", r.ledgerT.Ledger, err)
		}
		if len(page) == 0 {
			return nil
		}
		rep.checked += len(page)
		found, err := r.inboxPage(ctx, page)
		if err != nil {
			return err
		}
		rep.missing = append(rep.missing, found...)
		last := page[len(page)-1]
		after, afterUUID = last.publishedAt, last.uuid
		if len(page) < reconcilePage {
			return nil
		}
	}
}

// inboxPage returns the events of page that the inbox holds neither as
// done nor as dead, and that the dead-letter table has no entry of for
// the consumer (by key, or by UUID for an entry without a key), with the
// inbox's status of their key.
func (r reconciler) inboxPage(ctx context.Context, page []missing) ([]missing, error) {
	keys := make([]string, len(page))
	uuids := make([]string, len(page))
	for i, m := range page {
		keys[i], uuids[i] = m.key, m.uuid
	}
	status := map[string]string{}
	rows, err := r.inbox.Query(ctx, `SELECT key, status FROM `+r.inboxT.Inbox+` WHERE consumer = $1 AND key = ANY($2)`, r.opts.consumer, keys)
	if err != nil {
		return nil, fmt.Errorf("read the inbox %s: %w", r.inboxT.Inbox, err)
	}
	var k, s string
	if _, err := pgx.ForEachRow(rows, []any{&k, &s}, func() error { status[k] = s; return nil }); err != nil {
		return nil, fmt.Errorf("read the inbox %s: %w", r.inboxT.Inbox, err)
	}
	deadKeys, deadUUIDs := map[string]bool{}, map[string]bool{}
	rows, err = r.inbox.Query(ctx, `SELECT key, uuid FROM `+r.inboxT.DLQ+` WHERE consumer = $1 AND (key = ANY($2) OR uuid = ANY($3))`, r.opts.consumer, keys, uuids)
	if err != nil {
		return nil, fmt.Errorf("read the dead-letter table %s: %w", r.inboxT.DLQ, err)
	}
	var u string
	if _, err := pgx.ForEachRow(rows, []any{&k, &u}, func() error { deadKeys[k], deadUUIDs[u] = true, true; return nil }); err != nil {
		return nil, fmt.Errorf("read the dead-letter table %s: %w", r.inboxT.DLQ, err)
	}
	var out []missing
	for _, m := range page {
		st := status[m.key]
		if st == "done" || st == "dead" || deadKeys[m.key] || deadUUIDs[m.uuid] {
			continue
		}
		m.inbox = st
		out = append(out, m)
	}
	return out, nil
}

// checkInbox walks the consumer's keys done within the window, by key, a
// page at a time, and reports those no ledger row has (within its
// retention, which may reach further back than the window: an event
// published before the window and applied in it is explained).
func (r reconciler) checkInbox(ctx context.Context, rep *report) error {
	q := `SELECT key, done_at FROM ` + r.inboxT.Inbox + `
WHERE consumer = $1 AND status = 'done' AND done_at >= $2 AND done_at < $3 AND key > $4
ORDER BY key LIMIT $5`
	after := ""
	for {
		rows, err := r.inbox.Query(ctx, q, r.opts.consumer, rep.from, rep.to, after, reconcilePage)
		if err != nil {
			return fmt.Errorf("read the inbox %s: %w", r.inboxT.Inbox, err)
		}
		page, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (unexplained, error) {
			var u unexplained
			err := row.Scan(&u.key, &u.doneAt)
			return u, err
		})
		if err != nil {
			return fmt.Errorf("read the inbox %s: %w", r.inboxT.Inbox, err)
		}
		if len(page) == 0 {
			return nil
		}
		keys := make([]string, len(page))
		for i, u := range page {
			keys[i] = u.key
		}
		rows, err = r.ledger.Query(ctx, `SELECT DISTINCT idempotency_key FROM `+r.ledgerT.Ledger+` WHERE idempotency_key = ANY($1)`, keys)
		if err != nil {
			return fmt.Errorf("read the ledger %s: %w", r.ledgerT.Ledger, err)
		}
		known := map[string]bool{}
		var k string
		if _, err := pgx.ForEachRow(rows, []any{&k}, func() error { known[k] = true; return nil }); err != nil {
			return fmt.Errorf("read the ledger %s: %w", r.ledgerT.Ledger, err)
		}
		for _, u := range page {
			if !known[u.key] {
				rep.unexplained = append(rep.unexplained, u)
			}
		}
		after = page[len(page)-1].key
		if len(page) < reconcilePage {
			return nil
		}
	}
}

// write prints the report: one line per finding, then the counts.
func (rep report) write(w io.Writer, strict bool) {
	if len(rep.missing) > 0 {
		tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
		fmt.Fprintln(tw, "STATE\tUUID\tTOPIC\tKEY\tPUBLISHED AT\tINBOX")
		for _, m := range rep.missing {
			state, inbox := "lost", m.inbox
			if inbox != "" {
				state = "stuck"
			} else {
				inbox = "-"
			}
			fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\n", state, m.uuid, m.topic, m.key, m.publishedAt.UTC().Format(time.RFC3339), inbox)
		}
		tw.Flush() //nolint:errcheck // nowhere to report it
	}
	if len(rep.unexplained) > 0 {
		tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
		fmt.Fprintln(tw, "UNEXPLAINED KEY\tDONE AT")
		for _, u := range rep.unexplained {
			fmt.Fprintf(tw, "%s\t%s\n", u.key, u.doneAt.UTC().Format(time.RFC3339))
		}
		tw.Flush() //nolint:errcheck // nowhere to report it
	}
	window := fmt.Sprintf("of %d events published from %s to %s", rep.checked, rep.from.UTC().Format(time.RFC3339), rep.to.UTC().Format(time.RFC3339))
	if strict {
		fmt.Fprintf(w, "%d missing %s, %d unexplained done keys\n", len(rep.missing), window, len(rep.unexplained))
		return
	}
	fmt.Fprintf(w, "%d missing %s\n", len(rep.missing), window)
}
