//go:build chaos

package chaos_test

import (
	"context"
	"fmt"
	"sort"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/dedup"
	"github.com/oncemill/oncemill/dedup/postgres"
	"github.com/oncemill/oncemill/dedup/redis"
	"github.com/oncemill/oncemill/dedup/twotier"
	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/internal/testing/redistest"
	"github.com/oncemill/oncemill/middleware"
)

const (
	throughputWorkers = 8
	throughputRound   = 2 * time.Second
	throughputRounds  = 3
)

// redisDownThroughput measures, in this process, the inbox's throughput on
// new keys with the two-tier store while its Redis is down, against the
// PostgreSQL store alone, at the same concurrency on the same database,
// in alternating rounds. It reports the ratio; like every speed figure of
// the project it is not a pass/fail threshold, but the two-tier store
// must keep applying every message while Redis is down, once each.
func redisDownThroughput(t *testing.T, pgURL string, rds *redistest.Server) {
	ctx := context.Background()
	pool := connect(t, pgURL, 2*throughputWorkers)
	pg, err := postgres.New(pool, postgres.Config{Schema: schema})
	require.NoError(t, err)
	rds.Stop()
	lock, err := redis.New(redis.Config{Client: rds.Client(t), Prefix: "chaos_bench"})
	require.NoError(t, err)
	tt, err := twotier.New(twotier.Config{Lock: lock, Record: pg})
	require.NoError(t, err)

	stores := []struct {
		name  string
		store dedup.TxStore
		rates []float64
	}{{name: "postgres", store: pg}, {name: "twotier, Redis down", store: tt}}
	var seq atomic.Int64
	applied := map[string]int64{}
	for range throughputRounds {
		for i := range stores {
			s := &stores[i]
			inbox, err := middleware.NewInbox(middleware.InboxConfig{TxStore: s.store, Consumer: "chaos_bench"})
			require.NoError(t, err)
			h := inbox.Middleware(func(msg *message.Message) ([]*message.Message, error) {
				ctx := msg.Context()
				_, err := postgres.Tx(ctx).Exec(ctx, `INSERT INTO `+schema+`.effects (broker, key, pid) VALUES ('bench', $1, 0)`,
					middleware.IdempotencyKey(ctx))
				return nil, err
			})
			var n atomic.Int64
			var wg sync.WaitGroup
			var failed atomic.Value
			deadline := time.Now().Add(throughputRound)
			began := time.Now()
			for range throughputWorkers {
				wg.Add(1)
				go func() {
					defer wg.Done()
					for time.Now().Before(deadline) {
						msg := message.NewMessage(watermill.NewUUID(), nil)
						msg.Metadata.Set(delivery.IdempotencyKey, fmt.Sprintf("bench-%d", seq.Add(1)))
						msg.SetContext(ctx)
						if _, err := h(msg); err != nil {
							failed.Store(err)
							return
						}
						n.Add(1)
					}
				}()
			}
			wg.Wait()
			if err, _ := failed.Load().(error); err != nil {
				require.NoError(t, err, s.name)
			}
			s.rates = append(s.rates, float64(n.Load())/time.Since(began).Seconds())
			applied[s.name] += n.Load()
		}
	}
	var effects, keys int64
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*), count(DISTINCT key) FROM `+schema+`.effects WHERE broker = 'bench'`).Scan(&effects, &keys))
	require.Equal(t, applied["postgres"]+applied["twotier, Redis down"], effects, "every message applied")
	require.Equal(t, effects, keys, "once each")
	require.Positive(t, tt.Stats().Fallbacks+tt.Stats().Skipped, "the two-tier store went without Redis")

	med := func(r []float64) float64 {
		r = append([]float64(nil), r...)
		sort.Float64s(r)
		return r[len(r)/2]
	}
	pgRate, ttRate := med(stores[0].rates), med(stores[1].rates)
	line := fmt.Sprintf("new keys, %d workers, median of %d rounds of %s: PostgreSQL store %.0f msgs/s, two-tier store with Redis down %.0f msgs/s (%.2f×); breaker opened %d times",
		throughputWorkers, throughputRounds, throughputRound, pgRate, ttRate, ttRate/pgRate, tt.Stats().BreakerOpens)
	fmt.Println("\nchaos: " + line)
	t.Log(line)
}
