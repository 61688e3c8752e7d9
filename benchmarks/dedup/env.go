package main

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/go-sql-driver/mysql"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	goredis "github.com/redis/go-redis/v9"

	"github.com/oncemill/oncemill/benchmarks/internal/benchutil"
	"github.com/oncemill/oncemill/dedup/postgres"
	redisstore "github.com/oncemill/oncemill/dedup/redis"
	"github.com/oncemill/oncemill/dedup/sqlite"
	"github.com/oncemill/oncemill/dedup/sqlstore"
	dlv "github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/internal/testing/redistest"
	"github.com/oncemill/oncemill/sqlschema"
)

// env is what every measurement of one run shares: the connections, the
// run's random ID (in every schema, prefix and file name it creates) and a
// temp dir for the SQLite files.
type env struct {
	cfg  Config
	pool *pgxpool.Pool
	// std is the same PostgreSQL through database/sql on pgx's stdlib
	// driver, my the MySQL server: each opened only when a strategy of
	// the run needs it.
	std, my *sql.DB
	rdb     *goredis.Client
	runID   string
	tmp     string
	seq     atomic.Int64
}

// needs says which connections a run needs besides the pgx pool.
type needs struct{ redis, stdlib, mysql bool }

// needsOf collects what defs need.
func needsOf(defs []strategyDef) needs {
	var n needs
	for _, d := range defs {
		n.redis = n.redis || d.Redis
		n.stdlib = n.stdlib || d.Stdlib
		n.mysql = n.mysql || d.MySQL
	}
	return n
}

// newEnv connects to PostgreSQL and, as need says, to Redis, to PostgreSQL
// through database/sql and to MySQL, and makes the run's temp dir. close
// undoes all of it.
func newEnv(ctx context.Context, cfg Config, need needs) (e *env, closeFn func(), err error) {
	e = &env{cfg: cfg, runID: benchutil.RandomID()}
	var closers []func()
	// closeAll, not closeFn: a failed return sets closeFn to nil before
	// the deferred cleanup runs.
	closeAll := func() {
		for i := len(closers) - 1; i >= 0; i-- {
			closers[i]()
		}
	}
	defer func() {
		if err != nil {
			closeAll()
		}
	}()
	conns := int32(maxOf(cfg.Concurrency, cfg.CrashWorkers, cfg.PacedWorkers) + 8)

	pcfg, err := pgxpool.ParseConfig(cfg.DSN)
	if err != nil {
		return nil, nil, fmt.Errorf("parse PostgreSQL URL: %w", err)
	}
	pcfg.MaxConns = conns
	pcfg.ConnConfig.Tracer = pgTracer{}
	e.pool, err = pgxpool.NewWithConfig(ctx, pcfg)
	if err != nil {
		return nil, nil, fmt.Errorf("connect to PostgreSQL: %w", err)
	}
	closers = append(closers, e.pool.Close)
	if err := e.pool.Ping(ctx); err != nil {
		return nil, nil, fmt.Errorf("ping PostgreSQL: %w", err)
	}

	if need.stdlib {
		cc := pcfg.ConnConfig.Copy()
		e.std = stdlib.OpenDB(*cc)
		e.std.SetMaxOpenConns(int(conns))
		e.std.SetMaxIdleConns(int(conns))
		closers = append(closers, func() { _ = e.std.Close() })
		if err := e.std.PingContext(ctx); err != nil {
			return nil, nil, fmt.Errorf("ping PostgreSQL through database/sql: %w", err)
		}
	}
	if need.mysql {
		if e.my, err = openMySQL(ctx, cfg.MySQLDSN, int(conns)); err != nil {
			return nil, nil, err
		}
		closers = append(closers, func() { _ = e.my.Close() })
	}

	if need.redis {
		opts, err := goredis.ParseURL(cfg.RedisURL)
		if err != nil {
			return nil, nil, fmt.Errorf("parse Redis URL: %w", err)
		}
		opts.PoolSize = int(conns)
		e.rdb = goredis.NewClient(opts)
		closers = append(closers, func() { _ = e.rdb.Close() })
		if err := e.rdb.Ping(ctx).Err(); err != nil {
			return nil, nil, fmt.Errorf("ping Redis: %w", err)
		}
		e.rdb.AddHook(redisHook{})
	}

	e.tmp, err = os.MkdirTemp("", "oncemill-bench-dedup-")
	if err != nil {
		return nil, nil, fmt.Errorf("temp dir: %w", err)
	}
	closers = append(closers, func() { _ = os.RemoveAll(e.tmp) })
	return e, closeAll, nil
}

// openMySQL connects to the MySQL server of dsn with at most conns
// connections and pings it; an error names the DSN (its password masked)
// and the flag that sets it.
func openMySQL(ctx context.Context, dsn string, conns int) (*sql.DB, error) {
	mc, err := mysql.ParseDSN(dsn)
	if err != nil {
		return nil, fmt.Errorf("parse -mysql DSN: %w", err)
	}
	shown := mc.Clone()
	if shown.Passwd != "" {
		shown.Passwd = "xxxxx"
	}
	connector, err := mysql.NewConnector(mc)
	if err != nil {
		return nil, fmt.Errorf("MySQL connector for %s: %w", shown.FormatDSN(), err)
	}
	db := sql.OpenDB(connector)
	db.SetMaxOpenConns(conns)
	db.SetMaxIdleConns(conns)
	pctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if err := db.PingContext(pctx); err != nil {
		_ = db.Close()
		return nil, fmt.Errorf("MySQL/MariaDB unreachable at %s (set -mysql or $MYSQL_URL, or leave out %s and %s with -strategies): %w",
			shown.FormatDSN(), stSQLStoreMy, stRawMySQL, err)
	}
	return db, nil
}

// fixture is the durable state one measurement owns, fresh for it and gone
// after it: a PostgreSQL schema (oncemill's tables, the effects table, the
// raw baseline's keys table), a Redis key prefix, a SQLite file.
type fixture struct {
	e      *env
	id     string
	schema string
	pg     *postgres.Store
	prefix string
	redis  *redisstore.Store
	sqlite *sqlite.Store
	sqlDir string
	// myDB is the MySQL database of a MySQL strategy; sqlDB the
	// database/sql pool of a database/sql strategy (env's std or my), and
	// sqlStore its inbox store.
	myDB     string
	sqlDB    *sql.DB
	sqlStore *sqlstore.Store

	insertEffect, rawClaim string
	// insertEffects writes many effects at once: keys $1, payloads $2
	// (PostgreSQL only).
	insertEffects string

	// deliveries counts the deliveries of each message by UUID, as a
	// broker that counts them does: the count outlives a process.
	deliveries sync.Map // string → *atomic.Int32

	// markMu guards handedOut, the first deliveries handed out, and
	// marked, the hand-out mark written in the store (stPGMarked).
	markMu            sync.Mutex
	handedOut, marked int64
}

// markAhead is how far one mark's write reaches past the delivery that
// needs it: what the Kafka subscriber reads ahead of its lowest unacked
// offset (its minimum buffer).
const markAhead = 256

// handOut counts a first delivery and, when it passes the mark, raises the
// mark in the store markAhead further first, as the Kafka subscriber with
// a hand-out mark does before it hands out an offset above it; the
// deliveries behind wait for the write, as the partition's do.
func (f *fixture) handOut(ctx context.Context) error {
	f.markMu.Lock()
	defer f.markMu.Unlock()
	f.handedOut++
	if f.handedOut <= f.marked {
		return nil
	}
	to := f.handedOut + markAhead - 1
	var marks dlv.HandOutMarks = f.pg
	if f.sqlStore != nil {
		marks = f.sqlStore
	}
	if err := marks.InboxMarkHandOut(ctx, "bench", f.id, 0, to); err != nil {
		f.handedOut--
		return err
	}
	f.marked = to
	return nil
}

// delivered counts one more delivery of the message uuid and returns the
// count, this one included.
func (f *fixture) delivered(uuid string) int {
	n, _ := f.deliveries.LoadOrStore(uuid, new(atomic.Int32))
	return int(n.(*atomic.Int32).Add(1))
}

// sqliteInsertEffect is the effect in the SQLite database.
const sqliteInsertEffect = `INSERT INTO effects (key, payload) VALUES (?, ?)`

// newFixture creates what strategy d needs. close removes it again.
func (e *env) newFixture(ctx context.Context, d strategyDef) (_ *fixture, err error) {
	f := &fixture{e: e, id: fmt.Sprintf("%s_%03d", e.runID, e.seq.Add(1))}
	defer func() {
		if err != nil {
			err = errors.Join(err, f.close())
		}
	}()
	if d.Postgres {
		f.schema = "bench_dedup_" + f.id
		s := pgx.Identifier{f.schema}.Sanitize()
		if d.Name == stRaw || d.Name == stRawBatched || d.Name == stRawStdlib {
			if _, err := e.pool.Exec(ctx, `CREATE SCHEMA `+s); err != nil {
				return nil, fmt.Errorf("create schema %s: %w", f.schema, err)
			}
		} else if err := sqlschema.Migrate(ctx, e.pool, sqlschema.Config{Schema: f.schema}); err != nil {
			return nil, fmt.Errorf("migrate schema %s: %w", f.schema, err)
		}
		ddl := `CREATE TABLE ` + s + `.effects (key text NOT NULL, payload bytea NOT NULL);
CREATE TABLE ` + s + `.raw_keys (key text PRIMARY KEY)`
		if _, err := e.pool.Exec(ctx, ddl); err != nil {
			return nil, fmt.Errorf("create effects table: %w", err)
		}
		f.insertEffect = `INSERT INTO ` + s + `.effects (key, payload) VALUES ($1, $2)`
		f.insertEffects = `INSERT INTO ` + s + `.effects (key, payload) SELECT * FROM unnest($1::text[], $2::bytea[])`
		f.rawClaim = `INSERT INTO ` + s + `.raw_keys (key) VALUES ($1) ON CONFLICT DO NOTHING RETURNING key`
		if f.pg, err = postgres.New(e.pool, postgres.Config{Schema: f.schema}); err != nil {
			return nil, fmt.Errorf("postgres store: %w", err)
		}
		if d.Stdlib {
			if e.std == nil {
				return nil, errors.New("strategy needs database/sql on PostgreSQL but no pool is open")
			}
			f.sqlDB = e.std
			// dedup/postgres's tables, which sqlschema.Migrate made above.
			f.sqlStore, err = sqlstore.New(e.std, sqlstore.Config{Dialect: sqlstore.Postgres, Schema: sqlschema.Config{Schema: f.schema}})
			if err != nil {
				return nil, fmt.Errorf("sqlstore: %w", err)
			}
		}
	}
	if d.MySQL {
		if err := f.mysqlFixture(ctx, d); err != nil {
			return nil, err
		}
	}
	if d.Redis {
		if e.rdb == nil {
			return nil, errors.New("strategy needs Redis but no client is connected")
		}
		f.prefix = "bench-dedup:" + f.id + ":"
		if f.redis, err = redisstore.New(redisstore.Config{Client: e.rdb, Prefix: f.prefix}); err != nil {
			return nil, fmt.Errorf("redis store: %w", err)
		}
	}
	if d.SQLite {
		f.sqlDir = filepath.Join(e.tmp, f.id)
		if err := os.Mkdir(f.sqlDir, 0o700); err != nil {
			return nil, fmt.Errorf("sqlite dir: %w", err)
		}
		if f.sqlite, err = sqlite.Open(ctx, filepath.Join(f.sqlDir, "inbox.db"), sqlite.Config{}); err != nil {
			return nil, fmt.Errorf("sqlite store: %w", err)
		}
		if _, err := f.sqlite.DB().ExecContext(ctx, `CREATE TABLE effects (key TEXT NOT NULL, payload BLOB NOT NULL)`); err != nil {
			return nil, fmt.Errorf("sqlite effects table: %w", err)
		}
	}
	return f, nil
}

// mysqlFixture creates the MySQL database of strategy d: oncemill's
// tables (sqlschema.MigrateSQL, which creates the database too) for the
// store, an empty one for the raw baseline, and the effects and raw keys
// tables in it. Keys are VARBINARY, compared byte for byte as the store
// compares them.
func (f *fixture) mysqlFixture(ctx context.Context, d strategyDef) error {
	db := f.e.my
	if db == nil {
		return errors.New("strategy needs MySQL but no pool is open")
	}
	f.myDB, f.sqlDB = "bench_dedup_"+f.id, db
	q := "`" + f.myDB + "`"
	if d.Name == stRawMySQL {
		if _, err := db.ExecContext(ctx, "CREATE DATABASE "+q+" CHARACTER SET utf8mb4"); err != nil {
			return fmt.Errorf("create database %s: %w", f.myDB, err)
		}
	} else if err := sqlschema.MigrateSQL(ctx, db, sqlschema.MySQL, sqlschema.Config{Schema: f.myDB}); err != nil {
		return fmt.Errorf("migrate database %s: %w", f.myDB, err)
	}
	for _, ddl := range []string{
		"CREATE TABLE " + q + ".effects (`key` VARBINARY(255) NOT NULL, payload BLOB NOT NULL) ENGINE=InnoDB",
		"CREATE TABLE " + q + ".raw_keys (`key` VARBINARY(255) PRIMARY KEY) ENGINE=InnoDB",
	} {
		if _, err := db.ExecContext(ctx, ddl); err != nil {
			return fmt.Errorf("create tables in %s: %w", f.myDB, err)
		}
	}
	f.insertEffect = "INSERT INTO " + q + ".effects (`key`, payload) VALUES (?, ?)"
	f.rawClaim = "INSERT IGNORE INTO " + q + ".raw_keys (`key`) VALUES (?)"
	if d.Name != stRawMySQL {
		var err error
		f.sqlStore, err = sqlstore.New(db, sqlstore.Config{Dialect: sqlstore.MySQL, Schema: sqlschema.Config{Schema: f.myDB}})
		if err != nil {
			return fmt.Errorf("sqlstore: %w", err)
		}
	}
	return nil
}

// effectCounts is what the effects table holds at the end of a run.
type effectCounts struct {
	// Rows counts effect rows; Exactly, Doubles and Keys count keys with
	// exactly one, more than one, and at least one row.
	Rows, Exactly, Doubles, Keys int
}

// countEffects reads the effects table.
func (f *fixture) countEffects(ctx context.Context) (effectCounts, error) {
	var c effectCounts
	var err error
	switch {
	case f.myDB != "":
		err = f.e.my.QueryRowContext(ctx, "SELECT coalesce(sum(n = 1), 0), coalesce(sum(n > 1), 0), count(*), coalesce(sum(n), 0) "+
			"FROM (SELECT `key`, count(*) AS n FROM `"+f.myDB+"`.effects GROUP BY `key`) AS per_key").
			Scan(&c.Exactly, &c.Doubles, &c.Keys, &c.Rows)
	case f.sqlite != nil:
		err = f.sqlite.DB().QueryRowContext(ctx, `SELECT coalesce(sum(n = 1), 0), coalesce(sum(n > 1), 0), count(*), coalesce(sum(n), 0)
FROM (SELECT key, count(*) AS n FROM effects GROUP BY key)`).Scan(&c.Exactly, &c.Doubles, &c.Keys, &c.Rows)
	default:
		err = f.e.pool.QueryRow(ctx, `SELECT count(*) FILTER (WHERE n = 1), count(*) FILTER (WHERE n > 1), count(*), coalesce(sum(n), 0)
FROM (SELECT key, count(*) AS n FROM `+pgx.Identifier{f.schema, "effects"}.Sanitize()+` GROUP BY key) AS per_key`).
			Scan(&c.Exactly, &c.Doubles, &c.Keys, &c.Rows)
	}
	if err != nil {
		return c, fmt.Errorf("count effects: %w", err)
	}
	return c, nil
}

// close drops the schema, deletes the Redis keys and the SQLite file.
func (f *fixture) close() error {
	ctx := context.Background()
	var errs []error
	if f.sqlite != nil {
		errs = append(errs, f.sqlite.Close())
	}
	if f.sqlDir != "" {
		errs = append(errs, os.RemoveAll(f.sqlDir))
	}
	if f.schema != "" {
		if _, err := f.e.pool.Exec(ctx, `DROP SCHEMA IF EXISTS `+pgx.Identifier{f.schema}.Sanitize()+` CASCADE`); err != nil {
			errs = append(errs, fmt.Errorf("drop schema %s: %w", f.schema, err))
		}
	}
	if f.myDB != "" {
		if _, err := f.e.my.ExecContext(ctx, "DROP DATABASE IF EXISTS `"+f.myDB+"`"); err != nil {
			errs = append(errs, fmt.Errorf("drop database %s: %w", f.myDB, err))
		}
	}
	if f.prefix != "" {
		if err := redistest.DeleteKeys(ctx, f.e.rdb, f.prefix); err != nil {
			errs = append(errs, fmt.Errorf("delete Redis keys %s*: %w", f.prefix, err))
		}
	}
	return errors.Join(errs...)
}

// warmConnections makes sure the pools hold n connections before the
// clock starts, so that no measurement pays for dialling: the pgx pool,
// db when not nil, and Redis when redis.
func (e *env) warmConnections(ctx context.Context, n int, db *sql.DB, redis bool) error {
	conns := make([]*pgxpool.Conn, 0, n)
	sqlConns := make([]*sql.Conn, 0, n)
	defer func() {
		for _, c := range conns {
			c.Release()
		}
		for _, c := range sqlConns {
			_ = c.Close()
		}
	}()
	for range n {
		if db == nil {
			break
		}
		c, err := db.Conn(ctx)
		if err == nil {
			err = c.PingContext(ctx)
			sqlConns = append(sqlConns, c)
		}
		if err != nil {
			return fmt.Errorf("warm database/sql connections: %w", err)
		}
	}
	for range n {
		c, err := e.pool.Acquire(ctx)
		if err != nil {
			return fmt.Errorf("warm PostgreSQL connections: %w", err)
		}
		conns = append(conns, c)
	}
	if !redis || e.rdb == nil {
		return nil
	}
	var (
		wg   sync.WaitGroup
		errs = make([]error, n)
	)
	for i := range n {
		wg.Go(func() {
			for range 3 {
				if err := e.rdb.Ping(ctx).Err(); err != nil {
					errs[i] = err
					return
				}
			}
		})
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("warm Redis connections: %w", err)
	}
	return nil
}

// fault is what goes wrong in a delivery.
type fault int

const (
	faultNone fault = iota
	// faultAfterClaim: the process dies in the handler, before the effect
	// (after the claim, for the strategies that claim).
	faultAfterClaim
	// faultAfterEffect: the process dies after the effect, before the
	// commit or lease completion.
	faultAfterEffect
	// faultAfterCommit: the process dies after the handler chain returned
	// (committed, completed), before the ack.
	faultAfterCommit
	// faultHandlerError: the handler returns an error before the effect;
	// the process lives and the message is redelivered.
	faultHandlerError
)

// faults lists the faults of the correctness runs, in report order.
func faults() []fault {
	return []fault{faultAfterClaim, faultAfterEffect, faultAfterCommit, faultHandlerError}
}

func (f fault) String() string {
	switch f {
	case faultAfterClaim:
		return "crash after claim, before effect"
	case faultAfterEffect:
		return "crash after effect, before commit/complete"
	case faultAfterCommit:
		return "crash after commit, before ack"
	case faultHandlerError:
		return "handler error, process lives"
	}
	return "none"
}

// short is the fault's name in the CSV.
func (f fault) short() string {
	switch f {
	case faultAfterClaim:
		return "after_claim"
	case faultAfterEffect:
		return "after_effect"
	case faultAfterCommit:
		return "after_commit"
	case faultHandlerError:
		return "handler_error"
	}
	return "none"
}

// delivery travels in the message context of one delivery: the fault to
// inject, and the round trips its store calls made.
type delivery struct {
	fault     fault
	pg, redis atomic.Int64
	// commits counts the COMMIT statements among pg.
	commits atomic.Int64
}

type deliveryKey struct{}

// deliveryOf returns the delivery in ctx, or an empty one.
func deliveryOf(ctx context.Context) *delivery {
	if d, ok := ctx.Value(deliveryKey{}).(*delivery); ok {
		return d
	}
	return &delivery{}
}

// pgTracer counts every statement sent through the pool (BEGIN, COMMIT and
// ROLLBACK included) against the delivery in its context.
type pgTracer struct{}

func (pgTracer) TraceQueryStart(ctx context.Context, _ *pgx.Conn, q pgx.TraceQueryStartData) context.Context {
	if d, ok := ctx.Value(deliveryKey{}).(*delivery); ok {
		d.pg.Add(1)
		if strings.EqualFold(q.SQL, "commit") {
			d.commits.Add(1)
		}
	}
	return ctx
}

func (pgTracer) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// TraceBatchStart counts a batch (a pgx batch, or the inbox's pipelined
// attempt record, BEGIN and claim) as one round trip: its statements go
// out together and come back together.
func (pgTracer) TraceBatchStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchStartData) context.Context {
	if d, ok := ctx.Value(deliveryKey{}).(*delivery); ok {
		d.pg.Add(1)
	}
	return ctx
}

func (pgTracer) TraceBatchQuery(context.Context, *pgx.Conn, pgx.TraceBatchQueryData) {}

func (pgTracer) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData) {}

// redisHook counts every Redis command, and every pipeline as one round
// trip, against the delivery in its context.
type redisHook struct{}

func (redisHook) DialHook(next goredis.DialHook) goredis.DialHook { return next }

func (redisHook) ProcessHook(next goredis.ProcessHook) goredis.ProcessHook {
	return func(ctx context.Context, cmd goredis.Cmder) error {
		if d, ok := ctx.Value(deliveryKey{}).(*delivery); ok {
			d.redis.Add(1)
		}
		return next(ctx, cmd)
	}
}

func (redisHook) ProcessPipelineHook(next goredis.ProcessPipelineHook) goredis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []goredis.Cmder) error {
		if d, ok := ctx.Value(deliveryKey{}).(*delivery); ok {
			d.redis.Add(1)
		}
		return next(ctx, cmds)
	}
}

func isNoRows(err error) bool { return errors.Is(err, pgx.ErrNoRows) }

func maxOf(xs []int, more ...int) int {
	m := 0
	for _, x := range append(append([]int(nil), xs...), more...) {
		m = max(m, x)
	}
	return m
}
