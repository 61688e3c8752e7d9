package deduptest

import (
	"strings"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/delivery"
)

// txHandOutMark checks delivery.HandOutMarks: a partition without a mark
// reads -1; a mark only rises, whatever order its writes come in, also
// concurrent ones; each group, topic and partition has its own, long
// names included.
func txHandOutMark(t *testing.T, x txSubject) {
	m := need[delivery.HandOutMarks](t, x.s)
	ctx := t.Context()
	const group, topic = "deduptest-group", "orders"
	mark, err := m.InboxHandOutMark(ctx, group, topic, 3)
	require.NoError(t, err)
	require.Equal(t, int64(-1), mark, "no mark yet")

	for _, w := range []struct{ write, want int64 }{{0, 0}, {41, 41}, {17, 41}, {41, 41}, {1 << 40, 1 << 40}} {
		require.NoError(t, m.InboxMarkHandOut(ctx, group, topic, 3, w.write))
		mark, err = m.InboxHandOutMark(ctx, group, topic, 3)
		require.NoError(t, err)
		require.Equal(t, w.want, mark, "after a write of %d", w.write)
	}

	longGroup, longTopic := strings.Repeat("g", 300), strings.Repeat("t", 1100)
	for _, other := range []struct {
		group, topic string
		partition    int32
	}{{group, topic, 4}, {group, "refunds", 3}, {"other-group", topic, 3}, {longGroup, longTopic, 3}, {longGroup + "x", longTopic + "x", 3}} {
		mark, err := m.InboxHandOutMark(ctx, other.group, other.topic, other.partition)
		require.NoError(t, err)
		require.Equal(t, int64(-1), mark, "%.20s/%.20s/%d has a mark of its own", other.group, other.topic, other.partition)
	}
	require.NoError(t, m.InboxMarkHandOut(ctx, longGroup, longTopic, 3, 7))
	mark, err = m.InboxHandOutMark(ctx, longGroup, longTopic, 3)
	require.NoError(t, err)
	require.Equal(t, int64(7), mark)
	mark, err = m.InboxHandOutMark(ctx, longGroup+"x", longTopic+"x", 3)
	require.NoError(t, err)
	require.Equal(t, int64(-1), mark, "a long name is not cut: a longer one is another partition's")

	// Concurrent writers: the highest stays.
	var wg sync.WaitGroup
	errs := make([]error, copies)
	for i := range copies {
		wg.Go(func() { errs[i] = m.InboxMarkHandOut(ctx, group, "concurrent", 0, int64(i)) })
	}
	wg.Wait()
	for i, err := range errs {
		require.NoError(t, err, "writer %d", i)
	}
	mark, err = m.InboxHandOutMark(ctx, group, "concurrent", 0)
	require.NoError(t, err)
	require.Equal(t, int64(copies-1), mark)
}
