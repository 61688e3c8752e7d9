package console

import (
	"context"
	"errors"
	"fmt"
	"math"
	"net/http"
	"net/url"
	"slices"
	"sort"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill"

	"github.com/oncemill/oncemill/dlq"
)

// The actions: an operator replays or purges one entry, a selection, a
// group or everything a filter matches, in two steps. The first POST to
// dlq/confirm resolves the scope to the ids of the entries it selects now
// and renders them, counted by destination, for a second look; the second
// (confirm=1) acts on exactly those ids through dlq.Store, so that an
// entry that arrived in between is not touched, and redirects to the dead
// letters with the outcome.

const (
	actReplayConsumer = "replay-consumer"
	actReplayTopic    = "replay-topic"
	actPurge          = "purge"
	actReopen         = "reopen"
)

// destination is where some of an action's entries go.
type destination struct {
	Consumer, Topic string
	Entries         int
}

// confirmData is the confirm page's.
type confirmData struct {
	Action, Scope string
	// Summary is the one line that says what the button does.
	Summary string
	// Destinations count the entries by consumer and topic (by topic for
	// a replay to the topic).
	Destinations []destination
	// Notes qualify the summary: entries left out, entries beyond the
	// limit, entries already waiting for their replay.
	Notes []string
	// IDs are the entries the action takes, as ranges ("3-7,9").
	IDs     string
	Entries int
	Back    string
	BackURL string
}

// confirm serves POST /dlq/confirm: the confirm step, or, with
// confirm=1, the action.
func (c *Console) confirm(w http.ResponseWriter, r *http.Request) {
	if c.cfg.ReadOnly {
		c.fail(w, r, http.StatusForbidden, "This console is read-only: replays and purges are refused.")
		return
	}
	action := r.PostFormValue("action")
	switch action {
	case actReplayConsumer, actPurge:
	case actReopen:
		if r.PostFormValue("scope") != "entry" {
			c.fail(w, r, http.StatusBadRequest, "Reopen takes one entry: use it from the entry's page.")
			return
		}
	case actReplayTopic:
		if c.cfg.Publisher == nil {
			c.fail(w, r, http.StatusBadRequest, "This console has no publisher: it replays entries to their consumer only.")
			return
		}
	default:
		c.fail(w, r, http.StatusBadRequest, "Unknown action "+strconv.Quote(action)+": use replay-consumer, replay-topic, reopen or purge.")
		return
	}
	back := backQuery(r.PostFormValue("back"))
	if r.PostFormValue("confirm") == "1" {
		c.execute(w, r, action, back)
		return
	}

	scope := r.PostFormValue("scope")
	var cr criteria
	switch scope {
	case "entry", "selection":
		ids, err := formIDs(r.PostForm["id"])
		if err != nil {
			c.fail(w, r, http.StatusBadRequest, err.Error())
			return
		}
		if len(ids) == 0 {
			c.fail(w, r, http.StatusBadRequest, "No entries selected: tick the entries first.")
			return
		}
		if scope == "entry" && len(ids) != 1 {
			c.fail(w, r, http.StatusBadRequest, "An entry's action takes one id.")
			return
		}
		cr.IDs = ids
	case "group", "filter":
		var err error
		f := readFilter(r)
		if cr, err = f.criteria(c.cfg.Now()); err != nil {
			c.fail(w, r, http.StatusBadRequest, err.Error())
			return
		}
		if scope == "group" && cr.Group == "" {
			c.fail(w, r, http.StatusBadRequest, "No group given.")
			return
		}
	default:
		c.fail(w, r, http.StatusBadRequest, "Unknown scope "+strconv.Quote(scope)+": use entry, selection, group or filter.")
		return
	}

	ts, err := c.targets(r.Context(), cr, maxAction+1)
	if err != nil {
		c.internal(w, r, "select the entries", err)
		return
	}
	d := confirmData{Action: action, Scope: scope, Back: back.Encode()}
	d.BackURL = listURL("../", back)
	if scope == "entry" {
		d.BackURL = "../dlq/" + strconv.FormatInt(cr.IDs[0], 10)
	}
	if len(ts) > maxAction {
		total, err := c.countDead(r.Context(), cr)
		if err != nil {
			c.internal(w, r, "count the entries", err)
			return
		}
		ts = ts[:maxAction]
		d.Notes = append(d.Notes, fmt.Sprintf("%d entries match; this takes the oldest %d. Run it again for the rest.", total, maxAction))
	}
	if len(cr.IDs) > len(ts) {
		d.Notes = append(d.Notes, fmt.Sprintf("%d of the selected entries are gone (replayed or purged meanwhile).", len(cr.IDs)-len(ts)))
	}
	ts, d.Notes = eligible(action, ts, d.Notes)
	d.Notes = append(d.Notes, hopeless(action, ts)...)
	if action == actReplayConsumer {
		notes, err := c.unserved(r.Context(), ts)
		if err != nil {
			c.internal(w, r, "read the replay subscribers", err)
			return
		}
		d.Notes = append(d.Notes, notes...)
	}
	d.Entries = len(ts)
	d.Destinations = destinations(action, ts)
	d.Summary = summary(action, len(ts), d.Destinations)
	ids := make([]int64, len(ts))
	for i, t := range ts {
		ids[i] = t.ID
	}
	d.IDs = formatRanges(ids)
	c.render(w, r, http.StatusOK, "confirm", c.newPage(r, "Confirm", "dlq", d))
}

// eligible drops the entries action cannot take, with a note for each
// kind: a replay to the consumer needs a consumer and a topic (its
// ReplaySubscriber delivers by both), a replay to the topic a topic.
func eligible(action string, ts []target, notes []string) ([]target, []string) {
	var (
		out              []target
		dropped, waiting int
	)
	for _, t := range ts {
		switch {
		case action == actReplayConsumer && (t.Consumer == "" || t.Topic == ""):
			dropped++
		case action == actReplayTopic && t.Topic == "":
			dropped++
		case action == actReopen && (t.Consumer == "" || t.Key == ""):
			dropped++
		default:
			out = append(out, t)
			if action == actReplayConsumer && t.ReplayRequested {
				waiting++
			}
		}
	}
	switch {
	case dropped > 0 && action == actReopen:
		notes = append(notes, "The entry has no consumer or no key: there is no dead key to reopen.")
	case dropped > 0 && action == actReplayConsumer:
		notes = append(notes, fmt.Sprintf("%d %s no consumer or no topic and %s left out: no replay subscriber would deliver %s.",
			dropped, plural(dropped, "entry has", "entries have"), plural(dropped, "is", "are"), plural(dropped, "it", "them")))
	case dropped > 0:
		notes = append(notes, fmt.Sprintf("%d %s no topic and %s left out: there is nowhere to publish %s.",
			dropped, plural(dropped, "entry has", "entries have"), plural(dropped, "is", "are"), plural(dropped, "it", "them")))
	}
	if waiting > 0 {
		notes = append(notes, fmt.Sprintf("%d of them %s already waiting for %s replay, and %s left as %s.",
			waiting, plural(waiting, "is", "are"), plural(waiting, "its", "their"), plural(waiting, "is", "are"), plural(waiting, "it is", "they are")))
	}
	return out, notes
}

// maxHopeless bounds the entries hopeless names one by one.
const maxHopeless = 3

// hopeless notes the entries of a replay that cannot succeed as they
// are (dlq.Entry.Hopeless), before anything is sent: by id when they are
// few, else counted.
func hopeless(action string, ts []target) []string {
	if action != actReplayConsumer && action != actReplayTopic {
		return nil
	}
	var notes []string
	n := 0
	for _, t := range ts {
		why := dlq.Entry{Key: t.Key, Permanent: t.Permanent}.Hopeless()
		if why == "" {
			continue
		}
		if n++; n <= maxHopeless {
			notes = append(notes, fmt.Sprintf("Entry %d cannot succeed as it is: %s.", t.ID, why))
		}
	}
	if n > maxHopeless {
		notes = append(notes, fmt.Sprintf("%d more entries cannot succeed as they are (no key, or a permanent error).", n-maxHopeless))
	}
	return notes
}

// unserved notes the consumers of ts whose replay subscriber has not
// announced itself lately: a replay requested for them would wait in the
// table until one runs.
func (c *Console) unserved(ctx context.Context, ts []target) ([]string, error) {
	var notes []string
	seen := map[string]bool{}
	for _, t := range ts {
		if seen[t.Consumer] {
			continue
		}
		seen[t.Consumer] = true
		if msg, err := c.noReplayer(ctx, t.Consumer); err != nil || msg != "" {
			if err != nil {
				return nil, err
			}
			notes = append(notes, msg)
		}
	}
	return notes, nil
}

// noReplayer is the warning for a consumer whose replay subscriber has
// not announced itself lately, or "" when one runs (or the table of
// announcements is not migrated yet: nothing is known).
func (c *Console) noReplayer(ctx context.Context, consumer string) (string, error) {
	p, ok, err := c.dlq.Replayer(ctx, consumer)
	switch {
	case errors.Is(err, dlq.ErrNotMigrated):
		return "", nil
	case err != nil:
		return "", err
	case ok && p.Alive:
		return "", nil
	}
	since := "ever"
	if ok {
		since = "since " + p.SeenAt.UTC().Format(time.RFC3339)
	}
	what := "the request waits in the table until one runs: replay to the topic instead"
	if c.cfg.Publisher == nil {
		what = "the request waits in the table until one runs: start the consumer with dlq.WithReplays, or replay to the topic with oncemill dlq replay --broker"
	}
	return fmt.Sprintf("No replay subscriber seen for consumer %s %s; %s.", consumer, since, what), nil
}

// destinations counts ts by consumer and topic, or by topic for a replay
// to the topic, largest first.
func destinations(action string, ts []target) []destination {
	type key struct{ consumer, topic string }
	n := map[key]int{}
	for _, t := range ts {
		k := key{t.Consumer, t.Topic}
		if action == actReplayTopic {
			k.consumer = ""
		}
		n[k]++
	}
	out := make([]destination, 0, len(n))
	for k, v := range n {
		out = append(out, destination{Consumer: k.consumer, Topic: k.topic, Entries: v})
	}
	sort.Slice(out, func(i, j int) bool {
		if out[i].Entries != out[j].Entries {
			return out[i].Entries > out[j].Entries
		}
		if out[i].Consumer != out[j].Consumer {
			return out[i].Consumer < out[j].Consumer
		}
		return out[i].Topic < out[j].Topic
	})
	return out
}

// summary is the confirm page's line: what the button does, with the
// exact count.
func summary(action string, n int, dests []destination) string {
	entries := fmt.Sprintf("%d %s", n, plural(n, "entry", "entries"))
	if n == 0 {
		return "Nothing to do: no entry matches."
	}
	switch action {
	case actReplayConsumer:
		if len(dests) == 1 {
			return fmt.Sprintf("Replay %s to consumer %s (topic %s): only that consumer receives %s, through its replay subscriber.",
				entries, dests[0].Consumer, dests[0].Topic, plural(n, "it", "them"))
		}
		return fmt.Sprintf("Replay %s to their consumers, %d of them: only the consumer of each receives it, through its replay subscriber.", entries, len(dests))
	case actReopen:
		return fmt.Sprintf("Reopen the dead key of consumer %s for its next copy, whatever its payload, and delete the entry: the producer's corrected message runs once, and the copies after it are duplicates.",
			dests[0].Consumer)
	case actReplayTopic:
		if len(dests) == 1 {
			return fmt.Sprintf("Replay %s to topic %s: every consumer group of it receives %s.", entries, dests[0].Topic, plural(n, "it", "them"))
		}
		return fmt.Sprintf("Replay %s to their topics, %d of them: every consumer group of each receives them.", entries, len(dests))
	default:
		return fmt.Sprintf("Purge %s: they are deleted for good, never delivered again.", entries)
	}
}

// execute runs the confirmed action on the confirmed ids and redirects
// to the dead letters with the outcome.
func (c *Console) execute(w http.ResponseWriter, r *http.Request, action string, back url.Values) {
	ids, err := parseRanges(r.PostFormValue("ids"))
	if err != nil {
		c.fail(w, r, http.StatusBadRequest, err.Error())
		return
	}
	if len(ids) == 0 {
		c.fail(w, r, http.StatusBadRequest, "Nothing confirmed: no entry ids.")
		return
	}
	store := c.dlq
	ctx := r.Context()
	f := dlq.Filter{IDs: ids}
	var (
		n          int
		verb, rest string
	)
	switch action {
	case actPurge:
		verb = "Purged"
		n, err = store.Purge(ctx, f)
	case actReplayConsumer:
		verb, rest = "Requested a replay of", " to their consumer: each is delivered by its consumer's replay subscriber and deleted once handled"
		n, err = store.RequestReplay(ctx, f)
	case actReplayTopic:
		verb, rest = "Replayed", " to their topic"
		n, err = store.Replay(ctx, c.cfg.Publisher, f, nil)
	case actReopen:
		verb = "Reopened"
		if len(ids) != 1 {
			c.fail(w, r, http.StatusBadRequest, "Reopen takes one entry.")
			return
		}
		var e dlq.Entry
		if e, err = store.Reopen(ctx, ids[0]); err == nil {
			n = 1
			rest = fmt.Sprintf(" (consumer %s, key %s): the next copy of the key runs once, whatever its payload", e.Consumer, e.Key)
		}
	}
	fields := watermill.LogFields{"action": action, "entries": n, "confirmed": len(ids), "ids": formatRanges(ids), "remote": r.RemoteAddr}
	fl := flash{OK: err == nil, Text: outcome(verb, n, len(ids), rest)}
	if err != nil {
		c.cfg.Logger.Error("Console action failed", err, fields)
		fl.Text = fmt.Sprintf("%s %d of %d %s, then failed: %v. The rest stay in the table.",
			verb, n, len(ids), plural(len(ids), "entry", "entries"), err)
	} else {
		c.cfg.Logger.Info("Console action", fields)
	}
	c.setFlash(back, fl)
	seeOther(w, listURL("../", back))
}

// outcome words an action's result: "Purged 12 entries." or, when it took
// fewer than were confirmed, "Purged 10 of 12 entries (…)."
func outcome(verb string, n, confirmed int, rest string) string {
	if n == confirmed {
		return fmt.Sprintf("%s %d %s%s.", verb, n, plural(n, "entry", "entries"), rest)
	}
	return fmt.Sprintf("%s %d of %d %s%s (the others were gone, or already waiting for a replay).", verb, n, confirmed, plural(confirmed, "entry", "entries"), rest)
}

// backQuery keeps of a query string only the filter's fields, for the
// redirect after an action.
func backQuery(raw string) url.Values {
	q, _ := url.ParseQuery(raw) // what parses is kept; it only shapes a link
	return filterOf(q.Get).query()
}

// formIDs parses the id fields of a form.
func formIDs(values []string) ([]int64, error) {
	seen := map[int64]bool{}
	var ids []int64
	for _, v := range values {
		id, err := strconv.ParseInt(strings.TrimSpace(v), 10, 64)
		if err != nil || id <= 0 {
			return nil, fmt.Errorf("%q is not an entry id", clip(v))
		}
		if !seen[id] {
			seen[id] = true
			ids = append(ids, id)
		}
	}
	if len(ids) > maxAction {
		return nil, fmt.Errorf("%d entries selected: one action takes at most %d", len(ids), maxAction)
	}
	sort.Slice(ids, func(i, j int) bool { return ids[i] < ids[j] })
	return ids, nil
}

// maxQuoted is the most bytes of a form's value an error quotes: the
// value may be as long as the form (1 MiB).
const maxQuoted = 64

// clip cuts s to maxQuoted bytes, on a rune boundary, for an error that
// quotes it.
func clip(s string) string {
	if len(s) <= maxQuoted {
		return s
	}
	n := maxQuoted
	for n > 0 && !utf8.RuneStart(s[n]) {
		n--
	}
	return s[:n] + "…"
}

// formatRanges writes ascending ids as ranges: 3-7,9.
func formatRanges(ids []int64) string {
	var b strings.Builder
	for i := 0; i < len(ids); {
		j := i
		for j+1 < len(ids) && ids[j+1] == ids[j]+1 {
			j++
		}
		if b.Len() > 0 {
			b.WriteByte(',')
		}
		b.WriteString(strconv.FormatInt(ids[i], 10))
		if j > i {
			b.WriteByte('-')
			b.WriteString(strconv.FormatInt(ids[j], 10))
		}
		i = j + 1
	}
	return b.String()
}

// parseRanges reads formatRanges' output, at most maxAction ids; it
// returns them ascending, without repeats.
func parseRanges(s string) ([]int64, error) {
	var ids []int64
	if strings.TrimSpace(s) == "" {
		return nil, nil
	}
	for _, part := range strings.Split(s, ",") {
		from, to, isRange := strings.Cut(strings.TrimSpace(part), "-")
		a, err := strconv.ParseInt(from, 10, 64)
		b := a
		if err == nil && isRange {
			b, err = strconv.ParseInt(to, 10, 64)
		}
		if err != nil || a <= 0 || b < a {
			return nil, fmt.Errorf("bad id range %q: an id is a whole number from 1 to %d, a range is FROM-TO with FROM at most TO", clip(part), int64(math.MaxInt64))
		}
		// Both are positive: b-a does not overflow.
		if b-a >= int64(maxAction) || len(ids)+int(b-a+1) > maxAction {
			return nil, fmt.Errorf("more than %d ids: one action takes at most %d", maxAction, maxAction)
		}
		// Up to b and no further: id++ past math.MaxInt64 wraps to a
		// negative number, which is <= b, and the loop never ends.
		for id := a; ; id++ {
			ids = append(ids, id)
			if id == b {
				break
			}
		}
	}
	slices.Sort(ids)
	return slices.Compact(ids), nil
}
