package forwarder

import (
	"context"
	"errors"
	"time"

	"github.com/ThreeDotsLabs/watermill"
)

// ErrStalled is the error of the stall lines the relay logs at Error, on a
// logger without a Warn method (see [RelayConfig.Logger]): outbox rows wait
// on a transaction that has been open for StallWarning or longer; see
// [Lag.HeldBy].
var ErrStalled = errors.New("forwarder: outbox rows wait for an open transaction")

// stallWatch paces the stall checks and their log lines.
type stallWatch struct {
	// checked is the last check, warned the last line, flowed the last
	// batch that took rows.
	checked, warned, flowed time.Time
}

// stalled reports whether lag is a stall worth a line at now: rows wait,
// on a transaction open for at least every, and the last line is at least
// every old. A transaction younger than every is a writer in flight.
func (s *stallWatch) stalled(now time.Time, lag Lag, every time.Duration) bool {
	if lag.Waiting == 0 || lag.HeldBy == nil || lag.HeldBy.Age < every {
		return false
	}
	if !s.warned.IsZero() && now.Sub(s.warned) < every {
		return false
	}
	s.warned = now
	return true
}

// watchStall, while the relay finds nothing to publish, checks every
// StallWarning/2 whether rows wait on a transaction open for StallWarning
// or longer, and logs it at most once per StallWarning.
func (r *Relay) watchStall(ctx context.Context, s *stallWatch, reading *lagReading) {
	now := time.Now()
	if now.Sub(s.checked) < r.cfg.StallWarning/2 {
		return
	}
	s.checked = now
	// A reading from before rows last went out may name a transaction
	// that has ended since.
	// The stall needs the outbox alone, not the scheduled rows.
	lag, err := reading.measure(ctx, r, min(r.cfg.StallWarning/4, now.Sub(s.flowed)), false)
	if err != nil || !s.stalled(now, lag, r.cfg.StallWarning) {
		return
	}
	h := lag.HeldBy
	fields := watermill.LogFields{
		"waiting_rows": lag.Waiting, "pending_rows": lag.Pending,
		"oldest_row_age": lag.OldestAge.Round(time.Millisecond).String(), "outbox": r.outbox,
		"holder_pid": h.PID, "holder_database": h.Database, "holder_state": h.State,
		"holder_age": roundAge(h.Age).String(),
	}
	if h.GID != "" {
		fields["holder_gid"] = h.GID
	}
	msg := "Outbox rows wait for an open transaction: " + h.String()
	if w, ok := r.cfg.Logger.(interface {
		Warn(msg string, fields watermill.LogFields)
	}); ok {
		w.Warn(msg, fields)
		return
	}
	r.cfg.Logger.Error(msg, ErrStalled, fields)
}
