//go:build chaos

package chaos_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"hash/crc32"
	"os"
	"os/signal"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	goredis "github.com/redis/go-redis/v9"

	"github.com/oncemill/oncemill/adapters"
	"github.com/oncemill/oncemill/adapters/kafka/embedded"
	"github.com/oncemill/oncemill/dedup"
	"github.com/oncemill/oncemill/dedup/postgres"
	"github.com/oncemill/oncemill/dedup/redis"
	"github.com/oncemill/oncemill/dedup/twotier"
	"github.com/oncemill/oncemill/dlq"
	"github.com/oncemill/oncemill/internal/proctest"
	"github.com/oncemill/oncemill/middleware"
	"github.com/oncemill/oncemill/sqlschema"
)

// roleEnv, when set, makes the test binary run one process of the suite
// instead of the tests: "consumer" (configured by consumerEnv) or "kafka"
// (an embedded broker that prints its addresses and runs until SIGTERM).
const (
	roleEnv     = "ONCEMILL_CHAOS_ROLE"
	consumerEnv = "ONCEMILL_CHAOS_CONSUMER"
)

const (
	// Exit codes of a process of the suite.
	exitBadSetup = 4
	exitBadClose = 5
	exitStopped  = 6 // the router stopped by itself

	readyLine = "CHAOS READY"
	kafkaLine = "CHAOS KAFKA "
	statsLine = "CHAOS STATS "

	poisonPrefix = "poison-"
	maxAttempts  = 3
)

// consumerConfig is what a consumer process is told by the suite.
type consumerConfig struct {
	Broker      string // the lane: kafka, amqp or sqs
	BrokerURL   string
	Group       string
	Topic       string
	DatabaseURL string
	Schema      string
	Consumer    string // the inbox's consumer name, the same for the lane's processes
	Store       string // "postgres" or "twotier"
	RedisAddr   string // for twotier
}

// consumerStats is what a consumer prints on its last line when it exits
// cleanly.
type consumerStats struct {
	Inbox   middleware.InboxStats
	Poison  middleware.PoisonStats
	TwoTier *twotier.Stats `json:",omitempty"`
}

// runRole runs the process role names; it returns the exit code.
func runRole(role string) int {
	term := make(chan os.Signal, 1)
	signal.Notify(term, syscall.SIGTERM)
	var (
		code int
		err  error
	)
	switch role {
	case "consumer":
		var cfg consumerConfig
		if err := json.Unmarshal([]byte(os.Getenv(consumerEnv)), &cfg); err != nil {
			fmt.Fprintln(os.Stderr, "chaos consumer: bad config:", err)
			return exitBadSetup
		}
		code, err = consume(cfg, term)
	case "kafka":
		code, err = serveKafka(term)
	default:
		code, err = exitBadSetup, fmt.Errorf("unknown role %q", role)
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "chaos %s: %v\n", role, err)
	}
	return code
}

// serveKafka runs the embedded Kafka broker in this process, so that the
// consumers reach it over the network as they would a cluster.
func serveKafka(term <-chan os.Signal) (int, error) {
	cluster, err := embedded.Start(embedded.Config{DefaultPartitions: 4, GroupMinSessionTimeout: time.Second})
	if err != nil {
		return exitBadSetup, err
	}
	fmt.Println(kafkaLine + strings.Join(cluster.Addrs(), ","))
	<-term
	if err := cluster.Close(); err != nil {
		return exitBadClose, err
	}
	return 0, nil
}

// consume is a consumer process: its broker, a PostgreSQL inbox (through
// the PostgreSQL store or the two-tier store), the poison middleware with
// the PostgreSQL dead-letter table, and a handler that writes one effect
// row per key in the inbox's transaction and rejects the poison keys. It
// runs until SIGTERM, then closes the router and exits 0.
func consume(cfg consumerConfig, term <-chan os.Signal) (int, error) {
	ctx := context.Background()
	poolCfg, err := pgxpool.ParseConfig(cfg.DatabaseURL)
	if err != nil {
		return exitBadSetup, err
	}
	poolCfg.MaxConns = 6
	poolCfg.ConnConfig.ConnectTimeout = 2 * time.Second
	pool, err := pgxpool.NewWithConfig(ctx, poolCfg)
	if err != nil {
		return exitBadSetup, err
	}
	defer pool.Close()
	pg, err := postgres.New(pool, postgres.Config{Schema: cfg.Schema})
	if err != nil {
		return exitBadSetup, err
	}
	var (
		store dedup.TxStore = pg
		tt    *twotier.Store
	)
	if cfg.Store == "twotier" {
		client := goredis.NewClient(&goredis.Options{
			Addr: cfg.RedisAddr, MaxRetries: -1,
			DialTimeout: time.Second, ReadTimeout: time.Second, WriteTimeout: time.Second, PoolTimeout: time.Second,
		})
		defer client.Close()
		lock, err := redis.New(redis.Config{Client: client, Prefix: "chaos"})
		if err != nil {
			return exitBadSetup, err
		}
		if tt, err = twotier.New(twotier.Config{Lock: lock, Record: pg}); err != nil {
			return exitBadSetup, err
		}
		store = tt
	}
	dlqPub, err := dlq.NewPublisher(pool, sqlschema.Config{Schema: cfg.Schema})
	if err != nil {
		return exitBadSetup, err
	}
	ps, err := adapters.Open(ctx, cfg.BrokerURL, adapters.Options{ConsumerGroup: cfg.Group})
	if err != nil {
		return exitBadSetup, err
	}
	poison, err := middleware.NewPoison(middleware.PoisonConfig{
		Publisher: dlqPub, Topic: "chaos_dlq", MaxAttempts: maxAttempts,
		InitialBackoff: 20 * time.Millisecond, MaxBackoff: 200 * time.Millisecond,
	})
	if err != nil {
		return exitBadSetup, errors.Join(err, ps.Close())
	}
	inbox, err := middleware.NewInbox(middleware.InboxConfig{TxStore: store, Consumer: cfg.Consumer})
	if err != nil {
		return exitBadSetup, errors.Join(err, ps.Close())
	}
	effects := pgx.Identifier{cfg.Schema, "effects"}.Sanitize()
	pid := os.Getpid()
	handler := func(msg *message.Message) error {
		ctx := msg.Context()
		key := middleware.IdempotencyKey(ctx)
		if strings.HasPrefix(key, poisonPrefix) {
			return fmt.Errorf("chaos: the ledger rejects %s", key)
		}
		if _, err := postgres.Tx(ctx).Exec(ctx, `INSERT INTO `+effects+` (broker, key, pid) VALUES ($1, $2, $3)`, cfg.Broker, key, pid); err != nil {
			return err
		}
		// A little work after the effect, so that kills land inside
		// handlers as well as between them.
		return pause(ctx, time.Duration(crc32.ChecksumIEEE([]byte(key))%10)*time.Millisecond)
	}

	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
	if err != nil {
		return exitBadSetup, errors.Join(err, ps.Close())
	}
	r.AddMiddleware(poison.Middleware, inbox.Middleware)
	r.AddNoPublisherHandler(cfg.Consumer, cfg.Topic, ps.Subscriber, handler)
	code := 0
	switch err := proctest.RunRouter(ctx, r, readyLine, term); {
	case errors.Is(err, proctest.ErrRouterNotStarted):
		return exitBadSetup, errors.Join(err, ps.Close())
	case errors.Is(err, proctest.ErrRouterStopped):
		return exitStopped, errors.Join(err, ps.Close())
	case err != nil:
		code = exitBadClose
		fmt.Fprintln(os.Stderr, "chaos consumer: router close:", err)
	}
	if err := ps.Close(); err != nil {
		fmt.Fprintln(os.Stderr, "chaos consumer: close broker:", err)
	}
	stats := consumerStats{Inbox: inbox.Stats(), Poison: poison.Stats()}
	if tt != nil {
		s := tt.Stats()
		stats.TwoTier = &s
	}
	raw, err := json.Marshal(stats)
	if err != nil {
		return exitBadClose, err
	}
	fmt.Println(statsLine + string(raw))
	return code, nil
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

// startProcess starts the test binary in role with the extra environment,
// and waits up to a minute for it to print a line starting with ready.
func startProcess(role string, env []string, ready string) (*process, error) {
	p, err := proctest.Start(append([]string{roleEnv + "=" + role}, env...), ready, time.Minute)
	if err != nil {
		return nil, fmt.Errorf("%s process: %w", role, err)
	}
	return &process{Process: p}, nil
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
	stats       []consumerStats
	wg          sync.WaitGroup
}

// supervise starts the consumer and restarts it whenever it dies, until
// stop.
func (s *slot) supervise(restartDelay func() time.Duration) {
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		raw, _ := json.Marshal(s.cfg)
		for {
			s.mu.Lock()
			if s.stopping {
				s.mu.Unlock()
				return
			}
			s.mu.Unlock()
			p, err := startProcess("consumer", []string{consumerEnv + "=" + string(raw)}, readyLine)
			if err != nil {
				s.mu.Lock()
				s.startErrors++
				s.mu.Unlock()
				time.Sleep(time.Second)
				continue
			}
			s.mu.Lock()
			if s.stopping {
				// stop began while this one started: it ends here.
				s.mu.Unlock()
				if err := p.Terminate(20 * time.Second); err != nil || p.Code() != 0 {
					s.mu.Lock()
					s.exits = append(s.exits, fmt.Sprintf("exit %d at stop (%v):\n%s", p.Code(), err, p.Out.String()))
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
			err = p.Terminate(bound)
			if err == nil && p.Code() != 0 {
				err = fmt.Errorf("exit code %d after SIGTERM; output:\n%s", p.Code(), p.Out.String())
			}
			if err == nil {
				raw, ok := p.Out.Line(statsLine)
				var st consumerStats
				if !ok {
					err = fmt.Errorf("no stats printed; output:\n%s", p.Out.String())
				} else if err = json.Unmarshal([]byte(raw), &st); err == nil {
					s.mu.Lock()
					s.stats = append(s.stats, st)
					s.mu.Unlock()
				}
			}
		}
	}
	s.wg.Wait()
	return err
}
