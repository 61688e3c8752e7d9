package proctest

import (
	"os"
	"strings"
	"testing"
	"time"

	"github.com/oncemill/oncemill/adapters/kafka"
	"github.com/oncemill/oncemill/adapters/kafka/embedded"
)

// KafkaPartitions is the partition count of the topics of the broker that
// [StartKafka] starts.
const KafkaPartitions = 4

// kafkaRole is the embedded Kafka broker, which prints its addresses on
// its ready line and runs until SIGTERM.
var kafkaRole = NewRole("kafka", func(_ struct{}, term <-chan os.Signal) error {
	cluster, err := embedded.Start(embedded.Config{DefaultPartitions: KafkaPartitions, GroupMinSessionTimeout: time.Second})
	if err != nil {
		return Setup(err)
	}
	Ready(strings.Join(cluster.Addrs(), ","))
	<-term
	return cluster.Close()
})

// StartKafka runs the embedded Kafka broker in a child process and returns
// its addresses: consumers reach it over the network as they would a
// cluster, and killing one kills nothing of the broker. Its topics have
// KafkaPartitions partitions; it accepts session timeouts from 1s. It is
// stopped when the test ends.
func StartKafka(t testing.TB) []string {
	t.Helper()
	p := kafkaRole.Start(t, struct{}{})
	t.Cleanup(func() {
		if err := p.Terminate(10 * time.Second); err != nil {
			t.Errorf("Kafka broker process: %v", err)
		}
	})
	return strings.Split(p.Ready(), ",")
}

// KafkaCluster is the cluster named by ONCEMILL_KAFKA_BROKERS, which must
// accept 2s sessions (group.min.session.timeout.ms, as
// docker-compose.yml's does), else StartKafka's broker.
func KafkaCluster(t testing.TB) []string {
	t.Helper()
	if brokers := kafka.BrokersFromEnv(); len(brokers) > 0 {
		return brokers
	}
	return StartKafka(t)
}
