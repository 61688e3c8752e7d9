package kafka

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"net/url"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/oncemill/oncemill/adapters/internal/brokerurl"
)

func init() {
	brokerurl.Register(openURL, "kafka")
	brokerurl.RegisterChecker(func(u *url.URL, opts brokerurl.Options) error {
		_, _, _, err := urlConfigs(u, opts)
		return err
	}, "kafka")
}

// openURL opens Kafka through Sarama with commit-after-ack and the
// idempotent producer for the kafka:// URLs of adapters.Open:
// kafka://h1:9092,h2:9092?group=g. Parameters: group (required, here or
// in Options), offset=oldest|newest, connect_timeout, the client's
// read_timeout, session_timeout and rebalance_timeout, drain_timeout
// (Go durations; see [SubscriberConfig.DrainTimeout]), max_in_flight
// (see [SubscriberConfig.MaxInFlightPerPartition]), max_in_flight_total
// (see [SubscriberConfig.MaxInFlight]) and instance_id (see
// [SubscriberConfig.InstanceID]).
//
// kafka:// with no host starts the embedded in-process broker of package
// embedded, which the program links by importing it, and which lives as
// long as the PubSub: for development only, since no other process can
// reach it.
func openURL(ctx context.Context, u *url.URL, opts brokerurl.Options) (*brokerurl.Opened, error) {
	pcfg, scfg, timeout, err := urlConfigs(u, opts)
	if err != nil {
		return nil, err
	}
	ps := &brokerurl.Opened{}
	if u.Host == "" {
		addrs, err := brokerurl.StartEmbedded(ps, "kafka", opts.Logger)
		if err != nil {
			return nil, err
		}
		pcfg.Brokers, scfg.Brokers = addrs, addrs
	} else if err := probe(ctx, pcfg.Brokers, timeout); err != nil {
		return nil, err
	}
	fail := func(err error) (*brokerurl.Opened, error) { return nil, errors.Join(err, ps.Close()) }

	pub, err := NewPublisher(pcfg, opts.Logger)
	if err != nil {
		return fail(err)
	}
	ps.Publisher = pub
	scfg.HandOutMarks = opts.HandOutMarks
	sub, err := NewSubscriber(scfg, opts.Logger)
	if err != nil {
		return fail(err)
	}
	ps.Subscriber = sub
	return ps, nil
}

// urlConfigs reads a kafka:// URL and opts into the publisher and
// subscriber configs and the connect timeout, all checked. The brokers
// are left empty for the embedded broker.
func urlConfigs(u *url.URL, opts brokerurl.Options) (PublisherConfig, SubscriberConfig, time.Duration, error) {
	var (
		pcfg PublisherConfig
		scfg SubscriberConfig
	)
	fail := func(err error) (PublisherConfig, SubscriberConfig, time.Duration, error) {
		return PublisherConfig{}, SubscriberConfig{}, 0, err
	}
	q, err := brokerurl.Query(u, "offset", "read_timeout", "session_timeout", "rebalance_timeout", "drain_timeout", "max_in_flight", "max_in_flight_total", "instance_id")
	if err != nil {
		return fail(err)
	}
	switch v := q.Get("offset"); v {
	case "", "oldest":
		scfg.InitialOffset = Oldest
	case "newest":
		scfg.InitialOffset = Newest
	default:
		return fail(fmt.Errorf("%w: parameter offset=%q: use oldest or newest", brokerurl.ErrBadURL, v))
	}
	if scfg.ConsumerGroup, err = brokerurl.Group(q, opts); err != nil {
		return fail(err)
	}
	if scfg.ConsumerGroup == "" {
		// A subscriber without a group commits nothing, so a restarted
		// consumer would not resume where it stopped.
		return fail(fmt.Errorf("%w: kafka needs a consumer group: add ?group=<name> or set Options.ConsumerGroup", brokerurl.ErrBadURL))
	}
	timeout, err := brokerurl.ConnectTimeout(q, opts)
	if err != nil {
		return fail(err)
	}
	pcfg.DialTimeout, scfg.DialTimeout = timeout, timeout
	for _, p := range []struct {
		name string
		to   *time.Duration
	}{
		{"read_timeout", &scfg.ReadTimeout},
		{"session_timeout", &scfg.SessionTimeout},
		{"rebalance_timeout", &scfg.RebalanceTimeout},
		{"drain_timeout", &scfg.DrainTimeout},
	} {
		if *p.to, err = brokerurl.Duration(q, p.name, false); err != nil {
			return fail(err)
		}
	}
	if v := q.Get("max_in_flight"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 {
			return fail(fmt.Errorf("%w: parameter max_in_flight=%q: want a positive integer, the messages of a partition in flight at once (1 for one at a time)", brokerurl.ErrBadURL, v))
		}
		scfg.MaxInFlightPerPartition = n
	}
	if v := q.Get("max_in_flight_total"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 {
			return fail(fmt.Errorf("%w: parameter max_in_flight_total=%q: want a positive integer, the messages in flight at once across the partitions of a subscription", brokerurl.ErrBadURL, v))
		}
		scfg.MaxInFlight = n
	}
	if q.Has("instance_id") {
		// Present and empty is an error, not dynamic membership: it is
		// what instance_id=$POD_NAME gives when the variable is unset.
		v := q.Get("instance_id")
		if err := ValidateInstanceID(v); err != nil {
			return fail(fmt.Errorf("%w: parameter instance_id=%q: %w", brokerurl.ErrBadURL, v, err))
		}
		scfg.InstanceID = v
	}
	pcfg.ReadTimeout = scfg.ReadTimeout
	if scfg.ReadTimeout != 0 {
		rebalance, what := scfg.RebalanceTimeout, "rebalance_timeout"
		if rebalance == 0 {
			rebalance, what = DefaultRebalanceTimeout, "the default rebalance timeout"
		}
		if scfg.ReadTimeout <= rebalance {
			return fail(fmt.Errorf("%w: parameter read_timeout=%s must be longer than %s (%s): the broker holds a JoinGroup request for up to the rebalance timeout",
				brokerurl.ErrBadURL, q.Get("read_timeout"), what, rebalance))
		}
	}
	if u.Host != "" {
		for _, b := range strings.Split(u.Host, ",") {
			if _, _, err := net.SplitHostPort(b); err != nil {
				return fail(fmt.Errorf("%w: broker %q is not host:port", brokerurl.ErrBadURL, b))
			}
			pcfg.Brokers = append(pcfg.Brokers, b)
		}
		scfg.Brokers = pcfg.Brokers
		if err := pcfg.Validate(); err != nil {
			return fail(fmt.Errorf("%w: %w", brokerurl.ErrBadURL, err))
		}
		if err := scfg.Validate(); err != nil {
			return fail(fmt.Errorf("%w: %w", brokerurl.ErrBadURL, err))
		}
	}
	return pcfg, scfg, timeout, nil
}

// probe asks every seed broker at once for its API versions and
// returns when one answers, so that a wrong address, or a host that
// accepts connections and does not answer, fails at Open within the
// connect timeout, naming the brokers, rather than in Sarama's retries.
func probe(ctx context.Context, brokers []string, timeout time.Duration) error {
	timeout = brokerurl.Within(ctx, timeout)
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	results := make(chan error, len(brokers))
	for _, b := range brokers {
		go func() { results <- askAPIVersions(ctx, b, timeout) }()
	}
	var errs []error
	for range brokers {
		err := <-results
		if err == nil {
			// The others end at cancel; wait for them so that none
			// outlives Open.
			cancel()
			for range len(brokers) - len(errs) - 1 {
				<-results
			}
			return nil
		}
		errs = append(errs, err)
	}
	return fmt.Errorf("kafka unreachable: %w", errors.Join(errs...))
}

// askAPIVersions sends an ApiVersions v0 request, which every Kafka broker
// since 0.10 answers before any other request, to addr and reads the
// response header.
func askAPIVersions(ctx context.Context, addr string, timeout time.Duration) error {
	var d net.Dialer
	conn, err := d.DialContext(ctx, "tcp", addr)
	if err != nil {
		return brokerError(ctx, addr, timeout, err)
	}
	defer conn.Close()
	if dl, ok := ctx.Deadline(); ok {
		if err := conn.SetDeadline(dl); err != nil {
			return fmt.Errorf("broker %s: %w", addr, err)
		}
	}
	// Cancellation before the deadline (another broker answered, or the
	// caller gave up) interrupts the read too.
	stop := context.AfterFunc(ctx, func() { _ = conn.SetDeadline(time.Now()) })
	defer stop()

	const (
		apiVersionsKey = 18
		correlationID  = 1
		clientID       = "oncemill"
	)
	req := binary.BigEndian.AppendUint32(nil, uint32(2+2+4+2+len(clientID)))
	req = binary.BigEndian.AppendUint16(req, apiVersionsKey)
	req = binary.BigEndian.AppendUint16(req, 0) // version
	req = binary.BigEndian.AppendUint32(req, correlationID)
	req = binary.BigEndian.AppendUint16(req, uint16(len(clientID)))
	req = append(req, clientID...)
	var resp [8]byte // size, correlation id
	if _, err = conn.Write(req); err == nil {
		_, err = io.ReadFull(conn, resp[:])
	}
	if err != nil {
		return brokerError(ctx, addr, timeout, err)
	}
	if binary.BigEndian.Uint32(resp[4:]) != correlationID {
		return fmt.Errorf("broker %s answered, but not in the Kafka protocol", addr)
	}
	return nil
}

// brokerError describes err, from talking to the broker at addr under ctx.
// The connection's deadline is ctx's, and may pass an instant before ctx
// ends: a network timeout counts as ctx's deadline.
func brokerError(ctx context.Context, addr string, timeout time.Duration, err error) error {
	switch {
	case errors.Is(ctx.Err(), context.Canceled):
		return fmt.Errorf("broker %s: %w", addr, ctx.Err())
	case errors.Is(ctx.Err(), context.DeadlineExceeded), errors.Is(err, os.ErrDeadlineExceeded):
		return brokerurl.NoAnswer(addr, timeout, err)
	}
	return fmt.Errorf("broker %s: %w", addr, err)
}
