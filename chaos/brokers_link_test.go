//go:build chaos

package chaos

// The chaos consumers run on every broker: they link every broker.
import _ "github.com/oncemill/oncemill/internal/allbrokers"
