package delivery_test

import (
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/delivery"
)

// TestBound: short values are kept; long ones become at most
// MaxBoundBytes of valid UTF-8 (a rune is never split), the same value
// always gives the same form, two values that share their prefix stay
// apart, and bounding a bounded value changes nothing.
func TestBound(t *testing.T) {
	t.Parallel()
	short := strings.Repeat("a", delivery.MaxBoundBytes)
	require.Equal(t, short, delivery.Bound(short))
	for _, long := range []string{strings.Repeat("é", 4096), strings.Repeat("x", 1<<20), "ab" + strings.Repeat("€", 300)} {
		b := delivery.Bound(long)
		require.LessOrEqual(t, len(b), delivery.MaxBoundBytes)
		require.True(t, utf8.ValidString(b))
		require.Contains(t, b, "…sha256:")
		require.Equal(t, b, delivery.Bound(long))
		require.Equal(t, b, delivery.Bound(b))
		require.NotEqual(t, b, delivery.Bound(long+"!"))
	}
}
