package redis_test

import (
	"testing"

	goredis "github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/dedup/redis"
)

// TestNewRefusesTypedNilClient: a nil *goredis.Client as Config.Client is
// refused, naming the field (issue 31, case 9).
func TestNewRefusesTypedNilClient(t *testing.T) {
	t.Parallel()
	_, err := redis.New(redis.Config{Client: (*goredis.Client)(nil)})
	require.ErrorContains(t, err, "Config.Client holds a nil *redis.Client")
}
