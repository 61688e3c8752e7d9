package kafka_test

import (
	"fmt"
	"math/rand/v2"
	"testing"

	"github.com/IBM/sarama"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/oncemill/oncemill/adapters/kafka"
)

// TestKeyPartitionerMatchesKafka: the partitioner agrees with franz-go's
// default (which follows the Java client's: murmur2, masked positive,
// modulo n), so producers of either put a key in the same partition.
func TestKeyPartitionerMatchesKafka(t *testing.T) {
	ours := kafka.NewKeyPartitioner("t")
	theirs := kgo.StickyKeyPartitioner(nil).ForTopic("t")
	require.True(t, ours.RequiresConsistency())

	rng := rand.New(rand.NewPCG(1, 2))
	keys := [][]byte{{}, []byte("a"), []byte("ab"), []byte("abc"), []byte("abcd"), []byte("order-42")}
	for range 2000 {
		k := make([]byte, rng.IntN(40))
		for i := range k {
			k[i] = byte(rng.Uint32())
		}
		keys = append(keys, k)
	}
	for _, n := range []int{1, 2, 3, 4, 7, 16, 50, 1000} {
		for _, k := range keys {
			got, err := ours.Partition(&sarama.ProducerMessage{Key: sarama.ByteEncoder(k)}, int32(n))
			require.NoError(t, err)
			require.Equal(t, theirs.Partition(&kgo.Record{Key: k}, n), int(got), "key %x, %d partitions", k, n)
		}
	}
}

// TestKeyPartitionerJavaVectors checks partitions against the Java
// client's murmur2 test vectors (UtilsTest.testMurmur2), through the
// partition a big partition count yields: (h & 0x7fffffff) % n with
// n = 2^31-1 is h & 0x7fffffff unless that equals n.
func TestKeyPartitionerJavaVectors(t *testing.T) {
	for key, h := range map[string]int32{
		"21":                         -973932308,
		"foobar":                     -790332482,
		"a-little-bit-long-string":   -985981536,
		"a-little-bit-longer-string": -1486304829,
		"lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8": -58897971,
		"abc": 479470107,
	} {
		t.Run(fmt.Sprint(key), func(t *testing.T) {
			const n = 1<<31 - 1
			got, err := kafka.NewKeyPartitioner("t").Partition(&sarama.ProducerMessage{Key: sarama.StringEncoder(key)}, n)
			require.NoError(t, err)
			require.Equal(t, int32(uint32(h)&0x7fffffff%n), got)
		})
	}
}

func TestKeyPartitionerNullKey(t *testing.T) {
	p, err := kafka.NewKeyPartitioner("t").Partition(&sarama.ProducerMessage{}, 5)
	require.NoError(t, err)
	require.GreaterOrEqual(t, p, int32(0))
	require.Less(t, p, int32(5))
}
