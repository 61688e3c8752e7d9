package keygate

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"
)

// TestPollAsksForTheRoomThereIs: Poll asks for every free place at once,
// frees the places of what did not arrive, asks again only once a held
// delivery is freed, backs off after a failure (doubling, then from the
// start after a success) and stops when its context ends.
func TestPollAsksForTheRoomThereIs(t *testing.T) {
	room := NewRoom(4)
	ctx, cancel := context.WithCancel(context.Background())
	var (
		mu      sync.Mutex
		asked   []int
		waits   []time.Duration
		asks    = make(chan int, 10)
		results = []struct {
			got int
			err error
		}{{got: 1}, {got: 3}, {err: errors.New("down")}, {err: errors.New("down")}, {got: 0}, {got: 1}}
	)
	done := make(chan struct{})
	go func() {
		defer close(done)
		Poll(ctx, room, func(n int) (int, error) {
			mu.Lock()
			defer mu.Unlock()
			i := len(asked)
			asked = append(asked, n)
			asks <- n
			if i >= len(results) {
				<-ctx.Done()
				return 0, nil
			}
			return results[i].got, results[i].err
		}, func(_ error, retryIn time.Duration) {
			mu.Lock()
			waits = append(waits, retryIn)
			mu.Unlock()
		}, Backoff{Min: time.Millisecond, Max: 3 * time.Millisecond})
	}()
	recv := func() int {
		select {
		case n := <-asks:
			return n
		case <-time.After(5 * time.Second):
			t.Fatal("no ask")
			return 0
		}
	}
	if n := recv(); n != 4 {
		t.Fatalf("first ask for %d, want the whole room, 4", n)
	}
	if n := recv(); n != 3 {
		t.Fatalf("second ask for %d, want 3 (one held)", n)
	}
	// All four places are held now: no ask until one is freed.
	select {
	case n := <-asks:
		t.Fatalf("asked for %d with no room", n)
	case <-time.After(50 * time.Millisecond):
	}
	room.Free(2)
	for i, want := range []int{2, 2, 2, 2} { // two failures, an empty answer, one that holds one
		if n := recv(); n != want {
			t.Fatalf("ask %d after the frees: %d, want %d", i, n, want)
		}
	}
	if n := recv(); n != 1 {
		t.Fatalf("last ask for %d, want 1", n)
	}
	cancel()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		t.Fatal("Poll did not return after its context ended")
	}
	mu.Lock()
	defer mu.Unlock()
	if len(waits) != 2 || waits[0] != time.Millisecond || waits[1] != 2*time.Millisecond {
		t.Fatalf("waits after the failures %v, want [1ms 2ms]", waits)
	}
}
