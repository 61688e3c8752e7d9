package embedded

import (
	"github.com/ThreeDotsLabs/watermill"

	"github.com/oncemill/oncemill/adapters/internal/brokerurl"
)

// Importing the package makes adapters.Open start a server of its own
// for nats:// URLs without a host.
func init() {
	brokerurl.RegisterEmbedded("nats", func(logger watermill.LoggerAdapter) ([]string, func() error, error) {
		s, err := Start(Config{Logger: logger})
		if err != nil {
			return nil, nil, err
		}
		return []string{s.URL()}, s.Close, nil
	})
}
