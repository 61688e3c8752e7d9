package prom

import (
	"maps"
	"sync"
	"sync/atomic"
)

// cache maps label values to resolved series. It is read on every event
// and written once per new key, so reads are lock-free: the map is never
// changed once published, a write copies it under mu and publishes the
// copy. The number of keys is bounded by the labels' cardinality.
type cache[K comparable, V any] struct {
	mu sync.Mutex
	m  atomic.Pointer[map[K]V]
}

// load returns k's value, if it was added.
func (c *cache[K, V]) load(k K) (V, bool) {
	if m := c.m.Load(); m != nil {
		v, ok := (*m)[k]
		return v, ok
	}
	var zero V
	return zero, false
}

// add returns k's value. When k is missing, resolve is called, under the
// lock, with k and a function that adds entries: k's, which it must add,
// and any siblings worth creating with it. Entries already present are kept, so a value once
// returned for a key is the one returned ever after.
func (c *cache[K, V]) add(k K, resolve func(k K, set func(K, V))) V {
	c.mu.Lock()
	defer c.mu.Unlock()
	old := c.m.Load()
	if old != nil {
		if v, ok := (*old)[k]; ok {
			return v // added meanwhile
		}
	}
	next := make(map[K]V)
	if old != nil {
		maps.Copy(next, *old)
	}
	resolve(k, func(key K, v V) {
		if _, ok := next[key]; !ok {
			next[key] = v
		}
	})
	c.m.Store(&next)
	return next[k]
}
