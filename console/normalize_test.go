package console_test

import (
	"context"
	"database/sql"
	"math/rand/v2"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/console"
	"github.com/oncemill/oncemill/internal/testing/mysqltest"
	"github.com/oncemill/oncemill/internal/testing/pgtest"
	"github.com/oncemill/oncemill/internal/testing/sqltest"
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
	`json: cannot unmarshal string into Go struct field Order.amount of type int64`: `json: cannot unmarshal string into Go struct field Order.amount of type int64`,
	"value 300 overflows uint8, float32 and complex128":                             "value <n> overflows uint8, float32 and complex128",
	"int64(42) and int<n>": "int64(<n>) and int<n>",
	// Escaped quotes are inside their string; a string that ends in Z,
	// ] or ^ ends at its quote all the same.
	`malformed order "{\"id\":\"A-42\",\"tags\":[\"a\"]}": unexpected end`: `malformed order "<s>": unexpected end`,
	`key "a\"b" is dead`:                   `key "<s>" is dead`,
	`at "2026-03-01T10:00:00Z" for "A-42"`: `at "<s>" for "<s>"`,
	`tags "[a b]" and "x^" and "y"`:        `tags "<s>" and "<s>" and "<s>"`,
	`path "C:\\tmp\\x" not found`:          `path "<s>" not found`,
	`ZZ"q" ]"r" ^"s"`:                      `ZZ"<s>" ]"<s>" ^"<s>"`,
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

// normalizeCorpus is the cases that every database can store as text
// (no NUL, valid UTF-8), random text over an alphabet that the steps care
// about, and text around the 2000-character cut.
func normalizeCorpus() []string {
	corpus := []string{}
	for in := range normalizeCases {
		if !strings.ContainsAny(in, "\x00\xff") {
			corpus = append(corpus, in)
		}
	}
	alphabet := []rune("0123456789abcdefABCDEFxXgzZ-\"' \t\r\n:./_()[]^\\<>é日\u00a0\u2028")
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
	return append(corpus, strings.Repeat("1", 2500), strings.Repeat("é1", 1200), strings.Repeat(`"x"`, 800), "décodé 42 ĳ 日本 7\u2028 0xAb")
}

// textRows are the rows of a query of one text column, from pgx or
// database/sql.
type textRows interface {
	Next() bool
	Scan(dest ...any) error
	Err() error
}

// TestNormalizeErrorInSQL runs one corpus through NormalizeError and its
// SQL form in each dialect, which the console groups and filters by: they
// must agree on PostgreSQL, MariaDB and SQLite.
func TestNormalizeErrorInSQL(t *testing.T) {
	t.Parallel()
	corpus := normalizeCorpus()
	// stored keeps the corpus in a table corpus (i, s) of db, in a
	// transaction, a few hundred rows a statement.
	stored := func(t *testing.T, db *sql.DB, table, create string) {
		ctx := context.Background()
		_, err := db.ExecContext(ctx, create)
		require.NoError(t, err)
		tx, err := db.BeginTx(ctx, nil)
		require.NoError(t, err)
		for start := 0; start < len(corpus); start += 250 {
			end := min(start+250, len(corpus))
			args := []any{}
			for i := start; i < end; i++ {
				args = append(args, i, corpus[i])
			}
			values := strings.TrimSuffix(strings.Repeat("(?, ?), ", end-start), ", ")
			_, err := tx.ExecContext(ctx, `INSERT INTO `+table+` (i, s) VALUES `+values, args...)
			require.NoError(t, err)
		}
		require.NoError(t, tx.Commit())
	}
	for _, tc := range []struct {
		name string
		// normalized returns the SQL form's result for every text of
		// the corpus, in order.
		normalized func(t *testing.T) (textRows, error)
	}{
		{"postgres", func(t *testing.T) (textRows, error) {
			pool := pgtest.Pool(t, 2)
			rows, err := pool.Query(context.Background(), `SELECT `+console.NormalizeSQL("s")+` FROM unnest($1::text[]) WITH ORDINALITY AS u(s, i) ORDER BY i`, corpus)
			if err == nil {
				t.Cleanup(rows.Close)
			}
			return rows, err
		}},
		{"mariadb", func(t *testing.T) (textRows, error) {
			db, name := mysqltest.DB(t, 2)
			table := "`" + name + "`.corpus"
			stored(t, db, table, "CREATE TABLE "+table+" (i INT NOT NULL PRIMARY KEY, s LONGTEXT CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL)")
			rows, err := db.QueryContext(context.Background(), "SELECT "+console.NormalizeMySQL("s")+" FROM "+table+" ORDER BY i")
			if err == nil {
				t.Cleanup(func() { rows.Close() })
			}
			return rows, err
		}},
		{"sqlite", func(t *testing.T) (textRows, error) {
			db := sqltest.OpenSQLite(t, filepath.Join(t.TempDir(), "corpus.db"))
			stored(t, db, "corpus", `CREATE TABLE corpus (i INTEGER PRIMARY KEY, s TEXT NOT NULL)`)
			rows, err := db.QueryContext(context.Background(), `SELECT `+console.NormalizeSQLite("s")+` FROM corpus ORDER BY i`)
			if err == nil {
				t.Cleanup(func() { rows.Close() })
			}
			return rows, err
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			rows, err := tc.normalized(t)
			require.NoError(t, err)
			i := 0
			for ; rows.Next(); i++ {
				var got string
				require.NoError(t, rows.Scan(&got))
				require.Equal(t, console.NormalizeError(corpus[i]), got, "%q", corpus[i])
			}
			require.NoError(t, rows.Err())
			require.Equal(t, len(corpus), i)
		})
	}
}
