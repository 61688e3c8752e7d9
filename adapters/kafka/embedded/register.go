package embedded

import (
	"github.com/ThreeDotsLabs/watermill"

	"github.com/oncemill/oncemill/adapters/internal/brokerurl"
)

// Importing the package makes adapters.Open start a broker of its own
// for kafka:// URLs without a host.
func init() {
	brokerurl.RegisterEmbedded("kafka", func(watermill.LoggerAdapter) ([]string, func() error, error) {
		c, err := Start(Config{})
		if err != nil {
			return nil, nil, err
		}
		return c.Addrs(), c.Close, nil
	})
}
