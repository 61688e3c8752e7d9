package sqldb

import (
	"crypto/sha256"
	"database/sql"
	"database/sql/driver"
	"encoding/hex"
	"fmt"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	sqlitedriver "modernc.org/sqlite"

	"github.com/oncemill/oncemill/sqlschema"
)

// Builders for what reads the tables for a person: substring search,
// regular expressions, a field of a JSON object, and the form an inbox
// key is stored in.

// Position is the 1-based position of the text sub in the text s, 0 when
// s does not hold it.
func (d *Dialect) Position(sub, s string) string { return d.position(sub, s) }

// JSONText is the value of the field key of the JSON object in column
// col, as text; NULL when the object has no such field. key must be an
// identifier: letters, digits and '_'.
func (d *Dialect) JSONText(col, key string) string { return d.jsonText(col, key) }

// ReplaceAll is expr with every match of the regular expression pattern
// replaced by repl, taken literally. pattern and repl are written into
// the statement: they must hold no quote and no backslash. Matches are
// leftmost-first on MySQL, MariaDB and SQLite (RE2, Go's regexp, through
// the function sqliteReplaceAll registers), leftmost-longest on
// PostgreSQL: a pattern must be one on which the two agree.
func (d *Dialect) ReplaceAll(expr, pattern, repl string) string {
	return d.replaceAll(expr, pattern, repl)
}

// sqliteReplaceAll is the SQL function, registered with modernc.org/sqlite
// for every connection it opens, that ReplaceAll calls on SQLite.
const sqliteReplaceAll = "oncemill_regexp_replace_all"

var patterns sync.Map // pattern → *regexp.Regexp

func init() {
	sqlitedriver.MustRegisterDeterministicScalarFunction(sqliteReplaceAll, 3, func(_ *sqlitedriver.FunctionContext, args []driver.Value) (driver.Value, error) {
		if args[0] == nil {
			return nil, nil
		}
		s, ok1 := text(args[0])
		pattern, ok2 := text(args[1])
		repl, ok3 := text(args[2])
		if !ok1 || !ok2 || !ok3 {
			return nil, fmt.Errorf("%s: the arguments must be text", sqliteReplaceAll)
		}
		re, ok := patterns.Load(pattern)
		if !ok {
			compiled, err := regexp.Compile(pattern)
			if err != nil {
				return nil, fmt.Errorf("%s: %w", sqliteReplaceAll, err)
			}
			re, _ = patterns.LoadOrStore(pattern, compiled)
		}
		return re.(*regexp.Regexp).ReplaceAllLiteralString(s, repl), nil
	})
}

func text(v driver.Value) (string, bool) {
	switch v := v.(type) {
	case string:
		return v, true
	case []byte:
		return string(v), true
	}
	return "", false
}

// InboxKey returns consumer and key as the inbox table holds them: where
// its columns have a size (MySQL: 255 and 1024 bytes), a longer value is
// held as "sha256:" and its hex digest, as dedup/sqlstore writes it;
// elsewhere as it is.
func (d *Dialect) InboxKey(consumer, key string) (string, string) {
	return digestOver(consumer, d.keyBytes[0]), digestOver(key, d.keyBytes[1])
}

// InboxArgs is [Dialect.InboxKey] as arguments of byte-exact columns
// (see [Dialect.Text]).
func (d *Dialect) InboxArgs(consumer, key string) (any, any) {
	c, k := d.InboxKey(consumer, key)
	return d.Text(c), d.Text(k)
}

func digestOver(s string, max int) string {
	if max == 0 || len(s) <= max {
		return s
	}
	sum := sha256.Sum256([]byte(s))
	return "sha256:" + hex.EncodeToString(sum[:])
}

// CharLength is the length of the text expr in characters.
func (d *Dialect) CharLength(expr string) string { return d.charLength + "(" + expr + ")" }

// List is "(?, ?, …)": n placeholders, for IN.
func List(n int) string {
	if n == 0 {
		return "(NULL)"
	}
	return "(" + strings.Repeat("?, ", n-1) + "?)"
}

// Texts returns values as the arguments of byte-exact string columns
// ([Dialect.Text]).
func (d *Dialect) Texts(values []string) []any {
	args := make([]any, len(values))
	for i, v := range values {
		args[i] = d.Text(v)
	}
	return args
}

// Time returns the destination that scans a column read as Micros(col)
// into *t; NULL leaves *t zero.
func Time(t *time.Time) sql.Scanner { return microsDest{t: t} }

// TimeOrNil returns the destination that scans a column read as
// Micros(col) into *p, nil when NULL.
func TimeOrNil(p **time.Time) sql.Scanner { return microsDest{p: p} }

type microsDest struct {
	t *time.Time
	p **time.Time
}

func (m microsDest) Scan(src any) error {
	var us int64
	switch v := src.(type) {
	case nil:
		if m.p != nil {
			*m.p = nil
		}
		return nil
	case int64:
		us = v
	case []byte, string: // MySQL's text protocol
		s, _ := text(v)
		n, err := strconv.ParseInt(s, 10, 64)
		if err != nil {
			return fmt.Errorf("sqldb: a time in microseconds, got %q", s)
		}
		us = n
	default:
		return fmt.Errorf("sqldb: a time in microseconds, got %T", src)
	}
	t := time.UnixMicro(us).UTC()
	if m.p != nil {
		*m.p = &t
	} else {
		*m.t = t
	}
	return nil
}

// MicrosEach is Micros of each of cols, separated by commas.
func (d *Dialect) MicrosEach(cols ...string) string {
	out := make([]string, len(cols))
	for i, col := range cols {
		out[i] = d.Micros(col)
	}
	return strings.Join(out, ", ")
}

// FromConfig returns the database a Config gives as pool (PostgreSQL
// through pgx) or as db and dialect (database/sql), exactly one of them.
// The error names the Config's fields, each prefixed with field ("Ledger."
// say; "" for none), and the fix.
func FromConfig(field string, pool *pgxpool.Pool, db *sql.DB, dialect sqlschema.Dialect) (DB, error) {
	switch {
	case pool == nil && db == nil:
		return nil, fmt.Errorf("%sPool (pgx, PostgreSQL) or %sDB (database/sql, with Dialect) is required", field, field)
	case pool != nil && db != nil:
		return nil, fmt.Errorf("%sPool and %sDB are both set: set the one that holds the tables", field, field)
	case pool != nil:
		return Pgx(pool), nil
	}
	d, err := For(dialect)
	if err != nil {
		return nil, fmt.Errorf("%sDialect must be sqlschema.Postgres, sqlschema.MySQL or sqlschema.SQLite with DB, got %q", field, dialect)
	}
	return SQL(db, d), nil
}

// Named is q, written with '?', {DLQ}, {INBOX}, {INBOX_FAILURES} and
// {LEDGER} for the tables of names, and {key} and {error} for those
// columns (quoted: keywords on MySQL), in the dialect.
func (d *Dialect) Named(q string, names sqlschema.Names) string {
	return d.Rebind(strings.NewReplacer("{DLQ}", names.DLQ, "{INBOX_FAILURES}", names.InboxFailures, "{INBOX}", names.Inbox, "{LEDGER}", names.Ledger,
		"{key}", d.Quote("key"), "{error}", d.Quote("error")).Replace(q))
}
