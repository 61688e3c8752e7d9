package main

import (
	"context"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"
)

// pingTimeout bounds the database check of one /healthz request.
const pingTimeout = time.Second

// publishFailureWindow is how long a failed publish keeps the service
// unready when no publish has succeeded since. The relay retries a failed
// batch at least once per RelayConfig.MaxBackoff (10 s), so a failure
// that lasts is seen again within the window; one that ended without a
// publish to prove it (another instance published the rows) ages out.
const publishFailureWindow = 20 * time.Second

// health answers /healthz: 200 when all of these hold, 503 with the
// reasons otherwise.
//
//   - The database answers a ping within pingTimeout.
//   - The router is running: from the moment it runs until the drain
//     begins (a subscription that ends stops the router, and the process
//     with it).
//   - The broker, judged by what is cheap and honest, with no probe
//     message: the subscriber's connection is up when the adapter can
//     tell (watermill-amqp reconnects in the background and reports
//     IsConnected; Kafka, SQS and GoChannel report nothing and count as
//     up), and the last publish to the broker did not fail (within
//     publishFailureWindow). The outbox relay is what publishes, all the
//     time, so its publishes are the signal: they go through
//     [health.publisher]. On RabbitMQ a publish also fails while no queue
//     is bound to EVENTS_TOPIC (amqp.ErrUnroutable): the events then pile
//     up in the outbox, and that is reported too.
type health struct {
	pool     *pgxpool.Pool
	conn     interface{ IsConnected() bool } // nil when the subscriber cannot tell
	routerUp atomic.Bool

	mu           sync.Mutex
	publishErr   error
	publishErrAt time.Time
	publishOKAt  time.Time
}

func newHealth(pool *pgxpool.Pool, sub message.Subscriber) *health {
	h := &health{pool: pool}
	if c, ok := sub.(interface{ IsConnected() bool }); ok {
		h.conn = c
	}
	return h
}

// publisher returns pub, recording the outcome of each Publish.
func (h *health) publisher(pub message.Publisher) message.Publisher {
	return trackedPublisher{Publisher: pub, h: h}
}

type trackedPublisher struct {
	message.Publisher
	h *health
}

func (p trackedPublisher) Publish(topic string, msgs ...*message.Message) error {
	err := p.Publisher.Publish(topic, msgs...)
	p.h.mu.Lock()
	defer p.h.mu.Unlock()
	if err != nil {
		p.h.publishErr, p.h.publishErrAt = err, time.Now()
	} else {
		p.h.publishOKAt = time.Now()
	}
	return err
}

// problems returns why the service is not ready; none when it is.
func (h *health) problems(ctx context.Context) []string {
	var p []string
	ctx, cancel := context.WithTimeout(ctx, pingTimeout)
	defer cancel()
	if err := h.pool.Ping(ctx); err != nil {
		p = append(p, "database: "+err.Error())
	}
	if !h.routerUp.Load() {
		p = append(p, "router: not running")
	}
	if h.conn != nil && !h.conn.IsConnected() {
		p = append(p, "broker: subscriber disconnected, reconnecting")
	}
	h.mu.Lock()
	if h.publishErr != nil && h.publishErrAt.After(h.publishOKAt) && time.Since(h.publishErrAt) < publishFailureWindow {
		p = append(p, fmt.Sprintf("broker: last publish failed %s ago: %v", time.Since(h.publishErrAt).Round(time.Millisecond), h.publishErr))
	}
	h.mu.Unlock()
	return p
}

func (h *health) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	w.Header().Set("Cache-Control", "no-store")
	if p := h.problems(r.Context()); len(p) > 0 {
		w.WriteHeader(http.StatusServiceUnavailable)
		fmt.Fprintln(w, strings.Join(p, "\n"))
		return
	}
	fmt.Fprintln(w, "ok")
}
