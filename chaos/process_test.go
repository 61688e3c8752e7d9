//go:build chaos

package chaos_test

import (
	"context"
	"fmt"
	"hash/crc32"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"
	goredis "github.com/redis/go-redis/v9"

	"github.com/oncemill/oncemill/dedup"
	"github.com/oncemill/oncemill/dedup/postgres"
	"github.com/oncemill/oncemill/dedup/redis"
	"github.com/oncemill/oncemill/dedup/twotier"
	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/internal/testing/proctest"
	"github.com/oncemill/oncemill/middleware"
	"github.com/oncemill/oncemill/retry"
)

const (
	poisonPrefix = "poison-"
	maxAttempts  = 3
)

// consumerConfig is what a consumer process is told by the suite.
type consumerConfig struct {
	// Stack's Consumer is the inbox's consumer name, the same for the
	// lane's processes.
	proctest.Stack
	Broker    string // the lane: kafka, amqp, sqs, nats or nats_embedded
	Store     string // "postgres" or "twotier"
	RedisAddr string // for twotier
	// Batch runs the inbox's group commit and writes a batch's effects
	// with one multi-row INSERT through a middleware.BatchHandler, on
	// Subscriptions router handlers of the topic.
	Batch         bool
	Subscriptions int
}

// consumerRole is a consumer process: the standard stack on its broker,
// with the poison middleware and a PostgreSQL inbox (through the
// PostgreSQL store or the two-tier store, whose stats it prints with its
// own), around a handler that writes one effect row per key in the
// inbox's transaction and rejects the poison keys. It runs until SIGTERM,
// then closes the router and exits 0.
var consumerRole = proctest.NewRole("chaos consumer", func(cfg consumerConfig, term <-chan os.Signal) error {
	c := &proctest.Consumer{
		Stack: cfg.Stack, MaxConns: 6,
		Pool: func(pc *pgxpool.Config) { pc.ConnConfig.ConnectTimeout = 2 * time.Second },
		Poison: &middleware.PoisonConfig{Topic: "chaos_dlq", MaxAttempts: maxAttempts,
			InitialBackoff: 20 * time.Millisecond, MaxBackoff: 200 * time.Millisecond, Delays: chaosDelays},
		Retries: &retry.SubscriberConfig{PollInterval: 200 * time.Millisecond, Lease: 5 * time.Second},
	}
	if cfg.Store == "twotier" {
		client := goredis.NewClient(&goredis.Options{
			Addr: cfg.RedisAddr, MaxRetries: -1,
			DialTimeout: time.Second, ReadTimeout: time.Second, WriteTimeout: time.Second, PoolTimeout: time.Second,
		})
		defer client.Close()
		var tt *twotier.Store
		c.Store = func(pg *postgres.Store) (dedup.TxStore, error) {
			lock, err := redis.New(redis.Config{Client: client, Prefix: "chaos"})
			if err != nil {
				return nil, err
			}
			tt, err = twotier.New(twotier.Config{Lock: lock, Record: pg})
			return tt, err
		}
		c.Extra = func() any { return tt.Stats() }
	}
	effects := cfg.Table("effects")
	pid := os.Getpid()
	if cfg.Batch {
		c.MaxConns = 8
		c.Subscriptions = cfg.Subscriptions
		c.Inbox.Tuning.Batch = middleware.BatchConfig{MaxMessages: 16, Linger: 5 * time.Millisecond, Parallel: 2}
		return c.Run(term, middleware.BatchHandler(func(ctx context.Context, msgs []*message.Message) error {
			keys := make([]string, 0, len(msgs))
			failed := middleware.BatchErrors{}
			for _, msg := range msgs {
				key := middleware.IdempotencyKey(msg.Context())
				if err := rejected(msg, key); err != nil {
					failed[msg.UUID] = err
					continue
				}
				keys = append(keys, key)
			}
			if len(failed) > 0 {
				return failed
			}
			if len(keys) == 0 {
				return nil
			}
			if _, err := postgres.Tx(ctx).Exec(ctx, `INSERT INTO `+effects+` (broker, key, pid) SELECT $1, unnest($2::text[]), $3`, cfg.Broker, keys, pid); err != nil {
				return err
			}
			return pause(ctx, time.Duration(crc32.ChecksumIEEE([]byte(keys[0]))%10)*time.Millisecond)
		}))
	}
	return c.Run(term, func(msg *message.Message) error {
		ctx := msg.Context()
		key := middleware.IdempotencyKey(ctx)
		if err := rejected(msg, key); err != nil {
			return err
		}
		if _, err := postgres.Tx(ctx).Exec(ctx, `INSERT INTO `+effects+` (broker, key, pid) VALUES ($1, $2, $3)`, cfg.Broker, key, pid); err != nil {
			return err
		}
		// A little work after the effect, so that kills land inside
		// handlers as well as between them.
		return pause(ctx, time.Duration(crc32.ChecksumIEEE([]byte(key))%10)*time.Millisecond)
	})
})

// rejected is the ledger's answer to msg, of key, before its effect: the
// poison keys always fail, and a flaky key fails while the broker
// delivers it, so that it succeeds only once parked and handed back by
// the retry subscriber.
func rejected(msg *message.Message, key string) error {
	if strings.HasPrefix(key, poisonPrefix) {
		return fmt.Errorf("chaos: the ledger rejects %s", key)
	}
	if flakyKey(key) && msg.Metadata.Get(delivery.RetryID) == "" {
		return fmt.Errorf("chaos: the ledger is busy for %s", key)
	}
	return nil
}

// chaosDelays are the delayed attempts of the suite's consumers: short,
// so that a poison key reaches the dead-letter table within a few seconds
// of its last immediate attempt, and four of them, so that a flaky key,
// which spends its maxAttempts quick attempts by design, keeps as many
// attempts for the kills that land in its handler as a healthy key had
// before parking (the inbox dead-letters a key whose attempts pass the
// policy's horizon).
var chaosDelays = []time.Duration{300 * time.Millisecond, 600 * time.Millisecond, 600 * time.Millisecond, 600 * time.Millisecond}

// flakyKey reports whether a healthy key fails every attempt the broker
// delivers, so that it is applied only after it was parked: one key in
// eight.
func flakyKey(key string) bool {
	return !strings.HasPrefix(key, poisonPrefix) && crc32.ChecksumIEEE([]byte(key))%8 == 0
}

func pause(ctx context.Context, d time.Duration) error {
	if d <= 0 {
		return nil
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// process is a running process of the suite.
type process struct {
	*proctest.Process
	killed atomic.Bool // the suite SIGKILLed it
}

// kill SIGKILLs the process and waits until it is gone.
func (p *process) kill() {
	p.killed.Store(true)
	p.Kill()
}

// slot is one consumer of a lane, restarted by its supervisor whenever it
// dies, as a process supervisor would.
type slot struct {
	cfg consumerConfig

	mu       sync.Mutex
	cur      *process
	stopping bool
	kills    int
	// exits are the times the consumer died without being killed, with
	// its output.
	exits []string
	// startErrors counts starts that failed (during an outage a process
	// may not come up); the supervisor tries again.
	startErrors int
	stats       []proctest.Stats
	wg          sync.WaitGroup
}

// supervise starts the consumer and restarts it whenever it dies, until
// stop.
func (s *slot) supervise(restartDelay func() time.Duration) {
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		for {
			s.mu.Lock()
			if s.stopping {
				s.mu.Unlock()
				return
			}
			s.mu.Unlock()
			started, err := consumerRole.TryStart(s.cfg)
			if err != nil {
				s.mu.Lock()
				s.startErrors++
				s.mu.Unlock()
				time.Sleep(time.Second)
				continue
			}
			p := &process{Process: started}
			s.mu.Lock()
			if s.stopping {
				// stop began while this one started: it ends here.
				s.mu.Unlock()
				if _, err := p.Shutdown(20 * time.Second); err != nil {
					s.mu.Lock()
					s.exits = append(s.exits, fmt.Sprintf("at stop: %v", err))
					s.mu.Unlock()
				}
				return
			}
			s.cur = p
			s.mu.Unlock()
			<-p.Done()
			s.mu.Lock()
			if !p.killed.Load() && !s.stopping {
				s.exits = append(s.exits, fmt.Sprintf("exit %d:\n%s", p.Code(), p.Out.String()))
			}
			if stopping := s.stopping; stopping {
				s.mu.Unlock()
				return
			}
			s.mu.Unlock()
			time.Sleep(restartDelay())
		}
	}()
}

// kill SIGKILLs the running consumer, if one is running, and reports
// whether it did.
func (s *slot) kill() bool {
	s.mu.Lock()
	p := s.cur
	if p == nil || s.stopping {
		s.mu.Unlock()
		return false
	}
	select {
	case <-p.Done():
		s.mu.Unlock()
		return false
	default:
	}
	s.kills++
	s.mu.Unlock()
	p.kill()
	return true
}

// running reports whether the consumer is up.
func (s *slot) running() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.cur == nil {
		return false
	}
	select {
	case <-s.cur.Done():
		return false
	default:
		return true
	}
}

// stop stops restarting the consumer, sends SIGTERM to the one running
// and collects the stats it prints. A consumer that does not exit cleanly
// within bound is an error.
func (s *slot) stop(bound time.Duration) error {
	s.mu.Lock()
	s.stopping = true
	p := s.cur
	s.mu.Unlock()
	var err error
	if p != nil {
		select {
		case <-p.Done():
		default:
			var st proctest.Stats
			if st, err = p.Shutdown(bound); err == nil {
				s.mu.Lock()
				s.stats = append(s.stats, st)
				s.mu.Unlock()
			}
		}
	}
	s.wg.Wait()
	return err
}
