package breaker

import (
	"context"
	"time"

	"github.com/ThreeDotsLabs/watermill"
)

// Lines are the log lines of a breaker's transitions.
type Lines struct {
	// Opened is logged as an error, with the call's error, when the
	// breaker opens.
	Opened string
	// Closed is logged as information when it closes.
	Closed string
}

// Observe records the outcome of a call under ctx that ended with err
// (Answered when err is nil, Inconclusive when ctx ended, Unreachable when
// unreachable(err), else Answered: the dependency answered with an error)
// and logs the transition, if any, to logger.
func (b *Breaker) Observe(ctx context.Context, probe bool, err error, unreachable func(error) bool, logger watermill.LoggerAdapter, lines Lines) {
	o := Answered
	switch {
	case err == nil:
	case ctx.Err() != nil:
		o = Inconclusive
	case unreachable(err):
		o = Unreachable
	}
	switch b.Record(time.Now(), probe, o) {
	case Opened:
		logger.Error(lines.Opened, err, watermill.LogFields{
			"failures_in_a_row": b.Failures(), "probe_every": b.Probe().String(),
		})
	case Closed:
		logger.Info(lines.Closed, nil)
	}
}
