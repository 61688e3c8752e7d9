package sqlschema

import (
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"net"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// DefaultConnectTimeout bounds the first step of [Migrate], taking a
// connection and beginning the transaction, when ctx has no deadline, so
// that a server that does not answer fails Migrate instead of hanging it.
const DefaultConnectTimeout = 10 * time.Second

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
//
// When ctx has no deadline, taking the connection and beginning the
// transaction is bounded by [DefaultConnectTimeout], and the error then
// names the server; the migration itself, which may wait for the lock or
// rewrite large tables, is not bounded. Give ctx a deadline for another
// bound, or set connect_timeout on the pool.
func Migrate(ctx context.Context, db Beginner, cfg Config) error {
	cfg = cfg.WithDefaults()
	migrations, err := Migrations(Postgres, cfg)
	if err != nil {
		return err
	}
	names := NamesFor(Postgres, cfg)

	tx, err := begin(ctx, db)
	if err != nil {
		return err
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

// begin begins the migration's transaction, within DefaultConnectTimeout
// when ctx has no deadline. The transaction does not keep the context it
// began with: its statements run under ctx.
func begin(ctx context.Context, db Beginner) (pgx.Tx, error) {
	beginCtx, bounded := ctx, false
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		beginCtx, cancel = context.WithTimeout(ctx, DefaultConnectTimeout)
		defer cancel()
		bounded = true
	}
	tx, err := db.Begin(beginCtx)
	switch {
	case err == nil:
		return tx, nil
	case bounded && errors.Is(err, context.DeadlineExceeded) && ctx.Err() == nil:
		return nil, fmt.Errorf("sqlschema: begin migration on %s: no answer within %s: %w", server(db), DefaultConnectTimeout, err)
	}
	return nil, fmt.Errorf("sqlschema: begin migration on %s: %w", server(db), err)
}

// server names the PostgreSQL server db connects to, as host:port, for
// error messages.
func server(db Beginner) string {
	var cc *pgconn.Config
	switch db := db.(type) {
	case *pgxpool.Pool:
		cc = &db.Config().ConnConfig.Config
	case *pgx.Conn:
		cc = &db.Config().Config
	}
	if cc == nil {
		return "the database"
	}
	if strings.HasPrefix(cc.Host, "/") {
		return cc.Host // a Unix socket directory
	}
	return net.JoinHostPort(cc.Host, strconv.Itoa(int(cc.Port)))
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
