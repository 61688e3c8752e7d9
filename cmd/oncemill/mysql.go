package main

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"fmt"
	"net"
	"net/url"
	"strings"
	"time"

	"github.com/go-sql-driver/mysql"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/oncemill/oncemill/adapters"
	"github.com/oncemill/oncemill/dlq"
	"github.com/oncemill/oncemill/internal/redact"
	"github.com/oncemill/oncemill/sqlschema"
)

// dbTarget is a checked --database URL: PostgreSQL through pgx, or MySQL
// (MariaDB) through go-sql-driver/mysql; one of the two is set.
type dbTarget struct {
	pg *pgxpool.Config
	my *mysql.Config
}

// isMySQLURL reports whether raw names a MySQL database.
func isMySQLURL(raw string) bool {
	return strings.HasPrefix(strings.ToLower(raw), "mysql://")
}

// parseMySQLURL reads a MySQL or MariaDB URL,
//
//	mysql://user:password@host:3306/database?param=value
//
// into go-sql-driver/mysql's config: TCP to host (port 3306 when none is
// given), the user and password percent-decoded, the database the
// connection's own (oncemill's tables are in the --schema database,
// whatever it is), and the parameters go-sql-driver/mysql's DSN
// parameters (tls, timeout, readTimeout, …; one it does not know is a
// session variable to set). The connect timeout (timeout) defaults to
// adapters.DefaultConnectTimeout and bounds the whole connect, the
// server's handshake included (see [openMySQL]); readTimeout and
// writeTimeout default to [mysqlIOTimeout]. A parameter the URL gives
// wins, readTimeout=0 included (no bound). Its errors name the flag and
// never the password.
func parseMySQLURL(flagName, raw string) (*mysql.Config, error) {
	u, err := url.Parse(raw)
	if err != nil {
		return nil, usagef("%s: cannot parse %q", flagName, redact.URL(raw))
	}
	if u.Opaque != "" || u.Host == "" {
		return nil, usagef("%s: want mysql://user:password@host:3306/database", flagName)
	}
	safe := redact.URL(raw)
	// The parameters, checked by the driver as it checks a DSN's.
	cfg, err := mysql.ParseDSN("/?" + u.RawQuery)
	if err != nil {
		return nil, usagef("%s %s: %v", flagName, safe, err)
	}
	cfg.Net = "tcp"
	cfg.Addr = u.Host
	if _, _, err := net.SplitHostPort(u.Host); err != nil {
		cfg.Addr = net.JoinHostPort(strings.Trim(u.Host, "[]"), "3306")
	}
	if u.User != nil {
		cfg.User = u.User.Username()
		cfg.Passwd, _ = u.User.Password()
	}
	cfg.DBName = strings.TrimPrefix(u.Path, "/")
	if strings.Contains(cfg.DBName, "/") {
		return nil, usagef("%s %s: the path is one database name", flagName, safe)
	}
	if cfg.Timeout == 0 {
		// A server that accepts the connection and never answers would
		// otherwise hang the command: the same bound as adapters.Open.
		cfg.Timeout = adapters.DefaultConnectTimeout
	}
	// go-sql-driver/mysql reads and writes without a deadline unless
	// told: a server that stops answering mid-statement would hang the
	// command, and the driver's COMMIT watches no context.
	q := u.Query()
	if !q.Has("readTimeout") {
		cfg.ReadTimeout = mysqlIOTimeout
	}
	if !q.Has("writeTimeout") {
		cfg.WriteTimeout = mysqlIOTimeout
	}
	return cfg, nil
}

// mysqlIOTimeout is the default readTimeout and writeTimeout of a mysql://
// URL: the longest the command waits for the server's answer to a
// statement, or for it to take what the command sends. Longer than any
// statement of the command should take on a healthy server.
const mysqlIOTimeout = 30 * time.Second

// boundedConnector gives every connect of go-sql-driver/mysql at most
// bound, the server's handshake and authentication included: the driver's
// own timeout parameter bounds only the TCP dial, and the handshake is
// read until the server answers. The driver closes the connection when the
// context of Connect ends.
type boundedConnector struct {
	driver.Connector
	addr  string
	bound time.Duration
}

func (c boundedConnector) Connect(ctx context.Context) (driver.Conn, error) {
	cctx, cancel := context.WithTimeout(ctx, c.bound)
	defer cancel()
	conn, err := c.Connector.Connect(cctx)
	if err != nil && ctx.Err() == nil && cctx.Err() != nil {
		return nil, fmt.Errorf("the database at %s did not answer within %s: %w", c.addr, c.bound, err)
	}
	return conn, err
}

// openMySQL connects to cfg's server with at most maxConns connections and
// checks that it answers. Each connect, handshake included, is bounded by
// cfg.Timeout.
func openMySQL(ctx context.Context, cfg *mysql.Config, maxConns int) (*sql.DB, error) {
	connector, err := mysql.NewConnector(cfg)
	if err != nil {
		return nil, err
	}
	if cfg.Timeout > 0 {
		connector = boundedConnector{Connector: connector, addr: cfg.Addr, bound: cfg.Timeout}
	}
	db := sql.OpenDB(connector)
	db.SetMaxOpenConns(maxConns)
	if err := db.PingContext(ctx); err != nil {
		return nil, errors.Join(err, db.Close())
	}
	return db, nil
}

// connectMySQL opens the MySQL database and the store on its dead-letter
// table; closeDB releases them.
func connectMySQL(ctx context.Context, mcfg *mysql.Config, cfg sqlschema.Config) (*dlq.Store, func(), error) {
	db, err := openMySQL(ctx, mcfg, 4)
	if err != nil {
		return nil, nil, fmt.Errorf("connect to the database: %w", err)
	}
	store, err := dlq.NewSQLStore(db, sqlschema.MySQL, cfg)
	if err != nil {
		_ = db.Close()
		return nil, nil, err
	}
	return store, func() { _ = db.Close() }, nil
}
