package adapters

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/url"
	"strings"
	"time"

	"github.com/oncemill/oncemill/adapters/kafka"
	"github.com/oncemill/oncemill/adapters/kafka/embedded"
)

// openKafka opens Kafka through Sarama with commit-after-ack and the
// idempotent producer. kafka://h1:9092,h2:9092?group=g&offset=oldest|newest.
// kafka:// with no host starts an embedded in-process broker that lives as
// long as the PubSub: for development only, since no other process can
// reach it (start one with the embedded package to share it).
func openKafka(ctx context.Context, u *url.URL, opts Options) (*PubSub, error) {
	q := u.Query()
	offset := kafka.Oldest
	switch v := q.Get("offset"); v {
	case "", "oldest":
	case "newest":
		offset = kafka.Newest
	default:
		return nil, fmt.Errorf("%w: parameter offset=%q: use oldest or newest", ErrBadURL, v)
	}
	ps := &PubSub{}
	var brokers []string
	if u.Host == "" {
		cluster, err := embedded.Start(embedded.Config{})
		if err != nil {
			return nil, fmt.Errorf("start embedded kafka: %w", err)
		}
		ps.closers = append(ps.closers, cluster.Close)
		brokers = cluster.Addrs()
	} else {
		for _, b := range strings.Split(u.Host, ",") {
			if _, _, err := net.SplitHostPort(b); err != nil {
				return nil, fmt.Errorf("%w: broker %q is not host:port", ErrBadURL, b)
			}
			brokers = append(brokers, b)
		}
		if err := reachable(ctx, brokers); err != nil {
			return nil, err
		}
	}
	fail := func(err error) (*PubSub, error) { return nil, errors.Join(err, ps.Close()) }

	pub, err := kafka.NewPublisher(kafka.PublisherConfig{Brokers: brokers}, opts.Logger)
	if err != nil {
		return fail(err)
	}
	ps.Publisher = pub
	grp := group(u, opts)
	if grp == "" {
		// A subscriber without a group commits nothing, so a restarted
		// consumer would not resume where it stopped.
		return fail(fmt.Errorf("%w: kafka needs a consumer group: add ?group=<name> or set Options.ConsumerGroup", ErrBadURL))
	}
	sub, err := kafka.NewSubscriber(kafka.SubscriberConfig{Brokers: brokers, ConsumerGroup: grp, InitialOffset: offset}, opts.Logger)
	if err != nil {
		return fail(err)
	}
	ps.Subscriber = sub
	return ps, nil
}

// reachable dials the brokers until one answers, so that a wrong address
// fails at Open rather than in Sarama's retry loop.
func reachable(ctx context.Context, brokers []string) error {
	d := net.Dialer{Timeout: 3 * time.Second}
	var errs []error
	for _, b := range brokers {
		conn, err := d.DialContext(ctx, "tcp", b)
		if err == nil {
			return conn.Close()
		}
		errs = append(errs, err)
	}
	return fmt.Errorf("unreachable: %w", errors.Join(errs...))
}
