package redis_test

import (
	"context"
	"errors"
	"testing"

	goredis "github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/dedup"
	"github.com/oncemill/oncemill/dedup/deduptest"
	"github.com/oncemill/oncemill/dedup/redis"
	"github.com/oncemill/oncemill/internal/testing/redistest"
)

// TestConformance runs the lease store's conformance suite, each subtest
// under a prefix of its own, on a client whose connections go through a
// proxy that the Cut subtest breaks. Records expire by themselves, so
// the store is no dedup.Expirer and the Sweep subtest is skipped.
func TestConformance(t *testing.T) {
	t.Parallel()
	deduptest.RunLeaseStore(t, deduptest.LeaseHarness{
		New: func(t *testing.T) deduptest.LeaseBundle {
			direct := redistest.Client(t)
			prefix := redistest.Prefix(t, direct) // its keys are deleted through the direct client
			opts, err := goredis.ParseURL(redistest.URL())
			require.NoError(t, err)
			proxy := deduptest.NewProxy(t, opts.Addr)
			// After the cut a call fails at its first refused dial, not
			// after the client's retries.
			opts.Addr, opts.MaxRetries, opts.DialerRetries = proxy.Addr(), -1, 1
			client := goredis.NewClient(opts)
			t.Cleanup(func() { _ = client.Close() })
			store, err := redis.New(redis.Config{Client: client, Prefix: prefix})
			require.NoError(t, err)
			return deduptest.LeaseBundle{
				Store: store,
				DeadCopies: func(ctx context.Context, key dedup.Key) (int, error) {
					// The documented layout, for consumers that need no
					// escaping: <prefix>{<consumer>}:<key>.
					n, err := direct.HGet(ctx, prefix+"{"+key.Consumer+"}:"+key.Key, "dead_copies").Int()
					if errors.Is(err, goredis.Nil) {
						return 0, nil
					}
					return n, err
				},
				Cut: func(*testing.T) { proxy.Cut() },
			}
		},
	})
}
