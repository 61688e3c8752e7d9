package forwarder

import (
	"testing"
	"time"
)

// TestStallWatchPace: rows waiting on a transaction younger than the
// interval are no stall; on an older one, one line per interval however
// often the relay checks; no line without waiting rows or a holder.
func TestStallWatchPace(t *testing.T) {
	const every, check = time.Second, 10 * time.Millisecond
	start := time.Unix(1_000_000, 0)
	held := func(age time.Duration) Lag {
		return Lag{Pending: 3, Waiting: 2, HeldBy: &Holder{PID: 42, Database: "reporting", Age: age}}
	}
	var s stallWatch
	for d := time.Duration(0); d < every; d += check {
		if s.stalled(start.Add(d), held(d), every) {
			t.Fatalf("a line for a transaction open for %s, younger than %s", d, every)
		}
	}
	var lines []time.Duration
	for d := every; d <= 5*every; d += check {
		if s.stalled(start.Add(d), held(d), every) {
			lines = append(lines, d)
		}
	}
	want := []time.Duration{every, 2 * every, 3 * every, 4 * every, 5 * every}
	if len(lines) != len(want) {
		t.Fatalf("lines at %v, want one per interval %v", lines, want)
	}
	for i := range want {
		if lines[i] != want[i] {
			t.Fatalf("lines at %v, want %v", lines, want)
		}
	}

	later := start.Add(time.Hour)
	if s.stalled(later, Lag{Pending: 3, HeldBy: &Holder{Age: time.Hour}}, every) {
		t.Fatal("a line with no row waiting")
	}
	if s.stalled(later, Lag{Pending: 3, Waiting: 3}, every) {
		t.Fatal("a line with no holder (it ended between the queries)")
	}
	if !s.stalled(later, held(time.Hour), every) {
		t.Fatal("no line for a new stall an hour after the last line")
	}
}
