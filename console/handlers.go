package console

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/oncemill/oncemill/dlq"
	"github.com/oncemill/oncemill/forwarder"
	"github.com/oncemill/oncemill/retry"
)

// overviewData is the overview's.
type overviewData struct {
	InboxTable, DLQTable, OutboxTable string

	Inbox        []inboxStat
	InboxTotal   inboxStat
	InboxMissing bool
	InboxErr     string

	DLQ        []dlq.Count
	DLQTotal   int
	Groups     []group
	DLQMissing bool
	DLQErr     string
	// Pending are the replays to a consumer requested and not delivered
	// yet, each with the warning when no replay subscriber of its
	// consumer runs; PendingErr is why they could not be read.
	Pending    []pendingReplay
	PendingErr string

	Outbox        forwarder.Lag
	Holder        string
	OutboxMissing bool
	OutboxErr     string

	// Retries counts the parked messages per consumer and topic, and
	// RetryTotal all of them.
	RetryTable     string
	Retries        []retry.Count
	RetryTotal     retry.Count
	RetriesMissing bool
	RetriesErr     string
	Overdue        string

	// DeadDiffer lists the consumers whose dead inbox rows and dead
	// letters differ in number, which the page explains.
	DeadDiffer []deadDiff

	// Reconcile holds Config.Reconcile's checks, in order.
	Reconcile   []reconcileRow
	LedgerTable string
}

// deadDiff is a consumer whose count of dead inbox rows (Inbox) differs
// from its count of entries in the dead-letter table (Letters): they
// count different things.
type deadDiff struct {
	Consumer       string
	Inbox, Letters int
}

// deadDiffs compares, per consumer, the dead rows of the inbox with the
// entries of the dead-letter table, in the order of the consumers' names.
func deadDiffs(inbox []inboxStat, letters []dlq.Count) []deadDiff {
	by := map[string]*deadDiff{}
	get := func(consumer string) *deadDiff {
		if by[consumer] == nil {
			by[consumer] = &deadDiff{Consumer: consumer}
		}
		return by[consumer]
	}
	for _, s := range inbox {
		get(s.Consumer).Inbox += s.Dead
	}
	for _, n := range letters {
		if n.Consumer != "" {
			get(n.Consumer).Letters += n.Entries
		}
	}
	var out []deadDiff
	for _, d := range by {
		if d.Inbox != d.Letters {
			out = append(out, *d)
		}
	}
	slices.SortFunc(out, func(a, b deadDiff) int { return strings.Compare(a.Consumer, b.Consumer) })
	return out
}

// pendingReplay is a line of the overview's waiting replays.
type pendingReplay struct {
	dlq.PendingReplay
	// NoReplayer says that nobody would pick them up; "" when a replay
	// subscriber of the consumer runs.
	NoReplayer string
}

// pendingReplays are the replays requested and not delivered, with a
// warning for each consumer that no replay subscriber serves.
func (c *Console) pendingReplays(ctx context.Context) ([]pendingReplay, error) {
	ps, err := c.dlq.PendingReplays(ctx)
	if err != nil {
		return nil, err
	}
	out := make([]pendingReplay, len(ps))
	for i, p := range ps {
		out[i].PendingReplay = p
		if out[i].NoReplayer, err = c.noReplayer(ctx, p.Consumer); err != nil {
			return nil, err
		}
	}
	return out, nil
}

// overview serves GET /: the inbox per consumer, the dead letters per
// consumer and topic and by error, and the outbox's backlog. A section
// whose table is missing says so; one whose query fails shows the error,
// and the others are shown all the same.
func (c *Console) overview(w http.ResponseWriter, r *http.Request) {
	ctx := r.Context()
	sc := c.cfg.Schema
	d := overviewData{InboxTable: sc.Schema + "." + sc.InboxTable, DLQTable: sc.Schema + "." + sc.DLQTable, OutboxTable: sc.Schema + "." + sc.OutboxTable}

	stats, err := c.inboxStats(ctx, c.cfg.Now())
	switch {
	case c.undefined(err):
		d.InboxMissing = true
	case err != nil:
		d.InboxErr = err.Error()
	default:
		d.Inbox = stats
		d.InboxTotal.Consumer = "all consumers"
		for _, s := range stats {
			d.InboxTotal.LastHour += s.LastHour
			d.InboxTotal.LastDay += s.LastDay
			d.InboxTotal.Processing += s.Processing
			d.InboxTotal.Failing += s.Failing
			d.InboxTotal.Dead += s.Dead
			d.InboxTotal.DeadCopies += s.DeadCopies
		}
	}

	counts, err := c.dlq.Counts(ctx)
	if err == nil {
		d.Groups, err = c.groups(ctx, criteria{}, topGroups)
	}
	switch {
	case c.undefined(err):
		d.DLQMissing = true
	case err != nil:
		d.DLQErr = err.Error()
	default:
		d.DLQ = counts
		for _, n := range counts {
			d.DLQTotal += n.Entries
		}
	}

	if !d.InboxMissing && d.InboxErr == "" && !d.DLQMissing && d.DLQErr == "" {
		d.DeadDiffer = deadDiffs(d.Inbox, d.DLQ)
	}
	if !d.DLQMissing && d.DLQErr == "" {
		if d.Pending, err = c.pendingReplays(ctx); err != nil {
			d.PendingErr = err.Error()
		}
	}

	d.Reconcile = c.reconcileRows(ctx)

	d.RetryTable, d.Overdue = sc.Schema+"."+sc.RetryTable, compact(retry.DefaultOverdue)
	retries, err := c.retryStore.Counts(ctx, retry.DefaultOverdue)
	switch {
	case c.undefined(err):
		d.RetriesMissing = true
	case err != nil:
		d.RetriesErr = err.Error()
	default:
		d.Retries = retries
		for _, n := range retries {
			d.RetryTotal.Parked += n.Parked
			d.RetryTotal.Due += n.Due
			d.RetryTotal.Overdue += n.Overdue
		}
	}

	lag, err := c.outboxLag(ctx)
	switch {
	case c.undefined(err):
		d.OutboxMissing = true
	case err != nil:
		d.OutboxErr = err.Error()
	default:
		d.Outbox = lag
		if lag.HeldBy != nil {
			d.Holder = lag.HeldBy.String()
		}
	}
	c.render(w, r, http.StatusOK, "overview", c.newPage(r, "Overview", "overview", d))
}

// filterForm is the filter form as submitted: the raw values, shown back
// as they were typed.
type filterForm struct {
	Topic, Consumer, Error, Since, Until, Group string
}

// readFilter reads the filter fields of r's form (query or POST body).
func readFilter(r *http.Request) filterForm {
	return filterOf(func(k string) string { return strings.TrimSpace(r.FormValue(k)) })
}

// filterOf reads the filter fields with get, by their names in a form.
func filterOf(get func(string) string) filterForm {
	return filterForm{Topic: get("topic"), Consumer: get("consumer"), Error: get("error"),
		Since: get("since"), Until: get("until"), Group: get("group")}
}

// criteria parses f; the error names the field.
func (f filterForm) criteria(now time.Time) (criteria, error) {
	cr := criteria{Topic: f.Topic, Consumer: f.Consumer, Error: f.Error, Group: f.Group}
	var err error
	if f.Since != "" {
		if cr.Since, err = parseWhen(f.Since, now); err != nil {
			return criteria{}, fmt.Errorf("since: %w", err)
		}
	}
	if f.Until != "" {
		if cr.Until, err = parseWhen(f.Until, now); err != nil {
			return criteria{}, fmt.Errorf("until: %w", err)
		}
	}
	if !cr.Since.IsZero() && !cr.Until.IsZero() && cr.Since.After(cr.Until) {
		return criteria{}, fmt.Errorf("since (%s) is after until (%s)", cr.Since.UTC().Format(timeLayout), cr.Until.UTC().Format(timeLayout))
	}
	return cr, nil
}

// query returns f as a query string's values, empty fields left out.
func (f filterForm) query() url.Values {
	q := url.Values{}
	for k, v := range map[string]string{"topic": f.Topic, "consumer": f.Consumer, "error": f.Error,
		"since": f.Since, "until": f.Until, "group": f.Group} {
		if v != "" {
			q.Set(k, v)
		}
	}
	return q
}

// isEmpty reports whether f filters nothing.
func (f filterForm) isEmpty() bool { return f == filterForm{} }

// localLayouts are the zone-less times a since or until may be, taken as
// UTC: what a datetime-local input sends, and a date.
var localLayouts = []string{"2006-01-02T15:04", "2006-01-02T15:04:05", "2006-01-02 15:04", "2006-01-02 15:04:05", "2006-01-02"}

// parseWhen reads a since or until value: RFC 3339; a time without a zone
// (a datetime-local input's value), in UTC; or a duration ago, such as
// 90m, 2h or 7d, as the oncemill command takes them.
func parseWhen(s string, now time.Time) (time.Time, error) {
	if t, err := time.Parse(time.RFC3339Nano, s); err == nil {
		return t, nil
	}
	for _, layout := range localLayouts {
		if t, err := time.ParseInLocation(layout, s, time.UTC); err == nil {
			return t, nil
		}
	}
	bad := fmt.Errorf("%q is neither a time (RFC 3339, or 2006-01-02T15:04 in UTC) nor a duration ago like 90m, 2h or 7d", s)
	var d time.Duration
	if days, ok := strings.CutSuffix(s, "d"); ok {
		n, err := strconv.Atoi(days)
		if err != nil || n < 0 || n > 100000 {
			return time.Time{}, bad
		}
		d = time.Duration(n) * 24 * time.Hour
	} else {
		var err error
		if d, err = time.ParseDuration(s); err != nil || d < 0 {
			return time.Time{}, bad
		}
	}
	return now.Add(-d), nil
}

// groupView is a group row with its link.
type groupView struct {
	group
	URL    string
	Active bool
}

// dlqData is the dead letters' page's.
type dlqData struct {
	Filter     filterForm
	FilterErr  string
	Filtered   bool
	Total      int
	Rows       []listRow
	Page       int
	Pages      int
	From, To   int
	PrevURL    string
	NextURL    string
	Groups     []groupView
	GroupCount int
	ClearGroup string
	// BulkScope is the scope of the bulk form: "group" with a group,
	// else "filter".
	BulkScope string
	// Back is the query of this view, for the confirm step to come back
	// to.
	Back      string
	Topics    []string
	Consumers []string
}

// deadLetters serves GET /dlq: the filter form, the groups of the
// filtered entries by error, and one page of them, newest first.
func (c *Console) deadLetters(w http.ResponseWriter, r *http.Request) {
	ctx := r.Context()
	f := readFilter(r)
	d := dlqData{Filter: f, Filtered: !f.isEmpty(), Page: 1, BulkScope: "filter"}
	if f.Group != "" {
		d.BulkScope = "group"
	}
	p := c.newPage(r, "Dead letters", "dlq", &d)
	p.Flash = c.flashOf(r)

	if counts, err := c.dlq.Counts(ctx); err == nil {
		seenT, seenC := map[string]bool{}, map[string]bool{}
		for _, n := range counts {
			if n.Topic != "" && !seenT[n.Topic] {
				seenT[n.Topic] = true
				d.Topics = append(d.Topics, n.Topic)
			}
			if n.Consumer != "" && !seenC[n.Consumer] {
				seenC[n.Consumer] = true
				d.Consumers = append(d.Consumers, n.Consumer)
			}
		}
	} else if c.undefined(err) {
		c.fail(w, r, http.StatusNotFound, "There is no dead-letter table "+c.cfg.Schema.Schema+"."+c.cfg.Schema.DLQTable+": run sqlschema.Migrate with this Schema.")
		return
	} else {
		c.internal(w, r, "count dead letters", err)
		return
	}

	cr, err := f.criteria(c.cfg.Now())
	if err == nil {
		if ps := r.FormValue("page"); ps != "" {
			n, perr := strconv.Atoi(ps)
			if perr != nil || n < 1 {
				err = fmt.Errorf("page must be a positive number, got %q", ps)
			}
			d.Page = n
		}
	}
	if err != nil {
		d.FilterErr = err.Error()
		c.render(w, r, http.StatusBadRequest, "dlq", p)
		return
	}

	if d.Total, err = c.countDead(ctx, cr); err != nil {
		c.internal(w, r, "count dead letters", err)
		return
	}
	size := c.cfg.PageSize
	d.Pages = max(1, (d.Total+size-1)/size)
	if d.Rows, err = c.listDead(ctx, cr, size, (d.Page-1)*size); err != nil {
		c.internal(w, r, "list dead letters", err)
		return
	}
	if len(d.Rows) > 0 {
		d.From = (d.Page-1)*size + 1
		d.To = d.From + len(d.Rows) - 1
	}

	q := f.query()
	d.Back = q.Encode()
	pageURL := func(n int) string {
		q := f.query()
		if n > 1 {
			q.Set("page", strconv.Itoa(n))
		}
		return listURL(p.Base, q)
	}
	if d.Page > 1 {
		d.PrevURL = pageURL(min(d.Page-1, d.Pages))
	}
	if d.Page < d.Pages {
		d.NextURL = pageURL(d.Page + 1)
	}

	// The groups of the filter without its group, so that the others
	// stay in sight.
	all := cr
	all.Group = ""
	groups, err := c.groups(ctx, all, groupsShown)
	if err != nil {
		c.internal(w, r, "group dead letters", err)
		return
	}
	nogroup := f
	nogroup.Group = ""
	d.ClearGroup = listURL(p.Base, nogroup.query())
	for _, g := range groups {
		d.GroupCount = g.GroupsInTotal
		q := nogroup.query()
		q.Set("group", g.Text)
		d.Groups = append(d.Groups, groupView{group: g, URL: listURL(p.Base, q), Active: g.Text == f.Group})
	}
	c.render(w, r, http.StatusOK, "dlq", p)
}

// listURL is the dead letters' page with query q, relative to base.
func listURL(base string, q url.Values) string {
	if len(q) == 0 {
		return base + "dlq"
	}
	return base + "dlq?" + q.Encode()
}

// entryData is an entry's page's.
type entryData struct {
	E        entryRow
	Payload  shown
	Metadata []kv
	Group    string
	GroupURL string
	InboxURL string
	// CanReplayConsumer and CanReplayTopic say which replays the entry
	// allows: one to its consumer needs a consumer and a topic, one to
	// its topic a topic (and a Publisher).
	CanReplayConsumer, CanReplayTopic bool
	// CanReopen says that the entry's key is dead in the inbox table
	// beside, where a reopen lets its next copy run (dlq.Store.Reopen).
	CanReopen bool
	// NoReplayer warns that the entry's consumer has no replay subscriber
	// running; Hopeless says why a replay cannot succeed as it is.
	NoReplayer, Hopeless string
	// Counted says what E.Attempts counts and who counted it; Place is
	// the broker's place of the original, only what the entry has.
	Counted dlq.Counted
	Place   []dlq.Fact
}

// entry serves GET /dlq/{id}.
func (c *Console) entry(w http.ResponseWriter, r *http.Request, idText string) {
	id, err := strconv.ParseInt(idText, 10, 64)
	if err != nil || id <= 0 {
		c.fail(w, r, http.StatusNotFound, "No such dead letter: "+strconv.Quote(idText)+" is not an entry id.")
		return
	}
	ctx := r.Context()
	e, err := c.getEntry(ctx, id)
	switch {
	case errors.Is(err, errNoEntry):
		c.fail(w, r, http.StatusNotFound, fmt.Sprintf("No dead letter %d: it was replayed or purged, or never existed.", id))
		return
	case err != nil:
		c.internal(w, r, "read the dead letter", err)
		return
	}
	p := c.newPage(r, fmt.Sprintf("Dead letter %d", id), "dlq", nil)
	d := entryData{
		E:                 e,
		Payload:           show(e.Payload, e.PayloadSize),
		Metadata:          sortedMetadata(e.Metadata),
		Group:             NormalizeError(e.Error),
		CanReplayConsumer: e.Consumer != "" && e.Topic != "",
		CanReplayTopic:    e.Topic != "" && p.CanReplayTopic,
	}
	facts := dlq.Entry{Attempts: e.Attempts, Partition: e.Partition, Offset: e.Offset, Metadata: e.Metadata, Key: e.Key, Permanent: e.Permanent}
	d.Counted, d.Place, d.Hopeless = facts.AttemptsCounted(), facts.Place(), facts.Hopeless()
	d.CanReopen = e.Consumer != "" && e.Key != "" && e.CopiesKnown
	if d.CanReplayConsumer {
		if d.NoReplayer, err = c.noReplayer(ctx, e.Consumer); err != nil {
			c.internal(w, r, "read the replay subscribers", err)
			return
		}
	}
	d.GroupURL = listURL(p.Base, url.Values{"group": {d.Group}})
	if e.Consumer != "" && e.Key != "" {
		d.InboxURL = p.Base + "inbox?" + url.Values{"consumer": {e.Consumer}, "key": {e.Key}}.Encode()
	}
	p.Data = d
	c.render(w, r, http.StatusOK, "entry", p)
}

// inboxData is the inbox lookup's.
type inboxData struct {
	Consumers     []string
	Consumer, Key string
	Asked         bool
	Found         bool
	K             inboxRow
	Result        shown
	Missing       bool
	DLQURL        string
}

// inbox serves GET /inbox?consumer=&key=: one key's record.
func (c *Console) inbox(w http.ResponseWriter, r *http.Request) {
	ctx := r.Context()
	d := inboxData{Consumer: r.FormValue("consumer"), Key: r.FormValue("key")}
	p := c.newPage(r, "Inbox", "inbox", &d)
	consumers, err := c.consumers(ctx)
	switch {
	case c.undefined(err):
		d.Missing = true
		c.render(w, r, http.StatusNotFound, "inbox", p)
		return
	case err != nil:
		c.internal(w, r, "list the inbox's consumers", err)
		return
	}
	d.Consumers = consumers
	if d.Consumer != "" && !slices.Contains(consumers, d.Consumer) {
		d.Consumers = append([]string{d.Consumer}, consumers...)
	}
	if d.Consumer == "" || d.Key == "" {
		c.render(w, r, http.StatusOK, "inbox", p)
		return
	}
	d.Asked = true
	d.DLQURL = listURL(p.Base, url.Values{"consumer": {d.Consumer}})
	k, err := c.lookupKey(ctx, d.Consumer, d.Key)
	switch {
	case errors.Is(err, errNoKey):
		c.render(w, r, http.StatusNotFound, "inbox", p)
		return
	case err != nil:
		c.internal(w, r, "look up the key", err)
		return
	}
	d.Found, d.K = true, k
	size := 0
	if k.ResultSize != nil {
		size = *k.ResultSize
	}
	d.Result = show(k.Result, size)
	c.render(w, r, http.StatusOK, "inbox", p)
}
