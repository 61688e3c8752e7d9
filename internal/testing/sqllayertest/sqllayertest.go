// Package sqllayertest is the conformance suite of oncemill's SQL layer:
// the outbox relay (package forwarder), the dead-letter table (package
// dlq), the console (package console) and reconcile (package reconcile),
// each driven through its exported API only, as an application and an
// operator drive them, on one database backend at a time.
//
// A backend is a [Subject]: a name and a function that gives each subtest a
// fresh, migrated database, through pgx (Database.Pool) or database/sql
// (Database.DB with its Dialect). [Run] runs every subtest on it, in
// parallel, each named for the behaviour it checks:
//
//   - RelayOnceInOrder: the relay publishes every outbox row once, in
//     batches, keeps each partition key's order across keys and batches,
//     and deletes what it published (the outbox's lag drops to zero).
//   - RefusedRowDeadLettered: a row the broker refuses (its topic) is
//     dead-lettered once, never published, and the rows behind it go on.
//   - DeadLetterOnce: a message dead-lettered by the poison middleware,
//     and dead-lettered again after a lost ack, is one entry; its key is
//     dead in the inbox and a copy of it does not run.
//   - ListCountGet: the store lists, counts, filters and shows entries.
//   - ReplayOnce: a replay to the topic reopens the dead key through its
//     grant, is applied once, and removes the entry.
//   - RequestReplay: a replay requested for the consumer is delivered by
//     its ReplaySubscriber once, applied once, and removes the entry.
//   - Purge: purging needs a selection and deletes what it selects.
//   - Console: the console's overview counts what the database holds.
//   - Reconcile: reconcile reports a lost and a stuck event, accepts a
//     dead-lettered one, and reports nothing once every event is applied.
//   - StorableInputs: a NUL, a byte that is not UTF-8, a binary Kafka key
//     and 1 MB, as ordering key, key, UUID, error, header, consumer and
//     topic, go through parking, dead-lettering, the outbox and its
//     scheduled table: each stored (byte for byte where a message goes
//     on) or refused with a reason, never an error of the database.
//
// The broker is an in-process Watermill GoChannel, persistent (so that the
// relay and the replay, which delete what they published, accept it).
package sqllayertest

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/console"
	"github.com/oncemill/oncemill/dedup"
	"github.com/oncemill/oncemill/dedup/dedupdriver"
	"github.com/oncemill/oncemill/dedup/postgres"
	"github.com/oncemill/oncemill/dedup/sqlite"
	"github.com/oncemill/oncemill/dedup/sqlstore"
	"github.com/oncemill/oncemill/dlq"
	"github.com/oncemill/oncemill/forwarder"
	"github.com/oncemill/oncemill/internal/testing/sqltest"
	"github.com/oncemill/oncemill/reconcile"
	"github.com/oncemill/oncemill/sqlschema"
)

// Subject is one backend of the SQL layer under test.
type Subject struct {
	// Name names the backend in the subtests' names ("postgres-pgx",
	// "sqlite", …). Required.
	Name string
	// Open returns a fresh database for one subtest, migrated with
	// sqlschema.Migrate, MigrateSQL or MigrateSQLite and isolated from
	// every other one it returned (its own schema, database or file):
	// subtests assert exact counts and run in parallel, so Open is called
	// from several goroutines at once. Register the teardown with
	// t.Cleanup. Required.
	Open func(t *testing.T) Database
}

// Database is a migrated database of a [Subject] (its Bare is not used).
type Database = sqltest.Database

// Run runs the suite on s, one fresh database per subtest, the subtests
// in parallel.
func Run(t *testing.T, s Subject) {
	t.Helper()
	if s.Name == "" || s.Open == nil {
		t.Fatal("sqllayertest: Subject.Name and Subject.Open are required")
	}
	for _, st := range []struct {
		name string
		run  func(t *testing.T, e *env)
	}{
		{"RelayOnceInOrder", relayOnceInOrder},
		{"RefusedRowDeadLettered", refusedRowDeadLettered},
		{"DeadLetterOnce", deadLetterOnce},
		{"ListCountGet", listCountGet},
		{"ReplayOnce", replayOnce},
		{"RequestReplay", requestReplay},
		{"Purge", purge},
		{"Reopen", reopen},
		{"ReplayLineage", replayLineage},
		{"ReplayerBeat", replayerBeat},
		{"Console", consoleCounts},
		{"Reconcile", reconcileReports},
		{"StorableInputs", storableInputs},
	} {
		t.Run(st.name, func(t *testing.T) {
			t.Parallel()
			d := s.Open(t)
			if (d.Pool == nil) == (d.DB == nil) {
				t.Fatal("sqllayertest: Database needs exactly one of Pool and DB")
			}
			if d.DB != nil && d.Dialect == "" {
				t.Fatal("sqllayertest: Database.Dialect is required with DB")
			}
			st.run(t, &env{Database: d, t: t})
		})
	}
}

// patience bounds every wait for something the suite expects; a backend
// that takes longer fails the subtest. It bounds a failure, it measures
// no speed.
const patience = 30 * time.Second

// env is one subtest's database, with the packages' constructors on it.
type env struct {
	Database
	t *testing.T
}

// ctx is the subtest's context.
func (e *env) ctx() context.Context { return e.t.Context() }

// write commits one transaction that writes msgs to topic through the
// outbox's transactional publisher.
func (e *env) write(topic string, msgs ...*message.Message) {
	e.t.Helper()
	ctx := e.ctx()
	if e.Pool != nil {
		tx, err := e.Pool.Begin(ctx)
		require.NoError(e.t, err)
		defer tx.Rollback(ctx) //nolint:errcheck // a no-op after Commit
		pub, err := forwarder.NewTxPublisher(ctx, tx, e.Schema)
		require.NoError(e.t, err)
		require.NoError(e.t, pub.Publish(topic, msgs...))
		require.NoError(e.t, tx.Commit(ctx))
		return
	}
	tx, err := e.DB.BeginTx(ctx, nil)
	require.NoError(e.t, err)
	defer tx.Rollback() //nolint:errcheck // a no-op after Commit
	pub, err := forwarder.NewSQLTxPublisher(ctx, tx, e.Dialect, e.Schema)
	require.NoError(e.t, err)
	require.NoError(e.t, pub.Publish(topic, msgs...))
	require.NoError(e.t, tx.Commit())
}

// relay returns a relay of the outbox to pub, changed by mod.
func (e *env) relay(pub message.Publisher, mod func(*forwarder.RelayConfig)) *forwarder.Relay {
	e.t.Helper()
	cfg := forwarder.RelayConfig{Pool: e.Pool, DB: e.DB, Dialect: e.Dialect, Publisher: pub, Schema: e.Schema,
		// The suite's writers of one key write one after the other.
		LockOrderedWriters: true,
		MinBackoff:         10 * time.Millisecond, MaxBackoff: 50 * time.Millisecond, Ledger: true}
	if mod != nil {
		mod(&cfg)
	}
	r, err := forwarder.NewRelay(cfg)
	require.NoError(e.t, err)
	return r
}

// relayAll runs batches of r until want rows went out, and requires that
// no batch took more than batchSize (when positive). It returns the
// number of batches that took rows.
func (e *env) relayAll(r *forwarder.Relay, want, batchSize int) (batches int) {
	e.t.Helper()
	total := 0
	deadline := time.Now().Add(patience)
	for total < want {
		n, err := r.RelayBatch(e.ctx())
		require.NoError(e.t, err)
		if batchSize > 0 {
			require.LessOrEqual(e.t, n, batchSize, "a batch takes at most BatchSize rows")
		}
		if n > 0 {
			batches++
		}
		total += n
		if n == 0 {
			require.True(e.t, time.Now().Before(deadline), "relayed %d of %d rows in %s", total, want, patience)
			time.Sleep(10 * time.Millisecond)
		}
	}
	require.Equal(e.t, want, total, "the relay published more rows than were written")
	return batches
}

// lag is the outbox's lag as a dashboard reads it, without a relay.
func (e *env) lag() forwarder.Lag {
	e.t.Helper()
	var (
		l   forwarder.Lag
		err error
	)
	if e.Pool != nil {
		l, err = forwarder.OutboxLag(e.ctx(), e.Pool, e.Schema)
	} else {
		l, err = forwarder.SQLOutboxLag(e.ctx(), e.DB, e.Dialect, e.Schema)
	}
	require.NoError(e.t, err)
	return l
}

// dlqPublisher is the dead-letter table's publisher.
func (e *env) dlqPublisher() *dlq.Publisher {
	e.t.Helper()
	var (
		p   *dlq.Publisher
		err error
	)
	if e.Pool != nil {
		p, err = dlq.NewPublisher(e.Pool, e.Schema)
	} else {
		p, err = dlq.NewSQLPublisher(e.DB, e.Dialect, e.Schema)
	}
	require.NoError(e.t, err)
	return p
}

// dlqStore is the dead-letter table's store; its replays grant on the
// inbox table beside it.
func (e *env) dlqStore() *dlq.Store {
	e.t.Helper()
	var (
		s   *dlq.Store
		err error
	)
	if e.Pool != nil {
		s, err = dlq.NewStore(e.Pool, e.Schema)
	} else {
		s, err = dlq.NewSQLStore(e.DB, e.Dialect, e.Schema)
	}
	require.NoError(e.t, err)
	return s
}

// replaySubscriber delivers the requested replays of consumer.
func (e *env) replaySubscriber(consumer string) *dlq.ReplaySubscriber {
	return e.replaySubscriberBeating(consumer, 0)
}

// replaySubscriberBeating is replaySubscriber, announcing itself every
// beat (the default when 0).
func (e *env) replaySubscriberBeating(consumer string, beat time.Duration) *dlq.ReplaySubscriber {
	e.t.Helper()
	cfg := dlq.ReplaySubscriberConfig{Consumer: consumer, PollInterval: 10 * time.Millisecond, BeatEvery: beat}
	var (
		r   *dlq.ReplaySubscriber
		err error
	)
	if e.Pool != nil {
		r, err = dlq.NewReplaySubscriber(e.Pool, e.Schema, cfg)
	} else {
		r, err = dlq.NewSQLReplaySubscriber(e.DB, e.Dialect, e.Schema, cfg)
	}
	require.NoError(e.t, err)
	e.t.Cleanup(func() { require.NoError(e.t, r.Close()) })
	return r
}

// inboxStore is a transactional inbox store that can peek at a key.
type inboxStore interface {
	dedup.TxStore
	dedupdriver.Peeker
}

// inbox is the inbox store on the inbox table beside the others, the
// one the dead-letter store grants replays on by default.
func (e *env) inbox() inboxStore {
	e.t.Helper()
	var (
		s   dedup.TxStore
		err error
	)
	switch {
	case e.Pool != nil:
		s, err = postgres.New(e.Pool, postgres.Config(e.Schema))
	case e.Dialect == sqlschema.SQLite:
		s, err = sqlite.New(e.ctx(), e.DB, sqlite.Config{Table: e.Schema.InboxTable})
	case e.Dialect == sqlschema.Postgres:
		s, err = sqlstore.New(e.DB, sqlstore.Config{Dialect: sqlstore.Postgres, Schema: e.Schema})
	case e.Dialect == sqlschema.MySQL:
		s, err = sqlstore.New(e.DB, sqlstore.Config{Dialect: sqlstore.MySQL, Schema: e.Schema})
	default:
		err = errors.New("sqllayertest: no inbox store for dialect " + string(e.Dialect))
	}
	require.NoError(e.t, err)
	p, ok := s.(inboxStore)
	require.True(e.t, ok, "%T peeks", s)
	return p
}

// state is what the inbox holds of key.
func (e *env) state(store inboxStore, key dedup.Key) dedup.State {
	e.t.Helper()
	c, err := store.InboxPeek(e.ctx(), key)
	require.NoError(e.t, err)
	return c.State
}

// console returns the console on the database, with token as its token.
func (e *env) console(mod func(*console.Config)) *console.Console {
	e.t.Helper()
	cfg := console.Config{Pool: e.Pool, DB: e.DB, Dialect: e.Dialect, Schema: e.Schema, Token: consoleToken}
	if mod != nil {
		mod(&cfg)
	}
	c, err := console.New(cfg)
	require.NoError(e.t, err)
	return c
}

// tables is the database as one side of a reconcile check.
func (e *env) tables() reconcile.Tables {
	return reconcile.Tables{Pool: e.Pool, DB: e.DB, Dialect: e.Dialect, Schema: e.Schema}
}

// broker returns a persistent GoChannel, closed when the subtest ends.
// ordered makes each publish wait for its subscribers' ack, so that a
// subscriber that reads in one goroutine receives the messages in the
// order they were published: a GoChannel otherwise hands each message to
// its subscribers from a goroutine of its own.
func (e *env) broker(ordered bool) *gochannel.GoChannel {
	g := gochannel.NewGoChannel(gochannel.Config{Persistent: true, BlockPublishUntilSubscriberAck: ordered, OutputChannelBuffer: 64},
		watermill.NopLogger{})
	e.t.Cleanup(func() { require.NoError(e.t, g.Close()) })
	return g
}

// eventually calls cond until it reports true and fails the subtest when
// patience passes first. cond runs on the subtest's goroutine.
func (e *env) eventually(what string, cond func() bool) {
	e.t.Helper()
	deadline := time.Now().Add(patience)
	for !cond() {
		if time.Now().After(deadline) {
			e.t.Fatalf("gave up after %s waiting for %s", patience, what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}
