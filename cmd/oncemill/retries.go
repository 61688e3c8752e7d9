package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/oncemill/oncemill/dlq"
	"github.com/oncemill/oncemill/internal/sqldb"
	"github.com/oncemill/oncemill/retry"
	"github.com/oncemill/oncemill/sqlschema"
)

// The retries group: the table of parked messages, where the poison
// middleware parks a message for a delayed retry and the consumer's
// retry subscriber hands it back when due. Built as the dlq group is.

// retryFlags returns a flag set with the common flags of the retries
// group: the database, the table's names and --json.
func (c *cmd) retryFlags() *flag.FlagSet {
	fs := newFlags(c.name)
	fs.StringVar(&c.database, "database", "", "`URL` of the database holding the table: "+databaseURLs+" (default $DATABASE_URL)")
	fs.StringVar(&c.schema, "schema", sqlschema.DefaultSchema, "`NAME` of the table's schema (on MySQL: its database; SQLite has none)")
	fs.StringVar(&c.table, "table", sqlschema.DefaultRetryTable, "`NAME` of the table of parked messages")
	fs.BoolVar(&c.json, "json", false, "print JSON instead of text")
	return fs
}

// retryFilterFlags adds the filter flags, which fill f.
func retryFilterFlags(fs *flag.FlagSet, f *retry.Filter) {
	fs.StringVar(&f.Consumer, "consumer", "", "only messages parked by this `CONSUMER` (handler)")
	fs.StringVar(&f.Topic, "topic", "", "only messages consumed from this `TOPIC`")
	fs.StringVar(&f.UUID, "uuid", "", "only the message with this `UUID`")
	fs.StringVar(&f.Key, "key", "", "only messages of this idempotency `KEY`")
	fs.StringVar(&f.OrderKey, "order-key", "", "only messages of this ordering `KEY` (the partition key)")
	fs.IntVar(&f.Limit, "limit", 0, "only the first `N` matching messages, in the order they are handed back (0: all)")
}

// checkRetryFilter reports a filter out of range as a usage error naming
// the flag.
func checkRetryFilter(f retry.Filter) error {
	if f.Limit < 0 {
		return usagef("--limit must be 0 (all) or more, got %d", f.Limit)
	}
	if err := f.Validate(); err != nil {
		return usageError{msg: err.Error()}
	}
	return nil
}

// retryTarget checks the database flags (and the dead-letter table's,
// when dlqTable is not empty) and returns the database and the tables'
// names, before anything connects.
func (c *cmd) retryTarget(dlqTable string) (*dbURL, sqlschema.Config, error) {
	url, err := c.required("--database", c.database, "DATABASE_URL")
	if err == nil {
		err = checkNames("--schema", c.schema, "--table", c.table)
	}
	if err == nil && dlqTable != "" {
		err = checkNames("--dlq-table", dlqTable)
	}
	if err != nil {
		return nil, sqlschema.Config{}, err
	}
	db, err := parseDatabase("--database", url, false)
	return db, sqlschema.Config{Schema: c.schema, RetryTable: c.table, DLQTable: dlqTable}, err
}

// retryTable is what the command opened: the store of parked messages
// and, for cancel, the dead-letter publisher beside it.
type retryTable struct {
	store *retry.Store
	dead  *dlq.Publisher
	close func()
	// where names the table for errors: its flags' values.
	where string
}

// openRetries checks the flags, opens the database and the store on the
// table of parked messages; with dlqTable, also the dead-letter
// publisher on that table of the same database and schema.
func (c *cmd) openRetries(ctx context.Context, dlqTable string) (*retryTable, error) {
	u, cfg, err := c.retryTarget(dlqTable)
	if err != nil {
		return nil, err
	}
	db, err := u.connect(ctx, 4)
	if err != nil {
		return nil, err
	}
	t := &retryTable{close: db.Close, where: "--schema " + c.schema + " --table " + c.table}
	if u.dialect == sqlschema.SQLite {
		t.where = "--table " + c.table // SQLite has no schema
	}
	if dlqTable != "" {
		// A dead-letter table that is not there is most often a
		// mistyped flag: say that first, before anything moves.
		dialect, err := sqldb.For(u.dialect)
		if err == nil {
			var ok bool
			ok, err = db.hasTable(ctx, dialect.Names(cfg).DLQ)
			if err == nil && !ok {
				where := "in schema " + c.schema
				if u.dialect == sqlschema.SQLite {
					where = "in the database file"
				}
				err = fmt.Errorf("--dlq-table %s: no dead-letter table %q %s: correct --dlq-table (the consumer's is %q unless its sqlschema.Config.DLQTable says otherwise), "+
					"or, if it is right, run the consumer's migrations (sqlschema.Migrate), which create it; nothing was cancelled", dlqTable, dlqTable, where, sqlschema.DefaultDLQTable)
			}
		}
		if err != nil {
			db.Close()
			return nil, err
		}
	}
	if db.Pool != nil {
		t.store, err = retry.NewStore(db.Pool, cfg)
		if err == nil && dlqTable != "" {
			t.dead, err = dlq.NewPublisher(db.Pool, cfg)
		}
	} else {
		t.store, err = retry.NewSQLStore(db.DB, db.Dialect, cfg)
		if err == nil && dlqTable != "" {
			t.dead, err = dlq.NewSQLPublisher(db.DB, db.Dialect, cfg)
		}
	}
	if err != nil {
		db.Close()
		return nil, err
	}
	return t, nil
}

// fail says which table a missing table is, by the flags that named it.
func (t *retryTable) fail(err error) error {
	if errors.Is(err, retry.ErrNotMigrated) {
		return fmt.Errorf("%w (the table of %s: correct the flags if the consumer's table is another)", err, t.where)
	}
	return err
}

// checkParked fails, naming them, when some of ids are not parked: an
// operator who names messages means those, and nothing is done without
// them.
func (t *retryTable) checkParked(ctx context.Context, ids []int64, verb string) error {
	missing, err := t.store.Missing(ctx, ids)
	if err != nil {
		return t.fail(err)
	}
	if len(missing) == 0 {
		return nil
	}
	s := make([]string, len(missing))
	for i, id := range missing {
		s[i] = strconv.FormatInt(id, 10)
	}
	return fmt.Errorf("not parked: %s (handed back, cancelled, or never parked); nothing %s", strings.Join(s, ", "), verb)
}

// noneParked reports an empty selection: on stdout as text, on stderr
// beside empty, the JSON result.
func (c *cmd) noneParked(empty any) error {
	if c.json {
		fmt.Fprintln(c.stderr, "no parked messages matched")
		return c.writeJSON(empty)
	}
	fmt.Fprintln(c.stdout, "no parked messages matched")
	return nil
}

// parkedView is a parked message as JSON shows it: the payload as text or
// base64, and its state now.
type parkedView struct {
	ID              int64             `json:"id"`
	Consumer        string            `json:"consumer"`
	Topic           string            `json:"topic"`
	UUID            string            `json:"uuid"`
	Key             string            `json:"key"`
	OrderKey        string            `json:"order_key"`
	Attempts        int               `json:"attempts"`
	Error           string            `json:"error"`
	Behind          bool              `json:"behind"`
	WaitsFor        int64             `json:"waits_for,omitempty"`
	State           string            `json:"state"`
	FirstFailedAt   time.Time         `json:"first_failed_at,omitzero"`
	LastFailedAt    time.Time         `json:"last_failed_at,omitzero"`
	DueAt           time.Time         `json:"due_at"`
	ParkedAt        time.Time         `json:"parked_at"`
	LeasedUntil     *time.Time        `json:"leased_until,omitempty"`
	Payload         string            `json:"payload"`
	PayloadEncoding string            `json:"payload_encoding"`
	Metadata        map[string]string `json:"metadata"`
}

func parkedViewOf(m retry.Message, now time.Time) parkedView {
	text, enc := payloadText(m.Payload)
	utc := func(t time.Time) time.Time {
		if t.IsZero() {
			return t
		}
		return t.UTC()
	}
	v := parkedView{ID: m.ID, Consumer: m.Consumer, Topic: m.Topic, UUID: m.UUID, Key: m.Key, OrderKey: m.OrderKey,
		Attempts: m.Attempts, Error: m.Error, Behind: m.Behind, WaitsFor: m.WaitsFor, State: parkedState(m, now),
		FirstFailedAt: utc(m.FirstFailedAt), LastFailedAt: utc(m.LastFailedAt), DueAt: utc(m.DueAt), ParkedAt: utc(m.ParkedAt),
		Payload: text, PayloadEncoding: enc, Metadata: m.Metadata}
	if m.LeasedUntil != nil {
		t := m.LeasedUntil.UTC()
		v.LeasedUntil = &t
	}
	return v
}

// parkedState is a parked message's state now: "out" to its consumer,
// "behind N" (it waits for message N of its ordering key), "overdue"
// (due more than retry.DefaultOverdue ago: no retry subscriber hands it
// back), "due", or "waiting" for its due time.
func parkedState(m retry.Message, now time.Time) string {
	switch {
	case m.Out(now):
		return "out"
	case m.WaitsFor != 0:
		return "behind " + strconv.FormatInt(m.WaitsFor, 10)
	case m.Overdue(now, retry.DefaultOverdue):
		return "overdue"
	case m.Due(now):
		return "due"
	}
	return "waiting"
}

func (c *cmd) retriesList(ctx context.Context, args []string) error {
	var f retry.Filter
	fs := c.retryFlags()
	retryFilterFlags(fs, &f)
	if err := onlyFlags(fs, args, "list takes no IDs (use show ID, or a filter flag)"); err != nil {
		return err
	}
	if err := checkRetryFilter(f); err != nil {
		return err
	}
	t, err := c.openRetries(ctx, "")
	if err != nil {
		return err
	}
	defer t.close()
	ms, err := t.store.List(ctx, f)
	if err != nil {
		return t.fail(err)
	}
	if len(ms) == 0 {
		return c.noneParked([]parkedView{})
	}
	now := time.Now()
	if c.json {
		views := make([]parkedView, len(ms))
		for i, m := range ms {
			views[i] = parkedViewOf(m, now)
		}
		return c.writeJSON(views)
	}
	tw := tabwriter.NewWriter(c.stdout, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "ID\tDUE AT\tSTATE\tCONSUMER\tTOPIC\tKEY\tORDER KEY\tATTEMPTS\tERROR")
	for _, m := range ms {
		fmt.Fprintf(tw, "%d\t%s\t%s\t%s\t%s\t%s\t%s\t%d\t%s\n", m.ID, m.DueAt.UTC().Format(time.RFC3339), parkedState(m, now),
			cell(m.Consumer, 30), cell(m.Topic, 40), cell(m.Key, 40), cell(m.OrderKey, 30), m.Attempts, cell(m.Error, 60))
	}
	if err := tw.Flush(); err != nil {
		return fmt.Errorf("write table: %w", err)
	}
	return nil
}

func (c *cmd) retriesShow(ctx context.Context, args []string) error {
	fs := c.retryFlags()
	pos, err := parse(fs, args)
	if err != nil {
		return err
	}
	switch {
	case len(pos) == 0:
		return usagef("missing ID: show takes one parked message's ID")
	case len(pos) > 1:
		return usagef("unexpected argument %q: show takes one parked message's ID", pos[1])
	}
	ids, err := parseIDs(pos)
	if err != nil {
		return err
	}
	t, err := c.openRetries(ctx, "")
	if err != nil {
		return err
	}
	defer t.close()
	ms, err := t.store.List(ctx, retry.Filter{IDs: ids})
	if err != nil {
		return t.fail(err)
	}
	if len(ms) == 0 {
		return fmt.Errorf("%w: id %d (handed back, cancelled, or never parked)", retry.ErrNotFound, ids[0])
	}
	now := time.Now()
	if c.json {
		return c.writeJSON(parkedViewOf(ms[0], now))
	}
	return writeParked(c.stdout, ms[0], now)
}

// writeParked prints every field of m, its metadata and its payload.
func writeParked(w io.Writer, m retry.Message, now time.Time) error {
	optTime := func(t time.Time) string {
		if t.IsZero() {
			return "-"
		}
		return t.UTC().Format(time.RFC3339Nano)
	}
	leased := "-"
	if m.LeasedUntil != nil {
		leased = optTime(*m.LeasedUntil)
	}
	attempts := strconv.Itoa(m.Attempts)
	if m.Behind {
		attempts += " (parked behind a message of its ordering key, it has not run)"
	}
	fields := []dlq.Fact{
		{Label: "ID", Value: strconv.FormatInt(m.ID, 10)},
		{Label: "State", Value: parkedState(m, now)},
		{Label: "UUID", Value: m.UUID},
		{Label: "Consumer", Value: m.Consumer},
		{Label: "Topic", Value: m.Topic},
		{Label: "Key", Value: m.Key},
		{Label: "Order key", Value: m.OrderKey},
		{Label: "Failed attempts", Value: attempts},
		{Label: "Last error", Value: m.Error},
		{Label: "First failed at", Value: optTime(m.FirstFailedAt)},
		{Label: "Last failed at", Value: optTime(m.LastFailedAt)},
		{Label: "Due at", Value: optTime(m.DueAt)},
		{Label: "Parked at", Value: optTime(m.ParkedAt)},
		{Label: "Out until", Value: leased},
	}
	if m.WaitsFor != 0 {
		fields = append(fields, dlq.Fact{Label: "Waits for", Value: strconv.FormatInt(m.WaitsFor, 10)})
	}
	if err := writeMessage(w, fields, m.Metadata, m.Payload); err != nil {
		return fmt.Errorf("write parked message: %w", err)
	}
	return nil
}

// retrySelection parses the IDs and flags of now and cancel; it refuses
// an empty selection.
func (c *cmd) retrySelection(fs *flag.FlagSet, f *retry.Filter, args []string) error {
	retryFilterFlags(fs, f)
	fs.BoolVar(&f.All, "all", false, "act on every parked message (with filters: every one they match)")
	pos, err := parse(fs, args)
	if err != nil {
		return err
	}
	if f.IDs, err = parseIDs(pos); err != nil {
		return err
	}
	if err := checkRetryFilter(*f); err != nil {
		return err
	}
	if f.IsEmpty() && !f.All {
		return usagef("nothing selected: give IDs, a filter flag (--consumer, --topic, --uuid, --key, --order-key) or --all")
	}
	return nil
}

// openSelection opens the table for an action on f, checks that every ID
// it names is parked and counts what it selects. When nothing matches it
// says so (an empty result with --json), closes the table and returns
// total 0.
func (c *cmd) openSelection(ctx context.Context, f retry.Filter, dlqTable, verb string, empty any) (*retryTable, int, error) {
	t, err := c.openRetries(ctx, dlqTable)
	if err != nil {
		return nil, 0, err
	}
	total := 0
	err = t.checkParked(ctx, f.IDs, verb)
	if err == nil {
		total, err = t.store.Count(ctx, f)
		err = t.fail(err)
	}
	if err == nil && total > 0 {
		return t, total, nil
	}
	t.close()
	if err != nil {
		return nil, 0, err
	}
	return nil, 0, c.noneParked(empty)
}

// retryNowResult is now's JSON output.
type retryNowResult struct {
	Matched int `json:"matched"`
	Due     int `json:"made_due"`
}

func (c *cmd) retriesNow(ctx context.Context, args []string) error {
	var f retry.Filter
	fs := c.retryFlags()
	if err := c.retrySelection(fs, &f, args); err != nil {
		return err
	}
	t, total, err := c.openSelection(ctx, f, "", "retried", retryNowResult{})
	if err != nil || total == 0 {
		return err
	}
	defer t.close()
	n, err := t.store.RetryNow(ctx, f)
	if err != nil {
		return t.fail(err)
	}
	if c.json {
		return c.writeJSON(retryNowResult{Matched: total, Due: n})
	}
	fmt.Fprintf(c.stdout, "%d parked %s due now: %s consumer's retry subscriber hands %s back at its next read",
		n, plural(n, "message is", "messages are"), plural(n, "its", "their"), plural(n, "it", "them"))
	if n < total {
		fmt.Fprintf(c.stdout, "; %d of the %d matched %s left as %s: due already (one behind another of its ordering key goes out after it; retry the first of the key), or out to %s consumer",
			total-n, total, plural(total-n, "is", "are"), plural(total-n, "it was", "they were"), plural(total-n, "its", "their"))
	}
	fmt.Fprintln(c.stdout)
	return nil
}

// cancelResult is cancel's JSON output.
type cancelResult struct {
	Matched   int    `json:"matched"`
	Cancelled int    `json:"cancelled"`
	DLQTable  string `json:"dlq_table"`
}

func (c *cmd) retriesCancel(ctx context.Context, args []string) error {
	var f retry.Filter
	var dlqTable string
	fs := c.retryFlags()
	fs.StringVar(&dlqTable, "dlq-table", sqlschema.DefaultDLQTable, "`NAME` of the dead-letter table, in the same schema, that the cancelled messages move to")
	if err := c.retrySelection(fs, &f, args); err != nil {
		return err
	}
	t, total, err := c.openSelection(ctx, f, dlqTable, "cancelled", cancelResult{})
	if err != nil || total == 0 {
		return err
	}
	defer t.close()
	where := c.schema + "." + dlqTable
	n, err := t.store.Cancel(ctx, f, t.dead, "")
	if err != nil {
		if errors.Is(err, dlq.ErrNotMigrated) {
			err = fmt.Errorf("%w (the dead-letter table --dlq-table %s; correct it if the consumer uses another)", err, dlqTable)
		}
		return fmt.Errorf("cancelled %d of %d parked messages, then: %w", n, total, t.fail(err))
	}
	if c.json {
		return c.writeJSON(cancelResult{Matched: total, Cancelled: n, DLQTable: where})
	}
	fmt.Fprintf(c.stdout, "cancelled %d parked %s: moved to the dead-letter table %s (oncemill dlq list --error %q)",
		n, plural(n, "message", "messages"), where, retry.CancelReason)
	if n < total {
		fmt.Fprintf(c.stdout, "; %d of the %d matched %s out to %s consumer, or gone meanwhile, and %s left as %s",
			total-n, total, plural(total-n, "was", "were"), plural(total-n, "its", "their"), plural(total-n, "is", "are"), plural(total-n, "it is", "they are"))
	}
	fmt.Fprintln(c.stdout)
	return nil
}
