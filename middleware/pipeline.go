package middleware

import (
	"fmt"
	"sync/atomic"

	"github.com/oncemill/oncemill/dedup/dedupdriver"
)

// PipelineMode says when the inbox sends a delivery's first statements
// together, in one round trip, with a store that can
// (dedupdriver.StartClaimer, dedupdriver.BeginClaimer; the PostgreSQL
// store on a *pgxpool.Pool). docs/stores.md counts the round trips of each.
type PipelineMode int

const (
	// PipelineAuto, the default, always sends BEGIN and the claim together,
	// and the attempt record with them while duplicates are rare: a new key
	// costs three round trips and a duplicate two. Once more than 1 in 20
	// recent deliveries finds its key done (a redelivery after a crash or a
	// rebalance), the attempt record goes alone again, so that it answers
	// each duplicate in one round trip and a new key costs four; below 1 in
	// 50 the record rejoins the pipeline.
	PipelineAuto PipelineMode = iota
	// PipelineAlways sends the attempt record, BEGIN and the claim together
	// whatever the duplicates: three round trips per new key, two per
	// duplicate.
	PipelineAlways
	// PipelineNever sends each statement on its own: five round trips per
	// new key (the attempt record, BEGIN, the claim, the effect, COMMIT), one
	// per duplicate.
	PipelineNever
)

// String names the mode as Go code does.
func (m PipelineMode) String() string {
	switch m {
	case PipelineAuto:
		return "PipelineAuto"
	case PipelineAlways:
		return "PipelineAlways"
	case PipelineNever:
		return "PipelineNever"
	}
	return fmt.Sprintf("PipelineMode(%d)", int(m))
}

func (m PipelineMode) valid() bool { return m >= PipelineAuto && m <= PipelineNever }

// dupRate follows the share of recent deliveries that found their key done
// or dead (at the attempt record, or at the claim of a delivery that has
// none), for [PipelineAuto]: an exponentially weighted mean
// over about the last 256 (one part in 256 per sample, in units of 1/2^16),
// and whether the record currently rides with BEGIN and the claim. Leaving
// the pipeline at 5 % and rejoining at 2 % keeps a stream with a steady
// share of duplicates in between from switching back and forth.
type dupRate struct {
	mean    atomic.Int64 // share × 2^16
	leftOut atomic.Bool  // the record goes alone
}

const (
	dupRateOne   = 1 << 16
	dupRateShift = 8 // each sample moves the mean 1/256 of the way
	dupRateLeave = dupRateOne * 5 / 100
	dupRateJoin  = dupRateOne * 2 / 100
)

// observe adds one delivery's answer: dup says its key was done or dead.
func (r *dupRate) observe(dup bool) {
	var sample int64
	if dup {
		sample = dupRateOne
	}
	for {
		old := r.mean.Load()
		next := old + (sample-old)>>dupRateShift
		if sample > old && next == old {
			next++ // the shift rounds toward zero: a run of duplicates must still rise
		}
		if r.mean.CompareAndSwap(old, next) {
			switch {
			case next > dupRateLeave:
				r.leftOut.Store(true)
			case next < dupRateJoin:
				r.leftOut.Store(false)
			}
			return
		}
	}
}

// pipelineStart says whether the attempt record goes out with BEGIN and the
// claim.
func (in *Inbox) pipelineStart() bool {
	switch in.cfg.Tuning.Pipeline {
	case PipelineAlways:
		return true
	case PipelineNever:
		return false
	}
	return !in.dups.leftOut.Load()
}

// pipelineClaim says whether BEGIN and the claim go out together.
func (in *Inbox) pipelineClaim() bool { return in.cfg.Tuning.Pipeline != PipelineNever }

// claimHint is what a delivery's claim can expect: a new key after a start
// that found it so, and, for a delivery that started no count, a new key
// while duplicates are rare under PipelineAuto. Then the PostgreSQL store
// claims with the INSERT alone (a duplicate costs a round trip more);
// otherwise with the statement that also answers a duplicate.
func (in *Inbox) claimHint(o *attemptObs) dedupdriver.ClaimHint {
	if !o.unrecorded {
		return dedupdriver.ClaimHint{New: true}
	}
	return dedupdriver.ClaimHint{
		New:       in.cfg.Tuning.Pipeline == PipelineAuto && !in.dups.leftOut.Load(),
		Unstarted: true,
	}
}
