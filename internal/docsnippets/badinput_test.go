package docsnippets

import (
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
)

// badInputTests are the tests the "Bad input" tables of docs/testing.md
// name in their third column: each backticked `TestX`, `FuzzX`, or
// `TestX/case`, with the table's row for the message.
func badInputTests(t *testing.T) map[string]string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(root, "docs", "testing.md"))
	if err != nil {
		t.Fatal(err)
	}
	doc := string(b)
	start := strings.Index(doc, "\n## Bad input\n")
	if start < 0 {
		t.Fatal(`docs/testing.md has no "## Bad input" section`)
	}
	section := doc[start+1:]
	if end := strings.Index(section[1:], "\n## "); end >= 0 {
		section = section[:end+1]
	}
	named := regexp.MustCompile("`((?:Test|Fuzz)[A-Za-z0-9_]+(?:/[^`]+)?)`")
	tests := map[string]string{}
	rows := 0
	for _, line := range strings.Split(section, "\n") {
		cells := strings.Split(line, " | ")
		if !strings.HasPrefix(line, "| ") || len(cells) < 3 || strings.HasPrefix(line, "| input |") {
			continue
		}
		rows++
		last := cells[len(cells)-1]
		found := named.FindAllStringSubmatch(last, -1)
		if len(found) == 0 {
			t.Errorf("row %q names no test in its third column", line)
		}
		for _, m := range found {
			tests[m[1]] = line
		}
	}
	if rows < 60 {
		t.Errorf("the Bad input tables have %d rows, want at least 60", rows)
	}
	return tests
}

// TestBadInputTableNamesTests: every test the "Bad input" tables of
// docs/testing.md name exists (func TestX or FuzzX in a _test.go file of
// the repository), and a case after the slash is a string literal in the
// file of that test, so that the tables cannot name what is gone.
func TestBadInputTableNamesTests(t *testing.T) {
	files := map[string]string{}
	err := filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && (d.Name() == "testdata" || d.Name() == "node_modules" || strings.HasPrefix(d.Name(), ".") && path != root) {
			return filepath.SkipDir
		}
		if !d.IsDir() && strings.HasSuffix(path, "_test.go") {
			b, err := os.ReadFile(path)
			if err != nil {
				return err
			}
			files[path] = string(b)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	for name, row := range badInputTests(t) {
		fn, tcase, hasCase := strings.Cut(name, "/")
		decl := regexp.MustCompile(`(?m)^func ` + regexp.QuoteMeta(fn) + `\(`)
		found := false
		for _, src := range files {
			if decl.MatchString(src) && (!hasCase || strings.Contains(src, strconv.Quote(tcase))) {
				found = true
				break
			}
		}
		if !found {
			t.Errorf("docs/testing.md names %s, which no _test.go file declares (with the case %q): row %s", fn, tcase, row)
		}
	}
}
