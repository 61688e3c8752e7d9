// Package mdsection rewrites one "## " section of a markdown file, so that
// each benchmark owns its section of a shared results file and leaves the
// others as they are.
package mdsection

import (
	"errors"
	"io/fs"
	"os"
	"strings"
)

// Replace puts section, which must start with the line head (a "## "
// heading), in place of the section of path that starts with head, up to
// the next "## " heading; or appends it when path has no such section. A
// missing or empty file starts with title (a "# " heading).
func Replace(path, title, head, section string) error {
	old, err := os.ReadFile(path)
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	content := string(old)
	if content == "" {
		content = title + "\n\n"
	}
	section = strings.TrimRight(section, "\n") + "\n"
	if i := strings.Index(content, head+"\n"); i >= 0 {
		rest := content[i+len(head)+1:]
		end := len(content)
		if j := strings.Index(rest, "\n## "); j >= 0 {
			end = i + len(head) + 1 + j + 1
			section += "\n"
		}
		content = content[:i] + section + content[end:]
	} else {
		content = strings.TrimRight(content, "\n") + "\n\n" + section
	}
	return os.WriteFile(path, []byte(content), 0o644)
}
