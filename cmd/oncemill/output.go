package main

import (
	"encoding/base64"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"sort"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/oncemill/oncemill/dlq"
)

// entryView is an entry as JSON shows it: the payload as text when it is
// valid UTF-8, else as base64, and which of the two it is.
type entryView struct {
	dlq.Entry
	Payload         string `json:"payload"`
	PayloadEncoding string `json:"payload_encoding"`
	// AttemptsSource names who counted Attempts: "inbox", "broker",
	// "process", or "-" when the entry does not say (see
	// dlq.Entry.AttemptsCounted).
	AttemptsSource string `json:"attempts_source"`
	// CopiesSince counts the copies of the key that arrived after the
	// entry was written and were acked without running; absent when the
	// inbox table is not beside the dead-letter table.
	CopiesSince *int `json:"copies_since,omitempty"`
}

func viewOf(e dlq.Entry) entryView {
	text, enc := payloadText(e.Payload)
	return entryView{Entry: e, Payload: text, PayloadEncoding: enc, AttemptsSource: e.AttemptsCounted().Short}
}

// payloadText returns the payload as text, or base64 when it is not valid
// UTF-8, and the encoding's name.
func payloadText(p []byte) (string, string) {
	if utf8.Valid(p) {
		return string(p), "text"
	}
	return base64.StdEncoding.EncodeToString(p), "base64"
}

func (c *cmd) writeJSON(v any) error {
	enc := json.NewEncoder(c.stdout)
	enc.SetIndent("", "  ")
	enc.SetEscapeHTML(false)
	if err := enc.Encode(v); err != nil {
		return fmt.Errorf("write JSON: %w", err)
	}
	return nil
}

// writeTable prints entries as an aligned table, one line each.
func writeTable(w io.Writer, entries []dlq.Entry) error {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "ID\tDEAD AT\tTOPIC\tCONSUMER\tKEY\tATTEMPTS\tCOUNTED BY\tPERMANENT\tERROR")
	for _, e := range entries {
		fmt.Fprintf(tw, "%d\t%s\t%s\t%s\t%s\t%d\t%s\t%t\t%s\n",
			e.ID, e.DeadAt.UTC().Format(time.RFC3339), cell(e.Topic, 40), cell(e.Consumer, 30),
			cell(e.Key, 40), e.Attempts, e.AttemptsCounted().Short, e.Permanent, cell(e.Error, 60))
	}
	if err := tw.Flush(); err != nil {
		return fmt.Errorf("write table: %w", err)
	}
	return nil
}

// cell makes s fit a table cell: one line, at most width characters, "-"
// when empty.
func cell(s string, width int) string {
	s = strings.Map(func(r rune) rune {
		if unicode.IsControl(r) {
			return ' '
		}
		return r
	}, s)
	s = strings.TrimSpace(s)
	if s == "" {
		return "-"
	}
	if utf8.RuneCountInString(s) > width {
		s = string([]rune(s)[:width-1]) + "…"
	}
	return s
}

// writeEntry prints every field of e, its metadata and its payload. The
// attempt count is labelled with what it counts and who counted it, and
// the broker's place of the original (Kafka partition and offset,
// JetStream stream and sequence) is printed only as far as e has it. A
// value of several lines continues under its first line. table is the
// dead-letter table the entry was read from.
func writeEntry(w io.Writer, e dlq.Entry, table string, copiesSince *int) error {
	optTime := func(t time.Time) string {
		if t.IsZero() {
			return "-"
		}
		return t.UTC().Format(time.RFC3339Nano)
	}
	counted := e.AttemptsCounted()
	fields := []dlq.Fact{
		{Label: "ID", Value: strconv.FormatInt(e.ID, 10)},
		{Label: "UUID", Value: e.UUID},
		{Label: "Topic", Value: e.Topic},
		{Label: "Dead-letter table", Value: table},
		{Label: "Dead-letter topic", Value: e.DLQTopic + " (the name the dead-letter publisher was given, such as PoisonConfig.Topic; the entry is in the table above, not on a broker)"},
		{Label: "Consumer", Value: e.Consumer},
		{Label: "Key", Value: e.Key},
		{Label: counted.Label, Value: strconv.Itoa(e.Attempts) + " (" + counted.Source + ")"},
		{Label: "Permanent", Value: strconv.FormatBool(e.Permanent)},
		{Label: "Error", Value: e.Error},
		{Label: "First failed at", Value: optTime(e.FirstFailedAt)},
		{Label: "Last failed at", Value: optTime(e.LastFailedAt)},
	}
	fields = append(fields, e.Place()...)
	fields = append(fields,
		dlq.Fact{Label: "Dead at", Value: optTime(e.DeadAt)},
		dlq.Fact{Label: "Copies since dead", Value: copiesText(copiesSince)})
	if err := writeMessage(w, fields, e.Metadata, e.Payload); err != nil {
		return fmt.Errorf("write entry: %w", err)
	}
	return nil
}

// writeMessage writes what show prints of a stored message, a dead
// letter's or a parked one's: its facts, a label and a value a line ("-"
// for an empty value), then its metadata sorted by key, then its payload.
func writeMessage(w io.Writer, fields []dlq.Fact, metadata map[string]string, payload []byte) error {
	width := 0
	for _, f := range fields {
		width = max(width, utf8.RuneCountInString(f.Label)+3)
	}
	var b strings.Builder
	for _, f := range fields {
		v := f.Value
		if v == "" {
			v = "-"
		}
		fmt.Fprintf(&b, "%-*s%s\n", width, f.Label+":", indent(v, width))
	}
	keys := make([]string, 0, len(metadata))
	for k := range metadata {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	fmt.Fprintf(&b, "Metadata (%d):\n", len(keys))
	for _, k := range keys {
		fmt.Fprintf(&b, "  %s = %s\n", k, indent(metadata[k], 2+utf8.RuneCountInString(k)+3))
	}
	text, enc := payloadText(payload)
	fmt.Fprintf(&b, "Payload (%s, %d bytes):\n%s\n", enc, len(payload), text)
	_, err := io.WriteString(w, b.String())
	return err
}

// indent puts n spaces before every line of s but the first.
func indent(s string, n int) string {
	return strings.ReplaceAll(s, "\n", "\n"+strings.Repeat(" ", n))
}

// progress draws a replay's progress bar on a terminal.
type progress struct {
	w     io.Writer
	drawn bool
}

// progressMin is the number of entries above which a replay shows progress.
const progressMin = 20

// newProgress returns a bar on w for a replay of total entries, or nil when
// w is not a terminal or the replay is small.
func newProgress(w io.Writer, total int, terminal bool) *progress {
	if !terminal || total <= progressMin {
		return nil
	}
	return &progress{w: w}
}

const barWidth = 30

func (p *progress) update(done, total int) {
	if total <= 0 {
		return
	}
	filled := done * barWidth / total
	fmt.Fprintf(p.w, "\r[%s%s] %d/%d", strings.Repeat("#", filled), strings.Repeat(".", barWidth-filled), done, total)
	p.drawn = true
}

// finish ends the bar's line, so that what follows starts on its own.
func (p *progress) finish() {
	if p != nil && p.drawn {
		fmt.Fprintln(p.w)
	}
}

// isTerminal reports whether w is a terminal (a character device).
func isTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	if !ok {
		return false
	}
	fi, err := f.Stat()
	return err == nil && fi.Mode()&os.ModeCharDevice != 0
}

// copiesText says how many copies of a dead key its consumer acked
// without running since the entry was written, or why that is unknown.
func copiesText(n *int) string {
	if n == nil {
		return "- (no dead record of the key in an inbox table beside the dead-letter table)"
	}
	return strconv.Itoa(*n) + " (later deliveries of the key, acked by the inbox without running)"
}
