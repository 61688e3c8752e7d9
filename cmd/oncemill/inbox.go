package main

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"strings"

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

	db     *dbURL           // a database's inbox table
	schema sqlschema.Config // its schema and table
}

// parseInbox checks an --inbox URL before anything connects: redis:// or
// rediss:// (with an optional prefix parameter), or a database as
// --database names it, with optional schema and table parameters (on
// MySQL the schema is the database of the tables; SQLite has none), the
// SQLite file existing. Its errors are usage errors naming the flag.
func parseInbox(raw string) (*inboxTarget, error) {
	u, err := parseURL("--inbox", raw)
	if err != nil {
		return nil, err
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
		return t, nil
	case "":
		return nil, usagef("--inbox %s has no scheme; use redis:// or %s", t.safe, databaseURLs)
	}
	if _, ok := schemes[strings.ToLower(u.Scheme)]; !ok {
		return nil, usagef("--inbox: unknown scheme %q in %s; use redis:// or %s", u.Scheme, t.safe, databaseURLs)
	}
	if t.schema.Schema, err = take("schema"); err != nil {
		return nil, err
	}
	if t.schema.InboxTable, err = take("table"); err != nil {
		return nil, err
	}
	t.schema = t.schema.WithDefaults()
	if err := checkNames("--inbox parameter schema", t.schema.Schema, "--inbox parameter table", t.schema.InboxTable); err != nil {
		return nil, err
	}
	u.RawQuery = q.Encode()
	t.db, err = parseDatabase("--inbox", u.String(), false)
	return t, err
}

// open connects to the store and returns it with what closes it.
func (t *inboxTarget) open(ctx context.Context) (dlq.Granter, func(), error) {
	fail := func(err error) (dlq.Granter, func(), error) {
		return nil, nil, fmt.Errorf("--inbox %s: %w", t.safe, err)
	}
	if t.redis != nil {
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
	}
	db, err := t.db.connect(ctx, 2)
	if err != nil {
		return fail(err)
	}
	store, err := inboxStore(ctx, db, t.schema)
	if err != nil {
		db.Close()
		return fail(err)
	}
	return store, db.Close, nil
}

// inboxStore is the inbox store on db's table, as its consumers run it.
func inboxStore(ctx context.Context, db database, schema sqlschema.Config) (dlq.Granter, error) {
	if db.Pool != nil {
		return postgres.New(db.Pool, schema)
	}
	for _, d := range []sqlstore.Dialect{sqlstore.Postgres, sqlstore.MySQL} {
		if d.Schema() == db.Dialect {
			return sqlstore.New(db.DB, sqlstore.Config{Dialect: d, Schema: schema})
		}
	}
	return sqlite.New(ctx, db.DB, sqlite.Config{Table: schema.InboxTable})
}
