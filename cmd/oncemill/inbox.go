package main

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"os"
	"strings"

	"github.com/go-sql-driver/mysql"
	"github.com/jackc/pgx/v5/pgxpool"
	goredis "github.com/redis/go-redis/v9"

	"github.com/oncemill/oncemill/adapters"
	"github.com/oncemill/oncemill/dedup/postgres"
	"github.com/oncemill/oncemill/dedup/redis"
	"github.com/oncemill/oncemill/dedup/sqlite"
	"github.com/oncemill/oncemill/dedup/sqlstore"
	"github.com/oncemill/oncemill/dlq"
	"github.com/oncemill/oncemill/internal/redact"
	"github.com/oncemill/oncemill/sqlschema"
)

// inboxTarget is a checked --inbox URL: the consumers' inbox store, on
// whose dead keys a replay writes its grants.
type inboxTarget struct {
	safe string // the URL without its password, for errors

	redis  *goredis.Options
	prefix string

	sqlitePath string

	pg     *pgxpool.Config
	my     *mysql.Config
	schema string // postgres and mysql

	table string // sqlite and postgres
}

// parseInbox checks an --inbox URL before anything connects: redis:// or
// rediss:// (with an optional prefix parameter), sqlite:PATH (with an
// optional table parameter), postgres:// or mysql:// (with optional schema
// and table parameters; on MySQL the schema is the database of the
// tables). Its errors are usage errors naming the flag.
func parseInbox(raw string) (*inboxTarget, error) {
	u, err := url.Parse(raw)
	if err != nil {
		return nil, usagef("--inbox: cannot parse %q", redact.URL(raw))
	}
	t := &inboxTarget{safe: redact.URL(raw)}
	q, err := url.ParseQuery(u.RawQuery)
	if err != nil {
		return nil, usagef("--inbox %s: query: %v", t.safe, err)
	}
	take := func(name string) (string, error) {
		if len(q[name]) > 1 {
			return "", usagef("--inbox %s: parameter %s is given %d times", t.safe, name, len(q[name]))
		}
		v := q.Get(name)
		q.Del(name)
		return v, nil
	}
	switch u.Scheme {
	case "redis", "rediss":
		if t.prefix, err = take("prefix"); err != nil {
			return nil, err
		}
		if strings.ContainsAny(t.prefix, "{}") {
			return nil, usagef("--inbox %s: parameter prefix must not contain '{' or '}'", t.safe)
		}
		u.RawQuery = q.Encode()
		if t.redis, err = goredis.ParseURL(u.String()); err != nil {
			return nil, usagef("--inbox %s: %v", t.safe, err)
		}
	case "sqlite":
		if t.table, err = take("table"); err != nil {
			return nil, err
		}
		if len(q) > 0 {
			return nil, usagef("--inbox %s: unknown parameters for sqlite: (the known one is table)", t.safe)
		}
		t.sqlitePath = u.Opaque
		if t.sqlitePath == "" && u.Host == "" {
			t.sqlitePath = u.Path
		}
		if t.sqlitePath == "" {
			return nil, usagef("--inbox %s: want sqlite:PATH, the consumer's database file", t.safe)
		}
		if fi, err := os.Stat(t.sqlitePath); err != nil || fi.IsDir() {
			return nil, usagef("--inbox %s: %q is not the consumer's database file", t.safe, t.sqlitePath)
		}
	case "postgres", "postgresql":
		if t.schema, err = take("schema"); err != nil {
			return nil, err
		}
		if t.table, err = take("table"); err != nil {
			return nil, err
		}
		if t.schema == "" {
			t.schema = sqlschema.DefaultSchema
		}
		if err := sqlschema.ValidateIdentifier("--inbox parameter schema", t.schema); err != nil {
			return nil, usageError{msg: err.Error()}
		}
		u.RawQuery = q.Encode()
		if t.pg, err = pgxpool.ParseConfig(u.String()); err != nil {
			// pgx leaves the password out of its parse errors.
			return nil, usagef("--inbox: %v", err)
		}
		t.pg.MaxConns = 2
		if t.pg.ConnConfig.ConnectTimeout == 0 {
			t.pg.ConnConfig.ConnectTimeout = adapters.DefaultConnectTimeout
		}
	case "mysql":
		if t.schema, err = take("schema"); err != nil {
			return nil, err
		}
		if t.table, err = take("table"); err != nil {
			return nil, err
		}
		if t.schema == "" {
			t.schema = sqlschema.DefaultSchema
		}
		if err := sqlschema.ValidateIdentifier("--inbox parameter schema", t.schema); err != nil {
			return nil, usageError{msg: err.Error()}
		}
		u.RawQuery = q.Encode()
		if t.my, err = parseMySQLURL("--inbox", u.String()); err != nil {
			return nil, err
		}
	case "":
		return nil, usagef("--inbox %s has no scheme; use redis://, sqlite:PATH, postgres:// or mysql://", t.safe)
	default:
		return nil, usagef("--inbox: unknown scheme %q in %s; use redis://, sqlite:PATH, postgres:// or mysql://", u.Scheme, t.safe)
	}
	if t.table != "" {
		if err := sqlschema.ValidateIdentifier("--inbox parameter table", t.table); err != nil {
			return nil, usageError{msg: err.Error()}
		}
	}
	return t, nil
}

// open connects to the store and returns it with what closes it.
func (t *inboxTarget) open(ctx context.Context) (dlq.Granter, func(), error) {
	fail := func(err error) (dlq.Granter, func(), error) {
		return nil, nil, fmt.Errorf("--inbox %s: %w", t.safe, err)
	}
	switch {
	case t.redis != nil:
		opts := *t.redis
		if opts.DialTimeout == 0 {
			opts.DialTimeout = adapters.DefaultConnectTimeout
		}
		client := goredis.NewClient(&opts)
		if err := client.Ping(ctx).Err(); err != nil {
			return fail(errors.Join(err, client.Close()))
		}
		store, err := redis.New(redis.Config{Client: client, Prefix: t.prefix})
		if err != nil {
			return fail(errors.Join(err, client.Close()))
		}
		return store, func() { _ = client.Close() }, nil
	case t.my != nil:
		db, err := openMySQL(ctx, t.my, 2)
		if err != nil {
			return fail(err)
		}
		store, err := sqlstore.New(db, sqlstore.Config{Dialect: sqlstore.MySQL,
			Schema: sqlschema.Config{Schema: t.schema, InboxTable: t.table}})
		if err != nil {
			_ = db.Close()
			return fail(err)
		}
		return store, func() { _ = db.Close() }, nil
	case t.sqlitePath != "":
		store, err := sqlite.Open(ctx, t.sqlitePath, sqlite.Config{Table: t.table})
		if err != nil {
			return fail(err)
		}
		return store, func() { _ = store.Close() }, nil
	default:
		pool, err := pgxpool.NewWithConfig(ctx, t.pg)
		if err == nil {
			err = pool.Ping(ctx)
		}
		if err != nil {
			if pool != nil {
				pool.Close()
			}
			return fail(err)
		}
		store, err := postgres.New(pool, postgres.Config{Schema: t.schema, InboxTable: t.table})
		if err != nil {
			pool.Close()
			return fail(err)
		}
		return store, pool.Close, nil
	}
}
