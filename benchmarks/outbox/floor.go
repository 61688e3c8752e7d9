package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// rawBatch is the raw relay's batch size: forwarder.RelayConfig's default
// BatchSize.
const rawBatch = 500

// FloorResult sets a raw relay against oncemill's relay on the same backlog
// and broker: Raw and Relay are two throughput runs, one after the other.
type FloorResult struct {
	Broker    string
	Instances int
	Raw       Result
	Relay     Result
	// Ratio is Relay.Throughput / Raw.Throughput.
	Ratio float64
}

// raw is the floor: a hand-written relay on oncemill's outbox table with
// none of the relay's ordering. Each worker loops on one transaction per
// batch that deletes up to rawBatch rows in id order, skipping rows other
// workers hold, publishes what the DELETE returned, then commits. Rows are
// written through forwarder.TxPublisher, as for the relay.
type raw struct {
	*ours
	take string
}

func newRaw(ctx context.Context, e *env, id string) (*raw, error) {
	o, err := newOurs(ctx, e, id)
	if err != nil {
		return nil, err
	}
	return rawOn(o), nil
}

// rawOn returns the raw relay on o's outbox table.
func rawOn(o *ours) *raw {
	t := o.names().Outbox
	return &raw{ours: o, take: `DELETE FROM ` + t + ` WHERE id IN (
	SELECT id FROM ` + t + ` ORDER BY id FOR UPDATE SKIP LOCKED LIMIT $1)
RETURNING id, topic, uuid, payload, metadata`}
}

// start starts n raw workers on the benchmark's pool publishing to pub;
// the function it returns stops them and waits for them.
func (w *raw) start(ctx context.Context, n int, pub message.Publisher) (func() error, error) {
	return w.startOn(ctx, w.e.pool, n, pub)
}

// startOn starts n raw workers on pool publishing to pub; the function it
// returns stops them and waits for them.
func (w *raw) startOn(ctx context.Context, pool *pgxpool.Pool, n int, pub message.Publisher) (func() error, error) {
	ctx, cancel := context.WithCancel(ctx)
	var (
		wg   sync.WaitGroup
		errs = make([]error, n)
	)
	for i := range n {
		wg.Go(func() { errs[i] = w.work(ctx, pool, pub) })
	}
	return func() error {
		cancel()
		wg.Wait()
		return errors.Join(errs...)
	}, nil
}

// work runs batches until ctx is done; an empty batch waits 5ms.
func (w *raw) work(ctx context.Context, pool *pgxpool.Pool, pub message.Publisher) error {
	for ctx.Err() == nil {
		n, err := w.batch(ctx, pool, pub)
		if ctx.Err() != nil {
			return nil
		}
		if err != nil {
			return err
		}
		if n == 0 {
			sleep(ctx, 5*time.Millisecond)
		}
	}
	return nil
}

// batch is one raw transaction on pool: DELETE … RETURNING, publish,
// commit.
func (w *raw) batch(ctx context.Context, pool *pgxpool.Pool, pub message.Publisher) (int, error) {
	tx, err := pool.Begin(ctx)
	if err != nil {
		return 0, fmt.Errorf("begin: %w", err)
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	rows, err := tx.Query(ctx, w.take, rawBatch)
	if err != nil {
		return 0, fmt.Errorf("take rows: %w", err)
	}
	type row struct {
		topic string
		msg   *message.Message
	}
	batch, err := pgx.CollectRows(rows, func(rw pgx.CollectableRow) (row, error) {
		var (
			id      int64
			x       row
			uuid    string
			payload []byte
			mdRaw   []byte
			md      map[string]string
		)
		if err := rw.Scan(&id, &x.topic, &uuid, &payload, &mdRaw); err != nil {
			return x, err
		}
		if err := json.Unmarshal(mdRaw, &md); err != nil {
			return x, fmt.Errorf("row %d: metadata: %w", id, err)
		}
		x.msg = message.NewMessage(uuid, payload)
		for k, v := range md {
			x.msg.Metadata.Set(k, v)
		}
		x.msg.SetContext(ctx)
		return x, nil
	})
	if err != nil {
		return 0, fmt.Errorf("take rows: %w", err)
	}
	for start := 0; start < len(batch); {
		end := start + 1
		for end < len(batch) && batch[end].topic == batch[start].topic {
			end++
		}
		msgs := make([]*message.Message, 0, end-start)
		for _, x := range batch[start:end] {
			msgs = append(msgs, x.msg)
		}
		if err := pub.Publish(batch[start].topic, msgs...); err != nil {
			return 0, fmt.Errorf("publish %d rows: %w", len(msgs), err)
		}
		start = end
	}
	// Published: delete them even if the run is being stopped.
	if err := tx.Commit(context.WithoutCancel(ctx)); err != nil {
		return 0, fmt.Errorf("commit: %w", err)
	}
	return len(batch), nil
}

// floorStage runs, for every broker and instance count of the config, the
// throughput run of the raw relay and then that of oncemill's relay, each
// on a fresh backlog of NOurs rows.
func (e *env) floorStage(ctx context.Context) ([]FloorResult, error) {
	var results []FloorResult
	for _, b := range e.cfg.Brokers {
		for _, n := range e.cfg.Instances {
			f := FloorResult{Broker: b, Instances: n}
			for _, x := range []struct {
				sys string
				res *Result
			}{{systemRaw, &f.Raw}, {systemOurs, &f.Relay}} {
				sc := Scenario{System: x.sys, Instances: n, Broker: b}
				x.res.Scenario = sc
				if err := e.throughput(ctx, sc, x.res); err != nil {
					return results, fmt.Errorf("%s: %w", sc, err)
				}
			}
			if f.Raw.Throughput > 0 {
				f.Ratio = f.Relay.Throughput / f.Raw.Throughput
			}
			fmt.Fprintf(e.cfg.Out, "floor ×%d → %-16s raw %8.0f msgs/s, relay %8.0f msgs/s, relay/raw %.2f\n",
				n, b, f.Raw.Throughput, f.Relay.Throughput, f.Ratio)
			results = append(results, f)
		}
	}
	return results, nil
}
