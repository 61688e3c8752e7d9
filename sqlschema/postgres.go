package sqlschema

import (
	"context"
	"errors"
	"fmt"
	"hash/fnv"

	"github.com/jackc/pgx/v5"
)

// Beginner is what [Migrate] needs of a PostgreSQL connection: a
// *pgxpool.Pool, a *pgx.Conn or a pgx.Tx (a nested transaction is a savepoint).
type Beginner interface {
	Begin(ctx context.Context) (pgx.Tx, error)
}

// Migrate brings the PostgreSQL schema named by cfg up to the newest
// version. It is idempotent and safe when several processes start at once:
// all steps run in one transaction under an advisory lock keyed by the
// schema name, and applied versions are recorded in
// <schema>.oncemill_migrations.
func Migrate(ctx context.Context, db Beginner, cfg Config) error {
	cfg = cfg.WithDefaults()
	migrations, err := Migrations(Postgres, cfg)
	if err != nil {
		return err
	}
	names := NamesFor(Postgres, cfg)

	tx, err := db.Begin(ctx)
	if err != nil {
		return fmt.Errorf("sqlschema: begin migration: %w", err)
	}
	err = migrate(ctx, tx, cfg, names, migrations)
	if err == nil {
		err = tx.Commit(ctx)
	}
	if err != nil {
		if rbErr := tx.Rollback(ctx); rbErr != nil && !errors.Is(rbErr, pgx.ErrTxClosed) {
			err = errors.Join(err, fmt.Errorf("sqlschema: rollback: %w", rbErr))
		}
		return fmt.Errorf("sqlschema: migrate schema %s: %w", cfg.Schema, err)
	}
	return nil
}

func migrate(ctx context.Context, tx pgx.Tx, cfg Config, names Names, migrations []Migration) error {
	if _, err := tx.Exec(ctx, `SELECT pg_advisory_xact_lock($1)`, lockKey(cfg.Schema)); err != nil {
		return fmt.Errorf("take advisory lock: %w", err)
	}
	// CREATE SCHEMA IF NOT EXISTS is not safe against a concurrent
	// CREATE SCHEMA; under the lock it runs alone.
	if _, err := tx.Exec(ctx, `CREATE SCHEMA IF NOT EXISTS `+names.Schema); err != nil {
		return fmt.Errorf("create schema: %w", err)
	}
	versions := names.Schema + `.oncemill_migrations`
	if _, err := tx.Exec(ctx, `CREATE TABLE IF NOT EXISTS `+versions+` (
		version    integer     PRIMARY KEY,
		name       text        NOT NULL,
		applied_at timestamptz NOT NULL DEFAULT now()
	)`); err != nil {
		return fmt.Errorf("create version table: %w", err)
	}
	applied := map[int]bool{}
	rows, err := tx.Query(ctx, `SELECT version FROM `+versions)
	if err != nil {
		return fmt.Errorf("read versions: %w", err)
	}
	done, err := pgx.CollectRows(rows, pgx.RowTo[int])
	if err != nil {
		return fmt.Errorf("read versions: %w", err)
	}
	for _, v := range done {
		applied[v] = true
	}
	for _, m := range migrations {
		if applied[m.Version] {
			continue
		}
		if _, err := tx.Exec(ctx, m.Up); err != nil {
			return fmt.Errorf("apply %03d_%s: %w", m.Version, m.Name, err)
		}
		if _, err := tx.Exec(ctx, `INSERT INTO `+versions+` (version, name) VALUES ($1, $2)`, m.Version, m.Name); err != nil {
			return fmt.Errorf("record %03d_%s: %w", m.Version, m.Name, err)
		}
	}
	return nil
}

// lockKey derives the advisory lock key from the schema name, so that
// migrations of different schemas do not wait for each other.
func lockKey(schema string) int64 {
	h := fnv.New64a()
	h.Write([]byte("oncemill:migrate:" + schema))
	return int64(h.Sum64())
}
