package forwarder_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/adapters/amqp"
	"github.com/oncemill/oncemill/forwarder"
)

// TestNewRelayRefusesTypedNilPublisher: a publisher passed as a nil
// pointer is refused by NewRelay, naming the field (issue 31, case 9:
// before, it was accepted and every batch panicked).
func TestNewRelayRefusesTypedNilPublisher(t *testing.T) {
	t.Parallel()
	b := setup(t, 1)
	_, err := forwarder.NewRelay(forwarder.RelayConfig{Pool: b.pool, Schema: b.schema, Publisher: (*amqp.Publisher)(nil)})
	require.ErrorContains(t, err, "RelayConfig.Publisher holds a nil *amqp.Publisher")
}
