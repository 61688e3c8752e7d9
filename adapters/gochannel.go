package adapters

import (
	"net/url"

	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
)

// openGoChannel opens an in-process GoChannel: publisher and subscriber are
// one value. persistent=true keeps every message for later subscribers, the
// closest it comes to a broker's redelivery after a restart. group and
// connect_timeout are accepted, so that a URL switches between brokers by
// its scheme alone, and checked, but GoChannel has neither groups nor
// connections.
func openGoChannel(u *url.URL, opts Options) (*PubSub, error) {
	q, err := query(u, "persistent")
	if err != nil {
		return nil, err
	}
	if _, err := group(q, opts); err != nil {
		return nil, err
	}
	if _, err := connectTimeout(q, opts); err != nil {
		return nil, err
	}
	persistent, err := boolParam(q, "persistent", false)
	if err != nil {
		return nil, err
	}
	gc := gochannel.NewGoChannel(gochannel.Config{Persistent: persistent, OutputChannelBuffer: 1024}, opts.Logger)
	// GoChannel's Close is idempotent: PubSub.Close calls it twice.
	return &PubSub{Publisher: gc, Subscriber: gc}, nil
}
