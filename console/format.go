package console

import (
	"bytes"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"html/template"
	"sort"
	"strconv"
	"strings"
	"time"
	"unicode"
	"unicode/utf8"
)

// shown is a payload or a stored result as a page shows it.
type shown struct {
	// Kind is "json" (pretty-printed), "text", "binary" (a hex dump) or
	// "empty".
	Kind string
	// Text is what the page prints.
	Text string
	// Shown is how many bytes were read, Total how many there are.
	Shown, Total int
}

// Cut reports whether only the start of the bytes is shown.
func (s shown) Cut() bool { return s.Shown < s.Total }

// show formats p, the first bytes of total: valid JSON pretty-printed,
// printable UTF-8 as text, anything else as a hex dump. A cut JSON
// document is shown as text.
func show(p []byte, total int) shown {
	s := shown{Shown: len(p), Total: max(total, len(p))}
	switch {
	case s.Total == 0:
		s.Kind = "empty"
	case !s.Cut() && json.Valid(p):
		var b bytes.Buffer
		if err := json.Indent(&b, p, "", "  "); err == nil {
			s.Kind, s.Text = "json", b.String()
			break
		}
		fallthrough
	default:
		text := p
		if s.Cut() {
			text = trimCut(p)
		}
		if printable(text) {
			s.Kind, s.Text = "text", string(text)
		} else {
			s.Kind, s.Text = "binary", hex.Dump(p)
		}
	}
	return s
}

// printable reports whether p is valid UTF-8 with no control characters
// but tabs and line breaks.
func printable(p []byte) bool {
	if !utf8.Valid(p) {
		return false
	}
	for _, r := range string(p) {
		if unicode.IsControl(r) && r != '\n' && r != '\r' && r != '\t' {
			return false
		}
	}
	return true
}

// kv is one metadata pair.
type kv struct{ Key, Value string }

// sortedMetadata returns md's pairs ordered by key.
func sortedMetadata(md map[string]string) []kv {
	out := make([]kv, 0, len(md))
	for k, v := range md {
		out = append(out, kv{k, v})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Key < out[j].Key })
	return out
}

// timeLayout is how pages print times: UTC, to the second.
const timeLayout = "2006-01-02 15:04:05Z"

// asTime returns the time v holds (time.Time or *time.Time) and whether
// it holds one.
func asTime(v any) (time.Time, bool) {
	switch t := v.(type) {
	case time.Time:
		return t, !t.IsZero()
	case *time.Time:
		if t == nil {
			return time.Time{}, false
		}
		return *t, !t.IsZero()
	}
	return time.Time{}, false
}

// compact prints d in its two largest units: 3d4h, 2h5m, 4m10s, 12s.
func compact(d time.Duration) string {
	if d < 0 {
		d = -d
	}
	d = d.Round(time.Second)
	days := d / (24 * time.Hour)
	d -= days * 24 * time.Hour
	hours := d / time.Hour
	d -= hours * time.Hour
	mins := d / time.Minute
	secs := (d - mins*time.Minute) / time.Second
	switch {
	case days > 0:
		return fmt.Sprintf("%dd%dh", days, hours)
	case hours > 0:
		return fmt.Sprintf("%dh%dm", hours, mins)
	case mins > 0:
		return fmt.Sprintf("%dm%ds", mins, secs)
	default:
		return fmt.Sprintf("%ds", secs)
	}
}

// sizeOf prints a byte count.
func sizeOf(n int) string {
	switch {
	case n < 1<<10:
		return strconv.Itoa(n) + " B"
	case n < 1<<20:
		return strconv.FormatFloat(float64(n)/(1<<10), 'f', 1, 64) + " KiB"
	default:
		return strconv.FormatFloat(float64(n)/(1<<20), 'f', 1, 64) + " MiB"
	}
}

// plural picks one or many by n.
func plural(n int, one, many string) string {
	if n == 1 {
		return one
	}
	return many
}

// funcs are the templates' functions.
func (c *Console) funcs() template.FuncMap {
	return template.FuncMap{
		// when prints a time (time.Time or *time.Time) in UTC; "–" when
		// there is none.
		"when": func(v any) string {
			t, ok := asTime(v)
			if !ok {
				return "–"
			}
			return t.UTC().Format(timeLayout)
		},
		// iso is the time for a datetime attribute.
		"iso": func(v any) string {
			t, ok := asTime(v)
			if !ok {
				return ""
			}
			return t.UTC().Format(time.RFC3339)
		},
		// ago prints how long ago a time was (or "in …" for a future one).
		"ago": func(v any) string {
			t, ok := asTime(v)
			if !ok {
				return ""
			}
			d := c.cfg.Now().Sub(t)
			if d < 0 {
				return "in " + compact(d)
			}
			return compact(d) + " ago"
		},
		"has":     func(v any) bool { _, ok := asTime(v); return ok },
		"dur":     compact,
		"size":    sizeOf,
		"plural":  plural,
		"isempty": func(s string) bool { return strings.TrimSpace(s) == "" },
		"add":     func(a, b int) int { return a + b },
		"deadInboxHelp": func() string {
			return "keys the inbox itself gave up on, until their row expires or a replay reopens them; " +
				"a purged dead letter leaves its key dead here"
		},
		"deadLettersHelp": func() string {
			return "messages the poison middleware dead-lettered, with or without an inbox behind it " +
				"(a consumer without one, an undecodable message, an empty key), " +
				"kept until replayed or purged, also after the key's inbox row has expired"
		},
	}
}
