package kafka

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/IBM/sarama"
	wkafka "github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/oncemill/oncemill/adapters"
)

// backlogReader reads a consumer group's lag on a topic: each partition's
// high watermark minus the group's committed offset.
//
// It has a Sarama client of its own, opened on first use and closed by
// close, rather than the subscriber's: those belong to one Subscribe each
// and are replaced when the subscription reconnects, and the backlog is
// asked for whether or not the subscriber has subscribed (a member that
// has not joined yet, or whose partitions all went to other members, still
// wants to see its group's lag).
//
// Sarama's calls take no context and wait up to the read timeout for an
// answer (backlogReadTimeout at most): a read runs on a goroutine of the
// reader's, which Backlog stops waiting for when ctx ends and close waits
// for. Callers that ask for one
// topic while a read of it runs share that read, so a broker that does not
// answer holds one goroutine per topic, not one per scrape.
type backlogReader struct {
	brokers []string
	sc      *sarama.Config
	group   string

	mu       sync.Mutex
	client   sarama.Client
	closed   bool
	inFlight map[string]*backlogRead // by topic
	wg       sync.WaitGroup
}

// backlogRead is one read of a topic's backlog; done is closed once b and
// err are set.
type backlogRead struct {
	done chan struct{}
	b    adapters.Backlog
	err  error
}

// backlogReadTimeout bounds the wait for each answer to the backlog's
// client. The subscriber's Net.ReadTimeout is longer than the rebalance
// timeout, for the JoinGroup requests a coordinator holds; the backlog
// sends none, and Close waits for a read in flight.
const backlogReadTimeout = 10 * time.Second

// newBacklogReader returns a reader of group's lag with a copy of sc: its
// read timeout at most backlogReadTimeout, its metadata requests not
// retried (the next read asks again), for the topics it reads only, and
// never creating one: asking for a topic's backlog must not create it.
func newBacklogReader(brokers []string, sc *sarama.Config, group string) *backlogReader {
	c := *sc
	c.Net.ReadTimeout = min(c.Net.ReadTimeout, backlogReadTimeout)
	c.Metadata.Retry.Max = 0
	c.Metadata.Full = false
	c.Metadata.AllowAutoTopicCreation = false
	return &backlogReader{brokers: slices.Clone(brokers), sc: &c, group: group, inFlight: map[string]*backlogRead{}}
}

// Backlog implements adapters.Backlogger.
func (r *backlogReader) Backlog(ctx context.Context, topic string) (adapters.Backlog, error) {
	if err := ctx.Err(); err != nil {
		return adapters.Backlog{}, r.fail(topic, err)
	}
	r.mu.Lock()
	if r.closed {
		r.mu.Unlock()
		return adapters.Backlog{}, r.fail(topic, ErrSubscriberClosed)
	}
	read, ok := r.inFlight[topic]
	if !ok {
		read = &backlogRead{done: make(chan struct{})}
		r.inFlight[topic] = read
		r.wg.Add(1)
		go r.run(topic, read)
	}
	r.mu.Unlock()
	select {
	case <-read.done:
		if read.err != nil {
			return adapters.Backlog{}, r.fail(topic, read.err)
		}
		b := read.b
		b.Partitions = slices.Clone(b.Partitions) // each caller its own
		return b, nil
	case <-ctx.Done():
		return adapters.Backlog{}, r.fail(topic, ctx.Err())
	}
}

func (r *backlogReader) fail(topic string, err error) error {
	return fmt.Errorf("kafka: backlog of group %q on topic %q: %w", r.group, topic, err)
}

func (r *backlogReader) run(topic string, read *backlogRead) {
	defer r.wg.Done()
	read.b, read.err = r.read(topic)
	r.mu.Lock()
	delete(r.inFlight, topic)
	r.mu.Unlock()
	close(read.done)
}

// close stops new reads, closes the client, which fails the requests in
// flight, and waits for the reads to return.
func (r *backlogReader) close() error {
	r.mu.Lock()
	if r.closed {
		r.mu.Unlock()
		r.wg.Wait()
		return nil
	}
	r.closed = true
	client := r.client
	r.mu.Unlock()
	var err error
	if client != nil {
		if err = client.Close(); errors.Is(err, sarama.ErrClosedClient) {
			err = nil
		}
	}
	r.wg.Wait()
	if err != nil {
		return fmt.Errorf("kafka: close the backlog client: %w", err)
	}
	return nil
}

// connect returns the reader's client, opening it on first use.
func (r *backlogReader) connect() (sarama.Client, error) {
	r.mu.Lock()
	client := r.client
	r.mu.Unlock()
	if client != nil {
		return client, nil
	}
	client, err := sarama.NewClient(r.brokers, r.sc)
	if err != nil {
		return nil, fmt.Errorf("new client: %w", err)
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	switch {
	case r.closed:
		return nil, errors.Join(ErrSubscriberClosed, client.Close())
	case r.client != nil:
		// Another topic's read opened one meanwhile.
		return r.client, client.Close()
	}
	r.client = client
	return client, nil
}

// read asks the brokers for the group's committed offsets on topic and
// the partitions' high watermarks (and, for the partitions the group has
// not committed in, where it starts).
func (r *backlogReader) read(topic string) (adapters.Backlog, error) {
	client, err := r.connect()
	if err != nil {
		return adapters.Backlog{}, err
	}
	// Fresh metadata: partitions added and leaders moved since the last
	// read.
	if err := client.RefreshMetadata(topic); err != nil {
		return adapters.Backlog{}, fmt.Errorf("metadata: %w", err)
	}
	partitions, err := client.Partitions(topic)
	if err != nil {
		return adapters.Backlog{}, fmt.Errorf("partitions: %w", err)
	}
	committed, err := r.committed(client, topic, partitions)
	if err != nil {
		return adapters.Backlog{}, err
	}
	isolation := sarama.ReadUncommitted
	if r.sc.Consumer.IsolationLevel == sarama.ReadCommitted {
		isolation = sarama.ReadCommitted
	}
	high, err := r.offsets(client, topic, partitions, sarama.OffsetNewest, isolation)
	if err != nil {
		return adapters.Backlog{}, fmt.Errorf("high watermarks: %w", err)
	}
	var fresh []int32 // no committed offset
	for _, p := range partitions {
		if committed[p] < 0 {
			fresh = append(fresh, p)
		}
	}
	start := map[int32]int64{}
	if len(fresh) > 0 && r.sc.Consumer.Offsets.Initial == sarama.OffsetOldest {
		if start, err = r.offsets(client, topic, fresh, sarama.OffsetOldest, isolation); err != nil {
			return adapters.Backlog{}, fmt.Errorf("log start offsets: %w", err)
		}
	}
	slices.Sort(partitions)
	b := adapters.Backlog{Partitions: make([]adapters.PartitionBacklog, 0, len(partitions))}
	for _, p := range partitions {
		pb := adapters.PartitionBacklog{Partition: p, Committed: committed[p], HighWatermark: high[p]}
		switch from, ok := start[p]; {
		case pb.Committed >= 0:
			pb.Lag = pb.HighWatermark - pb.Committed
		case ok:
			pb.Lag = pb.HighWatermark - from
		}
		// A committed offset past the high watermark (a truncated log)
		// leaves nothing to read.
		pb.Lag = max(pb.Lag, 0)
		b.Messages += pb.Lag
		b.Partitions = append(b.Partitions, pb)
	}
	return b, nil
}

// committed returns the group's committed offset in each of partitions,
// -1 where it has none.
func (r *backlogReader) committed(client sarama.Client, topic string, partitions []int32) (map[int32]int64, error) {
	coordinator, err := client.Coordinator(r.group)
	if err != nil {
		return nil, fmt.Errorf("group coordinator: %w", err)
	}
	resp, err := coordinator.FetchOffset(sarama.NewOffsetFetchRequest(r.sc.Version, r.group, map[string][]int32{topic: partitions}))
	offsets := make(map[int32]int64, len(partitions))
	if err == nil && errors.Is(resp.Err, sarama.ErrGroupIDNotFound) {
		// A group that has never joined: Kafka answers -1 for each
		// partition, kfake that the group does not exist.
		for _, p := range partitions {
			offsets[p] = -1
		}
		return offsets, nil
	}
	if err == nil && !errors.Is(resp.Err, sarama.ErrNoError) {
		err = resp.Err
	}
	if err != nil {
		var kerr sarama.KError
		if !errors.As(err, &kerr) {
			// A broken connection: the next request opens a fresh one.
			_ = coordinator.Close()
		}
		// The coordinator may have moved: the next read looks it up again.
		_ = client.RefreshCoordinator(r.group)
		return nil, fmt.Errorf("committed offsets: %w", err)
	}
	for _, p := range partitions {
		block := resp.GetBlock(topic, p)
		switch {
		case block == nil:
			return nil, fmt.Errorf("committed offsets: no answer for partition %d", p)
		case !errors.Is(block.Err, sarama.ErrNoError):
			return nil, fmt.Errorf("committed offset of partition %d: %w", p, block.Err)
		}
		offsets[p] = block.Offset
	}
	return offsets, nil
}

// offsets returns the offset at at (sarama.OffsetNewest or
// sarama.OffsetOldest) of each of partitions, asking each leader once for
// all of its partitions.
func (r *backlogReader) offsets(client sarama.Client, topic string, partitions []int32, at int64, isolation sarama.IsolationLevel) (map[int32]int64, error) {
	requests := map[*sarama.Broker]*sarama.OffsetRequest{}
	for _, p := range partitions {
		leader, err := client.Leader(topic, p)
		if err != nil {
			return nil, fmt.Errorf("leader of partition %d: %w", p, err)
		}
		req, ok := requests[leader]
		if !ok {
			req = r.offsetRequest(isolation)
			requests[leader] = req
		}
		req.AddBlock(topic, p, at, 1)
	}
	offsets := make(map[int32]int64, len(partitions))
	for leader, req := range requests {
		resp, err := leader.GetAvailableOffsets(req)
		if err != nil {
			// As Sarama's GetOffset does: the next request opens a
			// fresh connection.
			_ = leader.Close()
			return nil, fmt.Errorf("broker %s: %w", leader.Addr(), err)
		}
		for _, p := range partitions {
			block := resp.GetBlock(topic, p)
			if block == nil {
				continue // another leader's
			}
			if !errors.Is(block.Err, sarama.ErrNoError) {
				return nil, fmt.Errorf("partition %d: %w", p, block.Err)
			}
			if len(block.Offsets) != 1 {
				return nil, fmt.Errorf("partition %d: %d offsets in the answer, want 1", p, len(block.Offsets))
			}
			offsets[p] = block.Offsets[0]
		}
	}
	for _, p := range partitions {
		if _, ok := offsets[p]; !ok {
			return nil, fmt.Errorf("partition %d: no answer from its leader", p)
		}
	}
	return offsets, nil
}

// offsetRequest returns a ListOffsets request in the version Sarama's own
// GetOffset sends for the configured Kafka version, reading at isolation
// where the version carries it.
func (r *backlogReader) offsetRequest(isolation sarama.IsolationLevel) *sarama.OffsetRequest {
	req := &sarama.OffsetRequest{}
	switch v := r.sc.Version; {
	case v.IsAtLeast(sarama.V2_1_0_0):
		req.Version = 4
	case v.IsAtLeast(sarama.V2_0_0_0):
		req.Version = 3
	case v.IsAtLeast(sarama.V0_11_0_0):
		req.Version = 2
	case v.IsAtLeast(sarama.V0_10_1_0):
		req.Version = 1
	}
	if req.Version >= 2 {
		req.IsolationLevel = isolation
	}
	return req
}

// groupSubscriber is watermill-kafka's one-at-a-time subscriber of a
// consumer group, which reports the group's backlog.
type groupSubscriber struct {
	*wkafka.Subscriber
	backlog *backlogReader
}

var (
	_ message.Subscriber           = (*groupSubscriber)(nil)
	_ message.SubscribeInitializer = (*groupSubscriber)(nil)
	_ adapters.Backlogger          = (*groupSubscriber)(nil)
	_ adapters.Backlogger          = (*parallelSubscriber)(nil)
)

// Backlog returns the group's lag on topic: per partition, the high
// watermark minus the group's committed offset. See
// adapters.PartitionBacklog.
func (s *groupSubscriber) Backlog(ctx context.Context, topic string) (adapters.Backlog, error) {
	return s.backlog.Backlog(ctx, topic)
}

// Close closes watermill-kafka's subscriber, then the backlog's client.
func (s *groupSubscriber) Close() error {
	return errors.Join(s.Subscriber.Close(), s.backlog.close())
}
