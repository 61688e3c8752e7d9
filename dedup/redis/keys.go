package redis

import (
	"fmt"
	"strings"

	"github.com/oncemill/oncemill/dedup"
)

// recordKey is <prefix>{<escaped consumer>}:<key>. The escaped consumer
// holds no '{' or '}', so the hash tag is exactly the consumer and the key
// can be read back after the first "}:".
func (s *Store) recordKey(k dedup.Key) string {
	return s.consumerPrefix(k.Consumer) + k.Key
}

func (s *Store) consumerPrefix(consumer string) string {
	return s.prefix + "{" + escapeConsumer(consumer) + "}:"
}

// escapeConsumer percent-encodes consumerSpecial. Escaping the escape byte
// makes it injective: two names never share an escaped form.
func escapeConsumer(c string) string {
	if !strings.ContainsAny(c, consumerSpecial) {
		return c
	}
	var b strings.Builder
	for i := 0; i < len(c); i++ {
		if strings.IndexByte(consumerSpecial, c[i]) >= 0 {
			fmt.Fprintf(&b, "%%%02X", c[i])
			continue
		}
		b.WriteByte(c[i])
	}
	return b.String()
}

// globEscape makes s match itself literally in a SCAN MATCH pattern.
func globEscape(s string) string {
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		switch s[i] {
		case '*', '?', '[', ']', '\\':
			b.WriteByte('\\')
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

// consumerSpecial are the bytes escaped in a consumer name: the escape byte
// itself, the hash tag's braces, and the glob metacharacters of SCAN MATCH,
// so that the hash tag of a SCAN pattern is the same as its keys'.
const consumerSpecial = `%{}*?[]\`
