package proctest

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/internal/testing/pgtest"
)

// DB is a schema of a test's own on the test database, for the test and
// its child consumers: oncemill's tables (inbox, dead-letter table) and
// the test's. In its queries {S} stands for the quoted schema.
type DB struct {
	Pool   *pgxpool.Pool
	Schema string // unquoted
}

// NewDB creates the schema, migrates oncemill's tables into it and runs
// tables, the test's CREATE statements; the schema is dropped when the
// test ends.
func NewDB(t testing.TB, tables string) *DB {
	t.Helper()
	pool := pgtest.Pool(t, 4)
	db := &DB{Pool: pool, Schema: pgtest.Schema(t, pool)}
	db.Exec(t, tables)
	return db
}

// Q replaces {S} in query with the quoted schema.
func (db *DB) Q(query string) string {
	return strings.ReplaceAll(query, "{S}", pgx.Identifier{db.Schema}.Sanitize())
}

// Exec runs query.
func (db *DB) Exec(t testing.TB, query string, args ...any) {
	t.Helper()
	_, err := db.Pool.Exec(context.Background(), db.Q(query), args...)
	require.NoError(t, err)
}

// Count runs query, which returns one number.
func (db *DB) Count(t testing.TB, query string, args ...any) int {
	t.Helper()
	var n int
	require.NoError(t, db.Pool.QueryRow(context.Background(), db.Q(query), args...).Scan(&n))
	return n
}

// Now is the database's clock, which the effects' timestamps are read on.
func (db *DB) Now(t testing.TB) time.Time {
	t.Helper()
	var at time.Time
	require.NoError(t, db.Pool.QueryRow(context.Background(), `SELECT clock_timestamp()`).Scan(&at))
	return at
}

// Stack is a consumer's stack on this schema.
func (db *DB) Stack(brokerURL, group, topic, consumer string) Stack {
	return Stack{BrokerURL: brokerURL, Group: group, Topic: topic, DatabaseURL: pgtest.URL(), Schema: db.Schema, Consumer: consumer}
}
