package sqlschema

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"fmt"
	"hash/fnv"
)

// MigrateSQL brings the schema named by cfg up to the newest version of
// dialect d through database/sql, for applications whose data layer is
// database/sql (GORM, sqlc, sqlx): db may use pgx's stdlib or lib/pq for
// Postgres, go-sql-driver/mysql for MySQL, any SQLite driver for SQLite.
// Like [Migrate] it is idempotent and safe when several processes start at
// once, and it applies the same versions:
//
//   - Postgres runs the PostgreSQL migrations in one transaction under the
//     advisory lock [Migrate] takes, so the two migrators may be mixed.
//   - MySQL takes a named lock (GET_LOCK) keyed by cfg.Schema on one
//     connection, creates the database cfg.Schema when it is missing
//     (which needs the CREATE privilege; create it beforehand and grant
//     the application its tables otherwise) and records applied versions
//     in <schema>.oncemill_migrations. MySQL commits each DDL statement on
//     its own, so every statement of the MySQL migrations is safe to run
//     again: a migration cut short is applied again, whole, by the next
//     run.
//   - SQLite is [MigrateSQLite].
//
// When ctx has no deadline, taking the connection (and for Postgres
// beginning the transaction) is bounded by [DefaultConnectTimeout].
func MigrateSQL(ctx context.Context, db *sql.DB, d Dialect, cfg Config) error {
	if db == nil {
		return errors.New("sqlschema: migrate: db is nil")
	}
	cfg = cfg.WithDefaults()
	migrations, err := Migrations(d, cfg)
	if err != nil {
		return err
	}
	names := NamesFor(d, cfg)
	switch d {
	case SQLite:
		return MigrateSQLite(ctx, db, cfg)
	case MySQL:
		if err := migrateMySQL(ctx, db, cfg, names, migrations); err != nil {
			return fmt.Errorf("sqlschema: migrate mysql database %s: %w", cfg.Schema, err)
		}
		return nil
	}
	if err := migratePostgresSQL(ctx, db, cfg, names, migrations); err != nil {
		return fmt.Errorf("sqlschema: migrate schema %s: %w", cfg.Schema, err)
	}
	return nil
}

// conn takes one connection of db, within DefaultConnectTimeout when ctx
// has no deadline.
func conn(ctx context.Context, db *sql.DB) (*sql.Conn, error) {
	connCtx, bounded := ctx, false
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		connCtx, cancel = context.WithTimeout(ctx, DefaultConnectTimeout)
		defer cancel()
		bounded = true
	}
	c, err := db.Conn(connCtx)
	switch {
	case err == nil:
		return c, nil
	case bounded && errors.Is(err, context.DeadlineExceeded) && ctx.Err() == nil:
		return nil, fmt.Errorf("connect: no answer within %s: %w", DefaultConnectTimeout, err)
	}
	return nil, fmt.Errorf("connect: %w", err)
}

func migratePostgresSQL(ctx context.Context, db *sql.DB, cfg Config, names Names, migrations []Migration) error {
	c, err := conn(ctx, db)
	if err != nil {
		return err
	}
	defer c.Close()
	tx, err := c.BeginTx(ctx, nil)
	if err != nil {
		return fmt.Errorf("begin: %w", err)
	}
	err = migratePostgresTx(ctx, tx, cfg, names, migrations)
	if err == nil {
		err = tx.Commit()
	}
	if err != nil {
		if rbErr := tx.Rollback(); rbErr != nil && !errors.Is(rbErr, sql.ErrTxDone) {
			err = errors.Join(err, fmt.Errorf("rollback: %w", rbErr))
		}
		return err
	}
	return nil
}

func migratePostgresTx(ctx context.Context, tx *sql.Tx, cfg Config, names Names, migrations []Migration) error {
	if _, err := tx.ExecContext(ctx, `SELECT pg_advisory_xact_lock($1)`, lockKey(cfg.Schema)); err != nil {
		return fmt.Errorf("take advisory lock: %w", err)
	}
	if _, err := tx.ExecContext(ctx, `CREATE SCHEMA IF NOT EXISTS `+names.Schema); err != nil {
		return fmt.Errorf("create schema: %w", err)
	}
	versions := names.Schema + `.oncemill_migrations`
	if _, err := tx.ExecContext(ctx, `CREATE TABLE IF NOT EXISTS `+versions+` (
		version    integer     PRIMARY KEY,
		name       text        NOT NULL,
		applied_at timestamptz NOT NULL DEFAULT now()
	)`); err != nil {
		return fmt.Errorf("create version table: %w", err)
	}
	applied, err := appliedVersions(ctx, tx, `SELECT version FROM `+versions)
	if err != nil {
		return err
	}
	for _, m := range migrations {
		if applied[m.Version] {
			continue
		}
		// Without arguments both drivers send the step in one simple
		// query, which may hold several statements.
		if _, err := tx.ExecContext(ctx, m.Up); err != nil {
			return fmt.Errorf("apply %03d_%s: %w", m.Version, m.Name, err)
		}
		if _, err := tx.ExecContext(ctx, `INSERT INTO `+versions+` (version, name) VALUES ($1, $2)`, m.Version, m.Name); err != nil {
			return fmt.Errorf("record %03d_%s: %w", m.Version, m.Name, err)
		}
	}
	return nil
}

// mysqlLockWait is how long a MySQL migrator waits for another one's
// named lock, in seconds, unless ctx ends first: a year, as good as for
// ever (MariaDB refuses GET_LOCK's negative "infinite").
const mysqlLockWait = 365 * 24 * 3600

func migrateMySQL(ctx context.Context, db *sql.DB, cfg Config, names Names, migrations []Migration) error {
	c, err := conn(ctx, db)
	if err != nil {
		return err
	}
	defer c.Close()
	// The named lock belongs to the session: take it on this connection,
	// and release it there, also when ctx ended the migration.
	lock := mysqlLockName(cfg.Schema)
	var got sql.NullInt64
	if err := c.QueryRowContext(ctx, `SELECT GET_LOCK(?, ?)`, lock, mysqlLockWait).Scan(&got); err != nil {
		return fmt.Errorf("take lock %s: %w", lock, err)
	}
	if got.Int64 != 1 {
		return fmt.Errorf("take lock %s: GET_LOCK answered %v", lock, got)
	}
	err = migrateMySQLLocked(ctx, c, cfg, names, migrations)
	var released sql.NullInt64
	if rlErr := c.QueryRowContext(context.WithoutCancel(ctx), `SELECT RELEASE_LOCK(?)`, lock).Scan(&released); rlErr != nil {
		// The session may still hold the lock: close it rather than give
		// it back to the pool, which releases the lock.
		_ = c.Raw(func(any) error { return driver.ErrBadConn })
		err = errors.Join(err, fmt.Errorf("release lock %s: %w", lock, rlErr))
	}
	return err
}

func migrateMySQLLocked(ctx context.Context, c *sql.Conn, cfg Config, names Names, migrations []Migration) error {
	// CREATE DATABASE IF NOT EXISTS needs the CREATE privilege even when
	// the database exists: look first, so that an application granted
	// only its database's tables can migrate.
	var n int
	if err := c.QueryRowContext(ctx, `SELECT COUNT(*) FROM information_schema.SCHEMATA WHERE SCHEMA_NAME = ?`, cfg.Schema).Scan(&n); err != nil {
		return fmt.Errorf("look up database: %w", err)
	}
	if n == 0 {
		if _, err := c.ExecContext(ctx, `CREATE DATABASE IF NOT EXISTS `+names.Schema+` CHARACTER SET utf8mb4`); err != nil {
			return fmt.Errorf("create database: %w", err)
		}
	}
	versions := names.Schema + ".`oncemill_migrations`"
	if _, err := c.ExecContext(ctx, `CREATE TABLE IF NOT EXISTS `+versions+` (
		version    INT          NOT NULL PRIMARY KEY,
		name       VARCHAR(128) NOT NULL,
		applied_at DATETIME(6)  NOT NULL
	) ENGINE = InnoDB`); err != nil {
		return fmt.Errorf("create version table: %w", err)
	}
	applied, err := appliedVersions(ctx, c, `SELECT version FROM `+versions)
	if err != nil {
		return err
	}
	for _, m := range migrations {
		if applied[m.Version] {
			continue
		}
		for i, stmt := range m.Statements(MySQL) {
			if _, err := c.ExecContext(ctx, stmt); err != nil {
				return fmt.Errorf("apply %03d_%s, statement %d: %w", m.Version, m.Name, i+1, err)
			}
		}
		if _, err := c.ExecContext(ctx, `INSERT INTO `+versions+` (version, name, applied_at) VALUES (?, ?, UTC_TIMESTAMP(6))`, m.Version, m.Name); err != nil {
			return fmt.Errorf("record %03d_%s: %w", m.Version, m.Name, err)
		}
	}
	return nil
}

// mysqlLockName is the named lock of a schema's migrations: a hash, since
// a lock name may hold 64 characters and a schema name 48.
func mysqlLockName(schema string) string {
	h := fnv.New64a()
	h.Write([]byte("oncemill:migrate:" + schema))
	return fmt.Sprintf("oncemill_migrate_%016x", h.Sum64())
}

type querier interface {
	QueryContext(ctx context.Context, query string, args ...any) (*sql.Rows, error)
}

func appliedVersions(ctx context.Context, q querier, query string) (map[int]bool, error) {
	rows, err := q.QueryContext(ctx, query)
	if err != nil {
		return nil, fmt.Errorf("read versions: %w", err)
	}
	defer rows.Close()
	applied := map[int]bool{}
	for rows.Next() {
		var v int
		if err := rows.Scan(&v); err != nil {
			return nil, fmt.Errorf("read versions: %w", err)
		}
		applied[v] = true
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("read versions: %w", err)
	}
	return applied, nil
}
