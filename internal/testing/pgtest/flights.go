package pgtest

import (
	"context"
	"net"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
)

// Flights counts a pool's round trips: a write after a read (or the first
// write) starts one, so that a pipeline's messages, however many writes
// they take, count once.
type Flights struct {
	n       atomic.Int64
	reading atomic.Bool
}

// Measure returns the round trips f made.
func (c *Flights) Measure(f func()) int64 {
	c.reading.Store(true)
	before := c.n.Load()
	f()
	return c.n.Load() - before
}

// FlightPool is a pool on the test server, its round trips counted.
func FlightPool(t testing.TB, maxConns int32) (*pgxpool.Pool, *Flights) {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(URL())
	if err != nil {
		t.Fatalf("parse test database URL: %v", err)
	}
	cfg.MaxConns = maxConns
	fl := &Flights{}
	dial := cfg.ConnConfig.DialFunc
	cfg.ConnConfig.DialFunc = func(ctx context.Context, network, addr string) (net.Conn, error) {
		c, err := dial(ctx, network, addr)
		if err != nil {
			return nil, err
		}
		return flightConn{Conn: c, fl: fl}, nil
	}
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		Unavailable(t, "PostgreSQL", err)
	}
	t.Cleanup(pool.Close)
	return pool, fl
}

type flightConn struct {
	net.Conn
	fl *Flights
}

func (c flightConn) Write(p []byte) (int, error) {
	if c.fl.reading.CompareAndSwap(true, false) {
		c.fl.n.Add(1)
	}
	return c.Conn.Write(p)
}

func (c flightConn) Read(p []byte) (int, error) {
	c.fl.reading.Store(true)
	return c.Conn.Read(p)
}
