// Package postgres registers the postgres:// and postgresql:// URLs of
// adapters.Open: watermill-sql v4 on PostgreSQL through pgx, one table per
// topic and offsets per consumer group. A program links it by importing
// it, for its side effect:
//
//	import _ "github.com/oncemill/oncemill/adapters/postgres"
//
// It is a broker for tests, development and low volumes on the database a
// service already has; the outbox relay and the inbox need no broker of
// this kind.
package postgres

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"net"
	"net/url"
	"strconv"
	"strings"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/oncemill/oncemill/adapters/internal/brokerurl"
	"github.com/oncemill/oncemill/delivery"
)

func init() {
	brokerurl.Register(openURL, "postgres", "postgresql")
	brokerurl.RegisterChecker(func(u *url.URL, opts brokerurl.Options) error {
		_, _, err := urlConfig(u, opts)
		return err
	}, "postgres", "postgresql")
}

// openURL opens watermill-sql v4 on PostgreSQL through pgx: one table
// per topic, offsets per consumer group. Parameters: group,
// connect_timeout (which bounds each connection of the pool, not only the
// first), and those of pgx (see postgresParams); the URL's own are removed
// before the rest reaches pgx.
func openURL(ctx context.Context, u *url.URL, opts brokerurl.Options) (*brokerurl.Opened, error) {
	cfg, grp, err := urlConfig(u, opts)
	if err != nil {
		return nil, err
	}
	timeout := cfg.ConnConfig.ConnectTimeout
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", brokerurl.ErrBadURL, err)
	}
	bound := brokerurl.Within(ctx, timeout)
	if err := pool.Ping(ctx); err != nil {
		pool.Close()
		if errors.Is(err, context.DeadlineExceeded) {
			err = brokerurl.NoAnswer(postgresHosts(cfg), bound, err)
		}
		return nil, fmt.Errorf("postgres unreachable: %w", err)
	}
	closePool := func() error { pool.Close(); return nil }

	db := wsql.BeginnerFromPgx(pool)
	// BYTEA, not the default JSON: a broker carries any payload, and a
	// malformed one must reach the handler chain (and the DLQ), not fail
	// the publish.
	schema := factlessSchema{wsql.DefaultPostgreSQLSchema{GeneratePayloadType: func(string) string { return "BYTEA" }}}
	pub, err := wsql.NewPublisher(db, wsql.PublisherConfig{
		SchemaAdapter:        schema,
		AutoInitializeSchema: true,
	}, opts.Logger)
	if err != nil {
		return nil, errors.Join(fmt.Errorf("watermill-sql publisher: %w", err), closePool())
	}
	sub, err := wsql.NewSubscriber(db, wsql.SubscriberConfig{
		ConsumerGroup:    grp,
		SchemaAdapter:    schema,
		OffsetsAdapter:   wsql.DefaultPostgreSQLOffsetsAdapter{},
		InitializeSchema: true,
	}, opts.Logger)
	if err != nil {
		return nil, errors.Join(fmt.Errorf("watermill-sql subscriber: %w", err), pub.Close(), closePool())
	}
	return &brokerurl.Opened{Publisher: pub, Subscriber: sub, Closers: []func() error{closePool}}, nil
}

// urlConfig reads a postgres:// URL and opts into a checked pool config,
// whose connect timeout is set, and the consumer group.
func urlConfig(u *url.URL, opts brokerurl.Options) (*pgxpool.Config, string, error) {
	q, err := brokerurl.Query(u, postgresParams()...)
	if err != nil {
		return nil, "", err
	}
	grp, err := brokerurl.Group(q, opts)
	if err != nil {
		return nil, "", err
	}
	timeout, err := brokerurl.ConnectTimeout(q, opts)
	if err != nil {
		return nil, "", err
	}
	dsn := *u
	q.Del("group")
	q.Del("connect_timeout")
	dsn.RawQuery = q.Encode()

	cfg, err := pgxpool.ParseConfig(dsn.String())
	if err != nil {
		return nil, "", fmt.Errorf("%w: %w", brokerurl.ErrBadURL, err)
	}
	cfg.ConnConfig.ConnectTimeout = timeout
	return cfg, grp, nil
}

// postgresParams are the URL parameters pgx reads: pgconn's connection
// settings, pgx's statement caches and query mode, and pgxpool's pool
// settings, with the server settings most often given in a URL. Any other
// server setting goes in options, as with libpq:
// options=-c%20statement_timeout%3D5s.
func postgresParams() []string {
	return []string{
		// pgconn
		"host", "port", "dbname", "user", "password", "passfile",
		"sslmode", "ssl", "sslkey", "sslcert", "sslcertmode", "sslrootcert",
		"sslnegotiation", "sslpassword", "sslsni", "krbspn", "krbsrvname",
		"target_session_attrs", "service", "servicefile",
		"min_protocol_version", "max_protocol_version", "channel_binding", "require_auth",
		// pgx
		"statement_cache_capacity", "description_cache_capacity", "default_query_exec_mode",
		// pgxpool
		"pool_max_conns", "pool_min_conns", "pool_min_idle_conns",
		"pool_max_conn_lifetime", "pool_max_conn_idle_time", "pool_max_conn_lifetime_jitter",
		"pool_health_check_period", "pool_ping_timeout",
		// server settings sent at connect
		"application_name", "client_encoding", "options", "search_path", "timezone",
	}
}

// postgresHosts names the servers cfg connects to, as host:port.
func postgresHosts(cfg *pgxpool.Config) string {
	addr := func(host string, port uint16) string {
		if strings.HasPrefix(host, "/") {
			return host // a Unix socket directory
		}
		return net.JoinHostPort(host, strconv.Itoa(int(port)))
	}
	hosts := []string{addr(cfg.ConnConfig.Host, cfg.ConnConfig.Port)}
	for _, f := range cfg.ConnConfig.Fallbacks {
		if a := addr(f.Host, f.Port); a != hosts[len(hosts)-1] {
			hosts = append(hosts, a)
		}
	}
	return strings.Join(hosts, ", ")
}

// factlessSchema is watermill-sql's PostgreSQL schema whose subscriber
// drops the delivery facts a message was stored with
// ([delivery.IsAdapterFact]: a consumed message published again, or a
// producer's own oncemill_decode_error), as every broker adapter ignores
// them: they are facts of another delivery, and this broker sets none.
type factlessSchema struct {
	wsql.DefaultPostgreSQLSchema
}

func (s factlessSchema) UnmarshalMessage(params wsql.UnmarshalMessageParams) (wsql.Row, error) {
	r, err := s.DefaultPostgreSQLSchema.UnmarshalMessage(params)
	if err == nil && r.Msg != nil {
		maps.DeleteFunc(r.Msg.Metadata, func(k, _ string) bool { return delivery.IsAdapterFact(k) })
	}
	return r, err
}
