// Package pgtest connects tests to the real PostgreSQL and gives each test
// its own schema, so that tests run in parallel without seeing each other.
//
// The server is ONCEMILL_TEST_DATABASE_URL, else DATABASE_URL, else
// postgres://postgres@127.0.0.1:5432/test. When it cannot be reached the
// test fails under CI=true and is skipped, loudly, elsewhere.
package pgtest

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/oncemill/oncemill/sqlschema"
)

// DefaultURL is the test server when no environment variable names one.
const DefaultURL = "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"

// URL returns the test server's connection string.
func URL() string {
	for _, v := range []string{"ONCEMILL_TEST_DATABASE_URL", "DATABASE_URL"} {
		if u := os.Getenv(v); u != "" {
			return u
		}
	}
	return DefaultURL
}

// Unavailable fails the test under CI=true and skips it elsewhere; a
// missing service (any service, not only PostgreSQL) is never a silent pass.
func Unavailable(t testing.TB, service string, err error) {
	t.Helper()
	if os.Getenv("CI") != "" {
		t.Fatalf("%s is required under CI but unreachable: %v (run scripts/services.sh)", service, err)
	}
	t.Skipf("SKIPPED: %s unreachable: %v (run scripts/services.sh, or set CI=true to make this a failure)", service, err)
}

// Pool connects to the test server with at most maxConns connections and
// closes the pool when the test ends.
func Pool(t testing.TB, maxConns int32) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(URL())
	if err != nil {
		t.Fatalf("parse test database URL: %v", err)
	}
	if maxConns > 0 {
		cfg.MaxConns = maxConns
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err == nil {
		err = pool.Ping(ctx)
	}
	if err != nil {
		if pool != nil {
			pool.Close()
		}
		Unavailable(t, "PostgreSQL", err)
	}
	t.Cleanup(pool.Close)
	return pool
}

// Schema creates a fresh schema named after the test, migrates oncemill's
// tables into it and drops it when the test ends.
func Schema(t testing.TB, pool *pgxpool.Pool) string {
	t.Helper()
	schema := Name(t)
	ctx := context.Background()
	if err := sqlschema.Migrate(ctx, pool, sqlschema.Config{Schema: schema}); err != nil {
		t.Fatalf("migrate test schema %s: %v", schema, err)
	}
	t.Cleanup(func() {
		if _, err := pool.Exec(context.Background(), `DROP SCHEMA IF EXISTS `+pgx.Identifier{schema}.Sanitize()+` CASCADE`); err != nil {
			t.Errorf("drop test schema %s: %v", schema, err)
		}
	})
	return schema
}

// Name returns a unique lower-case identifier that starts with a short form
// of the test's name, for schemas, consumers and topics.
func Name(t testing.TB) string {
	base := strings.Map(func(r rune) rune {
		switch {
		case r >= 'a' && r <= 'z', r >= '0' && r <= '9':
			return r
		case r >= 'A' && r <= 'Z':
			return r + 'a' - 'A'
		default:
			return '_'
		}
	}, t.Name())
	if len(base) > 30 {
		base = base[:30]
	}
	var b [4]byte
	if _, err := rand.Read(b[:]); err != nil {
		t.Fatalf("random name: %v", err)
	}
	return "t_" + base + "_" + hex.EncodeToString(b[:])
}
