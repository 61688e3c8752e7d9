package adapters

import (
	"net/url"

	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
)

// openGoChannel opens an in-process GoChannel: publisher and subscriber are
// one value. persistent=true keeps every message for later subscribers, the
// closest it comes to a broker's redelivery after a restart.
func openGoChannel(u *url.URL, opts Options) (*PubSub, error) {
	persistent, err := boolParam(u, "persistent", false)
	if err != nil {
		return nil, err
	}
	gc := gochannel.NewGoChannel(gochannel.Config{Persistent: persistent, OutputChannelBuffer: 1024}, opts.Logger)
	// GoChannel's Close is idempotent: PubSub.Close calls it twice.
	return &PubSub{Publisher: gc, Subscriber: gc}, nil
}
