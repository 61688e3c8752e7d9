package sqldb

import (
	"database/sql/driver"
	"errors"
	"strconv"
	"strings"

	"github.com/go-sql-driver/mysql"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/lib/pq"
	sqlitedriver "modernc.org/sqlite"
	sqlite3 "modernc.org/sqlite/lib"

	"github.com/oncemill/oncemill/sqlschema"
)

// Dialect is one database family: its capabilities, the expressions whose
// spelling differs, and how its drivers report errors. There are three,
// [Postgres], [MySQL] and [SQLite]; code above the seam asks for a
// capability, never for a name.
type Dialect struct {
	// Name is the family's migrations (sqlschema.Postgres, …).
	Name sqlschema.Dialect

	// Returning: INSERT, UPDATE and DELETE take RETURNING.
	Returning bool
	// SkipLocked: SELECT … FOR UPDATE SKIP LOCKED.
	SkipLocked bool
	// AdvisoryLocks: transaction-level advisory locks
	// (pg_try_advisory_xact_lock).
	AdvisoryLocks bool
	// Snapshots: each row can carry its transaction's id and a
	// transaction can read which transactions are still open
	// (pg_current_xact_id, pg_snapshot_xmin), so a reader can tell a row
	// that may still be overtaken.
	Snapshots bool
	// ReadUncommitted: a transaction can read rows of transactions in
	// flight, which is how a reader without snapshots finds them.
	ReadUncommitted bool
	// OneWriter: one write transaction at a time for the whole database,
	// and ids handed out in commit order: a committed row can never be
	// overtaken by one with a lower id.
	OneWriter bool
	// WriteFromSelf: an UPDATE or DELETE may select its rows in a subquery
	// on its own table, with ORDER BY and LIMIT (MySQL refuses both).
	WriteFromSelf bool
	// Pipeline: statements can be sent in one round trip (pgx batches);
	// only through [Pgx].
	Pipeline bool

	placeholder func(n int) string
	quote       byte
	now         string
	micros      func(expr string) string
	fromMicros  func(ph string) string
	json        func(ph string) string
	binaryArgs  bool
	beginStmts  func(TxOptions) []string
	undefined   func(error) bool
	unique      func(error) bool
	denied      func(error) bool
	conflict    func(error) bool
	undefCol    func(error) bool

	// What differs in the spelling of expressions and statements; the
	// builders in expr.go and writes.go read these, never the name.
	position   func(sub, s string) string
	jsonText   func(col, key string) string
	replaceAll func(expr, pattern, repl string) string
	charLength string // the function of a text's length in characters
	keyBytes   [2]int // sizes of the inbox's consumer and key columns; 0: unbounded
	insertOnce func(target, column string) string
	jsonInts   func(ph string) string
	joinIDs    bool   // rows are reached from a list of ids by a join, not IN (MySQL's optimizer may scan)
	updateJoin bool   // UPDATE a, b SET … (no UPDATE … FROM)
	rowID      string // the physical row id a bounded DELETE selects by; "": DELETE … LIMIT
	sessionID  string
	hashes     bool // the writer fills hash columns (no hash function in SQL)

	// The inbox's statements (inbox_sql.go).
	writeCTE      bool   // INSERT, UPDATE and DELETE inside WITH: one statement where others take two
	snapshotReads bool   // a plain read in a transaction sees its snapshot: the latest commit takes a locking read
	rowAlias      string // " AS i" where an upsert names the existing row i, "" where unqualified names are it
	excluded      func(col string) string
	greatest      string                      // the function of the larger of two values
	textBytes     int                         // the size of an error text column in bytes; 0: unbounded
	nowPlus       func(ph string) string      // the current time plus ph microseconds
	clockParam    bool                        // the current time is the writer's clock, the parameter :now
	counted       func(expr string) string    // expr, reported as the statement's insert id where there is no RETURNING
	reported      func(n, expr string) string // expr, with n reported as the insert id where there is no RETURNING
	upsert        func(conflict string, set [][2]string, where string) string

	// The server's answers and the drivers' errors (classes.go).
	answered     func(error) bool // the server's own answer to a statement
	unavailable  func(error) bool // the server cannot serve, or the driver's connection broke
	sessionEnded func(error) bool // the server ended the session
	notSent      func(error) bool // the driver says nothing of the statement was sent
	closed       func(dc any) bool
}

// Names returns the quoted table names of cfg in the dialect.
func (d *Dialect) Names(cfg sqlschema.Config) sqlschema.Names {
	return sqlschema.NamesFor(d.Name, cfg.WithDefaults())
}

// String is the family's name.
func (d *Dialect) String() string { return string(d.Name) }

// Rebind returns q, written with '?' placeholders, in the dialect's own
// ('$1', '$2', … on PostgreSQL). A '?' inside a quoted string or a quoted
// identifier is left alone.
func (d *Dialect) Rebind(q string) string {
	if d.placeholder == nil {
		return q
	}
	n := 0
	return rewrite(q, func(b *strings.Builder, q string, i int) int {
		if q[i] != '?' {
			return 0
		}
		n++
		b.WriteString(d.placeholder(n))
		return 1
	})
}

// rewrite copies q, calling at for each byte outside quoted strings and
// quoted identifiers: at writes the replacement of the bytes from i on
// to b and returns how many it replaced, or returns 0 to have the byte
// copied as it is.
func rewrite(q string, at func(b *strings.Builder, q string, i int) int) string {
	var (
		b     strings.Builder
		quote byte
	)
	b.Grow(len(q) + 8)
	for i := 0; i < len(q); {
		c := q[i]
		switch {
		case quote != 0:
			if c == quote {
				quote = 0
			}
		case c == '\'' || c == '"' || c == '`':
			quote = c
		default:
			if n := at(&b, q, i); n > 0 {
				i += n
				continue
			}
		}
		b.WriteByte(c)
		i++
	}
	return b.String()
}

// Quote quotes an identifier that [sqlschema.ValidateIdentifier] accepted.
func (d *Dialect) Quote(ident string) string {
	return string(d.quote) + ident + string(d.quote)
}

// Now is the current time in the type of the family's time columns.
func (d *Dialect) Now() string { return d.now }

// Micros is the time column expr as microseconds since the Unix epoch
// (an integer): how every time leaves the database, whatever the family
// stores (timestamptz, DATETIME(6) in UTC, INTEGER microseconds).
func (d *Dialect) Micros(expr string) string { return d.micros(expr) }

// FromMicros is the parameter ph, microseconds since the Unix epoch, in
// the type of the family's time columns: how every time enters.
func (d *Dialect) FromMicros(ph string) string { return d.fromMicros(ph) }

// JSON is the parameter ph, a JSON text, in the type of the family's JSON
// columns (jsonb, LONGTEXT, TEXT).
func (d *Dialect) JSON(ph string) string { return d.json(ph) }

// Text returns s as the argument of a byte-exact string column: MySQL's
// are BLOBs, compared byte for byte, and take the bytes; the others take
// the string.
func (d *Dialect) Text(s string) any {
	if d.binaryArgs {
		return []byte(s)
	}
	return s
}

// begin returns the statements that begin a transaction with opts.
func (d *Dialect) begin(opts TxOptions) []string { return d.beginStmts(opts) }

// UndefinedTable reports whether err is the server's answer that a table
// or the schema (MySQL: the database) does not exist: oncemill's tables
// were not migrated there.
func (d *Dialect) UndefinedTable(err error) bool { return err != nil && d.undefined(err) }

// UniqueViolation reports whether err is a unique index refusing a row.
func (d *Dialect) UniqueViolation(err error) bool { return err != nil && d.unique(err) }

// AccessDenied reports whether err is the server refusing for lack of a
// privilege.
func (d *Dialect) AccessDenied(err error) bool { return err != nil && d.denied(err) }

// Conflict reports whether err is a conflict with another transaction
// that running again may resolve: a serialization failure, a deadlock, a
// lock wait that timed out, SQLite's busy database.
func (d *Dialect) Conflict(err error) bool { return err != nil && d.conflict(err) }

func isolationName(i Isolation) string {
	switch i {
	case ReadUncommitted:
		return "READ UNCOMMITTED"
	case ReadCommitted:
		return "READ COMMITTED"
	case RepeatableRead:
		return "REPEATABLE READ"
	case Serializable:
		return "SERIALIZABLE"
	}
	return ""
}

// Postgres is PostgreSQL 13 or newer, through pgx ([Pgx]) or database/sql
// (pgx's stdlib or lib/pq).
var Postgres = &Dialect{
	Name:          sqlschema.Postgres,
	Returning:     true,
	SkipLocked:    true,
	AdvisoryLocks: true,
	Snapshots:     true,
	WriteFromSelf: true,
	Pipeline:      true,
	placeholder:   func(n int) string { return "$" + strconv.Itoa(n) },
	quote:         '"',
	now:           "now()",
	micros:        func(e string) string { return "(EXTRACT(EPOCH FROM " + e + ") * 1000000)::bigint" },
	fromMicros:    func(ph string) string { return "(timestamptz 'epoch' + " + ph + " * interval '1 microsecond')" },
	json:          func(ph string) string { return "CAST(" + ph + " AS jsonb)" },
	beginStmts: func(o TxOptions) []string {
		s := "BEGIN"
		if l := isolationName(o.Isolation); l != "" {
			s += " ISOLATION LEVEL " + l
		}
		if o.ReadOnly {
			s += " READ ONLY"
		}
		return []string{s}
	},
	undefined: func(err error) bool { c := pgCode(err); return c == "42P01" || c == "3F000" },
	unique:    func(err error) bool { return pgCode(err) == "23505" },
	denied:    func(err error) bool { return pgCode(err) == "42501" },
	conflict:  func(err error) bool { c := pgCode(err); return c == "40001" || c == "40P01" || c == "55P03" },
	undefCol:  func(err error) bool { return pgCode(err) == "42703" },

	position:   func(sub, s string) string { return "POSITION(" + sub + " IN " + s + ")" },
	jsonText:   func(col, key string) string { return "(" + col + " ->> '" + key + "')" },
	replaceAll: func(e, p, r string) string { return "regexp_replace(" + e + ", '" + p + "', '" + r + "', 'g')" },
	charLength: "char_length",
	insertOnce: onConflictNothing,
	jsonInts: func(ph string) string {
		return "SELECT CAST(value AS bigint) FROM jsonb_array_elements_text(CAST(" + ph + " AS jsonb))"
	},
	rowID:     "ctid",
	sessionID: "pg_backend_pid()",

	writeCTE: true,
	rowAlias: " AS i",
	excluded: func(col string) string { return "excluded." + col },
	greatest: "GREATEST",
	nowPlus:  func(ph string) string { return "now() + CAST(" + ph + " AS bigint) * interval '1 microsecond'" },
	counted:  func(e string) string { return e },
	reported: func(_, e string) string { return e },
	upsert:   onConflictUpdate,

	answered:     func(err error) bool { return pgCode(err) != "" },
	unavailable:  pgUnavailable,
	sessionEnded: func(err error) bool { c := pgCode(err); return c == "57P01" || c == "57P02" },
	notSent:      pgNotSent,
	closed:       pgClosed,
}

func onConflictNothing(target, _ string) string { return " ON CONFLICT " + target + " DO NOTHING" }

// pgCode is the SQLSTATE of a PostgreSQL error through pgx or lib/pq.
func pgCode(err error) string {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return pgErr.Code
	}
	var pqErr *pq.Error
	if errors.As(err, &pqErr) {
		return string(pqErr.Code)
	}
	return ""
}

// MySQL is MySQL 8.0 or newer, or MariaDB 10.6 or newer, with InnoDB,
// through go-sql-driver/mysql.
var MySQL = &Dialect{
	Name:            sqlschema.MySQL,
	SkipLocked:      true,
	ReadUncommitted: true,
	quote:           '`',
	now:             "UTC_TIMESTAMP(6)",
	micros:          func(e string) string { return "TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', " + e + ")" },
	fromMicros:      func(ph string) string { return "TIMESTAMPADD(MICROSECOND, " + ph + ", '1970-01-01 00:00:00')" },
	json:            func(ph string) string { return ph },
	binaryArgs:      true,
	beginStmts: func(o TxOptions) []string {
		var out []string
		if l := isolationName(o.Isolation); l != "" {
			out = append(out, "SET TRANSACTION ISOLATION LEVEL "+l)
		}
		if o.ReadOnly {
			return append(out, "START TRANSACTION READ ONLY")
		}
		return append(out, "START TRANSACTION")
	},
	undefined: func(err error) bool { n := myNumber(err); return n == 1146 || n == 1049 },
	unique:    func(err error) bool { return myNumber(err) == 1062 },
	denied:    func(err error) bool { n := myNumber(err); return n == 1227 || n == 1142 || n == 1044 },
	// 1020: MariaDB's snapshot isolation found the row changed.
	conflict: func(err error) bool { n := myNumber(err); return n == 1213 || n == 1205 || n == 1020 },
	undefCol: func(err error) bool { return myNumber(err) == 1054 },

	position:   func(sub, s string) string { return "POSITION(" + sub + " IN " + s + ")" },
	jsonText:   func(col, key string) string { return "JSON_UNQUOTE(JSON_EXTRACT(" + col + ", '$." + key + "'))" },
	replaceAll: func(e, p, r string) string { return "REGEXP_REPLACE(" + e + ", '" + p + "', '" + r + "')" },
	charLength: "char_length",
	keyBytes:   [2]int{255, 1024}, // sqlschema/mysql/001_inbox
	// Unique indexes are not partial and there is no DO NOTHING: an
	// update of a column to itself.
	insertOnce: func(_, column string) string { return " ON DUPLICATE KEY UPDATE " + column + " = " + column },
	jsonInts: func(ph string) string {
		return "SELECT id FROM JSON_TABLE(" + ph + ", '$[*]' COLUMNS (id BIGINT PATH '$')) AS j"
	},
	joinIDs:    true,
	updateJoin: true,
	sessionID:  "CONNECTION_ID()",

	snapshotReads: true,
	excluded:      func(col string) string { return "VALUES(" + col + ")" },
	greatest:      "GREATEST",
	textBytes:     65535, // TEXT
	nowPlus:       func(ph string) string { return "UTC_TIMESTAMP(6) + INTERVAL " + ph + " MICROSECOND" },
	counted:       func(e string) string { return "LAST_INSERT_ID(" + e + ")" },
	// Not IS NULL: the optimizer folds it for a function that is never
	// NULL, and LAST_INSERT_ID(n) is then not called.
	reported: func(n, e string) string { return "IF(LAST_INSERT_ID(" + n + ") = 0, " + e + ", " + e + ")" },
	upsert:   onDuplicateKeyUpdate,

	answered:     func(err error) bool { return myNumber(err) != 0 },
	unavailable:  myUnavailable,
	sessionEnded: mySessionEnded,
	notSent:      func(err error) bool { return errors.Is(err, driver.ErrBadConn) },
	closed:       invalidConn,
}

func myNumber(err error) uint16 {
	var me *mysql.MySQLError
	if errors.As(err, &me) {
		return me.Number
	}
	return 0
}

// SQLite is SQLite 3.35 or newer (RETURNING and upsert) through
// modernc.org/sqlite. One writer at a time: a write transaction begins
// IMMEDIATE, taking the write lock first.
var SQLite = &Dialect{
	Name:          sqlschema.SQLite,
	Returning:     true,
	OneWriter:     true,
	WriteFromSelf: true,
	quote:         '"',
	now:           sqliteNow,
	micros:        func(e string) string { return e },
	fromMicros:    func(ph string) string { return ph },
	json:          func(ph string) string { return ph },
	beginStmts: func(o TxOptions) []string {
		if o.ReadOnly {
			return []string{"BEGIN DEFERRED"}
		}
		return []string{"BEGIN IMMEDIATE"}
	},
	undefined: func(err error) bool {
		c, ok := sqliteCode(err)
		return ok && c&0xff == sqlite3.SQLITE_ERROR && strings.Contains(err.Error(), "no such table")
	},
	unique: func(err error) bool {
		c, ok := sqliteCode(err)
		return ok && (c == sqlite3.SQLITE_CONSTRAINT_UNIQUE || c == sqlite3.SQLITE_CONSTRAINT_PRIMARYKEY)
	},
	denied: func(err error) bool {
		c, ok := sqliteCode(err)
		return ok && (c&0xff == sqlite3.SQLITE_READONLY || c&0xff == sqlite3.SQLITE_PERM || c&0xff == sqlite3.SQLITE_AUTH)
	},
	conflict: func(err error) bool {
		c, ok := sqliteCode(err)
		return ok && (c&0xff == sqlite3.SQLITE_BUSY || c&0xff == sqlite3.SQLITE_LOCKED)
	},
	undefCol: func(err error) bool {
		c, ok := sqliteCode(err)
		return ok && c&0xff == sqlite3.SQLITE_ERROR && strings.Contains(err.Error(), "no such column")
	},

	position:   func(sub, s string) string { return "instr(" + s + ", " + sub + ")" },
	jsonText:   func(col, key string) string { return "json_extract(" + col + ", '$." + key + "')" },
	replaceAll: func(e, p, r string) string { return sqliteReplaceAll + "(" + e + ", '" + p + "', '" + r + "')" },
	charLength: "length",
	insertOnce: onConflictNothing,
	jsonInts:   func(ph string) string { return "SELECT value FROM json_each(" + ph + ")" },
	rowID:      "rowid",
	sessionID:  "0",
	hashes:     true, // no hash function to generate the outbox's lane with

	rowAlias: " AS i",
	excluded: func(col string) string { return "excluded." + col },
	greatest: "MAX",
	// The writer's clock: SQLite's own has milliseconds, and a record's
	// times are microseconds.
	clockParam: true,
	nowPlus:    func(ph string) string { return "(:now + " + ph + ")" },
	counted:    func(e string) string { return e },
	reported:   func(_, e string) string { return e },
	upsert:     onConflictUpdate,

	answered:     func(err error) bool { _, ok := sqliteCode(err); return ok },
	unavailable:  sqliteUnavailable,
	sessionEnded: func(error) bool { return false },
	notSent:      func(error) bool { return false },
	closed:       func(any) bool { return false }, // an embedded database has no connection to lose
}

// sqliteNow is the current time in SQLite's time columns: INTEGER
// microseconds since the Unix epoch.
const sqliteNow = "CAST((julianday('now') - 2440587.5) * 86400000000 AS INTEGER)"

func sqliteCode(err error) (int, bool) {
	var e *sqlitedriver.Error
	if errors.As(err, &e) {
		return e.Code(), true
	}
	return 0, false
}

// byName is the dialect of each family's migrations.
var byName = map[sqlschema.Dialect]*Dialect{sqlschema.Postgres: Postgres, sqlschema.MySQL: MySQL, sqlschema.SQLite: SQLite}

// For returns the dialect of the migrations d.
func For(d sqlschema.Dialect) (*Dialect, error) {
	if dialect, ok := byName[d]; ok {
		return dialect, nil
	}
	return nil, errors.New("sqldb: unknown dialect " + strconv.Quote(string(d)) + ": use sqlschema.Postgres, sqlschema.MySQL or sqlschema.SQLite")
}
