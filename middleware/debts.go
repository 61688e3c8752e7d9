package middleware

import (
	"context"
	"sync"
	"sync/atomic"

	"github.com/oncemill/oncemill/dedup"
)

// maxDebts bounds the keys whose counts an inbox remembers to take back;
// past it a count stays, which at worst dead-letters a message one
// outage early.
const maxDebts = 10000

// debts are the attempt counts that an inbox could not take back when it
// should have (the attempt ended through the infrastructure's fault or a
// shutdown, and the store did not answer the take-back, or a start broke
// after it was sent and may have been counted). Each is taken back before
// the key's next start, once the store answers again, so that outages in
// the middle of attempts never add up to a crash-loop dead letter. They
// live in memory: a process that dies during the outage leaves them
// counted. Safe for concurrent use; the zero value is empty.
type debts struct {
	n  atomic.Int64 // keys owed; read without the lock on every start
	mu sync.Mutex
	by map[dedup.Key]int
}

// owe notes one count of key to take back.
func (d *debts) owe(key dedup.Key) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.by == nil {
		d.by = make(map[dedup.Key]int)
	}
	if _, ok := d.by[key]; !ok {
		if len(d.by) >= maxDebts {
			return
		}
		d.n.Add(1)
	}
	d.by[key]++
}

// pay takes back what is owed for key, one count at a time. A take-back
// that fails leaves the rest owed, for the key's next start: the start
// goes ahead all the same, and fails by itself if the store is still
// down.
func (d *debts) pay(ctx context.Context, store dedup.TxStore, key dedup.Key) {
	if d.n.Load() == 0 {
		return
	}
	for {
		d.mu.Lock()
		owed := d.by[key]
		d.mu.Unlock()
		if owed == 0 || store.InboxUnstart(ctx, key) != nil {
			return
		}
		d.mu.Lock()
		if d.by[key]--; d.by[key] <= 0 {
			delete(d.by, key)
			d.n.Add(-1)
		}
		d.mu.Unlock()
	}
}
