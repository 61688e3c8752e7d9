package forwarder_test

import (
	"context"
	"database/sql"
	"encoding/json"
	"fmt"
	"hash/crc32"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/stretchr/testify/require"
	_ "modernc.org/sqlite"

	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/dlq"
	"github.com/oncemill/oncemill/forwarder"
	"github.com/oncemill/oncemill/sqlschema"
)

// outboxBackends are the four ways to reach a database the relay runs on.
var outboxBackends = []struct {
	name string
	open func(*testing.T) outboxUnderTest
}{
	{"PostgreSQL/pgx", pgOutboxUnderTest},
	{"PostgreSQL/database-sql", pgSQLOutboxUnderTest},
	{"MySQL", mysqlOutboxUnderTest},
	{"SQLite", sqliteOutboxUnderTest},
}

// sqlWrite is outboxUnderTest.write through database/sql.
func sqlWrite(db *sql.DB, d sqlschema.Dialect, schema sqlschema.Config) func(context.Context, string, bool, ...*message.Message) error {
	return func(ctx context.Context, topic string, commit bool, events ...*message.Message) error {
		tx, err := db.BeginTx(ctx, nil)
		if err != nil {
			return err
		}
		defer tx.Rollback() //nolint:errcheck // a no-op after Commit
		pub, err := forwarder.NewSQLTxPublisher(ctx, tx, d, schema)
		if err == nil {
			err = pub.Publish(topic, events...)
		}
		if err != nil || !commit {
			return err
		}
		return tx.Commit()
	}
}

// sqlLag is outboxUnderTest.lag through database/sql.
func sqlLag(db *sql.DB, d sqlschema.Dialect, schema sqlschema.Config) func(*testing.T) forwarder.Lag {
	return func(t *testing.T) forwarder.Lag {
		lag, err := forwarder.SQLOutboxLag(context.Background(), db, d, schema)
		require.NoError(t, err)
		return lag
	}
}

// pgSQLOutboxUnderTest is a PostgreSQL outbox written and relayed through
// database/sql (pgx's stdlib); its rows and dead letters are read through
// pgx.
func pgSQLOutboxUnderTest(t *testing.T) outboxUnderTest {
	b := setup(t, 8)
	o := pgOutboxUnderTestOn(t, b)
	db := stdlib.OpenDBFromPool(b.pool)
	t.Cleanup(func() { require.NoError(t, db.Close()) })
	o.relay = func(t *testing.T, pub message.Publisher, mod func(*forwarder.RelayConfig)) *forwarder.Relay {
		return newRelay(t, b, pub, func(c *forwarder.RelayConfig) {
			c.Pool, c.DB, c.Dialect = nil, db, sqlschema.Postgres
			if mod != nil {
				mod(c)
			}
		})
	}
	o.write = sqlWrite(db, sqlschema.Postgres, b.schema)
	o.lag = sqlLag(db, sqlschema.Postgres, b.schema)
	return o
}

// openSQLite opens a migrated SQLite database in a file of its own.
func openSQLite(t *testing.T, path string) *sql.DB {
	t.Helper()
	db, err := sql.Open("sqlite", "file:"+path+"?_pragma=busy_timeout(10000)&_pragma=journal_mode(WAL)&_pragma=foreign_keys(1)&_txlock=immediate")
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, db.Close()) })
	require.NoError(t, sqlschema.MigrateSQL(context.Background(), db, sqlschema.SQLite, sqlschema.Config{}))
	return db
}

// sqliteOutboxUnderTest is a SQLite outbox in a file of its own.
func sqliteOutboxUnderTest(t *testing.T) outboxUnderTest {
	db := openSQLite(t, filepath.Join(t.TempDir(), "outbox.db"))
	ctx := context.Background()
	query := func(t *testing.T, q string, scan func(*sql.Rows) error) {
		rs, err := db.QueryContext(ctx, q)
		require.NoError(t, err)
		defer rs.Close()
		for rs.Next() {
			require.NoError(t, scan(rs))
		}
		require.NoError(t, rs.Err())
	}
	return outboxUnderTest{
		insert: func(t *testing.T, rows [][]any) {
			tx, err := db.BeginTx(ctx, nil)
			require.NoError(t, err)
			for _, r := range rows {
				lane := crc32.ChecksumIEEE([]byte(r[2].(string))) & 63
				_, err := tx.ExecContext(ctx, `INSERT INTO outbox (topic, uuid, partition_key, payload, metadata, lane) VALUES (?, ?, ?, ?, ?, ?)`,
					append(r, lane)...)
				require.NoError(t, err)
			}
			require.NoError(t, tx.Commit())
		},
		count: func(t *testing.T, table string) int {
			var n int
			require.NoError(t, db.QueryRowContext(ctx, `SELECT COUNT(*) FROM "`+table+`"`).Scan(&n))
			return n
		},
		relay: func(t *testing.T, pub message.Publisher, mod func(*forwarder.RelayConfig)) *forwarder.Relay {
			cfg := forwarder.RelayConfig{DB: db, Dialect: sqlschema.SQLite, Publisher: pub, MinBackoff: 10 * time.Millisecond, MaxBackoff: 50 * time.Millisecond}
			if mod != nil {
				mod(&cfg)
			}
			r, err := forwarder.NewRelay(cfg)
			require.NoError(t, err)
			return r
		},
		dead: func(t *testing.T) []dlq.Entry {
			var es []dlq.Entry
			query(t, `SELECT uuid, topic, consumer, key, error, permanent, payload, metadata FROM dlq ORDER BY id`, func(rs *sql.Rows) error {
				var (
					e  dlq.Entry
					md string
				)
				if err := rs.Scan(&e.UUID, &e.Topic, &e.Consumer, &e.Key, &e.Error, &e.Permanent, &e.Payload, &md); err != nil {
					return err
				}
				es = append(es, e)
				return json.Unmarshal([]byte(md), &es[len(es)-1].Metadata)
			})
			return es
		},
		ledgerKeys: func(t *testing.T) []string {
			var keys []string
			query(t, `SELECT idempotency_key FROM outbox_ledger`, func(rs *sql.Rows) error {
				keys = append(keys, "")
				return rs.Scan(&keys[len(keys)-1])
			})
			return keys
		},
		write: sqlWrite(db, sqlschema.SQLite, sqlschema.Config{}),
		lag:   sqlLag(db, sqlschema.SQLite, sqlschema.Config{}),
	}
}

// TestRelayPromisesOnEveryBackend: on PostgreSQL through pgx and through
// database/sql, on MariaDB and on SQLite, writers of four keys commit
// (and roll back) events while a relay with the ledger runs, after a
// backlog and a row the relay must refuse (no topic). Every committed
// event is published once and deleted, each key's in its commit order,
// no rolled-back one; the refused row is one dead letter and never
// published; the ledger records exactly the published events; the lag
// counts the backlog, and nothing once it is drained.
func TestRelayPromisesOnEveryBackend(t *testing.T) {
	t.Parallel()
	for _, backend := range outboxBackends {
		t.Run(backend.name, func(t *testing.T) {
			t.Parallel()
			const keys, backlogTx, liveTx = 4, 2, 8
			o := backend.open(t)
			ctx := context.Background()
			var (
				mu        sync.Mutex
				committed = map[string]bool{}
				seq       = map[string]int{}
			)
			// write is one transaction of the key's next 1 to 3 events.
			write := func(key string, i int, commit bool) error {
				n := 1 + i%3
				events := make([]*message.Message, n)
				mu.Lock()
				for j := range events {
					events[j] = event(key, seq[key]+1+j)
				}
				mu.Unlock()
				if err := o.write(ctx, "orders", commit, events...); err != nil {
					return fmt.Errorf("%s: %w", key, err)
				}
				if commit {
					mu.Lock()
					seq[key] += n
					for _, e := range events {
						committed[e.UUID] = true
					}
					mu.Unlock()
				}
				return nil
			}
			for k := range keys {
				for i := range backlogTx {
					require.NoError(t, write(fmt.Sprintf("key-%d", k), i, true))
				}
			}
			o.insert(t, [][]any{{"", "refused-1", "key-0", []byte("no topic"), `{}`}})

			lag := o.lag(t)
			require.Equal(t, len(committed)+1, lag.Pending, "the backlog: every row, the refused one too")
			require.Positive(t, lag.OldestAge)

			s := &sink{}
			r := o.relay(t, s, func(c *forwarder.RelayConfig) { c.Ledger, c.BatchSize = true, 5 })
			relayLag, err := r.Lag(ctx)
			require.NoError(t, err)
			require.Equal(t, lag.Pending, relayLag.Pending, "the relay's lag reads the same backlog")
			run(t, r)

			var wg sync.WaitGroup
			errs := make(chan error, keys)
			for k := range keys {
				wg.Add(1)
				go func(key string) {
					defer wg.Done()
					for i := range liveTx {
						if err := write(key, i, i%4 != 3); err != nil {
							errs <- err
							return
						}
					}
				}(fmt.Sprintf("key-%d", k))
			}
			wg.Wait()
			close(errs)
			for err := range errs {
				require.NoError(t, err)
			}
			require.Eventually(t, func() bool { return o.count(t, "outbox") == 0 && len(s.snapshot()) >= len(committed) },
				60*time.Second, 10*time.Millisecond, "the relay drains the outbox")

			published := map[string]int{}
			last := map[string]int{}
			for _, m := range s.snapshot() {
				published[m.UUID]++
				require.True(t, committed[m.UUID], "only committed events are published, not %s", m.UUID)
				key := m.Metadata.Get(delivery.PartitionKey)
				n, err := strconv.Atoi(m.Metadata.Get("seq"))
				require.NoError(t, err)
				require.Equal(t, last[key]+1, n, "%s: the events go out in their commit order", key)
				last[key] = n
			}
			require.Len(t, published, len(committed), "every committed event is published")
			for uuid, n := range published {
				require.Equal(t, 1, n, "%s is published once", uuid)
			}
			for k := range keys {
				key := fmt.Sprintf("key-%d", k)
				require.Equal(t, seq[key], last[key], "%s: every event up to its last", key)
			}

			dead := o.dead(t)
			require.Len(t, dead, 1, "the refused row is one dead letter")
			require.Equal(t, "refused-1", dead[0].Message("").UUID)
			require.Contains(t, dead[0].Error, "topic is empty")
			require.True(t, strings.HasPrefix(dead[0].Consumer, "relay:") && strings.HasSuffix(dead[0].Consumer, ".outbox"),
				"the relay's consumer, relay:<schema>.outbox: %s", dead[0].Consumer)
			require.True(t, dead[0].Permanent)

			ledger := o.ledgerKeys(t)
			require.Len(t, ledger, len(published), "the ledger records each published event once")
			for _, k := range ledger {
				require.Equal(t, 1, published[k], "the ledger records published events only, not %s", k)
			}

			lag = o.lag(t)
			require.Zero(t, lag.Pending, "drained")
			require.Zero(t, lag.OldestAge)
			require.Zero(t, lag.Waiting)
			require.Nil(t, lag.HeldBy)
		})
	}
}
