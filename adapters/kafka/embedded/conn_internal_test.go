package embedded

import (
	"encoding/binary"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestFramesSplitAnywhere: frames counts size-prefixed frames however the
// stream is cut, an empty frame included.
func TestFramesSplitAnywhere(t *testing.T) {
	var stream []byte
	for _, size := range []int{5, 0, 300, 1} {
		stream = binary.BigEndian.AppendUint32(stream, uint32(size))
		stream = append(stream, make([]byte, size)...)
	}
	for chunk := 1; chunk <= len(stream); chunk++ {
		var f frames
		for b := stream; len(b) > 0; {
			k := min(chunk, len(b))
			f.add(b[:k])
			b = b[k:]
		}
		require.Equal(t, 4, f.n, "chunks of %d bytes", chunk)
		require.Zero(t, f.left, "chunks of %d bytes", chunk)
		require.Zero(t, f.got, "chunks of %d bytes", chunk)
	}
	var f frames
	f.add(stream[:len(stream)-1])
	require.Equal(t, 3, f.n, "the last frame is not complete")
}
