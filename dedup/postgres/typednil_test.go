package postgres_test

import (
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/dedup/postgres"
)

// TestNewRefusesTypedNilPool: a nil *pgxpool.Pool, which is not a nil DB,
// is refused (issue 31, case 9: before, it was accepted and every message
// panicked).
func TestNewRefusesTypedNilPool(t *testing.T) {
	t.Parallel()
	_, err := postgres.New((*pgxpool.Pool)(nil), postgres.Config{})
	require.ErrorContains(t, err, "db is nil")
}
