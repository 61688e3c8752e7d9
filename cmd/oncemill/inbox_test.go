package main

import (
	"context"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/adapters"
	"github.com/oncemill/oncemill/dedup"
	"github.com/oncemill/oncemill/dedup/redis"
	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/internal/testing/pgtest"
	"github.com/oncemill/oncemill/internal/testing/redistest"
	"github.com/oncemill/oncemill/middleware"
)

// TestReplayGrantsOnTheInboxURL: a consumer on the Redis lease store holds
// a key dead, and its message sits in the PostgreSQL dead-letter table.
// Without --inbox the replay finds no record of the key beside the table:
// it fails in one line that names --inbox, publishes nothing and keeps the
// entry. With --inbox redis://…?prefix=… the grant is written on the
// consumer's record: the copy runs once, and the entry is deleted.
func TestReplayGrantsOnTheInboxURL(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := setup(t)
	topic := pgtest.Name(t)
	broker := pgBroker(t, f.pool, topic)

	client := redistest.Client(t)
	prefix := redistest.Prefix(t, client)
	store, err := redis.New(redis.Config{Client: client, Prefix: prefix})
	require.NoError(t, err)
	m := dead(topic, "charge", "ledger unreachable")
	key := dedup.Key{Consumer: "charge", Key: m.Metadata.Get(delivery.DeadKey)}
	claim, err := store.LeaseClaim(ctx, key, time.Minute, time.Hour)
	require.NoError(t, err)
	require.NoError(t, store.LeaseBury(ctx, key, claim.Token, dedup.Failure{Err: "ledger unreachable", At: time.Now()}))
	ids := f.seedEntries(t, m)

	// The consumer: the inbox on Redis, the effect in PostgreSQL.
	effects := pgx.Identifier{f.schema, "effects"}.Sanitize()
	_, err = f.pool.Exec(ctx, `CREATE TABLE `+effects+` (key text NOT NULL)`)
	require.NoError(t, err)
	countEffects := func() (n int) {
		require.NoError(t, f.pool.QueryRow(ctx, `SELECT count(*) FROM `+effects).Scan(&n))
		return n
	}
	inbox, err := middleware.NewInbox(middleware.InboxConfig{LeaseStore: store, Consumer: "charge"})
	require.NoError(t, err)
	u, err := url.Parse(broker)
	require.NoError(t, err)
	q := u.Query()
	q.Set("group", pgtest.Name(t))
	u.RawQuery = q.Encode()
	runCtx, stop := context.WithCancel(ctx)
	ps, err := adapters.Open(runCtx, u.String(), adapters.Options{})
	require.NoError(t, err)
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
	require.NoError(t, err)
	router.AddMiddleware(inbox.Middleware)
	router.AddConsumerHandler("charge", topic, ps.Subscriber, func(msg *message.Message) error {
		_, err := f.pool.Exec(msg.Context(), `INSERT INTO `+effects+` (key) VALUES ($1)`, middleware.IdempotencyKey(msg.Context()))
		return err
	})
	done := make(chan error, 1)
	go func() { done <- router.Run(runCtx) }()
	<-router.Running()
	t.Cleanup(func() {
		stop()
		require.NoError(t, <-done)
		require.NoError(t, ps.Close())
	})
	published := func() (n int) {
		require.NoError(t, f.pool.QueryRow(ctx, `SELECT count(*) FROM `+pgx.Identifier{"watermill_" + topic}.Sanitize()).Scan(&n))
		return n
	}

	id := strconv.FormatInt(ids[0], 10)
	r := f.dlq(t, "replay", id, "--broker", broker)
	require.Equal(t, exitFailure, r.code, r.stderr)
	requireOneLine(t, r.stderr)
	require.Contains(t, r.stderr, `consumer "charge" key "`+key.Key+`" has no record`)
	require.Contains(t, r.stderr, "--inbox URL")
	require.Equal(t, ids, f.ids(t), "the entry stays")
	require.Zero(t, published(), "nothing published")

	inboxURL, err := url.Parse(redistest.URL())
	require.NoError(t, err)
	iq := inboxURL.Query()
	iq.Set("prefix", prefix)
	inboxURL.RawQuery = iq.Encode()
	r = f.dlq(t, "replay", id, "--broker", broker, "--inbox", inboxURL.String())
	require.Equal(t, exitOK, r.code, r.stderr)
	require.Equal(t, "replayed 1 entry\n", r.stdout)
	require.Empty(t, f.ids(t), "deleted once published")
	require.Eventually(t, func() bool {
		c, err := store.InboxPeek(ctx, key)
		require.NoError(t, err)
		return c.State == dedup.StateDone
	}, 30*time.Second, 10*time.Millisecond)
	require.Equal(t, 1, countEffects(), "the replay ran once")
	require.Equal(t, 1, published())
}

// TestInboxFlag: --inbox URLs that cannot name a store are usage errors
// that name the flag, before anything connects.
func TestInboxFlag(t *testing.T) {
	t.Parallel()
	f := setup(t)
	ids := f.seed(t, dead("orders", "charge", "boom"))
	id := strconv.FormatInt(ids[0], 10)
	file := filepath.Join(t.TempDir(), "inbox.db")
	require.NoError(t, os.WriteFile(file, nil, 0o600))
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--inbox", "cassandra://h/db"}, `--inbox: unknown scheme "cassandra"`},
		{[]string{"--inbox", "mysql://h/db?schema=a-b"}, "--inbox parameter schema"},
		{[]string{"--inbox", "mysql://h/db?timeout=never"}, "--inbox mysql://h/db?timeout=never:"},
		{[]string{"--inbox", "redis://127.0.0.1:6379/0?pool=9"}, "--inbox redis://127.0.0.1:6379/0?pool=xxxxx: redis: unexpected option: pool"},
		{[]string{"--inbox", "redis://127.0.0.1:6379/0?prefix={a}"}, "prefix must not contain"},
		{[]string{"--inbox", "sqlite:" + filepath.Join(t.TempDir(), "missing.db")}, "is not the consumer's database file"},
		{[]string{"--inbox", "sqlite:" + file + "?mode=ro"}, "unknown parameters for sqlite"},
		{[]string{"--inbox", "postgres://127.0.0.1/test?schema=a-b"}, "--inbox parameter schema"},
		{[]string{"--inbox", "postgres://127.0.0.1/test?table=x&table=y"}, "parameter table is given 2 times"},
		{[]string{"--to-consumer", "--inbox", "redis://127.0.0.1:6379/0"}, "--to-consumer writes no grant"},
		{[]string{"--to-consumer", "--force"}, "--to-consumer writes no grant"},
	} {
		args := append([]string{id}, tc.args...)
		if tc.args[0] != "--to-consumer" {
			args = append(args, "--broker", "kafka://127.0.0.1:1")
		}
		r := f.dlq(t, "replay", args...)
		require.Equal(t, exitUsage, r.code, "%v: %s", tc.args, r.stderr)
		require.Contains(t, r.stderr, tc.want, tc.args)
		requireOneLine(t, r.stderr)
	}
	require.Equal(t, ids, f.ids(t))

	r := oncemill(t, nil, "console", "--database", pgtest.URL(), "--inbox", "redis://127.0.0.1:6379/0")
	require.Equal(t, exitUsage, r.code, r.stderr)
	require.Contains(t, r.stderr, "--inbox is where replays to the topic write their grants: give --broker too")
}
