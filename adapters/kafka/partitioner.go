package kafka

import (
	"fmt"

	"github.com/IBM/sarama"
)

// NewKeyPartitioner returns a Sarama partitioner, for
// sarama.Config.Producer.Partitioner, that picks a record's partition the
// way the Java client's default partitioner and franz-go's do for a keyed
// record: murmur2 of the key, made positive, modulo the partition count.
// Producers in other languages thus put a key in the same partition as
// this package does. A record with a null key gets a partition at random;
// the [Marshaler] never produces one.
//
// Sarama's own hash partitioner uses FNV-1a, which would spread the same
// keys differently.
func NewKeyPartitioner(topic string) sarama.Partitioner {
	return keyPartitioner{random: sarama.NewRandomPartitioner(topic)}
}

type keyPartitioner struct {
	random sarama.Partitioner
}

func (p keyPartitioner) Partition(msg *sarama.ProducerMessage, numPartitions int32) (int32, error) {
	if msg.Key == nil {
		return p.random.Partition(msg, numPartitions)
	}
	key, err := msg.Key.Encode()
	if err != nil {
		return -1, fmt.Errorf("kafka: encode record key: %w", err)
	}
	return int32((murmur2(key) & 0x7fffffff) % uint32(numPartitions)), nil
}

// RequiresConsistency reports true: a key must always map to the same
// partition, so Sarama does not move records of an unavailable partition.
func (keyPartitioner) RequiresConsistency() bool { return true }

// murmur2 is Kafka's variant of MurmurHash2 (org.apache.kafka.common.
// utils.Utils.murmur2), seed 0x9747b28c.
func murmur2(data []byte) uint32 {
	const (
		seed = 0x9747b28c
		m    = 0x5bd1e995
		r    = 24
	)
	n := len(data)
	h := uint32(seed) ^ uint32(n)
	for i := 0; i+4 <= n; i += 4 {
		k := uint32(data[i]) | uint32(data[i+1])<<8 | uint32(data[i+2])<<16 | uint32(data[i+3])<<24
		k *= m
		k ^= k >> r
		k *= m
		h *= m
		h ^= k
	}
	tail := data[n&^3:]
	switch len(tail) {
	case 3:
		h ^= uint32(tail[2]) << 16
		fallthrough
	case 2:
		h ^= uint32(tail[1]) << 8
		fallthrough
	case 1:
		h ^= uint32(tail[0])
		h *= m
	}
	h ^= h >> 13
	h *= m
	h ^= h >> 15
	return h
}
