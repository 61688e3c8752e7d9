// Package breaker is the circuit breaker the stores put around a
// dependency that may go down (the Redis lock of dedup/twotier, Redis under
// dedup/redis's FailOpen): after enough unavailability in a row the caller
// stops calling it, and probes it once per interval until it answers.
package breaker

import (
	"sync"
	"time"
)

// Outcome is what a call said about the health of what it called.
type Outcome int

const (
	// Answered means it replied, with a result or an error of its own
	// (a lost lease, a script error): it is reachable.
	Answered Outcome = iota
	// Unreachable means the call failed with an unavailability error.
	Unreachable
	// Inconclusive means the caller's context ended first; the call says
	// nothing about its health.
	Inconclusive
)

// Transition is a change of the breaker's state made by one outcome.
type Transition int

const (
	// Unchanged means the state stayed as it was.
	Unchanged Transition = iota
	// Opened means the breaker just opened: calls are skipped from now.
	Opened
	// Closed means the breaker just closed: calls go through again.
	Closed
)

// Breaker is a circuit breaker, safe for concurrent use. It is closed while
// calls are answered. After Failures unreachable outcomes in a row it opens:
// calls are skipped. While it is open, one call per probe interval is let
// through (half-open), the others still skipped; the first answer closes
// it. It probes lazily, on the calls that
// come, so it needs no goroutine. Its methods take the time, so that tests
// need not wait.
type Breaker struct {
	failures int
	probe    time.Duration

	mu sync.Mutex
	// streak counts the unreachable outcomes in a row while closed.
	streak int
	open   bool
	// nextProbe is, while open, when the next call may go through.
	nextProbe time.Time
	opens     int64
	skipped   int64
}

// New returns a closed breaker that opens after failures unreachable
// outcomes in a row and probes every probe while open.
func New(failures int, probe time.Duration) *Breaker {
	return &Breaker{failures: failures, probe: probe}
}

// Failures is how many unreachable outcomes in a row open the breaker.
func (b *Breaker) Failures() int { return b.failures }

// Probe is how often an open breaker lets a call through.
func (b *Breaker) Probe() time.Duration { return b.probe }

// Allow reports whether a call may be made at now, and whether it
// is the probe of an open breaker. A skipped call is counted. Its outcome
// must be given to Record.
func (b *Breaker) Allow(now time.Time) (pass, probe bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if !b.open {
		return true, false
	}
	if now.Before(b.nextProbe) {
		b.skipped++
		return false, false
	}
	// One probe per interval, even if this one hangs until the client's
	// timeouts end it.
	b.nextProbe = now.Add(b.probe)
	return true, true
}

// Record takes the outcome of a call that ended at now; probe says whether
// Allow let it through as the probe. A call that did not ask Allow (one
// that settles a lease already held) records with probe false.
func (b *Breaker) Record(now time.Time, probe bool, o Outcome) Transition {
	b.mu.Lock()
	defer b.mu.Unlock()
	switch o {
	case Answered:
		b.streak = 0
		if b.open {
			b.open = false
			return Closed
		}
	case Unreachable:
		if b.open {
			if probe {
				// Wait a whole interval from the end of the failed
				// probe, which may have taken the client's full dial
				// cycle.
				b.nextProbe = now.Add(b.probe)
			}
			return Unchanged
		}
		b.streak++
		if b.streak >= b.failures {
			b.open, b.streak = true, 0
			b.opens++
			b.nextProbe = now.Add(b.probe)
			return Opened
		}
	case Inconclusive:
		if b.open && probe {
			b.nextProbe = now // the probe told nothing: let the next call probe
		}
	}
	return Unchanged
}

// State returns whether the breaker is open, how many times it opened and
// how many calls it skipped.
func (b *Breaker) State() (open bool, opens, skipped int64) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.open, b.opens, b.skipped
}
