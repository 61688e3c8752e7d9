package forwarder_test

import (
	"path/filepath"
	"testing"

	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/adapters"
	"github.com/oncemill/oncemill/forwarder"
	"github.com/oncemill/oncemill/internal/testing/sqltest"
	"github.com/oncemill/oncemill/sqlschema"
)

// TestRelayConfigDefaultsValidate: a RelayConfig left at its documented
// zero defaults (BatchSize, LanesPerBatch, the intervals, Schema) passes
// Validate; a field set out of range is named.
func TestRelayConfigDefaultsValidate(t *testing.T) {
	t.Parallel()
	db := sqltest.OpenSQLite(t, filepath.Join(t.TempDir(), "relay.db"))
	pub := adapters.NewGoChannel(gochannel.Config{Persistent: true}, nil)
	t.Cleanup(func() { require.NoError(t, pub.Close()) })
	cfg := forwarder.RelayConfig{DB: db, Dialect: sqlschema.SQLite, Publisher: pub}
	require.NoError(t, cfg.Validate())
	cfg.BatchSize = -1
	require.EqualError(t, cfg.Validate(), "forwarder: RelayConfig.BatchSize must be 1 to 10000, got -1")
}
