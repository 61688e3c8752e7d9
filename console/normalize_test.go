package console_test

import (
	"context"
	"math/rand/v2"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/console"
	"github.com/oncemill/oncemill/internal/testing/pgtest"
)

var normalizeCases = map[string]string{
	"order 123 not found":                                 "order <n> not found",
	"Card DECLINED by issuer":                             "Card DECLINED by issuer",
	"lock 0c8f9a4e-51f2-4b8e-9a0d-3c7e5d2b1a90 is held":   "lock <uuid> is held",
	"LOCK 0C8F9A4E-51F2-4B8E-9A0D-3C7E5D2B1A90":           "LOCK <uuid>",
	`key "A-42" is dead`:                                  `key "<s>" is dead`,
	`user "" unknown`:                                     `user "<s>" unknown`,
	`unclosed "quote 12`:                                  `unclosed "quote <n>`,
	"trace 4bf92f3577b34da6a3ce929d0e0e4736 failed":       "trace <hex> failed",
	"sha deadbeef12 and 12deadbeef":                       "sha <hex> and <hex>",
	"fault at 0xc000012345":                               "fault at <hex>",
	"deadline exceeded after 1.5s":                        "deadline exceeded after <n>.<n>s",
	"dial tcp 10.0.0.5:5432: connect: connection refused": "dial tcp <n>.<n>.<n>.<n>:<n>: connect: connection refused",
	"http2 stream 5 reset":                                "http<n> stream <n> reset",
	"panic: boom\n\ngoroutine 7 [running]:\nmain.f(0xc000012345)\n\t/src/main.go:12 +0x1d": "panic: boom goroutine <n> [running]: main.f(<hex>) /src/main.go:<n> +<hex>",
	"  padded\r\n":      "padded",
	"":                  "<empty>",
	" \t\n ":            "<empty>",
	"bad \xff byte":     "bad \uFFFD byte",
	"nul \x00 char":     "nul \uFFFD char",
	"décodé 42 ĳ 日本 7":  "décodé <n> ĳ 日本 <n>",
	"facade and decade": "facade and decade",
}

func TestNormalizeError(t *testing.T) {
	t.Parallel()
	for in, want := range normalizeCases {
		require.Equal(t, want, console.NormalizeError(in), "%q", in)
		require.Equal(t, want, console.NormalizeError(want), "a group is its own group: %q", want)
	}
	long := console.NormalizeError(strings.Repeat("x", 5000))
	require.Equal(t, strings.Repeat("x", 300), long, "cut at 300 characters")
	require.Equal(t, strings.Repeat("é", 300), console.NormalizeError(strings.Repeat("é", 301)), "characters, not bytes")
	require.Equal(t, strings.Repeat("x", 2000)[:300], console.NormalizeError(strings.Repeat("x", 2000)+" 1 2 3"))
	// Only the first 2000 characters count.
	require.Equal(t, console.NormalizeError(strings.Repeat("y ", 1000)+"tail one"), console.NormalizeError(strings.Repeat("y ", 1000)+"tail two"))
}

// TestNormalizeErrorInSQL runs a corpus through NormalizeError and its SQL
// form, which the console groups and filters by: they must agree.
func TestNormalizeErrorInSQL(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t, 2)
	corpus := []string{}
	for in := range normalizeCases {
		if !strings.ContainsAny(in, "\x00\xff") { // text PostgreSQL can store
			corpus = append(corpus, in)
		}
	}
	// Random text over an alphabet that the steps care about.
	alphabet := []rune("0123456789abcdefABCDEFxXgz-\"' \t\r\n:./_()[]<>é日\u00a0\u2028")
	rng := rand.New(rand.NewPCG(1, 2))
	for i := 0; i < 3000; i++ {
		n := rng.IntN(60)
		if i%100 == 0 {
			n = 1990 + rng.IntN(40) // around the 2000-character cut
		}
		var b strings.Builder
		for j := 0; j < n; j++ {
			if rng.IntN(20) == 0 {
				b.WriteString("0c8f9a4e-51f2-4b8e-9a0d-3c7e5d2b1a90")
				continue
			}
			b.WriteRune(alphabet[rng.IntN(len(alphabet))])
		}
		corpus = append(corpus, b.String())
	}
	corpus = append(corpus, strings.Repeat("1", 2500), strings.Repeat("é1", 1200), strings.Repeat(`"x"`, 800))

	rows, err := pool.Query(context.Background(), `SELECT `+console.NormalizeSQL("s")+` FROM unnest($1::text[]) WITH ORDINALITY AS u(s, i) ORDER BY i`, corpus)
	require.NoError(t, err)
	i := 0
	for rows.Next() {
		var got string
		require.NoError(t, rows.Scan(&got))
		require.Equal(t, console.NormalizeError(corpus[i]), got, "%q", corpus[i])
		i++
	}
	require.NoError(t, rows.Err())
	require.Equal(t, len(corpus), i)
}
