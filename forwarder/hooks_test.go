package forwarder_test

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/forwarder"
	"github.com/oncemill/oncemill/observe"
	"github.com/oncemill/oncemill/observe/prom"
)

// relayRecorder keeps what the outbox tells its hooks.
type relayRecorder struct {
	mu      sync.Mutex
	batches []observe.RelayBatch
	lags    []observe.OutboxLag
	out     []observe.Out
}

func (r *relayRecorder) OnRelayBatch(_ context.Context, b observe.RelayBatch) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.batches = append(r.batches, b)
}

func (r *relayRecorder) OnOutboxLag(_ context.Context, l observe.OutboxLag) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.lags = append(r.lags, l)
}

func (r *relayRecorder) OnMessageOut(_ context.Context, kind observe.Out, msg *message.Message) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.out = append(r.out, kind)
	msg.Metadata.Set("hop_"+string(kind), "yes")
}

// TestOutboxHooks: the writer's hooks see each event before it is written
// and what they add is stored with it; the relay's hooks see each row's
// message before it is published, each batch with rows, and the backlog.
func TestOutboxHooks(t *testing.T) {
	t.Parallel()
	b := setup(t, 4)
	ctx := context.Background()
	rec := &relayRecorder{}

	tx, err := b.pool.Begin(ctx)
	require.NoError(t, err)
	pub, err := forwarder.NewTxPublisher(ctx, tx, b.schema, forwarder.WithHooks(rec))
	require.NoError(t, err)
	require.NoError(t, pub.Publish("payments", event("k", 1), event("k", 2)))
	require.NoError(t, tx.Commit(ctx))

	s := &sink{}
	r := newRelay(t, b, s, func(c *forwarder.RelayConfig) {
		c.Hooks = []observe.Hook{rec}
		c.LagInterval = 10 * time.Millisecond
	})
	run(t, r)
	require.Eventually(t, func() bool { return len(s.snapshot()) == 2 }, 30*time.Second, 5*time.Millisecond)
	for _, m := range s.snapshot() {
		require.Equal(t, "yes", m.Metadata.Get("hop_outbox_write"), "the writer's hook wrote into the row")
		require.Equal(t, "yes", m.Metadata.Get("hop_relay"))
	}
	require.Eventually(t, func() bool {
		rec.mu.Lock()
		defer rec.mu.Unlock()
		return len(rec.lags) > 0 && rec.lags[len(rec.lags)-1].Pending == 0
	}, 30*time.Second, 5*time.Millisecond, "the backlog is reported, and it drained")

	rec.mu.Lock()
	defer rec.mu.Unlock()
	require.Equal(t, []observe.Out{observe.OutOutboxWrite, observe.OutOutboxWrite, observe.OutRelay, observe.OutRelay}, rec.out)
	rows := 0
	for _, bt := range rec.batches {
		require.NoError(t, bt.Err)
		require.Positive(t, bt.Rows)
		require.Equal(t, b.schema.Schema+".outbox", bt.Outbox)
		rows += bt.Rows
	}
	require.Equal(t, 2, rows)
}

// TestRelayMetricsNameTheOutboxPlainly: a scrape of the relay's Prometheus
// metrics labels them with the outbox table as schema.table, without the
// SQL quoting.
func TestRelayMetricsNameTheOutboxPlainly(t *testing.T) {
	t.Parallel()
	b := setup(t, 4)
	reg := prometheus.NewPedanticRegistry()
	metrics, err := prom.New(prom.Config{Registerer: reg})
	require.NoError(t, err)
	b.write(t, "payments", event("k", 1))

	s := &sink{}
	r := newRelay(t, b, s, func(c *forwarder.RelayConfig) {
		c.Hooks = []observe.Hook{metrics}
		c.LagInterval = 10 * time.Millisecond
	})
	run(t, r)
	require.Eventually(t, func() bool { return len(s.snapshot()) == 1 }, 30*time.Second, 5*time.Millisecond)

	srv := httptest.NewServer(promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	defer srv.Close()
	label := `{outbox="` + b.schema.Schema + `.outbox"}`
	var scrape string
	require.Eventually(t, func() bool {
		resp, err := http.Get(srv.URL)
		if err != nil {
			return false
		}
		defer resp.Body.Close()
		body, err := io.ReadAll(resp.Body)
		if err != nil {
			return false
		}
		scrape = string(body)
		return strings.Contains(scrape, "oncemill_outbox_published_total"+label+" 1") &&
			strings.Contains(scrape, "oncemill_outbox_lag_rows"+label)
	}, 30*time.Second, 5*time.Millisecond, "the batch and the lag are reported, labelled with the plain outbox name")
	require.NotContains(t, scrape, `\"`, "no label value carries SQL quotes")
}
