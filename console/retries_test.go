package console_test

import (
	"context"
	"net/http"
	"net/url"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/console"
	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/dlq"
	"github.com/oncemill/oncemill/internal/testing/msgtest"
	"github.com/oncemill/oncemill/internal/testing/sqltest"
	"github.com/oncemill/oncemill/retry"
)

// retryStores are the table of parked messages and the dead-letter table
// of cfg's database.
func retryStores(t *testing.T, cfg console.Config) (*retry.Store, *dlq.Store) {
	t.Helper()
	var (
		parked *retry.Store
		dead   *dlq.Store
		err    error
	)
	if cfg.Pool != nil {
		parked, err = retry.NewStore(cfg.Pool, cfg.Schema)
		require.NoError(t, err)
		dead, err = dlq.NewStore(cfg.Pool, cfg.Schema)
	} else {
		parked, err = retry.NewSQLStore(cfg.DB, cfg.Dialect, cfg.Schema)
		require.NoError(t, err)
		dead, err = dlq.NewSQLStore(cfg.DB, cfg.Dialect, cfg.Schema)
	}
	require.NoError(t, err)
	return parked, dead
}

// parkOne parks a message of consumer on orders, after attempts failed
// attempts (0: behind another of its ordering key), due at due, and
// returns its id.
func parkOne(t *testing.T, s *retry.Store, consumer, order string, attempts int, due time.Time) int64 {
	t.Helper()
	uuid := watermill.NewUUID()
	m := retry.Message{Consumer: consumer, Topic: "orders", UUID: uuid, OrderKey: order, DueAt: due, Payload: []byte(uuid),
		Metadata: map[string]string{delivery.PartitionKey: order}}
	if attempts == 0 {
		m.Behind = true
	} else {
		m.Key, m.Attempts, m.Error = "key-"+uuid, attempts, "gateway 503 for "+uuid
		m.FirstFailedAt, m.LastFailedAt = due.Add(-time.Hour), due.Add(-time.Minute)
	}
	wrote, err := s.Park(context.Background(), m)
	require.NoError(t, err)
	require.True(t, wrote)
	ms, err := s.List(context.Background(), retry.Filter{UUID: uuid})
	require.NoError(t, err)
	return ms[0].ID
}

// parkedRows are the ids and states of the retries page's rows, in order.
func parkedRows(body string) ([]int64, []string) {
	ids, states := []int64{}, []string{}
	for _, m := range regexp.MustCompile(`<tr data-id="(\d+)" data-state="(\w+)">`).FindAllStringSubmatch(body, -1) {
		id, _ := strconv.ParseInt(m[1], 10, 64)
		ids, states = append(ids, id), append(states, m[2])
	}
	return ids, states
}

// TestRetriesOnEveryDatabase: the retries page lists the parked messages
// in the order they go out, with their state; the overview counts them,
// parked, due and overdue; "retry now" and "cancel" act through the
// confirm step, behind the token and the CSRF field, and a cancelled
// message lands in the dead-letter table once.
func TestRetriesOnEveryDatabase(t *testing.T) {
	t.Parallel()
	for _, b := range sqltest.Backends {
		t.Run(b.Name, func(t *testing.T) {
			t.Parallel()
			cfg, _ := open(t, b)
			parked, dead := retryStores(t, cfg)
			now := time.Now()
			overdue := parkOne(t, parked, "charge", "acct-1", 6, now.Add(-5*time.Minute))
			out := parkOne(t, parked, "bill", "", 5, now.Add(-30*time.Second))
			due := parkOne(t, parked, "ship", "", 5, now.Add(-5*time.Second))
			behind := parkOne(t, parked, "charge", "acct-1", 0, now)
			waiting := parkOne(t, parked, "charge", "acct-2", 5, now.Add(time.Hour))

			// bill's subscriber has its message out, and holds it.
			sub, err := parked.Subscriber(retry.SubscriberConfig{Consumer: "bill", PollInterval: 10 * time.Millisecond})
			require.NoError(t, err)
			ctx, cancel := context.WithCancel(context.Background())
			msgs, err := sub.Subscribe(ctx, "orders")
			require.NoError(t, err)
			held := msgtest.Receive(t, msgs, 30*time.Second)
			defer func() {
				held.Ack()
				msgtest.WaitFor(t, "the held message's ack", func() bool {
					_, err := parked.Get(context.Background(), out)
					return err != nil
				})
				cancel()
				require.NoError(t, sub.Close())
			}()

			cfg.Token = testToken
			c, err := console.New(cfg)
			require.NoError(t, err)
			cl := bearer(t, c)

			body := cl.page("/", http.StatusOK)
			i := strings.Index(body, `id="overview-retries"`)
			require.Positive(t, i)
			section := body[i : i+strings.Index(body[i:], "</section>")]
			require.Contains(t, section, `id="retries-total-parked">5<`)
			require.Contains(t, section, `id="retries-total-due">2<`, "the overdue and the due one; not the one behind, out or waiting")
			require.Contains(t, section, `id="retries-total-overdue">1<`)
			require.Contains(t, section, `id="retries-overdue"`, "overdue is explained")
			require.Regexp(t, `<td class="mono">charge</td><td class="mono">orders</td>\s*<td class="num"><a class="badge failed" href="./retries\?consumer=charge&amp;topic=orders">3</a></td>`, section)

			body = cl.page("/retries", http.StatusOK)
			ids, states := parkedRows(body)
			require.Equal(t, []int64{overdue, out, due, behind, waiting}, ids, "in the order they go out: by due time")
			require.Equal(t, []string{"overdue", "out", "due", "behind", "waiting"}, states)
			require.Contains(t, body, `id="retries-total">5<`)
			require.Contains(t, body, ">behind "+idText(overdue)+"<", "which message it waits for")
			require.Contains(t, body, "gateway 503 for ", "the last error")
			ids, _ = parkedRows(cl.page("/retries?"+url.Values{"consumer": {"charge"}}.Encode(), http.StatusOK))
			require.Equal(t, []int64{overdue, behind, waiting}, ids)

			// Retry now: only the waiting one moves; the others are said.
			summary, next := cl.confirmAt("/retries/confirm", url.Values{"action": {"retry-now"}, "scope": {"selection"},
				"id": {idText(waiting), idText(behind), idText(out)}})
			require.Equal(t, "Retry 1 parked message now: its consumer's retry subscriber hands it back at its next read, to the same handler.", summary)
			require.Equal(t, idText(waiting), next.Get("ids"))
			m, err := parked.Get(context.Background(), waiting)
			require.NoError(t, err)
			require.True(t, m.DueAt.After(time.Now()), "nothing changed by the confirm step")
			rec := cl.post("/retries/confirm", url.Values{"action": {"retry-now"}, "scope": {"selection"}, "id": {idText(waiting), idText(behind), idText(out)}})
			require.Contains(t, rec.Body.String(), "1 is out to its consumer, whose handler decides, and is left out.")
			require.Contains(t, rec.Body.String(), "1 is due already and left as it is. 1 of them waits behind another message of its ordering key")
			body = cl.follow(cl.post("/retries/confirm", next), "/retries/confirm")
			require.Equal(t, "ok: Made 1 parked message due now.", flashOf(body))
			m, err = parked.Get(context.Background(), waiting)
			require.NoError(t, err)
			require.False(t, m.DueAt.After(time.Now()), "due now")

			// Cancel the overdue one: it moves to the dead-letter table,
			// and the one behind it is first of its key.
			summary, next = cl.confirmAt("/retries/confirm", url.Values{"action": {"cancel"}, "scope": {"selection"}, "id": {idText(overdue)}})
			require.Contains(t, summary, "Cancel 1 parked message: it is no longer retried and moves to the dead-letter table")
			body = cl.follow(cl.post("/retries/confirm", next), "/retries/confirm")
			require.Equal(t, "ok: Cancelled 1 parked message: moved to the dead-letter table.", flashOf(body))
			ids, states = parkedRows(body)
			require.Equal(t, []int64{out, due, behind, waiting}, ids)
			require.Equal(t, []string{"out", "due", "due", "due"}, states)
			entries, err := dead.List(context.Background(), dlq.Filter{})
			require.NoError(t, err)
			require.Len(t, entries, 1)
			require.Equal(t, "charge", entries[0].Consumer)
			require.Equal(t, 6, entries[0].Attempts)
			require.True(t, strings.HasPrefix(entries[0].Error, retry.CancelReason), entries[0].Error)

			// The same ids confirmed again: nothing to move twice.
			body = cl.follow(cl.post("/retries/confirm", next), "/retries/confirm")
			require.Equal(t, "ok: Cancelled 0 of 1 parked message: moved to the dead-letter table (the others were gone, due already, or out to their consumer).", flashOf(body))
			entries, err = dead.List(context.Background(), dlq.Filter{})
			require.NoError(t, err)
			require.Len(t, entries, 1, "one dead letter")

			// Everything ship's, by the filter.
			_, next = cl.confirmAt("/retries/confirm", url.Values{"action": {"cancel"}, "scope": {"filter"}, "consumer": {"ship"}, "back": {"consumer=ship"}})
			rec = cl.post("/retries/confirm", next)
			require.Equal(t, "../retries?consumer=ship&flash=Cancelled+1+parked+message%3A+moved+to+the+dead-letter+table.&flash_ok=1&flash_sig="+
				url.QueryEscape(regexp.MustCompile(`flash_sig=([^&]+)`).FindStringSubmatch(rec.Header().Get("Location"))[1]), rec.Header().Get("Location"),
				"back to the filtered page")
			_, err = parked.Get(context.Background(), due)
			require.ErrorIs(t, err, retry.ErrNotFound)

			// Behind the token and the CSRF field.
			anon := &client{t: t, h: c}
			require.Equal(t, http.StatusUnauthorized, anon.get("/retries").Code)
			form := url.Values{"action": {"cancel"}, "ids": {idText(waiting)}, "confirm": {"1"}}
			require.Equal(t, http.StatusForbidden, cl.do(http.MethodPost, "/retries/confirm", form).Code, "no CSRF field")
			_, err = parked.Get(context.Background(), waiting)
			require.NoError(t, err, "still parked")

			// Read-only: no buttons, and the action is refused.
			cfg.ReadOnly = true
			ro, err := console.New(cfg)
			require.NoError(t, err)
			rcl := bearer(t, ro)
			body = rcl.page("/retries", http.StatusOK)
			require.NotContains(t, body, "retries/confirm")
			require.Equal(t, http.StatusForbidden, rcl.post("/retries/confirm", form).Code)
			_, err = parked.Get(context.Background(), waiting)
			require.NoError(t, err, "still parked")
		})
	}
}

// TestRetriesWithoutTheTable: a database migrated before the table of
// parked messages shows the page's notice and the overview's, not an
// error.
func TestRetriesWithoutTheTable(t *testing.T) {
	t.Parallel()
	cfg, db := open(t, sqltest.Backends[0])
	d := db.Dialect()
	_, err := db.Exec(context.Background(), `DROP TABLE `+d.Names(cfg.Schema.WithDefaults()).Retries)
	require.NoError(t, err)
	cfg.Token = testToken
	c, err := console.New(cfg)
	require.NoError(t, err)
	cl := bearer(t, c)
	require.Contains(t, cl.page("/retries", http.StatusNotFound), `id="retries-missing"`)
	body := cl.page("/", http.StatusOK)
	require.Contains(t, body, "There is no table of parked messages")
	require.Contains(t, body, `id="overview-dlq"`, "the other sections are there")
}
