//go:build chaos

package chaos_test

import (
	"fmt"
	"net/url"
	"strconv"
	"sync"
	"testing"
	"time"

	natsgo "github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/adapters/nats/embedded"
	"github.com/oncemill/oncemill/internal/testing/brokertest"
	"github.com/oncemill/oncemill/internal/testing/natstest"
	"github.com/oncemill/oncemill/internal/testing/pgtest"
)

// faultNATS restarts the NATS servers: each is stopped (SIGTERM for the
// nats-server process, Close for the embedded one), stays down 3 s and
// starts again on its port and store.
const faultNATS = "NATS server restart"

// faultNATSKill SIGKILLs the nats-server process, which stays down 3 s and
// starts again on its port and store: the messages it acknowledged are
// on disk, the acks it received since its last write of the consumers'
// state are not, and it delivers those messages again.
const faultNATSKill = "NATS server SIGKILL"

// TestChaosNATS is the chaos suite on NATS JetStream: a lane on a private
// nats-server process and one on an embedded server in this process
// (restarted on its port and store directory), two consumer processes
// each on a private PostgreSQL with the PostgreSQL store, the stream of
// TestChaos, consumers SIGKILLed at random, both NATS servers restarted,
// PostgreSQL restarted, and the nats-server process SIGKILLed. A killed
// consumer's messages come back after the lanes' 5 s ack wait; across a
// server restart every client reconnects, publishes and acks whose
// answer was lost are sent again, and what the server delivers again (a
// killed server forgets the acks it had not written) the inbox absorbs.
func TestChaosNATS(t *testing.T) {
	seed, random := seeded(t)
	pg := pgtest.StartServer(t)
	pool := chaosDB(t, pg.URL())
	proc := natstest.StartServer(t)
	emb := startEmbedded(t)

	run := strconv.FormatInt(time.Now().UnixNano()%1e9, 36)
	var lanes []*lane
	for _, srv := range []struct{ name, url string }{{"nats", proc.URL()}, {"nats_embedded", emb.url()}} {
		l := newLane(srv.name, srv.url+"?create=true&ack_wait=5s", run)
		topic, group := l.topic, l.group
		l.pending = func(t *testing.T) int { return natsPending(t, srv.url, topic, group) }
		l.addSlots(pg.URL(), "", "postgres", "postgres")
		lanes = append(lanes, l)
	}
	runChaos(t, chaosRun{
		seed: seed, random: random, pool: pool, lanes: lanes,
		// 12 SIGKILLs of a random consumer of each lane in turn, a
		// restart of both NATS servers, one of PostgreSQL and a SIGKILL of
		// the nats-server process.
		schedule: []step{
			{4 * time.Second, faultKill}, {8 * time.Second, faultKill}, {12 * time.Second, faultKill}, {16 * time.Second, faultKill},
			{20 * time.Second, faultNATS},
			{30 * time.Second, faultKill}, {34 * time.Second, faultKill}, {38 * time.Second, faultKill},
			{42 * time.Second, faultPostgres},
			{52 * time.Second, faultKill}, {56 * time.Second, faultKill}, {60 * time.Second, faultKill},
			{64 * time.Second, faultNATSKill},
			{74 * time.Second, faultKill}, {78 * time.Second, faultKill},
		},
		outages: []outage{
			{name: faultNATS, do: downFor(3*time.Second,
				func() { proc.Stop(); emb.stop(t) },
				func() { proc.Start(); emb.start(t) })},
			{name: faultNATSKill, lanes: []string{"nats"}, do: downFor(3*time.Second, proc.Kill, proc.Start)},
			{name: faultPostgres, do: downFor(3*time.Second, pg.Stop, pg.Start)},
		},
		produceFor: 82 * time.Second,
		minKills:   10,
		summary: func(kills int) string {
			return fmt.Sprintf("%d SIGKILLs, both NATS servers restarted once (3 s down), PostgreSQL restarted once (3 s down), the nats-server process SIGKILLed once (3 s down)", kills)
		},
	})
}

// restartable is an embedded NATS server that stops and starts again on
// the same port and store directory, as a server process restarts.
type restartable struct {
	port int
	dir  string

	mu  sync.Mutex
	srv *embedded.Server
}

// startEmbedded starts an embedded server on a free port with a store of
// the test's own, stopped when the test ends.
func startEmbedded(t *testing.T) *restartable {
	t.Helper()
	r := &restartable{dir: t.TempDir()}
	r.start(t)
	u, err := url.Parse(r.srv.URL())
	require.NoError(t, err)
	r.port, err = strconv.Atoi(u.Port())
	require.NoError(t, err)
	t.Cleanup(func() {
		r.mu.Lock()
		defer r.mu.Unlock()
		if r.srv != nil {
			require.NoError(t, r.srv.Close())
		}
	})
	return r
}

func (r *restartable) url() string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.srv.URL()
}

func (r *restartable) start(t *testing.T) {
	t.Helper()
	r.mu.Lock()
	defer r.mu.Unlock()
	srv, err := embedded.Start(embedded.Config{Port: r.port, StoreDir: r.dir})
	require.NoError(t, err)
	r.srv = srv
}

func (r *restartable) stop(t *testing.T) {
	t.Helper()
	r.mu.Lock()
	defer r.mu.Unlock()
	require.NoError(t, r.srv.Close())
	r.srv = nil
}

// natsPending is what group's durable consumer of topic on server has
// not had acked.
func natsPending(t *testing.T, server, topic, group string) int {
	t.Helper()
	nc, err := natsgo.Connect(server, natsgo.Timeout(5*time.Second))
	require.NoError(t, err)
	defer nc.Close()
	js, err := jetstream.New(nc)
	require.NoError(t, err)
	return brokertest.NATSPending(t, js, topic, group)
}
