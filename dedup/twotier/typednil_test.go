package twotier_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/dedup/postgres"
	"github.com/oncemill/oncemill/dedup/redis"
	"github.com/oncemill/oncemill/dedup/twotier"
)

// TestNewRefusesTypedNilStores: a nil store pointer as Config.Lock or
// Config.Record is refused, naming the field (issue 31, case 9).
func TestNewRefusesTypedNilStores(t *testing.T) {
	t.Parallel()
	_, err := twotier.New(twotier.Config{Lock: (*redis.Store)(nil), Record: (*postgres.Store)(nil)})
	require.ErrorContains(t, err, "Config.Lock holds a nil *redis.Store")
}
