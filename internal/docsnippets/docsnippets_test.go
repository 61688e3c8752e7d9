package docsnippets

import (
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

var update = flag.Bool("update", false, "rewrite the Go blocks of README.md and docs/*.md from their sources")

// root is the repository root, seen from this package's directory.
const root = "../.."

// readmeMaxLines keeps README.md a landing page; the manual is in docs/.
const readmeMaxLines = 250

var (
	markerRE = regexp.MustCompile(`^<!-- snippet: ([^#\s]+)(?:#([A-Za-z0-9_-]+))? -->$`)
	// Watermill's own middlewares, which a reader would take for
	// oncemill's package middleware: name Watermill's package wmw.
	watermillMiddlewareRE = regexp.MustCompile(`\bmiddleware\.(Timeout|Recoverer|Retry|Deduplicator|Throttle|CorrelationID|PoisonQueue|PoisonQueueWithFilter|InstantAck|RandomFail|RandomPanic|Duplicator|IgnoreErrors|NewThrottle|NewCircuitBreaker|NewDelayOnError)\b`)
)

// block is one fenced Go block of a document.
type block struct {
	doc    string // the document, relative to root
	fence  int    // index of the opening fence line
	indent string // the fence's indentation
	source string // the marker's file, relative to root; "" without a marker
	region string // the marker's region; "" for the whole file
	body   []string
}

func (b block) where() string { return fmt.Sprintf("%s:%d", b.doc, b.fence+1) }

func (b block) name() string {
	if b.region == "" {
		return b.source
	}
	return b.source + "#" + b.region
}

// documents returns README.md and every docs/*.md, relative to root.
func documents(t *testing.T) []string {
	t.Helper()
	docs, err := filepath.Glob(filepath.Join(root, "docs", "*.md"))
	if err != nil {
		t.Fatal(err)
	}
	out := []string{"README.md"}
	for _, d := range docs {
		rel, err := filepath.Rel(root, d)
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, filepath.ToSlash(rel))
	}
	return out
}

func readLines(t *testing.T, path string) []string {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(root, filepath.FromSlash(path)))
	if err != nil {
		t.Fatal(err)
	}
	return strings.Split(strings.TrimSuffix(string(data), "\n"), "\n")
}

// parse finds the fenced blocks of a document's lines: the Go blocks with
// their markers, and markers that precede no Go block.
func parse(doc string, lines []string) (blocks []block, problems []string) {
	for i := 0; i < len(lines); i++ {
		trimmed := strings.TrimSpace(lines[i])
		if m := markerRE.FindStringSubmatch(trimmed); m != nil {
			next := ""
			if i+1 < len(lines) {
				next = strings.TrimSpace(lines[i+1])
			}
			if next != "```go" {
				problems = append(problems, fmt.Sprintf("%s:%d: marker %q is not on the line just above a ```go block", doc, i+1, trimmed))
			}
			continue
		}
		if !strings.HasPrefix(trimmed, "```") {
			continue
		}
		indent := lines[i][:len(lines[i])-len(strings.TrimLeft(lines[i], " \t"))]
		lang := strings.TrimSpace(strings.TrimPrefix(trimmed, "```"))
		end := i + 1
		for end < len(lines) && strings.TrimSpace(lines[end]) != "```" {
			end++
		}
		if end == len(lines) {
			problems = append(problems, fmt.Sprintf("%s:%d: the code block is never closed", doc, i+1))
			return blocks, problems
		}
		if lang == "go" || lang == "golang" {
			b := block{doc: doc, fence: i, indent: indent, body: lines[i+1 : end]}
			if i > 0 {
				if m := markerRE.FindStringSubmatch(strings.TrimSpace(lines[i-1])); m != nil {
					b.source, b.region = m[1], m[2]
				}
			}
			blocks = append(blocks, b)
		}
		i = end
	}
	return blocks, problems
}

// region returns the lines of a source file that a marker names: the whole
// file, or the lines between "// snippet:NAME" and "// endsnippet".
func region(t *testing.T, source, name string) ([]string, error) {
	t.Helper()
	if err := compiled(source); err != nil {
		return nil, err
	}
	lines := readLines(t, source)
	if name == "" {
		return lines, nil
	}
	start, end := -1, -1
	for i, l := range lines {
		switch strings.TrimSpace(l) {
		case "// snippet:" + name:
			if start >= 0 {
				return nil, fmt.Errorf("%s has region %q twice", source, name)
			}
			start = i
		case "// endsnippet":
			if start >= 0 && end < 0 {
				end = i
			}
		}
	}
	if start < 0 {
		return nil, fmt.Errorf("%s has no line \"// snippet:%s\"", source, name)
	}
	if end < 0 {
		return nil, fmt.Errorf("%s: region %q has no \"// endsnippet\" line after it", source, name)
	}
	return lines[start+1 : end], nil
}

// compiled reports why the go command would not build a snippet's source
// in `go vet ./...` and `go test ./...`, if it would not.
func compiled(source string) error {
	if !strings.HasSuffix(source, ".go") {
		return fmt.Errorf("%s is not a Go file", source)
	}
	clean := filepath.ToSlash(filepath.Clean(source))
	if strings.HasPrefix(clean, "../") || filepath.IsAbs(source) {
		return fmt.Errorf("%s is outside the repository", source)
	}
	for _, dir := range strings.Split(clean, "/") {
		if dir == "testdata" || strings.HasPrefix(dir, "_") || strings.HasPrefix(dir, ".") {
			return fmt.Errorf("%s is in a directory the go command ignores", source)
		}
	}
	data, err := os.ReadFile(filepath.Join(root, filepath.FromSlash(source)))
	if err != nil {
		return err
	}
	for _, l := range strings.Split(string(data), "\n") {
		if strings.HasPrefix(l, "//go:build") {
			return fmt.Errorf("%s has a build constraint (%s): the default build does not compile it", source, l)
		}
		if strings.HasPrefix(l, "package ") {
			break
		}
	}
	return nil
}

// dedent removes the indentation common to the non-blank lines, the
// trailing spaces of every line and blank lines at both ends.
func dedent(lines []string) []string {
	out := make([]string, len(lines))
	prefix := ""
	first := true
	for i, l := range lines {
		out[i] = strings.TrimRight(l, " \t")
		if out[i] == "" {
			continue
		}
		lead := out[i][:len(out[i])-len(strings.TrimLeft(out[i], " \t"))]
		if first {
			prefix, first = lead, false
			continue
		}
		for !strings.HasPrefix(lead, prefix) {
			prefix = prefix[:len(prefix)-1]
		}
	}
	for i := range out {
		out[i] = strings.TrimPrefix(out[i], prefix)
	}
	for len(out) > 0 && out[0] == "" {
		out = out[1:]
	}
	for len(out) > 0 && out[len(out)-1] == "" {
		out = out[:len(out)-1]
	}
	return out
}

// firstDifference describes where two blocks of lines first differ.
func firstDifference(doc, src []string) string {
	for i := 0; i < len(doc) || i < len(src); i++ {
		var d, s string
		if i < len(doc) {
			d = doc[i]
		}
		if i < len(src) {
			s = src[i]
		}
		if d != s || i >= len(doc) || i >= len(src) {
			return fmt.Sprintf("line %d of the block:\n\tdocument: %q\n\tsource:   %q", i+1, d, s)
		}
	}
	return ""
}

// TestGoBlocksMatchSources fails on every Go block of README.md and
// docs/*.md that has no snippet marker, whose source the build does not
// compile, or that differs from its source.
func TestGoBlocksMatchSources(t *testing.T) {
	for _, doc := range documents(t) {
		lines := readLines(t, doc)
		blocks, problems := parse(doc, lines)
		for _, p := range problems {
			t.Error(p)
		}
		changed := false
		// Backwards, so that rewriting a block keeps the earlier blocks' line numbers.
		for i := len(blocks) - 1; i >= 0; i-- {
			b := blocks[i]
			if b.source == "" {
				t.Errorf("%s: a ```go block without a source: put <!-- snippet: PATH#REGION --> on the line above it, "+
					"PATH a Go file the build compiles (an example_test.go, a file under examples/) whose lines "+
					"\"// snippet:REGION\" and \"// endsnippet\" enclose the code", b.where())
				continue
			}
			src, err := region(t, b.source, b.region)
			if err != nil {
				t.Errorf("%s: %v", b.where(), err)
				continue
			}
			want, got := dedent(src), dedent(b.body)
			if strings.Join(want, "\n") == strings.Join(got, "\n") {
				continue
			}
			if !*update {
				t.Errorf("%s: the block differs from %s, %s\n(go test ./internal/docsnippets -update copies the sources into the documents)",
					b.where(), b.name(), firstDifference(got, want))
				continue
			}
			body := make([]string, len(want))
			for j, l := range want {
				if l != "" {
					body[j] = b.indent + l
				}
			}
			lines = append(lines[:b.fence+1], append(body, lines[b.fence+1+len(b.body):]...)...)
			changed = true
		}
		if changed {
			path := filepath.Join(root, filepath.FromSlash(doc))
			if err := os.WriteFile(path, []byte(strings.Join(lines, "\n")+"\n"), 0o644); err != nil {
				t.Fatal(err)
			}
			t.Logf("%s: Go blocks copied from their sources", doc)
		}
	}
}

// TestGoBlocksCheckErrors fails on Go code in the documents that discards
// an error: readers copy it as it is.
func TestGoBlocksCheckErrors(t *testing.T) {
	for _, doc := range documents(t) {
		blocks, _ := parse(doc, readLines(t, doc))
		for _, b := range blocks {
			for i, l := range b.body {
				if strings.Contains(l, ", _ :=") || strings.Contains(l, ", _ =") {
					t.Errorf("%s:%d: %q discards a value, most likely an error: check it", b.doc, b.fence+2+i, strings.TrimSpace(l))
				}
			}
		}
	}
}

// TestWatermillMiddlewareIsWmw fails where a document calls one of
// Watermill's middlewares through the name middleware, which is
// oncemill's package: Watermill's is imported as wmw.
func TestWatermillMiddlewareIsWmw(t *testing.T) {
	for _, doc := range documents(t) {
		for i, l := range readLines(t, doc) {
			if m := watermillMiddlewareRE.FindString(l); m != "" {
				t.Errorf("%s:%d: %s is Watermill's: import github.com/ThreeDotsLabs/watermill/message/router/middleware as wmw and write wmw.%s",
					doc, i+1, m, strings.TrimPrefix(m, "middleware."))
			}
			if strings.Contains(l, `"github.com/ThreeDotsLabs/watermill/message/router/middleware"`) &&
				!strings.HasPrefix(strings.TrimSpace(l), `wmw "`) {
				t.Errorf("%s:%d: import Watermill's middleware package as wmw", doc, i+1)
			}
		}
	}
}

// TestREADMEIsALandingPage keeps README.md short enough to read on
// arrival.
func TestREADMEIsALandingPage(t *testing.T) {
	if n := len(readLines(t, "README.md")); n > readmeMaxLines {
		t.Errorf("README.md has %d lines, more than %d: move reference to a page in docs/", n, readmeMaxLines)
	}
}

// TestParse checks the parser on the cases the documents do not all have.
func TestParse(t *testing.T) {
	doc := []string{
		"text",
		"<!-- snippet: a/b.go#one -->",
		"```go",
		"x := 1",
		"```",
		"- a list item:",
		"  <!-- snippet: a/c.go -->",
		"  ```go",
		"  \tif x {",
		"  \t}",
		"  ```",
		"```sh",
		"<!-- snippet: a/d.go -->",
		"```",
		"```go",
		"bare()",
		"```",
		"<!-- snippet: a/e.go#two -->",
		"",
		"```go",
		"late()",
		"```",
	}
	blocks, problems := parse("doc.md", doc)
	if len(blocks) != 4 {
		t.Fatalf("blocks: %d, want 4", len(blocks))
	}
	for i, want := range []struct{ source, region, indent, first string }{
		{"a/b.go", "one", "", "x := 1"},
		{"a/c.go", "", "  ", "  \tif x {"},
		{"", "", "", "bare()"},
		{"", "", "", "late()"},
	} {
		b := blocks[i]
		if b.source != want.source || b.region != want.region || b.indent != want.indent || b.body[0] != want.first {
			t.Errorf("block %d: %+v, want %+v", i, b, want)
		}
	}
	if got := dedent(blocks[1].body); strings.Join(got, "|") != "if x {|}" {
		t.Errorf("dedent: %q", got)
	}
	if len(problems) != 1 || !strings.Contains(problems[0], "doc.md:18") {
		t.Errorf("problems: %q, want the marker of line 18 that a blank line separates from its block", problems)
	}
}

// TestREADMEComparesWatermillsOwn: the README's "Watermill's own, and what
// we add" table has a row for each of Watermill's middlewares and
// components a Watermill user would otherwise reach for, each row linking
// to where the difference is measured or explained.
func TestREADMEComparesWatermillsOwn(t *testing.T) {
	lines := readLines(t, "README.md")
	start := -1
	for i, l := range lines {
		if l == "## Watermill's own, and what we add" {
			start = i
		}
	}
	if start < 0 {
		t.Fatal(`README.md has no "## Watermill's own, and what we add" section`)
	}
	var rows []string
	for _, l := range lines[start+1:] {
		if strings.HasPrefix(l, "## ") {
			break
		}
		if strings.HasPrefix(l, "| `") {
			rows = append(rows, l)
		}
	}
	for _, own := range []string{"Deduplicator", "PoisonQueue", "Retry", "Forwarder", "Timeout", "Throttle"} {
		found := false
		for _, r := range rows {
			if strings.Contains(r, "`"+own+"`") {
				found = true
				if !strings.Contains(r, "](") {
					t.Errorf("README.md: the row for %s links to nothing: %s", own, r)
				}
			}
		}
		if !found {
			t.Errorf("README.md: the Watermill table has no row for %s", own)
		}
	}
}
