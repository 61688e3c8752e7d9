package dlq

import (
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/oncemill/oncemill/internal/sqldb"
)

var (
	// ErrInvalidFilter is returned, wrapped, for a [Filter] that is out of
	// range; the message names the field.
	ErrInvalidFilter = errors.New("dlq: invalid filter")
	// ErrNoSelection is returned by [Store.Replay] and [Store.Purge] for a
	// [Filter] that selects nothing in particular (no IDs, no criterion)
	// without Filter.All: acting on every entry must be asked for.
	ErrNoSelection = errors.New("dlq: no entries selected: give IDs or a criterion, or set Filter.All to act on every entry")
)

// Filter selects dead-letter entries. Its fields combine with AND; a zero
// field does not filter. The zero Filter selects every entry, which
// [Store.List] and [Store.Count] accept and [Store.Replay] and [Store.Purge]
// refuse unless All is set.
type Filter struct {
	// IDs selects these entries only. Each must be positive.
	IDs []int64
	// Topic selects entries dead-lettered from this original topic.
	Topic string
	// Consumer selects entries of this consumer (handler).
	Consumer string
	// ErrorContains selects entries whose last error contains this text,
	// ignoring case.
	ErrorContains string
	// Since selects entries dead-lettered at or after this time.
	Since time.Time
	// Until selects entries dead-lettered at or before this time. When
	// both are set, Since must not be after Until.
	Until time.Time
	// Limit, when positive, keeps the first Limit matching entries (by id).
	// Zero means no limit. It is not a criterion: a Filter with only a
	// Limit is empty.
	Limit int
	// All lets [Store.Replay] and [Store.Purge] act on an empty Filter,
	// that is on every entry. With IDs or criteria it changes nothing.
	All bool
}

// IsEmpty reports whether f has no IDs and no criterion (Limit and All
// are not criteria).
func (f Filter) IsEmpty() bool {
	return len(f.IDs) == 0 && f.Topic == "" && f.Consumer == "" && f.ErrorContains == "" &&
		f.Since.IsZero() && f.Until.IsZero()
}

// Validate reports the first field of f that is out of range; the error
// wraps [ErrInvalidFilter] and names the field.
func (f Filter) Validate() error {
	if f.Limit < 0 {
		return fmt.Errorf("%w: Limit must be 0 (no limit) or more, got %d", ErrInvalidFilter, f.Limit)
	}
	if !f.Since.IsZero() && !f.Until.IsZero() && f.Since.After(f.Until) {
		return fmt.Errorf("%w: Since (%s) is after Until (%s)", ErrInvalidFilter,
			f.Since.Format(time.RFC3339Nano), f.Until.Format(time.RFC3339Nano))
	}
	for i, id := range f.IDs {
		if id <= 0 {
			return fmt.Errorf("%w: IDs[%d] must be positive, got %d", ErrInvalidFilter, i, id)
		}
	}
	return nil
}

// selection validates f for an operation that changes entries.
func (f Filter) selection() error {
	if err := f.Validate(); err != nil {
		return err
	}
	if f.IsEmpty() && !f.All {
		return ErrNoSelection
	}
	return nil
}

// query renders a query of what (columns of t) for the entries f
// selects, in id order with the limit applied, in t's placeholders, and
// its arguments. Strings are cleaned as the publisher cleans what it
// stores, so that they match what was stored and never fail as text; the
// identifiers are compared byte for byte.
func (f Filter) query(t *table, what string) (string, []any) {
	var (
		conds []string
		args  []any
	)
	add := func(cond string, arg any) {
		conds, args = append(conds, cond), append(args, arg)
	}
	if len(f.IDs) > 0 {
		add("id IN ("+t.d.JSONInts("?")+")", idsJSON(f.IDs))
	}
	if f.Topic != "" {
		add("topic = ?", t.d.Text(sqldb.Ident(f.Topic)))
	}
	if f.Consumer != "" {
		add("consumer = ?", t.d.Text(sqldb.Ident(f.Consumer)))
	}
	if f.ErrorContains != "" {
		add("LOWER("+t.d.Quote("error")+") LIKE LOWER(?) ESCAPE '!'", "%"+likeEscape.Replace(sqldb.CleanText(f.ErrorContains))+"%")
	}
	if !f.Since.IsZero() {
		add("dead_at >= "+t.d.FromMicros("?"), f.Since.UnixMicro())
	}
	if !f.Until.IsZero() {
		add("dead_at <= "+t.d.FromMicros("?"), f.Until.UnixMicro())
	}
	q := "SELECT " + what + " FROM " + t.names.DLQ
	if len(conds) > 0 {
		q += " WHERE " + strings.Join(conds, " AND ")
	}
	q += " ORDER BY id"
	if f.Limit > 0 {
		q += " LIMIT ?"
		args = append(args, f.Limit)
	}
	return t.d.Rebind(q), args
}

// likeEscape makes a text match itself in a LIKE pattern with ESCAPE '!'.
var likeEscape = strings.NewReplacer("!", "!!", "%", "!%", "_", "!_")
