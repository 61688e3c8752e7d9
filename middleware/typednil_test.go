package middleware_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/dedup/postgres"
	"github.com/oncemill/oncemill/dedup/redis"
	"github.com/oncemill/oncemill/dlq"
	"github.com/oncemill/oncemill/middleware"
)

// TestConstructorsRefuseTypedNils: a store or publisher passed as a nil
// pointer inside an interface is refused by the constructor, with an error
// naming the field. Issue 31, case 9: before, each was accepted, and every
// message then hit a nil-pointer panic, which the router recovered in a
// hot loop.
func TestConstructorsRefuseTypedNils(t *testing.T) {
	t.Parallel()
	_, err := middleware.NewInbox(middleware.InboxConfig{TxStore: (*postgres.Store)(nil)})
	require.ErrorContains(t, err, "InboxConfig.TxStore holds a nil *postgres.Store")
	_, err = middleware.NewInbox(middleware.InboxConfig{LeaseStore: (*redis.Store)(nil)})
	require.ErrorContains(t, err, "InboxConfig.LeaseStore holds a nil *redis.Store")
	_, err = middleware.NewPoison(middleware.PoisonConfig{Publisher: (*dlq.Publisher)(nil)})
	require.ErrorContains(t, err, "PoisonConfig.Publisher holds a nil *dlq.Publisher")
}
