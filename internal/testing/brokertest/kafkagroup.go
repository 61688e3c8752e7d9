package brokertest

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"
)

// KafkaGroup is a consumer group as its coordinator describes it.
type KafkaGroup struct {
	// State is Kafka's name of the group's state: Empty,
	// PreparingRebalance, CompletingRebalance, Stable or Dead.
	State string
	// Members are the group's members, in the coordinator's order.
	Members []KafkaMember
}

// KafkaMember is a member of a consumer group.
type KafkaMember struct {
	MemberID string
	// InstanceID is the member's group.instance.id, empty for a dynamic
	// member.
	InstanceID string
	// Partitions are the partitions of topic assigned to the member, in
	// order, for the topic the group was described for.
	Partitions []int32
}

// InstanceIDs returns the instance ids of the group's members, sorted;
// dynamic members count as "".
func (g KafkaGroup) InstanceIDs() []string {
	ids := make([]string, 0, len(g.Members))
	for _, m := range g.Members {
		ids = append(ids, m.InstanceID)
	}
	slices.Sort(ids)
	return ids
}

// Assignment maps the instance id of each member (or its member id, for a
// dynamic member) to its partitions.
func (g KafkaGroup) Assignment() map[string][]int32 {
	a := make(map[string][]int32, len(g.Members))
	for _, m := range g.Members {
		id := m.InstanceID
		if id == "" {
			id = m.MemberID
		}
		a[id] = m.Partitions
	}
	return a
}

// KafkaGroups describes the consumer groups of a cluster, through a
// franz-go client that speaks whatever protocol version the broker offers
// (Sarama's DescribeGroups at the adapter's version 2.3 predates instance
// ids). It is safe for concurrent use.
type KafkaGroups struct {
	client *kgo.Client
}

// NewKafkaGroups connects to the cluster at brokers; the client closes
// when the test ends.
func NewKafkaGroups(t testing.TB, brokers []string) *KafkaGroups {
	t.Helper()
	client, err := kgo.NewClient(kgo.SeedBrokers(brokers...))
	require.NoError(t, err)
	t.Cleanup(client.Close)
	return &KafkaGroups{client: client}
}

// Describe asks group's coordinator for its state and members, with the
// partitions of topic each member is assigned, and fails the test if it
// cannot.
func (g *KafkaGroups) Describe(t testing.TB, group, topic string) KafkaGroup {
	t.Helper()
	d, err := g.Group(group, topic)
	require.NoError(t, err)
	return d
}

// Group is Describe for goroutines other than the test's: it returns the
// error.
func (g *KafkaGroups) Group(group, topic string) (KafkaGroup, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	req := kmsg.NewPtrDescribeGroupsRequest()
	req.Groups = []string{group}
	resp, err := req.RequestWith(ctx, g.client)
	if err != nil {
		return KafkaGroup{}, fmt.Errorf("describe group %s: %w", group, err)
	}
	if len(resp.Groups) != 1 {
		return KafkaGroup{}, fmt.Errorf("describe group %s: %d groups in the response", group, len(resp.Groups))
	}
	rg := resp.Groups[0]
	if err := kerr.ErrorForCode(rg.ErrorCode); err != nil {
		return KafkaGroup{}, fmt.Errorf("describe group %s: %w", group, err)
	}
	out := KafkaGroup{State: rg.State}
	for _, rm := range rg.Members {
		m := KafkaMember{MemberID: rm.MemberID}
		if rm.InstanceID != nil {
			m.InstanceID = *rm.InstanceID
		}
		if len(rm.MemberAssignment) > 0 {
			var a kmsg.ConsumerMemberAssignment
			if err := a.ReadFrom(rm.MemberAssignment); err != nil {
				return KafkaGroup{}, fmt.Errorf("describe group %s: assignment of %s: %w", group, rm.MemberID, err)
			}
			for _, at := range a.Topics {
				if at.Topic == topic {
					m.Partitions = append(m.Partitions, at.Partitions...)
				}
			}
			slices.Sort(m.Partitions)
		}
		out.Members = append(out.Members, m)
	}
	return out, nil
}

// Watch describes group every interval, in a goroutine of its own, and
// hands each answer to fn, until the returned stop is called (or the test
// ends); stop waits for the goroutine, and calling it again does nothing.
func (g *KafkaGroups) Watch(t testing.TB, group, topic string, every time.Duration, fn func(KafkaGroup, error)) (stop func()) {
	var (
		done    = make(chan struct{})
		stopped sync.WaitGroup
		once    sync.Once
	)
	stopped.Add(1)
	go func() {
		defer stopped.Done()
		for {
			select {
			case <-done:
				return
			case <-time.After(every):
			}
			fn(g.Group(group, topic))
		}
	}()
	stop = func() {
		once.Do(func() { close(done) })
		stopped.Wait()
	}
	t.Cleanup(stop)
	return stop
}
