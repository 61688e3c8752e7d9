package main

import (
	"fmt"
	"math"
	"math/rand/v2"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/oncemill/oncemill/benchmarks/internal/benchutil"
	"github.com/oncemill/oncemill/delivery"
)

// payment is the JSON payload of an event: one payment towards an order.
// Seq numbers the order's payments from 1, in publish order, so that the
// effects table shows whether an order's payments were applied in order.
type payment struct {
	PaymentID   string `json:"payment_id"`
	OrderID     string `json:"order_id"`
	Seq         int    `json:"seq"`
	AmountCents int64  `json:"amount_cents"`
	Currency    string `json:"currency"`
}

// event is one message of a generated stream. Its idempotency key is the
// payment ID; its partition key, and so its Kafka record key, is the order
// ID. A duplicate has a UUID of its own and the metadata and payload of an
// earlier event, as a producer's retry would.
type event struct {
	UUID    string
	Key     string // idempotency key: the payment ID
	Order   string // partition key and record key: the order ID
	Seq     int
	Payload []byte
	// Dup is set on a later copy of an earlier event.
	Dup bool
}

// message returns a fresh Watermill message for e.
func (e event) message() *message.Message {
	m := message.NewMessage(e.UUID, e.Payload)
	m.Metadata.Set(delivery.IdempotencyKey, e.Key)
	m.Metadata.Set(delivery.PartitionKey, e.Order)
	return m
}

// stream is a generated sequence of events.
type stream struct {
	Events []event
	// Keys counts distinct idempotency keys (payments), Dups the copies,
	// Orders the distinct record keys that have at least one payment.
	Keys, Dups, Orders int
	// MaxSeq is the most payments any order has.
	MaxSeq int
}

// newStream generates n events over the given number of orders, of which
// round(n×ratio) are duplicates (at most n-1: the first event is always
// new). Each new payment goes to an order drawn uniformly and takes the
// order's next sequence number; the positions of the duplicates are drawn
// at random, and each copies a payment drawn uniformly from the new ones
// before it. The same arguments always give the same stream, UUIDs
// included.
func newStream(n, orders int, ratio float64, seed uint64) stream {
	rng := rand.New(rand.NewPCG(seed, uint64(orders)<<32|math.Float64bits(ratio)>>32))
	dups := min(int(math.Round(float64(n)*ratio)), max(n-1, 0))
	isDup := make([]bool, n)
	for _, p := range rng.Perm(max(n-1, 0))[:dups] {
		isDup[p+1] = true
	}
	s := stream{Events: make([]event, n)}
	seqs := make([]int, orders)
	var fresh []int // positions of the new payments so far
	for i := range s.Events {
		uuid := benchutil.SeededUUID(rng)
		if isDup[i] {
			orig := s.Events[fresh[rng.IntN(len(fresh))]]
			orig.UUID, orig.Dup = uuid, true
			s.Events[i] = orig
			s.Dups++
			continue
		}
		o := rng.IntN(orders)
		if seqs[o] == 0 {
			s.Orders++
		}
		seqs[o]++
		p := payment{
			PaymentID:   fmt.Sprintf("pay-%07d", s.Keys),
			OrderID:     fmt.Sprintf("order-%05d", o),
			Seq:         seqs[o],
			AmountCents: 100 + rng.Int64N(100000),
			Currency:    "EUR",
		}
		payload := fmt.Appendf(nil, `{"payment_id":%q,"order_id":%q,"seq":%d,"amount_cents":%d,"currency":%q}`,
			p.PaymentID, p.OrderID, p.Seq, p.AmountCents, p.Currency)
		s.Events[i] = event{UUID: uuid, Key: p.PaymentID, Order: p.OrderID, Seq: p.Seq, Payload: payload}
		s.MaxSeq = max(s.MaxSeq, p.Seq)
		fresh = append(fresh, i)
		s.Keys++
	}
	return s
}
