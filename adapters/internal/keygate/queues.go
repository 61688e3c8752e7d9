package keygate

// Queues holds deliveries by ordering key, each key's in the order they
// were pushed, and says which may go next: the head of a key with no
// delivery out, keys taken in the order they became ready. It is the
// bookkeeping of per-key order that [Gate] and the Kafka partition share;
// it is not safe for concurrent use, its owner's goroutine alone touches
// it. The zero value is ready to use.
type Queues[K comparable, T any] struct {
	held    map[K][]T
	out     map[K]bool // keys with a delivery out
	ready   []K        // keys not out with held deliveries, in the order they became so
	inReady map[K]bool
}

// Push holds v behind k's deliveries.
func (q *Queues[K, T]) Push(k K, v T) {
	if q.held == nil {
		q.held, q.out, q.inReady = map[K][]T{}, map[K]bool{}, map[K]bool{}
	}
	q.held[k] = append(q.held[k], v)
	q.markReady(k)
}

// Next returns the delivery that goes next, without taking it; ok is
// false when no key is ready.
func (q *Queues[K, T]) Next() (v T, ok bool) {
	if len(q.ready) == 0 {
		return v, false
	}
	return q.held[q.ready[0]][0], true
}

// Take takes the delivery that goes next (the caller has checked Next)
// and marks its key out until Done.
func (q *Queues[K, T]) Take() T {
	k := q.ready[0]
	q.ready = q.ready[1:]
	delete(q.inReady, k)
	h := q.held[k]
	v := h[0]
	if len(h) == 1 {
		delete(q.held, k)
	} else {
		var zero T
		h[0] = zero
		q.held[k] = h[1:]
	}
	q.out[k] = true
	return v
}

// Done ends k's delivery out: k's next one may go.
func (q *Queues[K, T]) Done(k K) {
	delete(q.out, k)
	q.markReady(k)
}

// Remove takes and returns the deliveries held for k.
func (q *Queues[K, T]) Remove(k K) []T {
	h := q.held[k]
	delete(q.held, k)
	if q.inReady[k] {
		delete(q.inReady, k)
		for i, r := range q.ready {
			if r == k {
				q.ready = append(q.ready[:i], q.ready[i+1:]...)
				break
			}
		}
	}
	return h
}

// Clear takes and returns every delivery held, in no particular order.
func (q *Queues[K, T]) Clear() []T {
	var all []T
	for _, h := range q.held {
		all = append(all, h...)
	}
	clear(q.held)
	clear(q.inReady)
	q.ready = nil
	return all
}

func (q *Queues[K, T]) markReady(k K) {
	if q.out[k] || q.inReady[k] || len(q.held[k]) == 0 {
		return
	}
	q.ready = append(q.ready, k)
	q.inReady[k] = true
}
