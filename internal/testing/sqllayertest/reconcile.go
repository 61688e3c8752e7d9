package sqllayertest

import (
	"sort"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/dedup"
	"github.com/oncemill/oncemill/reconcile"
)

// reconcileReports: the relay's ledger against the consumer's inbox. Of
// four events relayed, one applied and one dead-lettered are accounted
// for, one the consumer never received is lost and one whose attempt
// failed is stuck; once the consumer ran again, nothing is missing.
func reconcileReports(t *testing.T, e *env) {
	broker := e.broker(false)
	c := e.newConsumer("charge", func(key string) error {
		if key == "k-dead" {
			return refuse
		}
		return nil
	})
	stop := c.run("orders", broker)
	r := e.relay(broker, nil)
	events := map[string]*message.Message{}
	for _, k := range []string{"k-done", "k-dead", "k-lost", "k-stuck"} {
		events[k] = order(k)
	}
	e.write("orders", events["k-done"], events["k-dead"])
	e.relayAll(r, 2, 0)
	e.eventually("k-done applied and k-dead dead", func() bool {
		return c.effectsOf("k-done") == 1 && e.state(c.store, c.key("k-dead")) == dedup.StateDead
	})
	stop()

	// The consumer is down: two more events are relayed, one attempt
	// fails (its retry not yet come).
	e.write("orders", events["k-lost"], events["k-stuck"])
	e.relayAll(r, 2, 0)
	require.NoError(t, c.store.InboxFail(e.ctx(), c.key("k-stuck"), dedup.Failure{Err: "gateway timeout", At: time.Now()}, time.Hour))

	cfg := reconcile.Config{Ledger: e.tables(), Consumer: "charge", Topics: []string{"orders"}, Grace: time.Millisecond}
	var rep reconcile.Report
	e.eventually("the four events in reconcile's window", func() bool {
		var err error
		rep, err = reconcile.Check(e.ctx(), cfg)
		require.NoError(t, err)
		return rep.Checked == 4
	})
	require.Equal(t, 1, rep.Lost, "k-lost")
	require.Equal(t, 1, rep.Stuck, "k-stuck")
	require.False(t, rep.OK())
	require.Len(t, rep.Missing, 2)
	missing := map[string]reconcile.Event{}
	for _, ev := range rep.Missing {
		missing[ev.Key] = ev
	}
	keys := make([]string, 0, len(missing))
	for k := range missing {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	require.Equal(t, []string{"k-lost", "k-stuck"}, keys, "the applied and the dead-lettered events are accounted for")
	require.True(t, missing["k-lost"].Lost())
	require.Equal(t, events["k-lost"].UUID, missing["k-lost"].UUID)
	require.Equal(t, "orders", missing["k-lost"].Topic)
	require.False(t, missing["k-stuck"].Lost())
	require.Equal(t, "failed", missing["k-stuck"].Inbox)
	require.Equal(t, events["k-stuck"].UUID, missing["k-stuck"].UUID)

	// The consumer again: the broker delivers every event once more; the
	// inbox absorbs the done and the dead ones and applies the others.
	c.run("orders", broker)
	e.eventually("k-lost and k-stuck applied", func() bool {
		return c.effectsOf("k-lost") == 1 && c.effectsOf("k-stuck") == 1
	})
	e.eventually("reconcile to find nothing missing", func() bool {
		var err error
		rep, err = reconcile.Check(e.ctx(), cfg)
		require.NoError(t, err)
		return rep.OK()
	})
	require.Equal(t, 4, rep.Checked)
	require.Zero(t, rep.MissingEvents())
	require.Equal(t, 1, c.effectsOf("k-done"), "the done event is not applied again")
	require.Equal(t, 1, c.callsOf("k-dead"), "the dead event does not run again")
}
