package reconcile

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/oncemill/oncemill/internal/sqldb"
	"github.com/oncemill/oncemill/sqlschema"
)

// ErrInvalidConfig is returned, wrapped, by [Config.Validate] and [Check]
// for a Config that is missing a field or has one out of range; the
// message names the field.
var ErrInvalidConfig = errors.New("reconcile: invalid config")

// ErrNoLedger is returned, wrapped, by [Check] when the ledger table does
// not exist: the relay keeps none unless forwarder.RelayConfig.Ledger is
// set, and sqlschema's migrations create it.
var ErrNoLedger = errors.New("reconcile: no ledger table")

const (
	// DefaultGrace is Config.Grace's default.
	DefaultGrace = 5 * time.Minute
	// DefaultSince is Config.Since's default.
	DefaultSince = 24 * time.Hour
	// DefaultLimit is Config.Limit's default.
	DefaultLimit = 1000
)

// page is how many ledger rows (or inbox keys) one look-up in the other
// database covers.
const page = 1000

// Tables is one side of the check: a database and the names of its
// tables.
type Tables struct {
	// Pool is a PostgreSQL database through pgx. Set Pool or DB. It stays
	// the caller's.
	Pool *pgxpool.Pool
	// DB is a database through database/sql, with Dialect naming its
	// family: PostgreSQL (pgx's stdlib or lib/pq), MySQL 8.0+ or MariaDB
	// 10.6+ (go-sql-driver/mysql), or SQLite (modernc.org/sqlite). Set
	// Pool or DB. It stays the caller's.
	DB *sql.DB
	// Dialect is DB's database family: sqlschema.Postgres,
	// sqlschema.MySQL or sqlschema.SQLite. Required with DB, ignored with
	// Pool.
	Dialect sqlschema.Dialect
	// Schema names the tables: the ledger's (Schema, LedgerTable), or the
	// inbox's and the dead-letter table's (Schema, InboxTable, DLQTable).
	// Defaults as sqlschema's.
	Schema sqlschema.Config
}

func (t Tables) isZero() bool { return t.Pool == nil && t.DB == nil }

func (t Tables) validate(field string) error {
	if _, err := sqldb.FromConfig(field+".", t.Pool, t.DB, t.Dialect); err != nil {
		return fmt.Errorf("%w: %w", ErrInvalidConfig, err)
	}
	if err := t.Schema.WithDefaults().Validate(); err != nil {
		return fmt.Errorf("%w: %s.Schema: %w", ErrInvalidConfig, field, err)
	}
	return nil
}

// Config configures [Check].
type Config struct {
	// Ledger is the database of the relay's ledger table. Required.
	Ledger Tables
	// Inbox is the database of the consumer's inbox and dead-letter
	// tables. Defaults to Ledger.
	Inbox Tables
	// Consumer is the consumer whose inbox is checked, as its inbox's
	// Consumer. Required.
	Consumer string
	// Topics are the topics the consumer reads: only their events are
	// checked. Defaults to every topic of the ledger.
	Topics []string
	// Grace is how long an event may take from its publish to its
	// consumer's commit: events published less than Grace ago are not
	// checked. Defaults to 5 minutes.
	Grace time.Duration
	// Since is how far back from now events are checked. Keep it within
	// the ledger's retention and the inbox's: a done key the inbox already
	// expired is reported lost. Defaults to 24 hours.
	Since time.Duration
	// Strict also reports the keys done in the inbox within the window
	// that no ledger row explains. Defaults to false.
	Strict bool
	// Limit is the most findings Report.Missing and Report.Unexplained
	// each keep, oldest first; the counts count them all. Defaults to
	// 1000.
	Limit int
}

// Validate reports the first field of c that is missing or out of range;
// the error wraps [ErrInvalidConfig] and names the field.
func (c Config) Validate() error {
	c = c.withDefaults()
	if err := c.Ledger.validate("Ledger"); err != nil {
		return err
	}
	if !c.Inbox.isZero() {
		if err := c.Inbox.validate("Inbox"); err != nil {
			return err
		}
	}
	switch {
	case c.Consumer == "":
		return fmt.Errorf("%w: Consumer is required: the inbox's Consumer, whose keys are checked", ErrInvalidConfig)
	case c.Grace < 0:
		return fmt.Errorf("%w: Grace must not be negative, got %s", ErrInvalidConfig, c.Grace)
	case c.Since < 0:
		return fmt.Errorf("%w: Since must not be negative, got %s", ErrInvalidConfig, c.Since)
	case c.Limit < 0:
		return fmt.Errorf("%w: Limit must not be negative, got %d", ErrInvalidConfig, c.Limit)
	}
	for i, topic := range c.Topics {
		if topic == "" {
			return fmt.Errorf("%w: Topics[%d] is empty", ErrInvalidConfig, i)
		}
	}
	if d := c.withDefaults(); d.Since <= d.Grace {
		return fmt.Errorf("%w: Since (%s) must be longer than Grace (%s): nothing would be checked", ErrInvalidConfig, d.Since, d.Grace)
	}
	return nil
}

func (c Config) withDefaults() Config {
	if c.Inbox.isZero() {
		c.Inbox = c.Ledger
	}
	c.Ledger.Schema = c.Ledger.Schema.WithDefaults()
	c.Inbox.Schema = c.Inbox.Schema.WithDefaults()
	if c.Grace == 0 {
		c.Grace = DefaultGrace
	}
	if c.Since == 0 {
		c.Since = DefaultSince
	}
	if c.Limit == 0 {
		c.Limit = DefaultLimit
	}
	return c
}

// Report is what [Check] found.
type Report struct {
	// From and To bound the window checked, on the ledger's server clock:
	// events published at or after From and before To.
	From, To time.Time
	// Checked is how many ledger events the window holds (of Topics).
	Checked int
	// Lost counts the events whose key the inbox has no row of, Stuck
	// those whose key is processing or failed.
	Lost, Stuck int
	// Missing lists the lost and stuck events, oldest first, at most
	// Config.Limit.
	Missing []Event
	// UnexplainedKeys counts the keys done in the window that no ledger
	// row explains (Config.Strict only).
	UnexplainedKeys int
	// Unexplained lists them, by key, at most Config.Limit.
	Unexplained []Key
}

// MissingEvents is Lost + Stuck.
func (r Report) MissingEvents() int { return r.Lost + r.Stuck }

// OK reports whether the check found nothing.
func (r Report) OK() bool { return r.MissingEvents() == 0 && r.UnexplainedKeys == 0 }

// Event is a ledger event the consumer's inbox holds neither as done nor
// as dead.
type Event struct {
	UUID, Topic, Key string
	PublishedAt      time.Time
	// Inbox is the key's inbox status ("processing", "failed"), or ""
	// when the inbox has no row for it (lost).
	Inbox string
}

// Lost reports whether the inbox has no row for the event's key.
func (e Event) Lost() bool { return e.Inbox == "" }

// Key is a key done in the inbox that no ledger row explains.
type Key struct {
	Key    string
	DoneAt time.Time
}

// Check compares the ledger's events in the window with the consumer's
// inbox and dead-letter entries, and reports what is missing. An error
// means the check could not run (a database unreachable, a table
// missing), never that events are missing: read the Report for that.
func Check(ctx context.Context, cfg Config) (Report, error) {
	if err := cfg.Validate(); err != nil {
		return Report{}, err
	}
	cfg = cfg.withDefaults()
	l, in := open(cfg.Ledger), open(cfg.Inbox)
	var rep Report
	var err error
	if rep.From, rep.To, err = l.window(ctx, cfg.Since, cfg.Grace); err != nil {
		return rep, err
	}
	if err := checkLedger(ctx, cfg, l, in, &rep); err != nil {
		return rep, err
	}
	if cfg.Strict {
		if err := checkInbox(ctx, cfg, l, in, &rep); err != nil {
			return rep, err
		}
	}
	return rep, nil
}

// checkLedger walks the ledger's window by (published_at, uuid), a page
// at a time, and looks each page's keys up in the inbox and the
// dead-letter table.
func checkLedger(ctx context.Context, cfg Config, l, in tables, rep *Report) error {
	at, uuid := rep.From.Add(-time.Microsecond), ""
	for {
		events, err := l.events(ctx, rep.From, rep.To, at, uuid, cfg.Topics, page)
		if err != nil {
			return err
		}
		if len(events) == 0 {
			return nil
		}
		rep.Checked += len(events)
		keys, uuids := make([]string, len(events)), make([]string, len(events))
		for i, e := range events {
			keys[i], uuids[i] = e.Key, e.UUID
		}
		status, deadKeys, deadUUIDs, err := in.statuses(ctx, cfg.Consumer, keys, uuids)
		if err != nil {
			return err
		}
		for _, e := range events {
			st := status[e.Key]
			if st == "done" || st == "dead" || deadKeys[e.Key] || deadUUIDs[e.UUID] {
				continue
			}
			e.Inbox = st
			if e.Lost() {
				rep.Lost++
			} else {
				rep.Stuck++
			}
			if len(rep.Missing) < cfg.Limit {
				rep.Missing = append(rep.Missing, e)
			}
		}
		last := events[len(events)-1]
		at, uuid = last.PublishedAt, last.UUID
		if len(events) < page {
			return nil
		}
	}
}

// checkInbox walks the consumer's keys done within the window, by key, a
// page at a time, and reports those no ledger row has (within its
// retention, which may reach further back than the window: an event
// published before the window and applied in it is explained).
func checkInbox(ctx context.Context, cfg Config, l, in tables, rep *Report) error {
	after := ""
	for {
		done, err := in.done(ctx, cfg.Consumer, rep.From, rep.To, after, page)
		if err != nil {
			return err
		}
		if len(done) == 0 {
			return nil
		}
		keys := make([]string, len(done))
		for i, k := range done {
			keys[i] = k.Key
		}
		known, err := l.known(ctx, keys)
		if err != nil {
			return err
		}
		for _, k := range done {
			if known[k.Key] {
				continue
			}
			rep.UnexplainedKeys++
			if len(rep.Unexplained) < cfg.Limit {
				rep.Unexplained = append(rep.Unexplained, k)
			}
		}
		after = done[len(done)-1].Key
		if len(done) < page {
			return nil
		}
	}
}
