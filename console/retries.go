package console

import (
	"fmt"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill"

	"github.com/oncemill/oncemill/retry"
)

// The retries page: the messages the poison middleware parked for a
// delayed retry, in the order their consumer's retry subscriber hands
// them back, each with its state. An operator retries some now or
// cancels them into the dead-letter table, in two steps as with the dead
// letters: the confirm step resolves the selection to ids and says what
// each action will do to them; the action takes exactly those ids.

const (
	actRetryNow = "retry-now"
	actCancel   = "cancel"
)

// retryFilter is the retries page's filter form, as submitted.
type retryFilter struct{ Consumer, Topic string }

func readRetryFilter(get func(string) string) retryFilter {
	return retryFilter{Consumer: strings.TrimSpace(get("consumer")), Topic: strings.TrimSpace(get("topic"))}
}

func (f retryFilter) query() url.Values {
	q := url.Values{}
	if f.Consumer != "" {
		q.Set("consumer", f.Consumer)
	}
	if f.Topic != "" {
		q.Set("topic", f.Topic)
	}
	return q
}

// retriesURL is the retries page with query q, relative to base.
func retriesURL(base string, q url.Values) string {
	if len(q) == 0 {
		return base + "retries"
	}
	return base + "retries?" + q.Encode()
}

// parkedRow is a parked message as the list shows it.
type parkedRow struct {
	retry.Message
	// State is waiting, due, overdue, out or behind; StateTitle says
	// what it means.
	State, StateTitle string
}

// parkedRowOf is m with its state at now.
func parkedRowOf(m retry.Message, now time.Time) parkedRow {
	r := parkedRow{Message: m}
	switch {
	case m.Out(now):
		r.State, r.StateTitle = "out", "Handed back to its consumer, whose handler runs it now"
	case m.WaitsFor != 0:
		r.State, r.StateTitle = "behind", fmt.Sprintf("Waits for message %d of its ordering key, whatever its due time", m.WaitsFor)
	case m.Overdue(now, retry.DefaultOverdue):
		r.State, r.StateTitle = "overdue", "Due more than "+compact(retry.DefaultOverdue)+" ago and not taken: no retry subscriber of its consumer and topic runs, or it is far behind"
	case m.Due(now):
		r.State, r.StateTitle = "due", "Its consumer's retry subscriber takes it at its next read"
	default:
		r.State, r.StateTitle = "waiting", "Waits for its due time"
	}
	return r
}

// retriesData is the retries page's.
type retriesData struct {
	Table     string
	Filter    retryFilter
	Filtered  bool
	Counts    []retry.Count
	Total     int
	Rows      []parkedRow
	Back      string
	Consumers []string
	Topics    []string
	Missing   bool
	Overdue   string
}

// retries serves GET /retries: the counts per consumer and topic, and the
// first PageSize parked messages the filter selects, in the order they
// go out.
func (c *Console) retries(w http.ResponseWriter, r *http.Request) {
	ctx := r.Context()
	f := readRetryFilter(r.FormValue)
	sc := c.cfg.Schema
	d := &retriesData{Table: sc.Schema + "." + sc.RetryTable, Filter: f, Filtered: f != retryFilter{},
		Back: f.query().Encode(), Overdue: compact(retry.DefaultOverdue)}
	p := c.newPage(r, "Retries", "retries", d)
	p.Flash = c.flashOf(r)
	counts, err := c.retryStore.Counts(ctx, retry.DefaultOverdue)
	switch {
	case c.undefined(err):
		d.Missing = true
		c.render(w, r, http.StatusNotFound, "retries", p)
		return
	case err != nil:
		c.internal(w, r, "count parked messages", err)
		return
	}
	d.Counts = counts
	for _, n := range counts {
		if !containsString(d.Consumers, n.Consumer) {
			d.Consumers = append(d.Consumers, n.Consumer)
		}
		if !containsString(d.Topics, n.Topic) {
			d.Topics = append(d.Topics, n.Topic)
		}
	}
	sel := retry.Filter{Consumer: f.Consumer, Topic: f.Topic}
	if d.Total, err = c.retryStore.Count(ctx, sel); err != nil {
		c.internal(w, r, "count parked messages", err)
		return
	}
	sel.Limit = c.cfg.PageSize
	ms, err := c.retryStore.List(ctx, sel)
	if err != nil {
		c.internal(w, r, "list parked messages", err)
		return
	}
	now := c.cfg.Now()
	for _, m := range ms {
		d.Rows = append(d.Rows, parkedRowOf(m, now))
	}
	c.render(w, r, http.StatusOK, "retries", p)
}

func containsString(list []string, s string) bool {
	for _, v := range list {
		if v == s {
			return true
		}
	}
	return false
}

// retryConfirmData is the retries' confirm page's.
type retryConfirmData struct {
	Action  string
	Summary string
	Notes   []string
	IDs     string
	Count   int
	Back    string
	BackURL string
}

// retryConfirm serves POST /retries/confirm: the confirm step, or, with
// confirm=1, the action.
func (c *Console) retryConfirm(w http.ResponseWriter, r *http.Request) {
	if c.cfg.ReadOnly {
		c.fail(w, r, http.StatusForbidden, "This console is read-only: retries and cancels are refused.")
		return
	}
	action := r.PostFormValue("action")
	if action != actRetryNow && action != actCancel {
		c.fail(w, r, http.StatusBadRequest, "Unknown action "+strconv.Quote(action)+": use retry-now or cancel.")
		return
	}
	back := readRetryFilter(func(k string) string {
		q, _ := url.ParseQuery(r.PostFormValue("back")) // what parses is kept; it only shapes a link
		return q.Get(k)
	}).query()
	if r.PostFormValue("confirm") == "1" {
		c.retryExecute(w, r, action, back)
		return
	}

	var sel retry.Filter
	switch scope := r.PostFormValue("scope"); scope {
	case "selection":
		ids, err := formIDs(r.PostForm["id"])
		if err != nil {
			c.fail(w, r, http.StatusBadRequest, err.Error())
			return
		}
		if len(ids) == 0 {
			c.fail(w, r, http.StatusBadRequest, "No parked messages selected: tick them first.")
			return
		}
		sel.IDs = ids
	case "filter":
		f := readRetryFilter(r.PostFormValue)
		sel.Consumer, sel.Topic, sel.All = f.Consumer, f.Topic, true
	default:
		c.fail(w, r, http.StatusBadRequest, "Unknown scope "+strconv.Quote(scope)+": use selection or filter.")
		return
	}
	sel.Limit = maxAction + 1
	ms, err := c.retryStore.List(r.Context(), sel)
	if err != nil {
		c.internal(w, r, "select the parked messages", err)
		return
	}
	d := retryConfirmData{Action: action, Back: back.Encode(), BackURL: retriesURL("../", back)}
	if len(ms) > maxAction {
		ms = ms[:maxAction]
		d.Notes = append(d.Notes, fmt.Sprintf("More than %d parked messages match; this takes the first %d to go out. Run it again for the rest.", maxAction, maxAction))
	}
	if len(sel.IDs) > len(ms) {
		gone := len(sel.IDs) - len(ms)
		d.Notes = append(d.Notes, fmt.Sprintf("%d of the selected %s gone (handed back and acked, or cancelled meanwhile).",
			gone, plural(gone, "message is", "messages are")))
	}
	now := c.cfg.Now()
	var ids []int64
	var out, due, behind int
	for _, m := range ms {
		switch {
		case m.Out(now):
			out++
		case action == actRetryNow && !m.DueAt.After(now):
			due++
			if m.WaitsFor != 0 {
				behind++
			}
		default:
			ids = append(ids, m.ID)
		}
	}
	if out > 0 {
		d.Notes = append(d.Notes, fmt.Sprintf("%d %s out to %s consumer, whose handler decides, and %s left out.",
			out, plural(out, "is", "are"), plural(out, "its", "their"), plural(out, "is", "are")))
	}
	if due > 0 {
		note := fmt.Sprintf("%d %s due already and left as %s.", due, plural(due, "is", "are"), plural(due, "it is", "they are"))
		if behind > 0 {
			note += fmt.Sprintf(" %d of them %s behind another message of %s ordering key, and %s right after it: retry that one.",
				behind, plural(behind, "waits", "wait"), plural(behind, "its", "their"), plural(behind, "goes", "go"))
		}
		d.Notes = append(d.Notes, note)
	}
	d.Count = len(ids)
	d.IDs = formatRanges(ids)
	messages := fmt.Sprintf("%d parked %s", d.Count, plural(d.Count, "message", "messages"))
	switch {
	case d.Count == 0:
		d.Summary = "Nothing to do: no parked message the action can take."
	case action == actRetryNow:
		d.Summary = "Retry " + messages + " now: " + plural(d.Count, "its", "their") + " consumer's retry subscriber hands " +
			plural(d.Count, "it", "them") + " back at its next read, to the same handler."
	default:
		d.Summary = fmt.Sprintf("Cancel %s: %s no longer retried and %s to the dead-letter table %s.%s, from where %s can be replayed or purged.",
			messages, plural(d.Count, "it is", "they are"), plural(d.Count, "moves", "move"),
			c.cfg.Schema.Schema, c.cfg.Schema.DLQTable, plural(d.Count, "it", "they"))
	}
	c.render(w, r, http.StatusOK, "retries-confirm", c.newPage(r, "Confirm", "retries", d))
}

// retryExecute runs the confirmed action on the confirmed ids and
// redirects to the retries page with the outcome.
func (c *Console) retryExecute(w http.ResponseWriter, r *http.Request, action string, back url.Values) {
	ids, err := parseRanges(r.PostFormValue("ids"))
	if err != nil {
		c.fail(w, r, http.StatusBadRequest, err.Error())
		return
	}
	if len(ids) == 0 {
		c.fail(w, r, http.StatusBadRequest, "Nothing confirmed: no parked message ids.")
		return
	}
	ctx := r.Context()
	f := retry.Filter{IDs: ids}
	var (
		n          int
		verb, rest string
	)
	switch action {
	case actRetryNow:
		verb, rest = "Made", " due now"
		n, err = c.retryStore.RetryNow(ctx, f)
	case actCancel:
		verb, rest = "Cancelled", ": moved to the dead-letter table"
		n, err = c.retryStore.Cancel(ctx, f, c.deadPublisher, "")
	}
	fields := watermill.LogFields{"action": action, "messages": n, "confirmed": len(ids), "ids": formatRanges(ids), "remote": r.RemoteAddr}
	text := fmt.Sprintf("%s %d parked %s%s.", verb, n, plural(n, "message", "messages"), rest)
	if n != len(ids) {
		text = fmt.Sprintf("%s %d of %d parked %s%s (the others were gone, due already, or out to their consumer).",
			verb, n, len(ids), plural(len(ids), "message", "messages"), rest)
	}
	fl := flash{OK: err == nil, Text: text}
	if err != nil {
		c.cfg.Logger.Error("Console action failed", err, fields)
		fl.Text = fmt.Sprintf("%s %d of %d parked %s, then failed: %v. The rest stay parked.",
			verb, n, len(ids), plural(len(ids), "message", "messages"), err)
	} else {
		c.cfg.Logger.Info("Console action", fields)
	}
	c.setFlash(back, fl)
	seeOther(w, retriesURL("../", back))
}
