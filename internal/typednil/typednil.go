// Package typednil tells a nil from an interface that holds a nil pointer,
// for the constructors that take a store, a pool or a publisher through an
// interface: a (*pgxpool.Pool)(nil) passed as one is not == nil, is
// accepted, and fails later in a nil-pointer panic on every message, which
// the router recovers in a hot loop.
package typednil

import "reflect"

// Is reports whether v is nil or an interface value holding a nil pointer,
// map, slice, channel or function.
func Is(v any) bool {
	if v == nil {
		return true
	}
	switch r := reflect.ValueOf(v); r.Kind() {
	case reflect.Pointer, reflect.Map, reflect.Slice, reflect.Chan, reflect.Func, reflect.Interface, reflect.UnsafePointer:
		return r.IsNil()
	}
	return false
}
