package keygate

import (
	"slices"
	"testing"
)

// TestQueuesKeepEachKeysOrder: a key's deliveries go one at a time, in the
// order they were pushed, the next only once the previous is done; keys go
// in the order they became ready; Remove and Clear take what is held.
func TestQueuesKeepEachKeysOrder(t *testing.T) {
	var q Queues[string, int]
	if _, ok := q.Next(); ok {
		t.Fatal("the zero value has a delivery to go")
	}
	keyOf := map[int]string{}
	push := func(k string, v int) {
		keyOf[v] = k
		q.Push(k, v)
	}
	for i, k := range []string{"a", "b", "a", "c", "a", "b"} {
		push(k, i)
	}
	take := func() (string, int) {
		t.Helper()
		v, ok := q.Next()
		if !ok {
			t.Fatal("nothing to go")
		}
		got := q.Take()
		if got != v {
			t.Fatalf("Take gave %d, Next said %d", got, v)
		}
		return keyOf[got], got
	}
	var order []int
	for range 3 {
		_, v := take()
		order = append(order, v)
	}
	if want := []int{0, 1, 3}; !slices.Equal(order, want) {
		t.Fatalf("first of each key %v, want %v", order, want)
	}
	if v, ok := q.Next(); ok {
		t.Fatalf("%d goes while every key has one out", v)
	}
	q.Done("b")
	q.Done("a")
	if k, v := take(); k != "b" || v != 5 {
		t.Fatalf("after b then a were done, %s's %d went, want b's 5", k, v)
	}
	if k, v := take(); k != "a" || v != 2 {
		t.Fatalf("then %s's %d, want a's 2", k, v)
	}
	q.Done("a")
	push("d", 6)
	if held := q.Remove("a"); !slices.Equal(held, []int{4}) {
		t.Fatalf("Remove(a) gave %v, want [4]", held)
	}
	if k, v := take(); k != "d" || v != 6 {
		t.Fatalf("after a's removal %s's %d went, want d's 6", k, v)
	}
	push("c", 7)
	push("e", 8)
	held := q.Clear()
	slices.Sort(held)
	if !slices.Equal(held, []int{7, 8}) {
		t.Fatalf("Clear gave %v, want [7 8]", held)
	}
	if v, ok := q.Next(); ok {
		t.Fatalf("%d goes after Clear", v)
	}
	q.Done("c")
	push("c", 9)
	if k, v := take(); k != "c" || v != 9 {
		t.Fatalf("after Clear and c's end, %s's %d went, want c's 9", k, v)
	}
}
