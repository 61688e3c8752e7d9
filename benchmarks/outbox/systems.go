package main

import (
	"context"
	"errors"
	"fmt"
	"sync"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	wforwarder "github.com/ThreeDotsLabs/watermill/components/forwarder"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/oncemill/oncemill/forwarder"
	"github.com/oncemill/oncemill/sqlschema"
)

// ours is oncemill's outbox: rows written by forwarder.TxPublisher, relayed
// by forwarder.Relay with its defaults.
type ours struct {
	e      *env
	schema sqlschema.Config
}

func newOurs(ctx context.Context, e *env, id string) (*ours, error) {
	cfg := sqlschema.Config{Schema: "bench_outbox_" + id}
	if err := sqlschema.Migrate(ctx, e.pool, cfg); err != nil {
		return nil, err
	}
	return &ours{e: e, schema: cfg}, nil
}

func (o *ours) write(ctx context.Context, tx pgx.Tx, topic string, msgs []*message.Message) error {
	p, err := forwarder.NewTxPublisher(ctx, tx, o.schema)
	if err != nil {
		return err
	}
	if err := p.Publish(topic, msgs...); err != nil {
		return err
	}
	return p.Close()
}

// names returns the quoted names of o's tables.
func (o *ours) names() sqlschema.Names {
	return sqlschema.NamesFor(sqlschema.Postgres, o.schema.WithDefaults())
}

func (o *ours) start(ctx context.Context, n int, pub message.Publisher) (func() error, error) {
	return o.startOn(ctx, o.e.pool, n, pub)
}

// startOn starts n relays on pool publishing to pub; the function it
// returns stops them and waits for them.
func (o *ours) startOn(ctx context.Context, pool *pgxpool.Pool, n int, pub message.Publisher) (func() error, error) {
	relays := make([]*forwarder.Relay, n)
	for i := range relays {
		r, err := forwarder.NewRelay(forwarder.RelayConfig{
			Pool:      pool,
			Publisher: pub,
			Schema:    o.schema,
			Logger:    o.e.logger,
		})
		if err != nil {
			return nil, err
		}
		relays[i] = r
	}
	var (
		wg   sync.WaitGroup
		errs = make([]error, n)
	)
	for i, r := range relays {
		wg.Go(func() { errs[i] = r.Run(ctx) })
	}
	return func() error {
		for _, r := range relays {
			_ = r.Close()
		}
		wg.Wait()
		return errors.Join(errs...)
	}, nil
}

func (o *ours) cleanup(ctx context.Context) error {
	_, err := o.e.pool.Exec(ctx, `DROP SCHEMA IF EXISTS `+pgx.Identifier{o.schema.Schema}.Sanitize()+` CASCADE`)
	return err
}

// stock is Watermill's forwarder over watermill-sql v4 with its defaults:
// the PostgreSQL subscriber polls every 1s when idle, reads 100 rows per
// query and acks one message at a time; all instances share one consumer
// group.
type stock struct {
	e      *env
	topic  string // the forwarder topic: the watermill_<topic> table
	group  string
	schema wsql.DefaultPostgreSQLSchema
	offs   wsql.DefaultPostgreSQLOffsetsAdapter
}

func newStock(ctx context.Context, e *env, id string) (*stock, error) {
	s := &stock{e: e, topic: "bench_fwd_" + id, group: "bench_group_" + id}
	// Create the tables before the pre-write: the publisher cannot in a
	// transaction, and the subscriber would only on Subscribe.
	sub, err := s.subscriber()
	if err != nil {
		return nil, err
	}
	defer sub.Close()
	if err := sub.SubscribeInitialize(s.topic); err != nil {
		return nil, fmt.Errorf("initialize watermill-sql schema: %w", err)
	}
	return s, nil
}

func (s *stock) subscriber() (*wsql.Subscriber, error) {
	return wsql.NewSubscriber(wsql.BeginnerFromPgx(s.e.pool), wsql.SubscriberConfig{
		SchemaAdapter:    s.schema,
		OffsetsAdapter:   s.offs,
		InitializeSchema: true,
		ConsumerGroup:    s.group,
	}, s.e.logger)
}

func (s *stock) write(ctx context.Context, tx pgx.Tx, topic string, msgs []*message.Message) error {
	sp, err := wsql.NewPublisher(wsql.TxFromPgx(tx), wsql.PublisherConfig{SchemaAdapter: s.schema}, s.e.logger)
	if err != nil {
		return err
	}
	for _, m := range msgs {
		m.SetContext(ctx)
	}
	fp := wforwarder.NewPublisher(sp, wforwarder.PublisherConfig{ForwarderTopic: s.topic})
	if err := fp.Publish(topic, msgs...); err != nil {
		return err
	}
	return fp.Close()
}

func (s *stock) start(ctx context.Context, n int, pub message.Publisher) (func() error, error) {
	var (
		fwds []*wforwarder.Forwarder
		subs []*wsql.Subscriber
		wg   sync.WaitGroup
		errs = make([]error, n)
	)
	stop := func() error {
		s.e.quiet.Store(true)
		defer s.e.quiet.Store(false)
		for _, f := range fwds {
			_ = f.Close()
		}
		wg.Wait()
		for _, sub := range subs {
			_ = sub.Close()
		}
		return errors.Join(errs...)
	}
	for i := range n {
		sub, err := s.subscriber()
		if err != nil {
			return nil, errors.Join(err, stop())
		}
		subs = append(subs, sub)
		f, err := wforwarder.NewForwarder(sub, pub, s.e.logger, wforwarder.Config{ForwarderTopic: s.topic})
		if err != nil {
			return nil, errors.Join(err, stop())
		}
		fwds = append(fwds, f)
		wg.Go(func() { errs[i] = f.Run(ctx) })
	}
	for _, f := range fwds {
		select {
		case <-f.Running():
		case <-ctx.Done():
			return nil, errors.Join(ctx.Err(), stop())
		}
	}
	return stop, nil
}

func (s *stock) cleanup(ctx context.Context) error {
	_, err := s.e.pool.Exec(ctx, `DROP TABLE IF EXISTS `+s.schema.MessagesTable(s.topic)+`, `+s.offs.MessagesOffsetsTable(s.topic))
	return err
}
