// Package mysqltest connects tests to the real MySQL or MariaDB server and
// gives each test its own database, so that tests run in parallel without
// seeing each other.
//
// The server is ONCEMILL_TEST_MYSQL_DSN (a go-sql-driver/mysql DSN), else
// root@tcp(127.0.0.1:3306)/test. When it cannot be reached the test fails
// under CI=true and is skipped, loudly, elsewhere.
package mysqltest

import (
	"context"
	"database/sql"
	"os"
	"testing"
	"time"

	"github.com/go-sql-driver/mysql"

	"github.com/oncemill/oncemill/internal/testing/pgtest"
)

// DefaultDSN is the test server when no environment variable names one.
const DefaultDSN = "root@tcp(127.0.0.1:3306)/test"

// DSN returns the test server's DSN.
func DSN() string {
	if d := os.Getenv("ONCEMILL_TEST_MYSQL_DSN"); d != "" {
		return d
	}
	return DefaultDSN
}

// Config returns the test server's driver configuration with database as
// the connection's database ("" keeps the DSN's); a test may set further
// fields (InterpolateParams, ParseTime) before [Open].
func Config(t testing.TB, database string) *mysql.Config {
	t.Helper()
	cfg, err := mysql.ParseDSN(DSN())
	if err != nil {
		t.Fatalf("parse test MySQL DSN: %v", err)
	}
	if database != "" {
		cfg.DBName = database
	}
	return cfg
}

// Open connects to the test server with cfg (from [Config]) and at most
// maxConns connections, and closes the pool when the test ends.
func Open(t testing.TB, cfg *mysql.Config, maxConns int) *sql.DB {
	t.Helper()
	connector, err := mysql.NewConnector(cfg)
	if err != nil {
		t.Fatalf("test MySQL connector: %v", err)
	}
	db := sql.OpenDB(connector)
	if maxConns > 0 {
		db.SetMaxOpenConns(maxConns)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := db.PingContext(ctx); err != nil {
		_ = db.Close()
		pgtest.Unavailable(t, "MySQL/MariaDB", err)
	}
	t.Cleanup(func() {
		if err := db.Close(); err != nil {
			t.Errorf("close test MySQL pool: %v", err)
		}
	})
	return db
}

// Database creates a fresh database named after the test and drops it when
// the test ends. It returns its name.
func Database(t testing.TB) string {
	t.Helper()
	admin := Open(t, Config(t, ""), 2)
	name := pgtest.Name(t)
	ctx := context.Background()
	if _, err := admin.ExecContext(ctx, "CREATE DATABASE `"+name+"` CHARACTER SET utf8mb4"); err != nil {
		t.Fatalf("create test database %s: %v", name, err)
	}
	t.Cleanup(func() {
		// admin is closed by its own cleanup, which runs after this one.
		if _, err := admin.ExecContext(context.Background(), "DROP DATABASE IF EXISTS `"+name+"`"); err != nil {
			t.Errorf("drop test database %s: %v", name, err)
		}
	})
	return name
}

// DB creates a fresh database named after the test (see [Database]) and
// returns a pool of at most maxConns connections whose connections use it,
// with the DSN's other settings.
func DB(t testing.TB, maxConns int) (*sql.DB, string) {
	t.Helper()
	name := Database(t)
	return Open(t, Config(t, name), maxConns), name
}
