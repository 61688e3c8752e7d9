package sqlschema

import (
	"bytes"
	"embed"
	"fmt"
	"io/fs"
	"path"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"text/template"
)

//go:embed postgres/*.sql sqlite/*.sql mysql/*.sql
var files embed.FS

// Dialect names a database family whose migrations this package holds.
type Dialect string

const (
	// Postgres is PostgreSQL 13 or newer.
	Postgres Dialect = "postgres"
	// SQLite is SQLite 3.35 or newer (for RETURNING and upsert).
	SQLite Dialect = "sqlite"
	// MySQL is MySQL 8.0 or newer, or MariaDB 10.6 or newer, with InnoDB.
	// It has every table: the inbox, the outbox, the dead-letter table and
	// the relay's ledger.
	MySQL Dialect = "mysql"
)

const (
	// DefaultSchema is the PostgreSQL schema (the MySQL database)
	// oncemill's tables live in.
	DefaultSchema = "oncemill"
	// DefaultInboxTable is the name of the inbox table.
	DefaultInboxTable = "inbox"
	// DefaultOutboxTable is the name of the outbox table.
	DefaultOutboxTable = "outbox"
	// DefaultDLQTable is the name of the dead-letter table.
	DefaultDLQTable = "dlq"
	// DefaultLedgerTable is the name of the relay's ledger table.
	DefaultLedgerTable = "outbox_ledger"
	// DefaultRetryTable is the name of the table of parked messages,
	// waiting for a delayed retry.
	DefaultRetryTable = "retries"
)

// identifier is what a schema or table name may be: lower-case, so that it
// needs no quoting rules of its own, and short enough for PostgreSQL (63
// bytes) with room for the index suffixes built from it.
var identifier = regexp.MustCompile(`^[a-z_][a-z0-9_]{0,47}$`)

// Config names where oncemill's tables live. The zero value is ready to use.
type Config struct {
	// Schema is the PostgreSQL schema of the tables, or the MySQL
	// database; it is created when missing. Ignored by SQLite. Defaults to
	// "oncemill".
	Schema string
	// InboxTable is the name of the inbox table. Defaults to "inbox".
	InboxTable string
	// OutboxTable is the name of the outbox table. Defaults to "outbox".
	OutboxTable string
	// DLQTable is the name of the dead-letter table, the one package dlq
	// writes and reads. Defaults to "dlq".
	DLQTable string
	// LedgerTable is the name of the table where the relay records what
	// it published when forwarder.RelayConfig.Ledger is set, and that `oncemill reconcile` reads. Defaults to
	// "outbox_ledger".
	LedgerTable string
	// RetryTable is the name of the table where messages wait for a
	// delayed retry (package retry). Defaults to "retries".
	RetryTable string
}

// WithDefaults returns a copy of c with empty fields set to their defaults.
func (c Config) WithDefaults() Config {
	if c.Schema == "" {
		c.Schema = DefaultSchema
	}
	if c.InboxTable == "" {
		c.InboxTable = DefaultInboxTable
	}
	if c.OutboxTable == "" {
		c.OutboxTable = DefaultOutboxTable
	}
	if c.DLQTable == "" {
		c.DLQTable = DefaultDLQTable
	}
	if c.LedgerTable == "" {
		c.LedgerTable = DefaultLedgerTable
	}
	if c.RetryTable == "" {
		c.RetryTable = DefaultRetryTable
	}
	return c
}

// Validate reports the first name of c, its empty fields taken as their
// defaults, that is not a safe identifier, or two tables that would share
// a name, a table named after another included (InboxTable + "_starts",
// OutboxTable + "_scheduled"), and the indexes and sequences the tables
// bring, which share the namespace of tables in PostgreSQL. The error
// names the field. Names are validated, never escaped from message data:
// no SQL is built from anything else.
func (c Config) Validate() error {
	c = c.WithDefaults()
	for _, f := range []struct{ field, value string }{
		{"Schema", c.Schema}, {"InboxTable", c.InboxTable}, {"OutboxTable", c.OutboxTable},
		{"DLQTable", c.DLQTable}, {"LedgerTable", c.LedgerTable}, {"RetryTable", c.RetryTable},
	} {
		if err := ValidateIdentifier(f.field, f.value); err != nil {
			return err
		}
	}
	return c.distinctTables()
}

// scheduledSuffix ends the name of the outbox's scheduled table, which
// holds the rows written with a due time until the relay moves them into
// the outbox: "<OutboxTable>_scheduled".
const scheduledSuffix = "_scheduled"

// derived are the suffixes of the relations (tables, sequences, indexes)
// that the migrations of some database name after each table field:
// "_starts" is the inbox's table of started attempts, "_lanes" the
// outbox's lanes (MySQL).
var derived = map[string][]string{
	"InboxTable":  {"_starts", "_failures", "_marks", "_token_seq", "_expires_at_idx", "_starts_expires_at_idx"},
	"OutboxTable": {scheduledSuffix, "_lanes", "_due_idx", "_lane_idx", "_lane_id_idx"},
	"DLQTable":    {"_consumer_idx", "_dead_at_idx", "_once_idx", "_replay_idx", "_topic_idx", "_uuid_idx"},
	"LedgerTable": {"_key_idx", "_published_at_idx"},
	"RetryTable":  {"_due_idx", "_once_idx", "_order_idx"},
}

// distinctTables reports two tables of c that share a name: they would be
// one table, and the second CREATE TABLE IF NOT EXISTS would silently keep
// the first one's columns. The relations named after a table (the
// outbox's scheduled table, the inbox's table of started attempts, the
// indexes) are among them: InboxTable "outbox_scheduled" would be the
// default outbox's scheduled table, DLQTable "inbox_starts" the inbox's
// table of started attempts.
func (c Config) distinctTables() error {
	type relation struct{ what, name string }
	var rels []relation
	for _, t := range []struct{ field, name string }{
		{"InboxTable", c.InboxTable}, {"OutboxTable", c.OutboxTable}, {"DLQTable", c.DLQTable},
		{"LedgerTable", c.LedgerTable}, {"RetryTable", c.RetryTable},
	} {
		rels = append(rels, relation{t.field, t.name})
	}
	for _, t := range rels[:5] {
		for _, suffix := range derived[t.what] {
			what := "an index of " + t.what
			switch suffix {
			case scheduledSuffix:
				what = "the scheduled table of OutboxTable"
			case "_starts":
				what = "the table of started attempts of InboxTable"
			case "_failures":
				what = "the failure table of InboxTable"
			case "_marks":
				what = "the hand-out marks table of InboxTable"
			case "_token_seq":
				what = "the token sequence of InboxTable"
			case "_lanes":
				what = "the lanes table of OutboxTable"
			}
			rels = append(rels, relation{what, t.name + suffix})
		}
	}
	for i := range rels {
		for j := i + 1; j < len(rels); j++ {
			if rels[i].name == rels[j].name {
				return fmt.Errorf("sqlschema: %s and %s are both %q: each table needs its own name", rels[i].what, rels[j].what, rels[i].name)
			}
		}
	}
	return nil
}

// ValidateIdentifier checks that value, the value of the config field named
// field, is a lower-case SQL identifier of at most 48 characters.
func ValidateIdentifier(field, value string) error {
	if !identifier.MatchString(value) {
		return fmt.Errorf("sqlschema: %s %q is not a valid identifier: use 1 to 48 characters of a-z, 0-9 and _, not starting with a digit", field, value)
	}
	return nil
}

// Names are the quoted, ready-to-use names for a Config, as the SQL files
// and the stores use them.
type Names struct {
	// Schema is the quoted schema (PostgreSQL), the quoted database
	// (MySQL) or empty (SQLite).
	Schema string
	// Inbox is the quoted, schema-qualified inbox table.
	Inbox string
	// InboxName is the bare inbox table name, for building index names.
	InboxName string
	// InboxStarts is the quoted, schema-qualified table that counts the
	// attempts of an inbox key that started and have not completed
	// ("<inbox>_starts"); in PostgreSQL it is UNLOGGED.
	InboxStarts string
	// InboxFailures is the quoted, schema-qualified table of the inbox
	// keys' failure state ("<inbox>_failures"): attempts, errors, the
	// dead mark's details, replay grants, written only when something
	// fails, while the inbox table holds one narrow row per key.
	InboxFailures string
	// InboxMarks is the quoted, schema-qualified table of the hand-out
	// marks ("<inbox>_marks"): per consumer group and Kafka partition,
	// the highest offset its subscriber may have handed out
	// (delivery.HandOutMarks).
	InboxMarks string
	// Outbox is the quoted, schema-qualified outbox table.
	Outbox string
	// OutboxName is the bare outbox table name.
	OutboxName string
	// Scheduled is the quoted, schema-qualified table of the outbox rows
	// written with a due time in the future ("<outbox>_scheduled"): the
	// relay moves each into the outbox once it is due.
	Scheduled string
	// ScheduledName is the bare scheduled table name.
	ScheduledName string
	// OutboxChannel is the LISTEN/NOTIFY channel the outbox notifies on
	// commit: "<schema>.<outbox table>" (PostgreSQL only).
	OutboxChannel string
	// DLQ is the quoted, schema-qualified dead-letter table.
	DLQ string
	// DLQName is the bare dead-letter table name.
	DLQName string
	// Ledger is the quoted, schema-qualified ledger table.
	Ledger string
	// LedgerName is the bare ledger table name.
	LedgerName string
	// Retries is the quoted, schema-qualified table of parked messages.
	Retries string
	// RetriesName is the bare name of the table of parked messages.
	RetriesName string
}

// NamesFor returns the quoted names of cfg for dialect d. cfg must be
// valid (see [Config.Validate]).
func NamesFor(d Dialect, cfg Config) Names {
	switch d {
	case SQLite:
		q := func(name string) string { return `"` + name + `"` }
		return Names{
			Inbox:         q(cfg.InboxTable),
			InboxName:     cfg.InboxTable,
			InboxStarts:   q(cfg.InboxTable + "_starts"),
			InboxFailures: q(cfg.InboxTable + "_failures"),
			InboxMarks:    q(cfg.InboxTable + "_marks"),
			Outbox:        q(cfg.OutboxTable),
			OutboxName:    cfg.OutboxTable,
			DLQ:           q(cfg.DLQTable),
			DLQName:       cfg.DLQTable,
			Ledger:        q(cfg.LedgerTable),
			LedgerName:    cfg.LedgerTable,
			Retries:       q(cfg.RetryTable),
			RetriesName:   cfg.RetryTable,
			Scheduled:     q(cfg.OutboxTable + scheduledSuffix),
			ScheduledName: cfg.OutboxTable + scheduledSuffix,
		}
	case MySQL:
		// Backticks: MySQL quotes identifiers with them unless the
		// session's sql_mode has ANSI_QUOTES.
		schema := "`" + cfg.Schema + "`"
		table := func(name string) string { return schema + ".`" + name + "`" }
		return Names{
			Schema:        schema,
			Inbox:         table(cfg.InboxTable),
			InboxName:     cfg.InboxTable,
			InboxStarts:   table(cfg.InboxTable + "_starts"),
			InboxFailures: table(cfg.InboxTable + "_failures"),
			InboxMarks:    table(cfg.InboxTable + "_marks"),
			Outbox:        table(cfg.OutboxTable),
			OutboxName:    cfg.OutboxTable,
			DLQ:           table(cfg.DLQTable),
			DLQName:       cfg.DLQTable,
			Ledger:        table(cfg.LedgerTable),
			LedgerName:    cfg.LedgerTable,
			Retries:       table(cfg.RetryTable),
			RetriesName:   cfg.RetryTable,
			Scheduled:     table(cfg.OutboxTable + scheduledSuffix),
			ScheduledName: cfg.OutboxTable + scheduledSuffix,
		}
	}
	schema := `"` + cfg.Schema + `"`
	return Names{
		Schema:        schema,
		Inbox:         schema + `."` + cfg.InboxTable + `"`,
		InboxName:     cfg.InboxTable,
		InboxStarts:   schema + `."` + cfg.InboxTable + `_starts"`,
		InboxFailures: schema + `."` + cfg.InboxTable + `_failures"`,
		InboxMarks:    schema + `."` + cfg.InboxTable + `_marks"`,
		Outbox:        schema + `."` + cfg.OutboxTable + `"`,
		OutboxName:    cfg.OutboxTable,
		Scheduled:     schema + `."` + cfg.OutboxTable + scheduledSuffix + `"`,
		ScheduledName: cfg.OutboxTable + scheduledSuffix,
		OutboxChannel: cfg.Schema + "." + cfg.OutboxTable,
		DLQ:           schema + `."` + cfg.DLQTable + `"`,
		DLQName:       cfg.DLQTable,
		Ledger:        schema + `."` + cfg.LedgerTable + `"`,
		LedgerName:    cfg.LedgerTable,
		Retries:       schema + `."` + cfg.RetryTable + `"`,
		RetriesName:   cfg.RetryTable,
	}
}

// Migration is one versioned step of the schema, rendered for a Config.
type Migration struct {
	// Version orders the migrations; it starts at 1.
	Version int
	// Name is the file name's description part, e.g. "inbox".
	Name string
	// Up applies the step.
	Up string
	// Down reverts it.
	Down string
}

// Statements returns m's up step for d as the migrator runs it: whole,
// except on MySQL, where it is split into its statements, each ending
// with ';' at the end of a line (lines that are only a comment are left
// out), for a driver or a tool that runs one statement at a time.
func (m Migration) Statements(d Dialect) []string {
	if d != MySQL {
		return []string{m.Up}
	}
	var (
		out []string
		cur strings.Builder
	)
	for _, line := range strings.Split(m.Up, "\n") {
		trimmed := strings.TrimSpace(line)
		if trimmed == "" || strings.HasPrefix(trimmed, "--") {
			continue
		}
		cur.WriteString(line)
		cur.WriteByte('\n')
		if strings.HasSuffix(trimmed, ";") {
			out = append(out, strings.TrimSpace(cur.String()))
			cur.Reset()
		}
	}
	if rest := strings.TrimSpace(cur.String()); rest != "" {
		out = append(out, rest)
	}
	return out
}

var migrationFile = regexp.MustCompile(`^(\d+)_([a-z0-9_]+)\.(up|down)\.sql$`)

// Migrations returns the migrations of dialect d rendered for cfg, in
// version order. Teams that run their own migration tool can take the SQL
// from here instead of calling [Migrate] or [MigrateSQL]. A MySQL step may
// hold several statements, each ending with ';' at the end of a line; run
// it with multiStatements=true or take them one by one from
// [Migration.Statements].
func Migrations(d Dialect, cfg Config) ([]Migration, error) {
	cfg = cfg.WithDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if d != Postgres && d != SQLite && d != MySQL {
		return nil, fmt.Errorf("sqlschema: unknown dialect %q", d)
	}
	names := NamesFor(d, cfg)
	entries, err := fs.ReadDir(files, string(d))
	if err != nil {
		return nil, fmt.Errorf("sqlschema: read %s migrations: %w", d, err)
	}
	byVersion := map[int]*Migration{}
	for _, e := range entries {
		m := migrationFile.FindStringSubmatch(e.Name())
		if m == nil {
			return nil, fmt.Errorf("sqlschema: unexpected file %s/%s", d, e.Name())
		}
		version, err := strconv.Atoi(m[1])
		if err != nil {
			return nil, fmt.Errorf("sqlschema: bad version in %s: %w", e.Name(), err)
		}
		raw, err := files.ReadFile(path.Join(string(d), e.Name()))
		if err != nil {
			return nil, fmt.Errorf("sqlschema: read %s: %w", e.Name(), err)
		}
		sql, err := render(e.Name(), string(raw), names)
		if err != nil {
			return nil, err
		}
		mig := byVersion[version]
		if mig == nil {
			mig = &Migration{Version: version, Name: m[2]}
			byVersion[version] = mig
		}
		if m[3] == "up" {
			mig.Up = sql
		} else {
			mig.Down = sql
		}
	}
	out := make([]Migration, 0, len(byVersion))
	for _, m := range byVersion {
		out = append(out, *m)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Version < out[j].Version })
	return out, nil
}

func render(name, raw string, names Names) (string, error) {
	tmpl, err := template.New(name).Option("missingkey=error").Parse(raw)
	if err != nil {
		return "", fmt.Errorf("sqlschema: parse %s: %w", name, err)
	}
	var b bytes.Buffer
	if err := tmpl.Execute(&b, names); err != nil {
		return "", fmt.Errorf("sqlschema: render %s: %w", name, err)
	}
	return strings.TrimSpace(b.String()), nil
}
