package keygate_test

import (
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/oncemill/oncemill/adapters/internal/keygate"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// item is what the tests add: a key and a sequence number within it.
type item struct {
	key string
	seq int
}

func (i item) String() string { return fmt.Sprintf("%s/%d", i.key, i.seq) }

// recorder collects what the hooks were called with.
type recorder struct {
	mu        sync.Mutex
	settled   map[string]bool // by item, acked
	released  []string
	abandoned []string
}

func newRecorder() *recorder { return &recorder{settled: map[string]bool{}} }

func (r *recorder) hooks(releaseBehindNack bool) keygate.Hooks[item] {
	return keygate.Hooks[item]{
		Settled: func(v item, acked bool) {
			r.mu.Lock()
			defer r.mu.Unlock()
			r.settled[v.String()] = acked
		},
		Release: func(vs []item) {
			r.mu.Lock()
			defer r.mu.Unlock()
			for _, v := range vs {
				r.released = append(r.released, v.String())
			}
		},
		Abandoned: func(v item) {
			r.mu.Lock()
			defer r.mu.Unlock()
			r.abandoned = append(r.abandoned, v.String())
		},
		ReleaseBehindNack: releaseBehindNack,
	}
}

func (r *recorder) snapshot() (settled map[string]bool, released, abandoned []string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	settled = map[string]bool{}
	for k, v := range r.settled {
		settled[k] = v
	}
	released = slices.Clone(r.released)
	abandoned = slices.Clone(r.abandoned)
	slices.Sort(released)
	slices.Sort(abandoned)
	return settled, released, abandoned
}

func add(g *keygate.Gate[item], key string, seq int) *message.Message {
	msg := message.NewMessage(fmt.Sprintf("%s/%d", key, seq), nil)
	g.Add(key, msg, item{key: key, seq: seq})
	return msg
}

func receive(t *testing.T, out <-chan *message.Message) *message.Message {
	t.Helper()
	select {
	case msg, ok := <-out:
		require.True(t, ok, "output channel closed")
		return msg
	case <-time.After(5 * time.Second):
		t.Fatal("no message handed out within 5s")
		return nil
	}
}

func nothingWithin(t *testing.T, out <-chan *message.Message, d time.Duration) {
	t.Helper()
	select {
	case msg := <-out:
		t.Fatalf("handed out %s, want nothing", msg.UUID)
	case <-time.After(d):
	}
}

// TestOrderPerKeyConcurrently: 20 keys of 5 deliveries each, added
// interleaved, and 10 without a key, handled as Watermill's router does (a
// goroutine per message) by a handler that sleeps a little: every key's
// deliveries are handled in the order added, never two of a key at once,
// never more than the limit at once, and more than one at once.
func TestOrderPerKeyConcurrently(t *testing.T) {
	const keys, perKey, keyless, limit = 20, 5, 10, 8
	out := make(chan *message.Message)
	rec := newRecorder()
	g := keygate.New(out, limit, rec.hooks(false))

	var (
		mu          sync.Mutex
		order       = map[string][]string{}
		running     int
		maxRunning  int
		runningKeys = map[string]int{}
		sameKey     []string
		wg          sync.WaitGroup
	)
	handled := make(chan struct{})
	go func() {
		defer close(handled)
		for msg := range out {
			wg.Add(1)
			go func() {
				defer wg.Done()
				key := msg.Metadata.Get("key")
				mu.Lock()
				running++
				maxRunning = max(maxRunning, running)
				if key != "" {
					runningKeys[key]++
					if runningKeys[key] > 1 {
						sameKey = append(sameKey, msg.UUID)
					}
					order[key] = append(order[key], msg.UUID)
				}
				mu.Unlock()
				time.Sleep(2 * time.Millisecond)
				mu.Lock()
				running--
				if key != "" {
					runningKeys[key]--
				}
				mu.Unlock()
				msg.Ack()
			}()
		}
	}()

	for seq := 1; seq <= perKey; seq++ {
		for k := range keys {
			key := fmt.Sprintf("k%02d", k)
			msg := message.NewMessage(fmt.Sprintf("%s/%d", key, seq), nil)
			msg.Metadata.Set("key", key)
			g.Add(key, msg, item{key: key, seq: seq})
		}
		for i := range keyless / perKey {
			msg := message.NewMessage(fmt.Sprintf("own-%d-%d", seq, i), nil)
			g.Add("", msg, item{key: "", seq: seq*100 + i})
		}
	}
	require.Eventually(t, func() bool {
		settled, _, _ := rec.snapshot()
		return len(settled) == keys*perKey+keyless
	}, 10*time.Second, 5*time.Millisecond)
	require.Equal(t, 0, g.Close(time.Second))
	<-handled
	wg.Wait()

	settled, released, abandoned := rec.snapshot()
	for k, acked := range settled {
		require.True(t, acked, "%s settled as acked", k)
	}
	require.Empty(t, released)
	require.Empty(t, abandoned)
	require.Empty(t, sameKey, "deliveries handled while another of their key ran")
	require.Len(t, order, keys)
	for key, got := range order {
		want := make([]string, perKey)
		for i := range want {
			want[i] = fmt.Sprintf("%s/%d", key, i+1)
		}
		require.Equal(t, want, got, "key %s in the order added", key)
	}
	require.LessOrEqual(t, maxRunning, limit, "in flight at once")
	require.Greater(t, maxRunning, 1, "in flight at once")
	t.Logf("%d keys × %d and %d keyless: at most %d in flight at once (limit %d)", keys, perKey, keyless, maxRunning, limit)
}

// TestNackHandsOutNext: by default a nacked message frees its key, whose
// next delivery is handed out; nothing is given back.
func TestNackHandsOutNext(t *testing.T) {
	out := make(chan *message.Message)
	rec := newRecorder()
	g := keygate.New(out, 4, rec.hooks(false))
	add(g, "a", 1)
	add(g, "a", 2)
	first := receive(t, out)
	require.Equal(t, "a/1", first.UUID)
	nothingWithin(t, out, 50*time.Millisecond)
	first.Nack()
	second := receive(t, out)
	require.Equal(t, "a/2", second.UUID)
	second.Ack()
	require.Eventually(t, func() bool { s, _, _ := rec.snapshot(); return len(s) == 2 }, 5*time.Second, time.Millisecond)
	require.Equal(t, 0, g.Close(time.Second))
	settled, released, abandoned := rec.snapshot()
	require.Equal(t, map[string]bool{"a/1": false, "a/2": true}, settled)
	require.Empty(t, released)
	require.Empty(t, abandoned)
}

// TestReleaseBehindNack: with ReleaseBehindNack a nack gives back the
// deliveries of its key held behind it, and other keys go on.
func TestReleaseBehindNack(t *testing.T) {
	out := make(chan *message.Message)
	rec := newRecorder()
	g := keygate.New(out, 1, rec.hooks(true))
	add(g, "a", 1)
	add(g, "a", 2)
	add(g, "b", 1)
	add(g, "a", 3)
	first := receive(t, out)
	require.Equal(t, "a/1", first.UUID)
	nothingWithin(t, out, 50*time.Millisecond) // the limit is 1
	first.Nack()
	next := receive(t, out)
	require.Equal(t, "b/1", next.UUID, "a's later deliveries are given back, not handed out")
	next.Ack()
	require.Eventually(t, func() bool { _, r, _ := rec.snapshot(); return len(r) == 2 }, 5*time.Second, time.Millisecond)
	// A delivery of the key added after the nack is handed out.
	add(g, "a", 4)
	later := receive(t, out)
	require.Equal(t, "a/4", later.UUID)
	later.Ack()
	require.Eventually(t, func() bool { s, _, _ := rec.snapshot(); return len(s) == 3 }, 5*time.Second, time.Millisecond)
	require.Equal(t, 0, g.Close(time.Second))
	settled, released, abandoned := rec.snapshot()
	require.Equal(t, map[string]bool{"a/1": false, "b/1": true, "a/4": true}, settled)
	require.Equal(t, []string{"a/2", "a/3"}, released)
	require.Empty(t, abandoned)
}

// TestCloseDrains: Close closes the output channel, gives back what was
// never handed out, waits for a handler that acks within the drain and
// abandons one that does not; Add after Close gives back at once.
func TestCloseDrains(t *testing.T) {
	out := make(chan *message.Message)
	rec := newRecorder()
	g := keygate.New(out, 2, rec.hooks(false))
	add(g, "a", 1)
	add(g, "b", 1)
	add(g, "a", 2)
	add(g, "c", 1)
	slow := receive(t, out)
	late := receive(t, out)
	require.Equal(t, []string{"a/1", "b/1"}, []string{slow.UUID, late.UUID})
	go func() {
		time.Sleep(20 * time.Millisecond)
		late.Ack()
	}()
	start := time.Now()
	abandoned := g.Close(300 * time.Millisecond)
	took := time.Since(start)
	require.Equal(t, 1, abandoned)
	require.GreaterOrEqual(t, took, 300*time.Millisecond, "waited for the drain")
	_, open := <-out
	require.False(t, open, "output channel closed")
	add(g, "d", 1)
	settled, released, abandonedItems := rec.snapshot()
	require.Equal(t, map[string]bool{"b/1": true}, settled)
	require.Equal(t, []string{"a/2", "c/1", "d/1"}, released)
	require.Equal(t, []string{"a/1"}, abandonedItems)
	require.Equal(t, 0, g.Close(time.Second), "a second Close")
	slow.Ack() // too late: nothing watches it
}

// TestCloseWaitsForAcks: Close returns as soon as the handlers in flight
// have acked, well before the drain time.
func TestCloseWaitsForAcks(t *testing.T) {
	out := make(chan *message.Message)
	rec := newRecorder()
	g := keygate.New(out, 2, rec.hooks(false))
	add(g, "a", 1)
	msg := receive(t, out)
	go func() {
		time.Sleep(20 * time.Millisecond)
		msg.Ack()
	}()
	start := time.Now()
	require.Equal(t, 0, g.Close(time.Minute))
	require.Less(t, time.Since(start), 10*time.Second)
	settled, _, _ := rec.snapshot()
	require.Equal(t, map[string]bool{"a/1": true}, settled)
}
