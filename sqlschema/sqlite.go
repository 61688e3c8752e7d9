package sqlschema

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"fmt"
	"time"
)

// sqliteVersions is the SQLite table that records applied versions. SQLite
// has no schemas, so there is one per database file.
const sqliteVersions = `"oncemill_migrations"`

// MigrateSQLite brings the SQLite schema named by cfg up to the newest
// version. cfg.Schema is ignored. It is idempotent and safe when several
// processes start at once: all steps run in one BEGIN IMMEDIATE transaction,
// which takes the database's write lock first, so concurrent migrators run
// one after the other; applied versions are recorded in oncemill_migrations.
// Versions are recorded per database file, not per table, as [Migrate]
// records them per schema: once one InboxTable is migrated in a file, a
// second, differently named one is not created there.
//
// db may use any SQLite driver. It should set a busy timeout (for
// modernc.org/sqlite, _pragma=busy_timeout(10000) in the DSN): without one a
// migrator that finds the write lock taken fails at once with SQLITE_BUSY
// instead of waiting for it.
func MigrateSQLite(ctx context.Context, db *sql.DB, cfg Config) error {
	if db == nil {
		return errors.New("sqlschema: migrate sqlite: db is nil")
	}
	cfg = cfg.WithDefaults()
	migrations, err := Migrations(SQLite, cfg)
	if err != nil {
		return err
	}

	// BEGIN IMMEDIATE is not available through database/sql's BeginTx, so
	// the transaction is run by hand on one dedicated connection.
	conn, err := db.Conn(ctx)
	if err != nil {
		return fmt.Errorf("sqlschema: migrate sqlite table %s: connect: %w", cfg.InboxTable, err)
	}
	defer conn.Close()

	if _, err := conn.ExecContext(ctx, `BEGIN IMMEDIATE`); err != nil {
		return fmt.Errorf("sqlschema: migrate sqlite table %s: begin: %w", cfg.InboxTable, err)
	}
	err = migrateSQLite(ctx, conn, migrations)
	if err == nil {
		if _, err = conn.ExecContext(ctx, `COMMIT`); err != nil {
			err = fmt.Errorf("commit: %w", err)
		}
	}
	if err != nil {
		// The rollback must run even when ctx is what ended the migration.
		if _, rbErr := conn.ExecContext(context.WithoutCancel(ctx), `ROLLBACK`); rbErr != nil {
			err = errors.Join(err, fmt.Errorf("rollback: %w", rbErr))
			// The connection may still be inside the transaction: make
			// database/sql close it instead of returning it to the pool.
			_ = conn.Raw(func(any) error { return driver.ErrBadConn })
		}
		return fmt.Errorf("sqlschema: migrate sqlite table %s: %w", cfg.InboxTable, err)
	}
	return nil
}

func migrateSQLite(ctx context.Context, conn *sql.Conn, migrations []Migration) error {
	if _, err := conn.ExecContext(ctx, `CREATE TABLE IF NOT EXISTS `+sqliteVersions+` (
		version    INTEGER PRIMARY KEY,
		name       TEXT    NOT NULL,
		applied_at INTEGER NOT NULL -- microseconds since the Unix epoch
	)`); err != nil {
		return fmt.Errorf("create version table: %w", err)
	}
	applied, err := sqliteApplied(ctx, conn)
	if err != nil {
		return err
	}
	for _, m := range migrations {
		if applied[m.Version] {
			continue
		}
		if _, err := conn.ExecContext(ctx, m.Up); err != nil {
			return fmt.Errorf("apply %03d_%s: %w", m.Version, m.Name, err)
		}
		if _, err := conn.ExecContext(ctx, `INSERT INTO `+sqliteVersions+` (version, name, applied_at) VALUES (?, ?, ?)`,
			m.Version, m.Name, time.Now().UnixMicro()); err != nil {
			return fmt.Errorf("record %03d_%s: %w", m.Version, m.Name, err)
		}
	}
	return nil
}

func sqliteApplied(ctx context.Context, conn *sql.Conn) (map[int]bool, error) {
	rows, err := conn.QueryContext(ctx, `SELECT version FROM `+sqliteVersions)
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
