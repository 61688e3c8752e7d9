package deduptest_test

import (
	"context"
	"errors"
	"testing"

	goredis "github.com/redis/go-redis/v9"

	"github.com/oncemill/oncemill/dedup"
	"github.com/oncemill/oncemill/dedup/deduptest"
	"github.com/oncemill/oncemill/dedup/redis"
)

// conformanceRedis is what a lease store that reaches its server over TCP
// runs: the store dials the server through a [deduptest.Proxy], whose
// Cut breaks every connection, and each subtest writes under a key prefix
// of its own.
func conformanceRedis(t *testing.T) {
	deduptest.RunLeaseStore(t, deduptest.LeaseHarness{
		New: func(t *testing.T) deduptest.LeaseBundle {
			direct := goredis.NewClient(&goredis.Options{Addr: "127.0.0.1:6379"})
			t.Cleanup(func() { _ = direct.Close() })
			proxy := deduptest.NewProxy(t, "127.0.0.1:6379")
			// No retries: after the cut a call fails at once.
			client := goredis.NewClient(&goredis.Options{Addr: proxy.Addr(), MaxRetries: -1})
			t.Cleanup(func() { _ = client.Close() })
			prefix := "conformance:" + t.Name() + ":" // delete its keys with direct in t.Cleanup
			store, err := redis.New(redis.Config{Client: client, Prefix: prefix})
			if err != nil {
				t.Fatal(err)
			}
			return deduptest.LeaseBundle{
				Store: store,
				// Optional: lets the suite check the count of dead copies.
				DeadCopies: func(ctx context.Context, key dedup.Key) (int, error) {
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

// A lease store runs the suite from a test of its own package:
//
//	func TestConformance(t *testing.T) { conformanceRedis(t) }
func ExampleRunLeaseStore() {}
