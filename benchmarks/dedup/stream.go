package main

import (
	"fmt"
	"math"
	"math/rand/v2"

	"github.com/oncemill/oncemill/benchmarks/internal/benchutil"
)

// msgSpec is one message of a generated stream: what a broker would hand to
// the consumer. A duplicate has a UUID of its own and the key and payload of
// an earlier message, as a producer's retry or a replay would.
type msgSpec struct {
	UUID    string
	Key     string
	Payload []byte
	// Dup is set on a later copy of an earlier key.
	Dup bool
}

// stream is a generated sequence of messages.
type stream struct {
	Msgs []msgSpec
	// Keys counts distinct keys; Dups counts the copies.
	Keys, Dups int
	// Ratio is the share of duplicates asked for.
	Ratio float64
}

// newStream generates n messages of which round(n×ratio) are duplicates
// (at most n-1: the first message is always new). The positions of the
// duplicates are drawn at random; each copies the key and payload of a key
// drawn uniformly from the distinct keys that came before it. The same n,
// ratio and seed always give the same stream, UUIDs included.
func newStream(n int, ratio float64, seed uint64) stream {
	rng := rand.New(rand.NewPCG(seed, math.Float64bits(ratio)))
	dups := min(int(math.Round(float64(n)*ratio)), max(n-1, 0))
	isDup := make([]bool, n)
	for _, p := range rng.Perm(max(n-1, 0))[:dups] {
		isDup[p+1] = true
	}
	s := stream{Msgs: make([]msgSpec, n), Ratio: ratio}
	var seen []int // positions of the first copy of every key so far
	for i := range s.Msgs {
		uuid := benchutil.SeededUUID(rng)
		if isDup[i] {
			orig := s.Msgs[seen[rng.IntN(len(seen))]]
			s.Msgs[i] = msgSpec{UUID: uuid, Key: orig.Key, Payload: orig.Payload, Dup: true}
			s.Dups++
			continue
		}
		key := fmt.Sprintf("order-%07d", s.Keys)
		payload := fmt.Sprintf(`{"order_id":%q,"customer":"c-%05d","amount_cents":%d,"currency":"EUR"}`,
			key, rng.IntN(100000), 100+rng.IntN(100000))
		s.Msgs[i] = msgSpec{UUID: uuid, Key: key, Payload: []byte(payload)}
		seen = append(seen, i)
		s.Keys++
	}
	return s
}
