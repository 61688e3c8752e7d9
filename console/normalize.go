package console

import (
	"regexp"
	"slices"
	"strconv"
	"strings"
	"unicode/utf8"

	"github.com/oncemill/oncemill/internal/sqldb"
)

// Grouping dead letters by error.
//
// NormalizeError is implemented twice, in Go and as one SQL expression over
// the error column (normalizeSQL), and the two agree on every text the
// dead-letter table can hold (valid UTF-8 without NUL): each step is a
// regular expression without alternation, anchors or word boundaries, made
// of ASCII classes, greedy quantifiers and literals, on which RE2's
// leftmost-first and PostgreSQL's leftmost-longest matching give the same
// matches; a test runs a corpus through both.
//
// The SQL form is what the console uses (MySQL's and MariaDB's engines, and
// SQLite's function, match leftmost-first as RE2 does): the groups are
// counted by the database (GROUP BY over the expression, with the list's filters), and a
// group filters the list in the WHERE clause, with LIMIT and OFFSET, so that
// neither a page nor the group table ever brings more than its own rows out
// of the database, and never a payload.

const (
	// groupInput is how many characters of an error count for its group:
	// the rest (the bottom of a stack trace, say) does not split groups.
	groupInput = 2000
	// groupMax is the longest group text, in characters.
	groupMax = 300
	// emptyGroup is the group of entries with no error text.
	emptyGroup = "<empty>"
)

// quoteMark is the marker the string steps put between a Z, ] or ^ and
// a quote after it.
const quoteMark = "<q>"

// normalizer is one step: every match of pattern becomes repl.
type normalizer struct {
	pattern, repl string
	re            *regexp.Regexp
}

func step(pattern, repl string) normalizer {
	return normalizer{pattern: pattern, repl: repl, re: regexp.MustCompile(pattern)}
}

// normalizers are the steps, in order. The patterns hold no quote or
// backslash, so that they read the same as SQL string literals whatever
// standard_conforming_strings says; the whitespace class holds a real tab,
// carriage return and line feed.
var normalizers = slices.Concat(keepTypeNames(true), []normalizer{
	// UUIDs.
	step(`[0-9A-Fa-f]{8}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{12}`, `<uuid>`),
	// Double-quoted strings (Go's %q: keys, ids, names), with their
	// escaped quotes: `"{\"id\":\"A-42\"}"` is one string, not three. A
	// pattern holds no backslash, so an escape is a run of the class
	// [Z-^] (Z, [, \, ], ^: no class names the backslash alone in every
	// database's engine without one, and MySQL's reads a [ in a class as
	// a class) followed by any character (any but \x01, which no class
	// leaves out otherwise). A string that ends in Z, ] or ^ (a time in
	// UTC, say) would then run on past its closing quote: the first steps
	// put a marker between such a character and the quote, and the step
	// after the strings takes the markers out. What is left to chance is
	// a string that ends in [ or in an escaped backslash (\\"), which
	// runs on to the next quote.
	step(`Z"`, `Z`+quoteMark+`"`),
	step(`]"`, `]`+quoteMark+`"`),
	step(`[Z^]"`, `^`+quoteMark+`"`),
	step(`"[^"Z-^]*([Z-^]+[^`+"\x01"+`][^"Z-^]*)*"`, `"<s>"`),
	step(quoteMark, ``),
	// 0x hex numbers (addresses in a panic's stack).
	step(`0[xX][0-9A-Fa-f]+`, `<hex>`),
	// Runs of hex digits with a letter before a digit, then with a digit
	// before a letter: ids, hashes, trace ids. Each is spelt from the
	// first letter (digit) and the first digit (letter) after it, which
	// matches what [0-9A-Fa-f]*[A-Fa-f][0-9A-Fa-f]*[0-9][0-9A-Fa-f]* does
	// without its cubic backtracking: MySQL's and MariaDB's engines
	// backtrack, and a corpus with runs of a few thousand digits took
	// MariaDB over a minute.
	step(`[0-9]*[A-Fa-f][A-Fa-f]*[0-9][0-9A-Fa-f]*`, `<hex>`),
	step(`[A-Fa-f]*[0-9][0-9]*[A-Fa-f][0-9A-Fa-f]*`, `<hex>`),
	// Decimal numbers.
	step(`[0-9]+`, `<n>`),
	// Runs of whitespace, line breaks included.
	step("[ \t\r\n]+", " "),
}, keepTypeNames(false))

// typeNames are the Go type names with digits in them ("cannot unmarshal
// string into int64"), which name a type, not a figure that varies: the
// decimal step must not make them int<n>. uint8 … uint64 contain int8 …
// int64.
var typeNames = []string{"int8", "int16", "int32", "int64", "float32", "float64", "complex64", "complex128"}

// keepTypeNames returns the steps that hide each type name's digits
// behind a spelling without digits (before, true) and bring them back
// (after, false). The steps replace literal text only, so that the SQL
// form stays as simple as the others: a backreference would read
// differently in each database.
func keepTypeNames(before bool) []normalizer {
	digits := []string{"ZERO", "ONE", "TWO", "THREE", "FOUR", "FIVE", "SIX", "SEVEN", "EIGHT", "NINE"}
	steps := make([]normalizer, 0, len(typeNames))
	for _, name := range typeNames {
		i := strings.IndexAny(name, "0123456789")
		hidden := name[:i]
		for _, d := range name[i:] {
			hidden += digits[d-'0']
		}
		if before {
			steps = append(steps, step(name, hidden))
		} else {
			steps = append(steps, step(hidden, name))
		}
	}
	return steps
}

// NormalizeError returns the group of a dead letter's error text: the text
// with the parts that vary between occurrences of one failure replaced by
// placeholders, so that "order 123 not found" and "order 456 not found"
// fall in one group, "order <n> not found". In order:
//
//   - UUIDs become <uuid>;
//   - double-quoted strings become "<s>", the quotes escaped with a
//     backslash in them included;
//   - 0x numbers, and runs of hex digits that mix letters and digits
//     (hashes, trace ids), become <hex>;
//   - decimal numbers become <n>, except in Go's sized type names
//     (int64, uint8, float32, …), which stay as they are;
//   - runs of spaces, tabs and line breaks become one space, and the
//     text is trimmed.
//
// Only the first 2000 characters of s count, and the group is cut at 300
// characters; an empty result is "<empty>". Text that PostgreSQL cannot
// store (invalid UTF-8, NUL) is first cleaned as the dead-letter table
// stores it. The console computes the same function in SQL, over the
// table's error column, to count groups and filter by them.
func NormalizeError(s string) string {
	s = strings.ToValidUTF8(s, "\uFFFD")
	s = strings.ReplaceAll(s, "\x00", "\uFFFD")
	s = truncateRunes(s, groupInput)
	for _, n := range normalizers {
		s = n.re.ReplaceAllLiteralString(s, n.repl)
	}
	s = truncateRunes(strings.Trim(s, " "), groupMax)
	if s == "" {
		return emptyGroup
	}
	return s
}

// normalizeSQL returns the SQL expression of NormalizeError over the text
// expression col, in dialect d.
func normalizeSQL(d *sqldb.Dialect, col string) string {
	expr := `substr(` + col + `, 1, ` + strconv.Itoa(groupInput) + `)`
	for _, n := range normalizers {
		expr = d.ReplaceAll(expr, n.pattern, n.repl)
	}
	return `COALESCE(NULLIF(substr(trim(` + expr + `), 1, ` + strconv.Itoa(groupMax) + `), ''), '` + emptyGroup + `')`
}

// truncateRunes cuts s to at most n characters.
func truncateRunes(s string, n int) string {
	if len(s) <= n {
		return s
	}
	i := 0
	for pos := range s {
		if i == n {
			return s[:pos]
		}
		i++
	}
	return s
}

// trimCut drops the bytes of a character that a cut at the end of p split,
// if any; p may still be invalid UTF-8 elsewhere.
func trimCut(p []byte) []byte {
	for i := 0; i < utf8.UTFMax-1 && len(p) > 0 && !utf8.Valid(p); i++ {
		p = p[:len(p)-1]
	}
	return p
}
