package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"strconv"
	"strings"
	"time"

	"github.com/oncemill/oncemill/dlq"
	"github.com/oncemill/oncemill/sqlschema"
)

// cmd is one run of a dlq subcommand: where it writes and the common flags.
type cmd struct {
	name   string
	env    func(string) string
	stdout io.Writer
	stderr io.Writer
	// stdin is what publish reads messages from. Defaults to os.Stdin.
	stdin io.Reader
	now   time.Time

	database string
	schema   string
	table    string
	json     bool
}

// flags returns a flag set with the common flags.
func (c *cmd) flags() *flag.FlagSet {
	fs := newFlags(c.name)
	fs.StringVar(&c.database, "database", "", "`URL` of the database holding the table: "+databaseURLs+" (default $DATABASE_URL)")
	fs.StringVar(&c.schema, "schema", sqlschema.DefaultSchema, "`NAME` of the dead-letter table's schema (on MySQL: its database; SQLite has none)")
	fs.StringVar(&c.table, "table", sqlschema.DefaultDLQTable, "`NAME` of the dead-letter table")
	fs.BoolVar(&c.json, "json", false, "print JSON instead of text")
	return fs
}

// filterFlags adds the filter flags, which fill f.
func (c *cmd) filterFlags(fs *flag.FlagSet, f *dlq.Filter) {
	fs.StringVar(&f.Topic, "topic", "", "only entries of this original `TOPIC`, the one the message was consumed from")
	fs.StringVar(&f.Consumer, "consumer", "", "only entries of this `CONSUMER` (handler), the one that gave up on the message")
	fs.StringVar(&f.ErrorContains, "error", "", "only entries whose last error contains `TEXT`, ignoring case")
	since := func(s string) (time.Time, error) { return parseTime(s, c.now) }
	parsedFlag(fs, "since", "only entries dead-lettered at or after `TIME`", &f.Since, since)
	parsedFlag(fs, "until", "only entries dead-lettered at or before `TIME`", &f.Until, since)
	fs.IntVar(&f.Limit, "limit", 0, "only the first `N` matching entries, by id (0: all)")
}

// checkFilter reports a filter out of range as a usage error naming the
// flag or argument.
func checkFilter(f dlq.Filter) error {
	if f.Limit < 0 {
		return usagef("--limit must be 0 (all) or more, got %d", f.Limit)
	}
	if !f.Since.IsZero() && !f.Until.IsZero() && f.Since.After(f.Until) {
		return usagef("--since (%s) is after --until (%s)", f.Since.Format(time.RFC3339), f.Until.Format(time.RFC3339))
	}
	if err := f.Validate(); err != nil {
		return usageError{msg: err.Error()}
	}
	return nil
}

// target checks the database flags and returns the database and the
// table's names, before anything connects. create allows a SQLite file
// that does not exist yet.
func (c *cmd) target(create bool) (*dbURL, sqlschema.Config, error) {
	url, err := c.required("--database", c.database, "DATABASE_URL")
	if err == nil {
		err = checkNames("--schema", c.schema, "--table", c.table)
	}
	if err != nil {
		return nil, sqlschema.Config{}, err
	}
	db, err := parseDatabase("--database", url, create)
	return db, sqlschema.Config{Schema: c.schema, DLQTable: c.table}, err
}

// open checks the database flags, opens the database and the store on
// the dead-letter table; closeDB releases them.
func (c *cmd) open(ctx context.Context) (store *dlq.Store, closeDB func(), err error) {
	u, cfg, err := c.target(false)
	if err != nil {
		return nil, nil, err
	}
	db, err := u.connect(ctx, 4)
	if err != nil {
		return nil, nil, err
	}
	if db.Pool != nil {
		store, err = dlq.NewStore(db.Pool, cfg)
	} else {
		store, err = dlq.NewSQLStore(db.DB, db.Dialect, cfg)
	}
	if err != nil {
		db.Close()
		return nil, nil, err
	}
	return store, db.Close, nil
}

// tableMissing is the error of a dlq command whose dead-letter table
// does not exist: the flags that named it, and how to name another. It
// unwraps to the store's error ([dlq.ErrNotMigrated]), whose own text
// speaks to a Go program (run sqlschema.Migrate with the same Schema and
// DLQTable), not to the command's user.
type tableMissing struct {
	table string
	err   error
}

func (e tableMissing) Error() string {
	return fmt.Sprintf("dead-letter table %s not found in this database: give the consumers' dead-letter table with --schema NAME and --table NAME (their sqlschema.Config's Schema and DLQTable; on SQLite --table alone); their migrations create it (sqlschema.Migrate)", e.table)
}

func (e tableMissing) Unwrap() error { return e.err }

// dlqCommand runs a dlq command, saying which flags named a missing
// dead-letter table.
func dlqCommand(run func(*cmd, context.Context, []string) error) func(*cmd, context.Context, []string) error {
	return func(c *cmd, ctx context.Context, args []string) error {
		err := run(c, ctx, args)
		if errors.Is(err, dlq.ErrNotMigrated) {
			return tableMissing{table: c.tableName(), err: err}
		}
		return err
	}
}

// tableName is the dead-letter table the flags name, for messages: a
// SQLite file has no schema.
func (c *cmd) tableName() string {
	raw, _ := c.required("--database", c.database, "DATABASE_URL") // it opened: it is there
	if u, err := parseDatabase("--database", raw, false); err == nil && u.dialect == sqlschema.SQLite {
		return fmt.Sprintf("%q (--table %s)", c.table, c.table)
	}
	return fmt.Sprintf("%q.%q (--schema %s --table %s)", c.schema, c.table, c.schema, c.table)
}

// checkIDs fails, naming them, when some of ids have no entry: an operator
// who names entries means those entries, and nothing is done without them.
func checkIDs(ctx context.Context, store *dlq.Store, ids []int64, verb string) error {
	missing, err := store.Missing(ctx, ids)
	if err != nil {
		return err
	}
	if len(missing) == 0 {
		return nil
	}
	s := make([]string, len(missing))
	for i, id := range missing {
		s[i] = strconv.FormatInt(id, 10)
	}
	noun := "entry"
	if len(missing) > 1 {
		noun = "entries"
	}
	return fmt.Errorf("no such %s: %s; nothing %s", noun, strings.Join(s, ", "), verb)
}

// nothingMatched reports an empty selection: on stdout as text, on stderr
// beside empty, the JSON result.
func (c *cmd) nothingMatched(empty any) error {
	if c.json {
		fmt.Fprintln(c.stderr, "no entries matched")
		return c.writeJSON(empty)
	}
	fmt.Fprintln(c.stdout, "no entries matched")
	return nil
}

func (c *cmd) list(ctx context.Context, args []string) error {
	var f dlq.Filter
	fs := c.flags()
	c.filterFlags(fs, &f)
	if err := onlyFlags(fs, args, "list takes no IDs (use show ID, or a filter flag)"); err != nil {
		return err
	}
	if err := checkFilter(f); err != nil {
		return err
	}
	store, closeDB, err := c.open(ctx)
	if err != nil {
		return err
	}
	defer closeDB()
	entries, err := store.List(ctx, f)
	if err != nil {
		return err
	}
	if len(entries) == 0 {
		return c.nothingMatched([]entryView{})
	}
	if c.json {
		views := make([]entryView, len(entries))
		for i, e := range entries {
			views[i] = viewOf(e)
		}
		return c.writeJSON(views)
	}
	return writeTable(c.stdout, entries)
}

func (c *cmd) show(ctx context.Context, args []string) error {
	id, err := oneID(c.flags(), args, "show")
	if err != nil {
		return err
	}
	store, closeDB, err := c.open(ctx)
	if err != nil {
		return err
	}
	defer closeDB()
	e, err := store.Get(ctx, id)
	if err != nil {
		return err
	}
	var copies *int
	if n, ok, err := store.CopiesSince(ctx, e); err != nil {
		return err
	} else if ok {
		copies = &n
	}
	if c.json {
		v := viewOf(e)
		v.CopiesSince = copies
		return c.writeJSON(v)
	}
	table := c.table
	if c.schema != "" {
		table = c.schema + "." + table
	}
	return writeEntry(c.stdout, e, table, copies)
}

// selection parses the IDs and flags of replay and purge; it refuses an
// empty selection.
func (c *cmd) selection(fs *flag.FlagSet, f *dlq.Filter, args []string) error {
	c.filterFlags(fs, f)
	fs.BoolVar(&f.All, "all", false, "act on every entry (with filters: every one they match)")
	pos, err := parse(fs, args)
	if err != nil {
		return err
	}
	if f.IDs, err = parseIDs(pos); err != nil {
		return err
	}
	if err := checkFilter(*f); err != nil {
		return err
	}
	if f.IsEmpty() && !f.All {
		return usagef("nothing selected: give IDs, a filter flag (--topic, --consumer, --error, --since, --until) or --all")
	}
	return nil
}

// replayResult is replay's JSON output.
type replayResult struct {
	Matched  int `json:"matched"`
	Replayed int `json:"replayed"`
}

func (c *cmd) replay(ctx context.Context, args []string) error {
	var (
		f          dlq.Filter
		broker     string
		inboxURL   string
		toConsumer bool
		force      bool
	)
	fs := c.flags()
	fs.StringVar(&broker, "broker", "", "`URL` of the broker to publish to (default $BROKER_URL): kafka://, amqp://, sqs://, nats:// or postgres://, as adapters.Open takes them; gochannel:// and kafka:// or nats:// with no host, brokers inside this process, are refused")
	fs.BoolVar(&toConsumer, "to-consumer", false, "deliver each entry to its own consumer only, through the dlq.ReplaySubscriber it runs, instead of publishing it to the topic")
	fs.StringVar(&inboxURL, "inbox", "", "`URL` of the consumers' inbox store, where the replay grants are written, when it is not beside the dead-letter table: redis://[:PASSWORD@]HOST:PORT[/DB][?prefix=P], sqlite:PATH[?table=T], postgres://…[?schema=S&table=T] or mysql://…[?schema=DB&table=T]")
	fs.BoolVar(&force, "force", false, "replay an entry whose key has no record in the inbox as a new key (its record expired)")
	if err := c.selection(fs, &f, args); err != nil {
		return err
	}
	if toConsumer {
		switch {
		case broker != "":
			return usagef("--to-consumer publishes nothing: drop --broker")
		case inboxURL != "", force:
			return usagef("--to-consumer writes no grant (the consumer's replay subscriber does): drop --inbox and --force")
		}
		return c.requestReplay(ctx, f, broker == "" && c.env("BROKER_URL") != "")
	}
	var inbox *inboxTarget
	if inboxURL != "" {
		var err error
		if inbox, err = parseInbox(inboxURL); err != nil {
			return err
		}
	}
	broker, err := c.required("--broker", broker, "BROKER_URL")
	if err != nil {
		return err
	}
	if err := checkDurableBroker("--broker", broker, "nothing replayed"); err != nil {
		return err
	}
	store, closeDB, total, err := c.openReplay(ctx, f, "replayed")
	if err != nil || total == 0 {
		return err
	}
	defer closeDB()
	if err := c.warnHopeless(ctx, store, f); err != nil {
		return err
	}
	if inbox != nil {
		g, closeInbox, err := inbox.open(ctx)
		if err != nil {
			return fmt.Errorf("nothing replayed: %w", err)
		}
		defer closeInbox()
		if store, err = store.WithGranter(g); err != nil {
			return err
		}
	}
	if force {
		store = store.WithNewKeys()
	}

	ps, err := openBroker(ctx, "--broker", broker, "oncemill-dlq-replay", "nothing replayed", nil)
	if err != nil {
		return err
	}
	var report func(done, total int)
	bar := newProgress(c.stderr, total, isTerminal(c.stderr))
	if bar != nil {
		report = bar.update
	}
	n, err := store.Replay(ctx, ps.Publisher, f, report)
	bar.finish()
	closeBroker(ps, &err)
	if err != nil {
		return fmt.Errorf("replayed %d of %d entries, then: %w", n, total, err)
	}
	if c.json {
		return c.writeJSON(replayResult{Matched: total, Replayed: n})
	}
	fmt.Fprintf(c.stdout, "replayed %d %s", n, plural(n, "entry", "entries"))
	if n < total {
		fmt.Fprintf(c.stdout, " of %d matched (the others were replayed or purged meanwhile)", total)
	}
	fmt.Fprintln(c.stdout)
	return nil
}

// openReplay opens the table for a replay of f and counts the entries it
// selects. When none match it says so (an empty result with --json),
// closes the table and returns total 0.
func (c *cmd) openReplay(ctx context.Context, f dlq.Filter, verb string) (*dlq.Store, func(), int, error) {
	store, closeDB, err := c.openSelected(ctx, f, verb)
	if err != nil {
		return nil, nil, 0, err
	}
	total, err := store.Count(ctx, f)
	if err == nil && total > 0 {
		return store, closeDB, total, nil
	}
	closeDB()
	if err != nil {
		return nil, nil, 0, err
	}
	return nil, nil, 0, c.nothingMatched(replayResult{})
}

// requestReplay marks the selected entries for their consumers'
// ReplaySubscribers, which deliver and delete them. A consumer whose
// replay subscriber has not announced itself lately would strand its
// entries in the table: nothing is requested, and the error offers the
// replay to the topic (haveBroker: BROKER_URL is set already).
func (c *cmd) requestReplay(ctx context.Context, f dlq.Filter, haveBroker bool) error {
	store, closeDB, total, err := c.openReplay(ctx, f, "requested")
	if err != nil || total == 0 {
		return err
	}
	defer closeDB()
	entries, err := store.List(ctx, f)
	if err != nil {
		return err
	}
	var absent []string
	seen := map[string]bool{}
	for _, e := range entries {
		if seen[e.Consumer] || e.Consumer == "" {
			continue
		}
		seen[e.Consumer] = true
		p, ok, err := store.Replayer(ctx, e.Consumer)
		if err != nil {
			return fmt.Errorf("nothing requested: %w", err)
		}
		if !ok || !p.Alive {
			absent = append(absent, dlq.NoReplayerError(e.Consumer, p, ok).Error())
		}
	}
	if len(absent) > 0 {
		fix := "use --broker URL (or BROKER_URL) to replay to the topic instead"
		if haveBroker {
			fix = "drop --to-consumer to replay to the topic through BROKER_URL instead"
		}
		return fmt.Errorf("nothing requested: %s; the request would wait in the table until one runs: %s, or start the consumer with dlq.WithReplays",
			strings.Join(absent, "; "), fix)
	}
	if err := c.warnHopeless(ctx, store, f); err != nil {
		return err
	}
	n, err := store.RequestReplay(ctx, f)
	if err != nil {
		return err
	}
	if c.json {
		return c.writeJSON(replayResult{Matched: total, Replayed: n})
	}
	fmt.Fprintf(c.stdout, "requested a replay of %d %s to %s; each is delivered by its consumer's replay subscriber and deleted once handled\n",
		n, plural(n, "entry", "entries"), plural(n, "its consumer", "their consumers"))
	return nil
}

// maxHopeless bounds the warnings of warnHopeless; the rest are counted.
const maxHopeless = 10

// warnHopeless says on stderr, before anything is sent, which of the
// entries f selects would only die again (dlq.Entry.Hopeless), so that a
// replay that makes new entries is not a surprise. They are replayed all
// the same: a handler fixed since may take them.
func (c *cmd) warnHopeless(ctx context.Context, store *dlq.Store, f dlq.Filter) error {
	entries, err := store.List(ctx, f)
	if err != nil {
		return err
	}
	n := 0
	for _, e := range entries {
		why := e.Hopeless()
		if why == "" {
			continue
		}
		if n++; n <= maxHopeless {
			fmt.Fprintf(c.stderr, "warning: entry %d cannot succeed as it is: %s\n", e.ID, why)
		}
	}
	if n > maxHopeless {
		fmt.Fprintf(c.stderr, "warning: %d more entries cannot succeed as they are\n", n-maxHopeless)
	}
	return nil
}

// reopenResult is reopen's JSON output.
type reopenResult struct {
	Reopened int64  `json:"reopened"`
	Consumer string `json:"consumer"`
	Key      string `json:"key"`
}

func (c *cmd) reopen(ctx context.Context, args []string) error {
	id, err := oneID(c.flags(), args, "reopen")
	if err != nil {
		return err
	}
	store, closeDB, err := c.open(ctx)
	if err != nil {
		return err
	}
	defer closeDB()
	e, err := store.Reopen(ctx, id)
	if err != nil {
		return fmt.Errorf("nothing reopened: %w", err)
	}
	if c.json {
		return c.writeJSON(reopenResult{Reopened: e.ID, Consumer: e.Consumer, Key: e.Key})
	}
	fmt.Fprintf(c.stdout, "reopened consumer %q key %q and deleted entry %d: the next copy of the key runs once, whatever its payload; the copies after it are duplicates\n",
		e.Consumer, e.Key, e.ID)
	return nil
}

// openSelected connects to the table and checks that every ID f names
// exists, so that a typo acts on nothing; verb says what would have been
// done, for the error.
func (c *cmd) openSelected(ctx context.Context, f dlq.Filter, verb string) (*dlq.Store, func(), error) {
	store, closeDB, err := c.open(ctx)
	if err != nil {
		return nil, nil, err
	}
	if err := checkIDs(ctx, store, f.IDs, verb); err != nil {
		closeDB()
		return nil, nil, err
	}
	return store, closeDB, nil
}

// purgeResult is purge's JSON output.
type purgeResult struct {
	Purged int `json:"purged"`
}

func (c *cmd) purge(ctx context.Context, args []string) error {
	var f dlq.Filter
	fs := c.flags()
	if err := c.selection(fs, &f, args); err != nil {
		return err
	}
	store, closeDB, err := c.openSelected(ctx, f, "purged")
	if err != nil {
		return err
	}
	defer closeDB()
	n, err := store.Purge(ctx, f)
	if err != nil {
		return err
	}
	if n == 0 {
		return c.nothingMatched(purgeResult{})
	}
	if c.json {
		return c.writeJSON(purgeResult{Purged: n})
	}
	fmt.Fprintf(c.stdout, "purged %d %s\n", n, plural(n, "entry", "entries"))
	return nil
}

func plural(n int, one, many string) string {
	if n == 1 {
		return one
	}
	return many
}

// oneID parses the one entry ID that show and reopen take, after their
// flags.
func oneID(fs *flag.FlagSet, args []string, verb string) (int64, error) {
	pos, err := parse(fs, args)
	if err != nil {
		return 0, err
	}
	switch {
	case len(pos) == 0:
		return 0, usagef("missing ID: %s takes one entry ID", verb)
	case len(pos) > 1:
		return 0, usagef("unexpected argument %q: %s takes one entry ID", pos[1], verb)
	}
	ids, err := parseIDs(pos)
	if err != nil {
		return 0, err
	}
	return ids[0], nil
}
