-- Dead keys and crash-proof attempt counts (see the PostgreSQL migration
-- of the same name). SQLite cannot change a CHECK constraint in place, so
-- the inbox table is rebuilt with status 'dead' allowed.
CREATE TABLE "{{.InboxName}}_v2" (
    consumer        TEXT    NOT NULL,
    key             TEXT    NOT NULL,
    status          TEXT    NOT NULL CHECK (status IN ('processing', 'failed', 'done', 'dead')),
    attempts        INTEGER NOT NULL DEFAULT 0,
    token           INTEGER NOT NULL DEFAULT 0,
    lease_until     INTEGER,
    result          BLOB,
    first_error     TEXT,
    last_error      TEXT,
    first_failed_at INTEGER,
    last_failed_at  INTEGER,
    created_at      INTEGER NOT NULL DEFAULT (CAST((julianday('now') - 2440587.5) * 86400000000 AS INTEGER)),
    updated_at      INTEGER NOT NULL DEFAULT (CAST((julianday('now') - 2440587.5) * 86400000000 AS INTEGER)),
    done_at         INTEGER,
    expires_at      INTEGER NOT NULL,
    dead_at         INTEGER,
    dead_copies     INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (consumer, key)
);

INSERT INTO "{{.InboxName}}_v2" (consumer, key, status, attempts, token, lease_until, result,
    first_error, last_error, first_failed_at, last_failed_at, created_at, updated_at, done_at, expires_at)
SELECT consumer, key, status, attempts, token, lease_until, result,
    first_error, last_error, first_failed_at, last_failed_at, created_at, updated_at, done_at, expires_at
FROM {{.Inbox}};

DROP TABLE {{.Inbox}};
ALTER TABLE "{{.InboxName}}_v2" RENAME TO "{{.InboxName}}";
CREATE INDEX IF NOT EXISTS "{{.InboxName}}_expires_at_idx" ON {{.Inbox}} (expires_at);

-- Attempts that started and have not committed, written before the
-- handler's transaction begins.
CREATE TABLE IF NOT EXISTS {{.InboxStarts}} (
    consumer   TEXT    NOT NULL,
    key        TEXT    NOT NULL,
    started    INTEGER NOT NULL,
    expires_at INTEGER NOT NULL,
    PRIMARY KEY (consumer, key)
);
