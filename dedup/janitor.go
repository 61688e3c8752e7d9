package dedup

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
)

// Sweep deletes every expired record, batch records at a time, each batch in
// its own short statement so that no long lock is held. It stops early when
// ctx is done and returns how many records it deleted.
func Sweep(ctx context.Context, e Expirer, batch int) (int, error) {
	if batch <= 0 {
		return 0, fmt.Errorf("dedup: sweep: batch must be positive, got %d", batch)
	}
	total := 0
	for {
		n, err := e.InboxDeleteExpired(ctx, batch)
		total += n
		if err != nil {
			return total, err
		}
		if n < batch {
			return total, nil
		}
		if err := ctx.Err(); err != nil {
			return total, err
		}
	}
}

// JanitorConfig configures a [Janitor].
type JanitorConfig struct {
	// Interval between sweeps. Defaults to 1 minute.
	Interval time.Duration
	// BatchSize is the most records one statement deletes. Defaults to
	// 1000.
	BatchSize int
	// Logger receives a line per sweep that deleted something, and sweep
	// errors. Defaults to watermill.NopLogger.
	Logger watermill.LoggerAdapter
}

func (c *JanitorConfig) setDefaults() {
	if c.Interval == 0 {
		c.Interval = time.Minute
	}
	if c.BatchSize == 0 {
		c.BatchSize = 1000
	}
	if c.Logger == nil {
		c.Logger = watermill.NopLogger{}
	}
}

// Validate reports the first field out of range.
func (c JanitorConfig) Validate() error {
	c.setDefaults()
	if c.Interval < time.Millisecond {
		return fmt.Errorf("dedup: JanitorConfig.Interval must be at least 1ms, got %s", c.Interval)
	}
	if c.BatchSize < 1 {
		return fmt.Errorf("dedup: JanitorConfig.BatchSize must be at least 1, got %d", c.BatchSize)
	}
	return nil
}

// Janitor sweeps expired records in the background. NewJanitor starts one
// goroutine, which Close stops.
type Janitor struct {
	cfg    JanitorConfig
	store  Expirer
	cancel context.CancelFunc
	done   chan struct{}
	once   sync.Once
}

// NewJanitor starts a goroutine that runs [Sweep] on store every
// cfg.Interval, the first time at once. Call Close to stop it.
func NewJanitor(store Expirer, cfg JanitorConfig) (*Janitor, error) {
	if store == nil {
		return nil, errors.New("dedup: NewJanitor: store is nil")
	}
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	ctx, cancel := context.WithCancel(context.Background())
	j := &Janitor{cfg: cfg, store: store, cancel: cancel, done: make(chan struct{})}
	go j.run(ctx)
	return j, nil
}

func (j *Janitor) run(ctx context.Context) {
	defer close(j.done)
	t := time.NewTicker(j.cfg.Interval)
	defer t.Stop()
	for {
		n, err := Sweep(ctx, j.store, j.cfg.BatchSize)
		switch {
		case err != nil && ctx.Err() == nil:
			j.cfg.Logger.Error("Dedup sweep failed", err, watermill.LogFields{"deleted": n})
		case n > 0:
			j.cfg.Logger.Debug("Dedup sweep deleted expired keys", watermill.LogFields{"deleted": n})
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// Close stops the janitor and waits for a sweep in progress to end. It is
// safe to call more than once.
func (j *Janitor) Close() error {
	j.once.Do(j.cancel)
	<-j.done
	return nil
}
