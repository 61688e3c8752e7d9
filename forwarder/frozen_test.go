package forwarder_test

import (
	"context"
	"net"
	"strconv"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/forwarder"
	"github.com/oncemill/oncemill/internal/testing/mysqltest"
	"github.com/oncemill/oncemill/internal/testing/netfault"
	"github.com/oncemill/oncemill/internal/testing/pgtest"
	"github.com/oncemill/oncemill/sqlschema"
)

// freezingPublisher hands the messages to the broker, then freezes the
// relay's database proxy: the broker has the batch and the database
// stops answering before the relay deletes it.
type freezingPublisher struct {
	next      message.Publisher
	proxy     *netfault.Freezer
	published chan struct{}
}

func (p *freezingPublisher) Publish(topic string, msgs ...*message.Message) error {
	err := p.next.Publish(topic, msgs...)
	p.proxy.Freeze()
	select {
	case p.published <- struct{}{}:
	default:
	}
	return err
}

func (p *freezingPublisher) Close() error { return nil }

// TestRelayStopsWhenTheDatabaseFreezesAfterPublishing: the database stops
// answering (a proxy that forwards nothing more, connections left open)
// once the broker took a batch. The relay's delete and commit give up
// within DatabaseTimeout, so that Close returns: the rows stay in the
// outbox (to be published again, which the inboxes absorb) and the broker
// got each message once. On PostgreSQL (the commit) and on MariaDB (the
// delete, the commit; database/sql's Tx.Commit honours no context).
func TestRelayStopsWhenTheDatabaseFreezesAfterPublishing(t *testing.T) {
	t.Parallel()
	const dbTimeout = time.Second
	t.Run("postgres", func(t *testing.T) {
		t.Parallel()
		b := setup(t, 4)
		cfg, err := pgxpool.ParseConfig(pgtest.URL())
		require.NoError(t, err)
		proxy := netfault.FreezeProxy(t, net.JoinHostPort(cfg.ConnConfig.Host, strconv.Itoa(int(cfg.ConnConfig.Port))))
		cfg.MaxConns = 2
		cfg.ConnConfig.DialFunc = func(ctx context.Context, network, _ string) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, network, proxy.Addr())
		}
		pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
		require.NoError(t, err)
		t.Cleanup(pool.Close)
		t.Cleanup(proxy.Close) // before pool.Close, which would wait on the frozen connections
		b.write(t, "orders", event("k", 1), event("k", 2), event("k", 3))
		runFrozen(t, proxy, forwarder.RelayConfig{Pool: pool, Schema: b.schema, DatabaseTimeout: dbTimeout},
			func() int { return b.count(t, "outbox") })
	})
	t.Run("mysql", func(t *testing.T) {
		t.Parallel()
		b := setupMySQL(t, 4)
		mcfg := mysqltest.Config(t, b.name)
		proxy := netfault.FreezeProxy(t, mcfg.Addr)
		mcfg.Addr = proxy.Addr()
		db := mysqltest.Open(t, mcfg, 4)
		w := b.begin(t)
		b.publish(t, w.tx, event("k", 1), event("k", 2), event("k", 3))
		require.NoError(t, w.tx.Commit())
		runFrozen(t, proxy, forwarder.RelayConfig{DB: db, Dialect: sqlschema.MySQL, Schema: b.schema, DatabaseTimeout: dbTimeout},
			func() int { return b.count(t, "outbox") })
	})
}

// runFrozen runs a relay of cfg (through proxy) on an outbox of three
// rows, stops it once its publish froze the proxy and checks that it
// stopped within the bound.
func runFrozen(t *testing.T, proxy *netfault.Freezer, cfg forwarder.RelayConfig, rows func() int) {
	t.Helper()
	gc := orderedGoChannel(t)
	in := subscribe(t, gc, "orders")
	pub := &freezingPublisher{next: gc, proxy: proxy, published: make(chan struct{}, 1)}
	cfg.Publisher = pub
	cfg.DrainTimeout = time.Second
	// No wait for transactions elsewhere on the shared server.
	cfg.LockOrderedWriters = true
	r, err := forwarder.NewRelay(cfg)
	require.NoError(t, err)
	t.Cleanup(func() { _ = r.Close() })
	done := make(chan error, 1)
	go func() { done <- r.Run(context.Background()) }()
	select {
	case <-pub.published:
	case <-time.After(30 * time.Second):
		t.Fatal("the relay published nothing in 30s")
	}

	stopped := make(chan struct{})
	began := time.Now()
	go func() {
		defer close(stopped)
		_ = r.Close()
	}()
	select {
	case <-stopped:
	case <-time.After(20 * time.Second):
		// Let the test end: the proxy's Close breaks the connections.
		proxy.Close()
		<-stopped
		t.Fatalf("Close returned only once the connections broke, after %s", time.Since(began).Round(time.Second))
	}
	took := time.Since(began)
	t.Logf("Close returned after %s", took.Round(10*time.Millisecond))
	require.NoError(t, <-done)
	require.Less(t, took, 5*time.Second, "DatabaseTimeout (1s) bounds the commit, DrainTimeout (1s) the rest")
	require.Len(t, in.snapshot(), 3, "the broker took the batch once")
	require.Equal(t, 3, rows(), "the rows stay, to be published again")
}
