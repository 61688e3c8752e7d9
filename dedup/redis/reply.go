package redis

import (
	"fmt"
	"time"
)

func millis(d time.Duration) int64 {
	ms := d.Milliseconds()
	if ms < 1 {
		ms = 1
	}
	return ms
}

// reply reads a script's array reply; the first error sticks, and a
// missing or mistyped field reads as its zero value.
type reply struct {
	vals []any
	err  error
}

// fields wraps vals, which must hold at least n fields.
func fields(vals []any, n int) *reply {
	r := &reply{vals: vals}
	if len(vals) < n {
		r.fail(fmt.Errorf("script reply %v has %d fields, want at least %d", vals, len(vals), n))
	}
	return r
}

func (r *reply) fail(err error) {
	if r.err == nil {
		r.err = err
	}
}

func (r *reply) at(i int) any {
	if i >= len(r.vals) {
		return nil
	}
	return r.vals[i]
}

func (r *reply) str(i int) string {
	s, ok := r.at(i).(string)
	if !ok {
		r.fail(fmt.Errorf("script reply field %d is %T, not a string", i, r.at(i)))
	}
	return s
}

func (r *reply) int(i int) int64 {
	n, ok := r.at(i).(int64)
	if !ok {
		r.fail(fmt.Errorf("script reply field %d is %T, not an integer", i, r.at(i)))
	}
	return n
}

// time returns field i, Unix milliseconds, as a time; 0 is the zero time.
func (r *reply) time(i int) time.Time {
	ms := r.int(i)
	if ms == 0 {
		return time.Time{}
	}
	return time.UnixMilli(ms)
}

// bytes returns field i as bytes, or nil when it is absent or nil.
func (r *reply) bytes(i int) []byte {
	v := r.at(i)
	if v == nil {
		return nil
	}
	s, ok := v.(string)
	if !ok {
		r.fail(fmt.Errorf("script reply field %d is %T, not a string", i, v))
	}
	return []byte(s)
}
